"""The engine reproduces greedy decoding token for token, and the checks catch each way it could break."""

from __future__ import annotations

import random

import pytest
import torch

from recap_cli.decoding import compat
from recap_cli.decoding.batched import padded_ancestors
from recap_cli.drafters import Drafter
from recap_cli.decoding.engine import Engine, accept, ancestors, generate
from recap_cli.decoding.tree import Tree
from recap_cli.prefix_cache import PrefixCache

from .conftest import OracleDrafter, request

NEW_TOKENS = 50
ARCHS = ["qwen", "llava", "text"]
QUESTIONS = ["What colour is the square?", "Describe the picture in one sentence, please."]


def hf_generate(adapter, messages, images, n: int) -> list[int]:
    """transformers' own greedy generate(), fed by the processor directly (not through recap's adapter)."""
    proc, model = adapter.tokenizer, adapter.model
    if adapter.arch == "text":
        inputs = proc.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    else:
        text = proc.apply_chat_template(messages, add_generation_prompt=True)
        inputs = proc(text=[text], images=images, return_tensors="pt")
        inputs = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


_REFS: dict = {}


def reference(adapter, arch, qi, seed):
    key = (arch, adapter.model.config._attn_implementation, qi, seed)
    if key not in _REFS:
        msgs, imgs = request(arch, QUESTIONS[qi], seed)
        _REFS[key] = hf_generate(adapter, msgs, imgs, NEW_TOKENS)
    return _REFS[key]


def decode(adapter, arch, qi, seed, drafter, n=NEW_TOKENS) -> list[int]:
    msgs, imgs = request(arch, QUESTIONS[qi], seed)
    return generate(Engine(adapter), adapter.build(msgs, imgs), drafter, n).tokens


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_one_token_decoding_equals_hf_generate(get_adapter, arch, attn):
    adapter = get_adapter(arch, attn)
    for qi, seed in [(0, 1), (1, 2)]:
        ref = reference(adapter, arch, qi, seed)
        assert len(ref) >= 10
        assert decode(adapter, arch, qi, seed, Drafter()) == ref


TREES = [(1, 0.0), (2, 1.0), (8, 0.5), (16, 0.9), (64, 0.0), (64, 0.6), (64, 0.95), (33, 0.8)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_decoding_equals_greedy(get_adapter, arch, attn):
    """Random trees of 1-64 nodes, from all-wrong to mostly-right, over two prompts and images."""
    adapter = get_adapter(arch, attn)
    for i, (nodes, p_right) in enumerate(TREES):
        qi, seed = i % 2, 1 + i % 2
        ref = reference(adapter, arch, qi, seed)
        drafter = OracleDrafter(ref, p_right, nodes, seed=i, vocab=adapter.vocab_size)
        assert decode(adapter, arch, qi, seed, drafter) == ref, (nodes, p_right)


EARLY_TREES = [(2, 1.0), (8, 0.0), (16, 0.9), (33, 0.6), (12, 1.0)]


def decode_early(engine, adapter, arch, i, nodes, p_right):
    """One request whose first tree rides on its prefill (an early oracle), checked against generate()."""
    qi, seed = i % 2, 1 + i % 2
    ref = reference(adapter, arch, qi, seed)
    msgs, imgs = request(arch, QUESTIONS[qi], seed)
    prompt = adapter.build(msgs, imgs)
    drafter = OracleDrafter(ref, p_right, nodes, seed=i, vocab=adapter.vocab_size, early=True)
    gen = generate(engine, prompt, drafter, NEW_TOKENS)
    assert gen.tokens == ref, (nodes, p_right)
    engine.hold(prompt, gen.tokens)
    return gen


@pytest.mark.parametrize("attn,static", [("sdpa", False), ("eager", False), ("sdpa", True)])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_tree_verified_at_prefill_equals_greedy(get_adapter, arch, attn, static):
    """The first tree rides on the prompt's forward pass (Engine.prefill_tree: the prompt causal, the nodes by
    ancestry after its last position, M-RoPE delta included; over a static cache too), then steps go on as usual.
    From all-wrong to all-right the tokens are generate()'s; a right draft is taken by the prefill, a wrong one
    leaves only the first token."""
    adapter = get_adapter(arch, attn)
    for i, (nodes, p_right) in enumerate(EARLY_TREES):
        gen = decode_early(Engine(adapter, static=static), adapter, arch, i, nodes, p_right)
        assert (gen.prefill_tokens > 1) == (p_right > 0), (nodes, p_right, gen.prefill_tokens)
        assert gen.mean_accepted == (len(gen.tokens) - gen.prefill_tokens) / gen.steps


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tree_verified_at_prefill_over_a_reused_prefix_equals_greedy(get_adapter, arch):
    """The same over a prefix already in the cache (Engine.prefill_from: the prompt's rest as a chain, then the
    tree): a request repeated, and its prompt's start reused."""
    adapter = get_adapter(arch)
    engine = Engine(adapter)
    engine.prefixes = PrefixCache(64)
    hits = []
    for i, (nodes, p_right) in enumerate([(16, 0.9), (16, 0.9), (12, 1.0)]):
        gen = decode_early(engine, adapter, arch, 2 * (i // 2), nodes, p_right)  # requests 0, 0, 2: the same prompt
        hits.append(engine.hit)
        assert gen.prefill_tokens > 1
    assert hits[0] == 0 and hits[1] > 0 and hits[2] > 0


def test_good_trees_take_fewer_steps(get_adapter):
    adapter = get_adapter("qwen")
    ref = reference(adapter, "qwen", 0, 1)
    msgs, imgs = request("qwen", QUESTIONS[0], 1)
    steps = {}
    for p in (0.0, 0.95):
        gen = generate(Engine(adapter), adapter.build(msgs, imgs), OracleDrafter(ref, p, 32, 0, 400), NEW_TOKENS)
        assert gen.tokens == ref
        steps[p] = gen.steps
    assert steps[0.95] * 3 < steps[0.0]


def test_every_forward_runs_without_cudnn_attention(get_adapter, monkeypatch):
    """On an H200, cuDNN's attention built a plan for each decoding step's new shape (steps of 3 ms to 0.8 s,
    compat.attention_kernels). The prefill with its tree and every step run inside the kernels' context; on
    CUDA it leaves cuDNN out and puts the setting back after, and on a CPU it changes nothing."""
    real, devices = compat.attention_kernels, []
    monkeypatch.setattr(compat, "attention_kernels", lambda device: (devices.append(device), real(device))[1])
    adapter = get_adapter("qwen")
    ref = reference(adapter, "qwen", 0, 1)
    msgs, imgs = request("qwen", QUESTIONS[0], 1)
    drafter = OracleDrafter(ref, 0.6, 8, seed=0, vocab=adapter.vocab_size, early=True)
    gen = generate(Engine(adapter), adapter.build(msgs, imgs), drafter, NEW_TOKENS)
    assert gen.tokens == ref and gen.prefill_tokens > 1
    assert devices == [adapter.device] * (gen.steps + 1)
    cuda = torch.backends.cuda
    before = cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()
    with real(torch.device("cuda")):
        assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == (
            False, True, True)
    with real(torch.device("cpu")):
        assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == before
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == before


@pytest.mark.parametrize("early", [False, True])
def test_max_new_tokens_and_eos_end_like_generate(get_adapter, early):
    """Also when the first tree rides on the prefill (``early``): its path is cut there as a step's is."""
    adapter = get_adapter("llava")
    for n in (1, 2, 7):
        msgs, imgs = request("llava", QUESTIONS[0], 1)
        ref = hf_generate(adapter, msgs, imgs, n)
        full = reference(adapter, "llava", 0, 1)
        drafter = OracleDrafter(full, 1.0, 16, 0, adapter.vocab_size, early=early)
        assert decode(adapter, "llava", 0, 1, drafter, n) == ref
    # An EOS inside an accepted path ends the request there, as generate() does.
    eos = next(iter(adapter.eos_token_ids))
    ref = reference(adapter, "llava", 0, 1)
    adapter.eos_token_ids = {ref[5]}
    try:
        out = decode(adapter, "llava", 0, 1, OracleDrafter(ref, 1.0, 16, 0, adapter.vocab_size, early=early))
    finally:
        adapter.eos_token_ids = {eos}
    assert out == ref[: ref.index(ref[5]) + 1]


def test_a_tree_without_a_token_drops_its_nodes_and_those_under_them():
    tree = Tree(tokens=[9, 1, 7, 2, 3, 7], parents=[-1, 0, 0, 1, 2, 3], sources=[0, 1, 2, 3, 4, 5])
    assert tree.without(None) is tree and tree.without(4) is tree
    cut = tree.without(7)  # node 2 (and node 4 under it) and node 5 go
    assert (cut.tokens, cut.parents, cut.sources) == ([9, 1, 2], [-1, 0, 1], [0, 1, 3])
    assert Tree.root(7).without(7).tokens == [7]  # the root is committed text, never dropped


def walked_ancestors(parents: list[int], width: int) -> torch.Tensor:
    """What each node sees, by walking up its parents: itself and its ancestors; rows past the tree see themselves."""
    want = torch.eye(width, dtype=torch.bool)
    for i in range(len(parents)):
        j = parents[i]
        while j >= 0:
            want[i, j] = True
            j = parents[j]
    return want


def random_parents(rng: random.Random, n: int) -> list[int]:
    """A random tree of ``n`` nodes (none: a free static slot), a few of them static padding (parent -1)."""
    return [-1 if i == 0 or rng.random() < 0.05 else rng.randrange(i) for i in range(n)]


def test_ancestors_open_each_node_to_itself_and_its_ancestors_only():
    """The mask's tree block (engine.ancestors, bitmasks unpacked) against a walk up each node's parents, on random
    trees of 1-130 nodes (past one 64-bit word), with static padding (parent -1) inside and padding rows after."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 130)
        parents = random_parents(rng, n)
        width = n + rng.randint(0, 5)
        assert torch.equal(ancestors(parents, width), walked_ancestors(parents, width)), (n, width)


def test_a_batchs_trees_are_unpacked_together_each_padded_to_the_width():
    """batched.padded_ancestors (every row's bitmasks unpacked in one call) against the walk, tree by tree: batches
    of 1-16 trees of 0-70 nodes (0: a free static slot, all padding), padded to the widest or wider."""
    rng = random.Random(1)
    for _ in range(100):
        trees = [Tree(tokens=[0] * n, parents=random_parents(rng, n))
                 for n in (rng.choice((0, 1, 2, 5, 70)) for _ in range(rng.randint(1, 16)))]
        width = max(max(len(t) for t in trees), 1) + rng.randint(0, 3)
        want = torch.stack([walked_ancestors(t.parents, width) for t in trees])
        assert torch.equal(padded_ancestors(trees, width), want), ([len(t) for t in trees], width)


def test_accept_walks_the_greedy_path():
    tree = Tree(tokens=[9, 1, 2, 3, 4, 5], parents=[-1, 0, 0, 1, 2, 4])
    # argmax at root is 2 -> node 2; at node 2 is 4 -> node 4; at node 4 is 5 -> node 5; at node 5, 7: stop.
    argmax = [2, 0, 4, 0, 5, 7]
    assert accept(tree, argmax) == [0, 2, 4, 5]
    assert accept(tree, [8, 0, 0, 0, 0, 0]) == [0]


# --- Each breakage below must be caught by the same exactness check. ---------------------------------------

def _any_mismatch(get_adapter, arch="qwen", attn="sdpa", early=False) -> bool:
    adapter = get_adapter(arch, attn)
    for i, (nodes, p_right) in enumerate([(64, 0.6), (33, 0.8), (16, 0.9)]):
        qi, seed = i % 2, 1 + i % 2
        ref = reference(adapter, arch, qi, seed)
        drafter = OracleDrafter(ref, p_right, nodes, seed=i, vocab=adapter.vocab_size, early=early)
        if decode(adapter, arch, qi, seed, drafter) != ref:
            return True
    return False


@pytest.mark.parametrize("arch", ["qwen", "llava"])
def test_check_catches_a_causal_instead_of_ancestor_mask(get_adapter, monkeypatch, arch):
    def causal(self, parents):
        n, p = len(parents), self.length
        tree = torch.full((n, n), torch.finfo(self.dtype).min, dtype=self.dtype).triu(1)
        return torch.cat([torch.zeros(n, p, dtype=self.dtype), tree], 1)[None, None]

    assert not _any_mismatch(get_adapter, arch)
    monkeypatch.setattr(Engine, "_tree_mask", causal)
    assert _any_mismatch(get_adapter, arch)


@pytest.mark.parametrize("arch", ["qwen", "llava"])
def test_check_catches_a_causal_mask_over_a_tree_at_prefill(get_adapter, monkeypatch, arch):
    """The tree riding on the prompt's pass must see its ancestors only, not every node before it."""
    real = Engine._chain_tree_mask

    def causal(self, t, parents):
        return real(self, t + len(parents) - 1, [-1])

    assert not _any_mismatch(get_adapter, arch, early=True)
    monkeypatch.setattr(Engine, "_chain_tree_mask", causal)
    assert _any_mismatch(get_adapter, arch, early=True)


@pytest.mark.parametrize("arch", ["qwen", "llava"])
def test_check_catches_index_instead_of_depth_positions(get_adapter, monkeypatch, arch):
    monkeypatch.setattr(Tree, "depths", lambda self: list(range(len(self.tokens))))
    assert _any_mismatch(get_adapter, arch)


def test_check_catches_a_bool_mask_under_eager(get_adapter, monkeypatch):
    real = Engine._tree_mask
    monkeypatch.setattr(Engine, "_tree_mask", lambda self, parents: real(self, parents) == 0)
    assert _any_mismatch(get_adapter, "llava", "eager")


def test_check_catches_a_missing_mrope_delta(get_adapter, monkeypatch):
    real = Engine.prefill_tree

    def no_delta(self, prompt, *args, **kw):
        out = real(self, prompt, *args, **kw)
        self.rope_delta = 0
        return out

    assert get_adapter("qwen").build(*request("qwen", "hi", 1)).rope_delta != 0
    monkeypatch.setattr(Engine, "prefill_tree", no_delta)
    assert _any_mismatch(get_adapter, "qwen")


@pytest.mark.parametrize("arch", ["qwen", "llava"])
def test_check_catches_kv_compaction_that_skips_the_copy(get_adapter, monkeypatch, arch):
    real = compat.keep_rows
    monkeypatch.setattr(compat, "keep_rows", lambda cache, start, rows, n: real(cache, start, None, n))
    assert _any_mismatch(get_adapter, arch)


# --- The static-cache path (preallocated KV, bucketed steps: what CUDA graphs capture) --------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_static_cache_path_equals_greedy(get_adapter, arch):
    adapter = get_adapter(arch)
    engine = Engine(adapter, static=True, buckets=(1, 8, 16, 32, 64))
    for i, (nodes, p_right) in enumerate([(1, 0.0), (7, 0.5), (16, 0.9), (40, 0.6), (64, 0.95)]):
        qi, seed = i % 2, 1 + i % 2
        ref = reference(adapter, arch, qi, seed)
        msgs, imgs = request(arch, QUESTIONS[qi], seed)
        drafter = OracleDrafter(ref, p_right, nodes, seed=i, vocab=adapter.vocab_size)
        assert generate(engine, adapter.build(msgs, imgs), drafter, NEW_TOKENS).tokens == ref, (nodes, p_right)
    assert engine.capacity >= NEW_TOKENS  # one preallocated cache, reused across the requests
    assert all(int(layer.cumulative_length) == engine.length for layer in engine.cache.layers)


def test_check_catches_a_static_counter_left_unreset(get_adapter, monkeypatch):
    adapter = get_adapter("llava")

    def leaky(cache, start, rows, n):  # copies the rows but leaves the write counter past the tree
        for layer in cache.layers:
            if rows is not None:
                layer.keys[:, :, start:start + rows.numel()] = layer.keys[:, :, start + rows]
                layer.values[:, :, start:start + rows.numel()] = layer.values[:, :, start + rows]

    ref = reference(adapter, "llava", 0, 1)
    msgs, imgs = request("llava", QUESTIONS[0], 1)
    monkeypatch.setattr(compat, "keep_rows", leaky)
    with pytest.raises((AssertionError, RuntimeError, IndexError)):  # wrong tokens, or writes past the end
        out = generate(Engine(adapter, static=True), adapter.build(msgs, imgs),
                       OracleDrafter(ref, 0.6, 16, 0, adapter.vocab_size), NEW_TOKENS).tokens
        assert out == ref


def test_grouped_attention_equals_transformers_sdpa_for_each_new_mask():
    """Tree steps fold a group's query heads against its one key/value head and repeat the mask once per step,
    not per layer: two steps with different masks, each read by two layers, give transformers' own results."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=False, training=False)
    for t in (3, 4):  # two steps: a new mask each
        mask = torch.zeros(1, 1, t, 5 + t)
        mask[..., 5:] = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)
        mask[0, 0, -1, 2] = torch.finfo(torch.float32).min  # not causal: a tree mask
        for _ in range(2):  # two layers read the same mask
            q, k, v = torch.randn(1, 4, t, 8), torch.randn(1, 2, 5 + t, 8), torch.randn(1, 2, 5 + t, 8)
            got, _ = compat._grouped_sdpa(module, q, k, v, mask, scaling=0.5)
            want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.5)
            torch.testing.assert_close(got, want)
