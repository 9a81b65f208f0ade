"""Batched decoding: every request's tokens equal its batch-1 greedy tokens, whatever shares its batch.

The tiny models run in float64: batched matrix products may sum in another order than batch 1, and in float64
that moves logits by ~1e-14, far below any top-2 gap of a random-init model, so an argmax cannot flip. (On real
fp32 models benchmarks/batching.py reports the match rate instead.)
"""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import pytest
import torch

from recap_cli.decoding import batched, compat
from recap_cli.batch import answer_all
from recap_cli.decoding.batched import (PROBE_WAIT, TRUST_RANGE, Batch, BatchEngine, Flight, learned_trust,
                                        length_groups)
from recap_cli.decoding.batched_static import StaticBatchEngine
from recap_cli.decoding.cost import BatchCost, RowShare, SizeChooser, batch_width, draining_width
from recap_cli.drafters import Drafter, RecapDrafter
from recap_cli.drafters.stream import StreamMemory
from recap_cli.decoding.engine import Engine, generate
from recap_cli.prefix_cache import PrefixCache
from recap_cli.records import Request
from recap_cli.session import Session
from recap_cli.decoding.tree import Tree

from .conftest import OracleDrafter, make_image, request

QUESTIONS = ["What colour is the square?", "Describe the picture in one sentence, please.", "hi",
             "Summarise: the quick brown fox jumps over the lazy dog and runs into the forest."]
# Requests of very different lengths (token limits 1..40, one multi-turn) join and leave the batch as others end.
LIMITS = [5, 40, 12, 30, 20, 1, 35, 8, 25, 40, 3]
METHODS = [("ar", {}, None), ("recap", {}, "flat"), ("recap", {}, None), ("tr", {}, None), ("pld", {}, "flat"),
           ("suffix", {}, None)]


def stream(arch: str, tmp_path, n: int = len(LIMITS)) -> list[Request]:
    reqs = []
    for i in range(n):
        image = None
        if arch != "text":
            image = tmp_path / f"img{i}.png"
            make_image(i, (80 + 8 * (i % 4), 60)).save(image)  # different sizes: different prompt lengths
        turns = [QUESTIONS[i % len(QUESTIONS)]] + (["And then?", "Why?"] if i == 4 else [])
        reqs.append(Request(line=i + 1, id=f"r{i}", image=image, turns=turns, max_new_tokens=LIMITS[i % len(LIMITS)]))
    return reqs


def flat_batch_costs(session: Session) -> Session:
    """Steps of up to 16 nodes a row cost one token's, wider ones far more, frozen: real trees in every row."""
    for curve in session.batch_engine.cost.by_rows.values():
        curve.set([1.0 if width <= 16 else 1e3 for width in curve.sizes])
        curve.alpha = 0.0
    return session


def run(session: Session, reqs: list[Request], max_new_tokens: int = 40) -> list[tuple[dict, list[list[int]]]]:
    return list(answer_all(session, reqs, "tiny", max_new_tokens))


@pytest.mark.parametrize("arch", ["qwen", "llava", "text"])
def test_every_method_at_every_batch_size_equals_batch_one(get_adapter, arch, tmp_path):
    adapter = get_adapter(arch)
    reqs = stream(arch, tmp_path)
    want = [tokens for _, tokens in run(Session(adapter, "ar"), reqs)]
    assert all(want) and len(want[4]) == 3  # the multi-turn request answered all three turns
    for method, knobs, costs in METHODS:
        for n in (1, 2, 5, 8):
            session = Session(adapter, method, batch=n, **knobs)
            if costs == "flat" and n > 1:
                flat_batch_costs(session)
            out = run(session, reqs)
            assert [r["id"] for r, _ in out] == [r.id for r in reqs], (method, n)  # input order
            assert [tokens for _, tokens in out] == want, (method, knobs, costs, n)
            if n > 1:
                assert session.occupancy is not None and 1 < session.occupancy <= n
                if method in ("recap", "tr") and (costs == "flat" or method == "tr"):  # real trees, many rows
                    nodes = sum(r["mean_nodes"] * r["steps"] for r, _ in out) / sum(r["steps"] for r, _ in out)
                    assert nodes > 3, (method, n)
                if method == "recap" and costs == "flat":  # openings verified by the joint prefills
                    assert any(r["prefill_tokens"] > 1 for r, _ in out), n


def test_batched_forwards_run_without_cudnn_attention(get_adapter, tmp_path, monkeypatch):
    """Joint prefills (fresh, and over reused prefixes: a conversation's next turns) and steps each run inside
    compat.attention_kernels (cuDNN's attention planned every step anew on an H200: tests/test_engine.py)."""
    real, callers = compat.attention_kernels, []

    def kernels(device):
        callers.append((sys._getframe(1).f_code.co_name, device))
        return real(device)

    monkeypatch.setattr(compat, "attention_kernels", kernels)
    adapter = get_adapter("qwen")
    reqs = stream("qwen", tmp_path)
    want = [tokens for _, tokens in run(Session(adapter, "ar"), reqs)]
    callers.clear()  # batch 1's (tests/test_engine.py)
    assert [tokens for _, tokens in run(Session(adapter, "recap", batch=3, prefix_cache=64), reqs)] == want
    assert {name for name, _ in callers} == {"_prefill", "_extend", "verify"}
    assert {device for _, device in callers} == {adapter.device}


@pytest.mark.parametrize("arch", ["qwen", "llava", "text"])
def test_recap_with_prompt_rows_at_a_joint_prefill_equals_batch_one(get_adapter, arch, tmp_path, monkeypatch):
    """``recap:prompt_rows=on``: the joint prefill keeps every row's text positions beside its opening's nodes."""
    adapter = get_adapter(arch)
    reqs = stream(arch, tmp_path)
    want = [tokens for _, tokens in run(Session(adapter, "ar"), reqs)]
    seeded = []  # per call: did it bring the prompt's rows (``start`` calls it without, before the prefill)
    real_rows = RecapDrafter.prompt_rows

    def prompt_rows(self, prompt, rows):
        seeded.append(rows is not None and len(rows.positions) > 1)
        real_rows(self, prompt, rows)

    monkeypatch.setattr(RecapDrafter, "prompt_rows", prompt_rows)
    out = run(flat_batch_costs(Session(adapter, "recap", batch=5, prompt_rows=True)), reqs)
    assert [tokens for _, tokens in out] == want
    assert sum(seeded) == sum(len(r.turns) for r in reqs)  # every turn's drafter got its prompt's rows
    assert any(r["prefill_tokens"] > 1 for r, _ in out)  # openings verified beside the prompt rows
    assert sum(r["mean_nodes"] * r["steps"] for r, _ in out) / sum(r["steps"] for r, _ in out) > 3  # real trees


def test_each_rows_cache_holds_its_own_accepted_rows(get_adapter):
    """After steps of ragged trees, row r's cached keys at 0..length_r-1 are the ones batch 1 caches for the
    same tokens: the compaction kept each row's accepted path and nothing else."""
    adapter = get_adapter("qwen")
    prompts = [adapter.build(*request("qwen", q, seed, size)) for seed, (q, size) in
               enumerate([(QUESTIONS[0], (80, 60)), (QUESTIONS[1], (104, 60)), (QUESTIONS[2], (80, 60))])]
    batch = BatchEngine(adapter, max_batch=3)
    firsts = batch.join(prompts)
    contexts = [[p.input_ids[0].tolist(), [f]] for p, (f, _) in zip(prompts, firsts)]
    for step in range(6):
        trees = []
        for r, (_, new) in enumerate(contexts):  # chains and bushes of several widths, some nodes right
            n = 1 + (step + 2 * r) % 7
            trees.append(Tree(tokens=[new[-1]] + [(new[-1] + k) % 50 for k in range(1, n)],
                              parents=[-1] + [0 if k % 2 else k - 1 for k in range(1, n)]))
        for (_, new), tree, v in zip(contexts, trees, batch.verify(trees)):
            new.extend([tree.tokens[i] for i in v.path[1:]] + [v.bonus])
    for r, (prompt, (_, new)) in enumerate(zip(prompts, contexts)):
        single = Engine(adapter)
        single.prefill(prompt)
        for token in new[:-1]:  # one token at a time: the cache batch 1 would hold
            single.verify(Tree.root(token))
        length = batch.slots[r].length
        assert length == single.length == prompt.length + len(new) - 1
        for mine, theirs in zip(compat._layers(batch.cache), compat._layers(single.cache)):
            assert torch.allclose(mine.keys[r, :, :length], theirs.keys[0], atol=1e-10)
            assert torch.allclose(mine.values[r, :, :length], theirs.values[0], atol=1e-10)
    assert batch.cache.layers[0].keys.shape[2] == max(s.length for s in batch.slots)  # cut to the longest row


# Each row's opening (nodes, chance a node is right): all right, all wrong, bushy and often right.
OPENINGS = [(12, 1.0), (12, 0.0), (64, 0.6), (33, 0.8)]
EARLY_TOKENS = 24


def early_prompts(adapter, arch: str) -> list:
    """Prompts of different lengths (questions, image sizes): the joint prefill pads them. On Qwen the last is
    text-only: 1-D positions beside M-RoPE rows."""
    prompts = [adapter.build(*request(arch, q, seed, (80 + 24 * (seed % 2), 60))) for seed, q in enumerate(QUESTIONS)]
    if arch == "qwen":
        prompts[-1] = adapter.build(*request("text", QUESTIONS[-1]))
        assert prompts[-1].position_ids is None and prompts[0].position_ids is not None
    return prompts


def decode_with_openings(batch: BatchEngine, adapter, prompts: list, refs: list[list[int]],
                         seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Join ``prompts`` with oracle openings (``OPENINGS``) verified by their joint prefill, then oracle trees
    step by step: each row's tokens as long as its reference, and how many of them the prefill gave."""
    contexts = [p.input_ids[0].tolist() for p in prompts]
    drafters = [OracleDrafter(ref, p_right, nodes, seed=seed + r, vocab=adapter.vocab_size, early=True)
                for r, (ref, (nodes, p_right)) in enumerate(zip(refs, OPENINGS))]
    for drafter, context in zip(drafters, contexts):
        drafter.start(context, None)
    trees = [d.propose(c, EARLY_TOKENS - 1).without(adapter.image_token_id) for d, c in zip(drafters, contexts)]
    outs = [[t.tokens[i] for i in v.path[1:]] + [v.bonus] for t, (v, _) in zip(trees, batch.join_trees(prompts, trees))]
    firsts = [len(o) for o in outs]
    for r, (prompt, out) in enumerate(zip(prompts, outs)):
        assert batch.slots[r].length == prompt.length + len(out) - 1  # its prompt and accepted path, no more
    while any(len(o) < EARLY_TOKENS for o in outs):
        trees = [d.propose(c + o, EARLY_TOKENS) for d, c, o in zip(drafters, contexts, outs)]
        for out, tree, v in zip(outs, trees, batch.verify(trees)):
            out.extend([tree.tokens[i] for i in v.path[1:]] + [v.bonus])
    return [o[:len(ref)] for o, ref in zip(outs, refs)], firsts  # a reference ends early at its EOS


def greedy_refs(adapter, prompts: list) -> list[list[int]]:
    return [generate(Engine(adapter), p, Drafter(), EARLY_TOKENS).tokens for p in prompts]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("arch", ["qwen", "llava", "text"])
def test_trees_verified_at_a_joint_prefill_equal_greedy(get_adapter, arch, static):
    """Every joining prompt's first tree rides on the joint prefill (BatchEngine.join_trees: right-padded
    prompts, each tree after its own prompt under a per-row 4-D mask and explicit positions, M-RoPE delta
    included): from all-wrong to all-right, each row's tokens are batch 1's, a right draft is taken by the
    prefill, and each row keeps only its prompt and accepted path (on the static-shape engine too)."""
    adapter = get_adapter(arch)
    prompts = early_prompts(adapter, arch)
    assert len({p.length for p in prompts}) > 1
    refs = greedy_refs(adapter, prompts)
    batch = (StaticBatchEngine(adapter, max_batch=4, capacity=96) if static else BatchEngine(adapter, max_batch=4))
    got, firsts = decode_with_openings(batch, adapter, prompts, refs)
    assert got == refs
    assert firsts[0] > 1 and firsts[1] == 1  # an all-right tree gives its deepest path, an all-wrong one the first


@pytest.mark.parametrize("arch", ["qwen", "llava", "text"])
def test_trees_verified_over_reused_prefixes_equal_greedy(get_adapter, arch):
    """The same prompts again, their starts taken from the prefix cache: each suffix runs as a chain after its
    prefix and its tree after the chain (BatchEngine._extend), in one pass with any fresh prompt."""
    adapter = get_adapter(arch)
    prompts = early_prompts(adapter, arch)
    refs = greedy_refs(adapter, prompts)
    batch = BatchEngine(adapter, max_batch=4)
    batch.prefixes = PrefixCache(64)
    assert decode_with_openings(batch, adapter, prompts[:2], refs[:2])[0] == refs[:2]
    batch.leave(list(range(len(batch.slots))))
    got, firsts = decode_with_openings(batch, adapter, prompts, refs, seed=7)  # 0 and 1 reused, 2 and 3 fresh
    assert batch.hits[:2] != [0, 0] and got == refs
    assert firsts[0] > 1 and firsts[1] == 1


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl", "llava_onevision", "idefics3", "smolvlm", "internvl"])
def test_every_family_takes_trees_at_a_joint_prefill(get_adapter, arch):
    """Each family's own image inputs, padded and concatenated, with every row's tree after its prompt."""
    adapter = get_adapter(arch)
    prompts = early_prompts(adapter, arch)
    refs = greedy_refs(adapter, prompts)
    got, firsts = decode_with_openings(BatchEngine(adapter, max_batch=4), adapter, prompts, refs)
    assert got == refs and firsts[0] > 1 and firsts[1] == 1


def hidden_path(ref: list[int], root: int, vocab: int, wrong: int = 20, right: int = 8) -> Tree:
    """A right chain of ``right`` tokens under the root, placed after a wrong chain of ``wrong`` in node order:
    under a mask causal over the nodes the right path would see the wrong branch."""
    rng = random.Random(root)
    tokens = [root] + [(ref[0] + 1 + rng.randrange(vocab - 1)) % vocab for _ in range(wrong)] + ref[:right]
    return Tree(tokens=tokens, parents=[-1] + list(range(wrong)) + [0] + list(range(wrong + 1, wrong + right)))


@pytest.mark.parametrize("arch", ["qwen", "llava", "text"])
def test_check_catches_a_causal_mask_over_trees_at_a_joint_prefill(get_adapter, monkeypatch, arch):
    """A node riding on the joint prefill must see its prompt and its ancestors only, not every node before it."""
    adapter = get_adapter(arch)
    prompts = early_prompts(adapter, arch)
    refs = greedy_refs(adapter, prompts)
    trees = [hidden_path(ref, int(p.input_ids[0, -1]), adapter.vocab_size).without(adapter.image_token_id)
             for p, ref in zip(prompts, refs)]

    def emitted() -> list[list[int]]:
        joined = BatchEngine(adapter, max_batch=4).join_trees(prompts, trees)
        return [[t.tokens[i] for i in v.path[1:]] + [v.bonus] for t, (v, _) in zip(trees, joined)]

    assert emitted() == [ref[:9] for ref in refs]  # the whole right path, and the bonus after it
    real = batched.chain_tree_seen
    monkeypatch.setattr(batched, "chain_tree_seen", lambda chains, parents, *a: real(
        [c + len(p) - 1 for c, p in zip(chains, parents)], [[-1]] * len(chains), *a))
    assert emitted() != [ref[:9] for ref in refs]


def test_gemma3_joins_without_trees(get_adapter):
    """Gemma 3 prefills under a mask of its own (image blocks both ways): a joint prefill takes no tree, and a
    drafter that drafts at prefill gets its first tree after it (Batch asks the engine)."""
    adapter = get_adapter("gemma3")
    batch = BatchEngine(adapter, max_batch=2)
    prompt = adapter.build(*request("gemma3", QUESTIONS[0]))
    tree = Tree(tokens=[int(prompt.input_ids[0, -1]), 5, 6], parents=[-1, 0, 1])
    with pytest.raises(ValueError, match="mask of its own"):
        batch.join_trees([prompt], [tree])
    assert not batch.drafts_in_prefill and batch.join([prompt])[0][0] == generate(Engine(adapter), prompt, Drafter(),
                                                                                   1).tokens[0]


def test_gemma3_under_eager_attention_batches_a_short_prompt_beside_a_long_one(get_adapter, tmp_path):
    """Right padding longer than Gemma 3's sliding window (8 positions here): a 2-D mask hiding padding from
    padding left a padding token nothing to see, eager attention made it NaN, and the full layer's zero weights on
    NaN values made the short row's every logit NaN (its answer token 0 throughout)."""
    adapter = get_adapter("gemma3", "eager")
    image = tmp_path / "img.png"
    make_image(0).save(image)
    reqs = [Request(line=1, id="long", image=image, turns=[QUESTIONS[3]]), Request(line=2, id="short", turns=["hi"])]
    want = [tokens for _, tokens in run(Session(adapter, "ar"), reqs, 12)]
    assert want[1][0][0] != 0
    for method in ("ar", "recap"):
        assert [tokens for _, tokens in run(Session(adapter, method, batch=2), reqs, 12)] == want, method


def test_hostile_input_fails_only_its_own_record(get_adapter, tmp_path, monkeypatch):
    adapter = get_adapter("qwen")
    reqs = stream("qwen", tmp_path, 8)
    (tmp_path / "img1.png").write_bytes(b"not an image")  # fails while its request prepares
    reqs[6].image = tmp_path / "missing.png"
    want = run(Session(adapter, "recap"), reqs)
    assert want[1][0]["error"] and want[6][0]["error"]

    session = Session(adapter, "recap", batch=4)
    calls, real_fork = [], RecapDrafter.fork

    def fork(self):
        row = real_fork(self)
        real_propose = row.propose

        def propose(context, room):  # the batch's eighth draft raises, in whichever row it falls, mid-batch (a
            calls.append(1)  # count of one row's drafts would hang on timing: which request joins when, and how
            if len(calls) == 8:  # many steps it takes, move with the step costs measured under load)
                raise IndexError("drafter bug")
            return real_propose(context, room)

        row.propose = propose
        return row

    monkeypatch.setattr(RecapDrafter, "fork", fork)
    out = run(session, reqs)
    failed = [i for i, (r, _) in enumerate(out) if r["error"]]
    culprit = next(i for i, (r, _) in enumerate(out) if (r["error"] or "").endswith("IndexError: drafter bug"))
    assert failed == sorted({1, 6, culprit})
    assert out[1][0]["error"] == want[1][0]["error"] and out[6][0]["error"] == want[6][0]["error"]
    for i, ((record, tokens), (_, expected)) in enumerate(zip(out, want)):
        if i not in failed:
            assert tokens == expected, i


def test_a_joint_prefill_that_fails_is_retried_alone(get_adapter, tmp_path, monkeypatch):
    """One huge input running a joint prefill out of memory must not take the requests beside it down, nor leave
    its prompt in the memory the stream shares (at batch 1 too)."""
    adapter = get_adapter("text")
    reqs = stream("text", tmp_path, 6)
    reqs[2].turns = ["a very long question " * 60]
    want = run(Session(adapter, "ar"), reqs)
    real_join = BatchEngine.join_trees

    def join(self, prompts, trees, want_rows=False):
        if any(p.length > 200 for p in prompts):
            raise RuntimeError("out of memory\nat some allocator frame")
        return real_join(self, prompts, trees, want_rows)

    def prefill_tree(self, prompt, *args, **kwargs):
        if prompt.length > 200:
            raise RuntimeError("out of memory\nat some allocator frame")
        return real_prefill(self, prompt, *args, **kwargs)

    monkeypatch.setattr(BatchEngine, "join_trees", join)
    real_prefill = Engine.prefill_tree
    monkeypatch.setattr(Engine, "prefill_tree", prefill_tree)
    turns = sum(len(r.turns) for i, r in enumerate(reqs) if i != 2)
    resumed = []  # turns that went on from their conversation's last one (its text, in the same request)
    real_resume = StreamMemory.resume

    def resume(self, prompt):
        ended = real_resume(self, prompt)
        resumed.append(ended)
        return ended

    monkeypatch.setattr(StreamMemory, "resume", resume)
    for method, batch in (("ar", 4), ("recap", 4), ("suffix", 4), ("recap", 1)):
        session = Session(adapter, method, batch=batch)
        resumed.clear()
        out = run(session, reqs)
        assert out[2][0]["error"] == "RuntimeError: out of memory", method
        assert [t for i, (_, t) in enumerate(out) if i != 2] == [t for i, (_, t) in enumerate(want) if i != 2]
        # Every turn that ran is in the shared memory once (a next turn inside its conversation's request); the
        # turn whose prefill failed is not.
        if method == "recap":
            assert len(session.drafter.stream.requests) == turns - sum(e is not None for e in resumed)
        if method == "suffix":
            assert len(session.drafter.cached) == turns


@pytest.mark.parametrize("static", [False, True])
def test_a_step_that_fails_fails_its_rows_and_the_run_goes_on(get_adapter, tmp_path, monkeypatch, static):
    """The rows' caches growing a step out of memory mid-batch used to end the whole run (a traceback, no
    memory saved, the finished records waiting behind the failed ones lost): now the rows of that step get
    the error, as a failed decode does at batch 1, and every later request is answered as at batch 1."""
    adapter = get_adapter("text")
    reqs = stream("text", tmp_path, 8)
    want = run(Session(adapter, "ar"), reqs)
    engine = StaticBatchEngine if static else BatchEngine
    real, calls = engine.verify, []

    def verify(self, trees, *args):
        calls.append(len(trees))
        if len(calls) == 3:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")
        return real(self, trees, *args)

    monkeypatch.setattr(engine, "verify", verify)
    out = run(Session(adapter, "recap", batch=4, static=static), reqs)
    failed = [i for i, (record, _) in enumerate(out) if record["error"]]
    assert len(failed) == calls[2]  # every row of the failed step, and only those
    assert all(out[i][0]["error"].endswith("RuntimeError: CUDA out of memory. Tried to allocate 2 GiB")
               for i in failed)
    assert all(out[i][0]["retry"] is True for i in failed)  # no fault of theirs: --resume answers them again
    assert [t for i, (_, t) in enumerate(out) if i not in failed] == [
        t for i, (_, t) in enumerate(want) if i not in failed]


def test_rows_share_persistent_memory_and_own_request_memory(get_adapter, tmp_path):
    adapter = get_adapter("text")
    session = Session(adapter, "recap", batch=3)
    row = session.drafter.fork()
    assert row.order1 is session.drafter.order1 and row.stream_chances is session.drafter.stream_chances
    assert row.keyed[2] is not session.drafter.keyed[2] and row.index is not session.drafter.index
    run(session, stream("text", tmp_path, 5))
    assert session.drafter.order1.filled() > 0  # every row wrote the shared order-1 table
    assert not session.drafter.keyed[2]  # the session's own per-request memories were never written


def test_a_turn_that_ends_at_its_first_token_leaves_at_once(get_adapter):
    adapter = get_adapter("text")
    engine = BatchEngine(adapter, max_batch=2)
    batch = Batch(engine, Session(adapter, "ar").drafter, 2)
    prompt = adapter.build(*request("text", "hi"))
    out = batch.add([("a", prompt, 1), ("b", prompt, 5)])
    assert [tag for tag, _ in out] == ["a"] and len(out[0][1].tokens) == 1
    assert len(batch) == 1 and len(engine.slots) == 1
    with pytest.raises(ValueError, match="rows are free"):
        batch.add([("c", prompt, 5), ("d", prompt, 5)])


def test_a_busy_batch_tells_its_cost_model_which_steps_shared_the_cores(get_adapter):
    adapter = get_adapter("text")
    engine = BatchEngine(adapter, max_batch=2)
    batch = Batch(engine, Session(adapter, "recap").drafter, 2)
    prompt = adapter.build(*request("text", "hi"))
    batch.add([("a", prompt, 8), ("b", prompt, 8)])
    seen, real = [], engine.cost.observe

    def observe(rows, width, seconds):
        seen.append(engine.cost.busy)
        real(rows, width, seconds)

    engine.cost.observe = observe
    for busy in (True, False, True):
        batch.busy = busy
        batch.step()
    assert seen == [True, False, True] and not engine.cost.busy  # read once, by the step it was set for


def flat_cost(rows_seconds: dict[int, list[float]]) -> BatchCost:
    cost = BatchCost(max_batch=8, per_row=16)
    for rows, curve in cost.by_rows.items():
        curve.set(rows_seconds[rows])
    return cost


def test_batch_cost_is_read_by_rows_and_width():
    cost = BatchCost(max_batch=8, per_row=16)
    assert cost.rows == (1, 2, 4, 8) and cost.by_rows[1].sizes == (1, 2, 4, 8, 16)
    for rows, curve in cost.by_rows.items():
        curve.set([rows * 1.0 + width / 16 for width in curve.sizes])
    assert cost.forward_table(4)[1] == pytest.approx(4 + 1 / 16)
    assert cost.forward_table(6)[16] == pytest.approx(6 + 1)  # between 4 and 8 rows: linear
    cost.observe(4, 16, 100.0)  # an outlier counts at most three times the estimate
    assert cost.by_rows[4].seconds[-1] < 3 * 5.0


def test_row_share_widens_only_where_nodes_pay():
    # Wide steps cost 10x a narrow one: a row adds nodes only if it is the first, with a sure chance.
    cost = flat_cost({r: [1.0, 10.0, 10.0, 10.0, 10.0] for r in (1, 2, 4, 8)})
    lone = RowShare(cost, rows=8, width=1, base=7.0, other_nodes=7)
    chooser = lone.chooser()
    assert not chooser.worth_growing(0.9)  # 0.9 more tokens for 10x the step: no
    # Once an earlier row set the width to 4, nodes up to it cost this row nothing but drafting.
    wide = RowShare(cost, rows=8, width=4, base=7.0, other_nodes=7)
    chooser: SizeChooser = wide.chooser()
    for chance in (0.5, 0.4, 0.3):
        assert chooser.worth_growing(chance)
        chooser.place(chance)
    assert chooser.size == 4 and wide.chosen_expected() == pytest.approx(2.2)


def test_rows_guess_the_node_their_growth_stopped_before():
    """A row's growth stops where one more node does not pay for widening every row's step alone; the rows
    together may pay for it. So a row's guess for the next step carries the node it stopped before, and the
    batch can widen past the width the rows' last trees were grown for (without it these rows, cut to their
    roots, would guess nothing, and only a probe would widen the batch)."""
    cost = flat_cost({r: [1.0, 1.5, 2.0, 3.0, 5.0] for r in (1, 2, 4, 8)})  # widths 1, 2, 4, 8, 16
    rows = []
    for _ in range(8):
        share = RowShare(cost, rows=8, width=1, base=7.0, other_nodes=7)
        assert not share.chooser().worth_growing(0.6)  # 0.6 more tokens a node for 1.5x the step and up: no
        assert share.cut_to_root() and share.grown_chances() == [0.6]
        rows.append(share.grown_chances())
    assert batch_width(cost, rows) == 2  # 8 x 0.6 more tokens pay for 1.5x
    # Growth that ran out of candidates guesses nothing past its last node.
    wide = RowShare(cost, rows=8, width=4, base=7.0, other_nodes=7)
    chooser = wide.chooser()
    assert chooser.worth_growing(0.5)
    chooser.place(0.5)
    assert wide.grown_chances() == [0.5]


def test_batch_width_widens_when_rows_together_pay():
    # A wider step costs 1.5x a one-token step: no single row's node (chance 0.6) pays for it, all rows' do.
    cost = flat_cost({r: [1.0, 1.5, 1.5, 1.5, 1.5] for r in (1, 2, 4, 8)})
    assert batch_width(cost, [[0.6]] + [[] for _ in range(7)]) == 1
    assert batch_width(cost, [[0.6, 0.5, 0.4]] * 8) == 4  # free up to the next grid width once paid for
    assert batch_width(cost, [[0.2]] * 8) == 1  # 8 x 0.2 more tokens do not pay for 1.5x


def test_a_draining_batch_widens_only_for_its_slowest_bounding_row():
    """Nothing will join: the run ends with its last row, so a step is worth what its least-gaining bounding row
    gains, however much the others would."""
    cost = flat_cost({r: [1.0, 1.5, 1.5, 1.5, 1.5] for r in (1, 2, 4, 8)})
    chances = [[0.9, 0.9, 0.9]] * 7 + [[]]
    assert batch_width(cost, chances) == 4  # by the sum of every row's tokens: 7 sure rows pay
    assert draining_width(cost, chances, [True] * 8) == 1  # the row with nothing to draft ends no sooner
    assert draining_width(cost, chances, [True] * 7 + [False]) == 4  # unless it ends sooner anyway
    assert draining_width(cost, [[0.6]] * 8, [True] * 8) == 2  # (1 + 0.6) / 1.5 > 1 / 1
    assert draining_width(cost, [[0.6]] * 7 + [[0.3]], [True] * 8) == 1  # (1 + 0.3) / 1.5 < 1


def test_in_a_draining_batch_only_rows_that_bound_the_run_draft(get_adapter, tmp_path, monkeypatch):
    """Once the stream has nothing left to join, a row whose whole room (one token a step) fits in the steps
    the row with the most room still needs does not draft; the rows with the most room always do. Tokens stay
    batch 1's."""
    adapter = get_adapter("text")
    reqs = stream("text", tmp_path, 3)
    for req, limit in zip(reqs, (40, 10, 16)):  # the third joins when the second ends, with less room than the first
        req.max_new_tokens = limit
    want = [tokens for _, tokens in run(Session(adapter, "ar"), reqs)]
    assert [len(t[0]) for t in want] == [40, 10, 16]
    session = flat_batch_costs(Session(adapter, "recap", batch=2))
    seen, draft = [], Batch._draft

    def spy(self, failed):
        rooms = [self._room(f) for f in self.flights]
        trees = draft(self, failed)
        seen.append((self.draining, self.yields, rooms, [f.drafted for f in self.flights]))
        return trees

    monkeypatch.setattr(Batch, "_draft", spy)
    out = run(session, reqs)
    assert [tokens for _, tokens in out] == want
    draining = [(y, rooms, drafted) for d, y, rooms, drafted in seen if d]
    assert draining and not seen[0][0]  # the stream fed the batch first, then it drained
    assert any(not all(drafted) for _, _, drafted in draining)  # some row ended sooner anyway
    for yields, rooms, drafted in draining:
        for room, did in zip(rooms, drafted):
            assert did == (room * yields >= max(rooms)), (yields, rooms, drafted)
    assert all(all(drafted) for d, _, _, drafted in seen if not d)  # while fed, every row drafted


def test_a_draining_batch_takes_no_probe(get_adapter, tmp_path, monkeypatch):
    """A probe buys knowledge of a width's cost for the steps after it; once nothing will join, the run ends with
    its slowest row and there is none to buy it for. Every width but 1 costs thousands of steps here, so a wide
    step can only be a probe: there are some while the batch is fed, none once it drains. Tokens stay batch 1's."""
    adapter = get_adapter("text")
    reqs = stream("text", tmp_path, 5)
    want = [tokens for _, tokens in run(Session(adapter, "ar"), reqs)]
    session = Session(adapter, "recap", batch=2)
    for curve in session.batch_engine.cost.by_rows.values():
        curve.set([1.0 if width == 1 else 1e3 * width for width in curve.sizes])
        curve.alpha = 0.0  # frozen: what a probe took does not make wide steps look cheap afterwards
    monkeypatch.setattr(BatchCost, "probe", lambda self: 4)  # a probe is due at every step
    steps, draft, verify = [], Batch._draft, BatchEngine.verify

    def spy_draft(self, failed):
        steps.append([self.draining])
        return draft(self, failed)

    def spy_verify(self, trees, *args):
        steps[-1].append(max(len(t) for t in trees))
        return verify(self, trees, *args)

    monkeypatch.setattr(Batch, "_draft", spy_draft)
    monkeypatch.setattr(BatchEngine, "verify", spy_verify)
    assert [tokens for _, tokens in run(session, reqs)] == want
    assert any(width == 4 for draining, width in steps if not draining)  # fed: probes of width 4
    drained = [width for draining, width in steps if draining]
    assert drained and drained == [1] * len(drained)  # draining: none


def test_a_busy_batch_puts_a_due_probe_off_for_a_while():
    """A step that shares the cores with the next turns' preparation times that contention as much as its width:
    a probe due waits for a quiet step, PROBE_WAIT busy steps at most (preparation that never idles cannot put
    re-testing off for good); a quiet batch probes at once, a draining one never."""
    cost = SimpleNamespace(probe=lambda: 4, busy=True)  # a probe of width 4 is due; the step shares the cores
    batch = SimpleNamespace(draining=False, _waited=0)
    assert [Batch._probe(batch, cost) for _ in range(PROBE_WAIT + 1)] == [None] * PROBE_WAIT + [4]
    assert Batch._probe(batch, cost) is None  # the wait starts again after a probe
    cost.busy = False
    assert Batch._probe(batch, cost) == 4 and batch._waited == 0
    batch.draining = True
    assert Batch._probe(batch, cost) is None


def test_a_busy_batch_on_a_gpu_probes_when_due(get_adapter, monkeypatch):
    """Preparation's threads share a CPU's cores, not a GPU: a busy batch whose forward pass runs elsewhere neither
    times its steps as upper bounds nor puts a due probe off (``Batch._probe`` reads the step's one flag)."""
    adapter = get_adapter("text")
    engine = BatchEngine(adapter, max_batch=2)
    batch = Batch(engine, Session(adapter, "recap").drafter, 2)
    monkeypatch.setattr(engine.cost, "probe", lambda: 4)
    batch.busy = True
    batch._draft({})
    assert engine.cost.busy and not engine.cost.probing  # on this CPU: the due probe is put off
    monkeypatch.setattr(engine, "device", torch.device("meta"))  # a pass on another device (read, not run)
    batch._draft({})
    assert not engine.cost.busy and engine.cost.probing  # not busy there: the due probe steps now


def test_the_batch_trusts_guesses_as_far_as_rows_deliver_on_them():
    """A width is chosen from the rows' last trees, grown for the last step's width: at a wider step the rows fill
    nodes never guessed and deliver more than guessed. The trust follows what they deliver, above 1 too, within
    TRUST_RANGE; a run of steps that deliver nothing brings it down to the floor, not to 0."""
    trust = 1.0
    for _ in range(60):
        trust = learned_trust(trust, guessed=2.0, drafted=3)
    assert trust == pytest.approx(1.5, abs=0.01)
    for _ in range(60):
        trust = learned_trust(trust, guessed=1.0, drafted=5)
    assert trust == TRUST_RANGE[1]
    for _ in range(200):
        trust = learned_trust(trust, guessed=4.0, drafted=0)
    assert trust == TRUST_RANGE[0] > 0


def test_only_rows_cut_by_cost_rest(get_adapter):
    """A row rests after the cost model cut its tree to the root, not when it simply had nothing to draft."""
    cost = flat_cost({r: [1.0, 10.0, 10.0, 10.0, 10.0] for r in (1, 2, 4, 8)})
    flight = Flight(tag=0, drafter=None, context=[], max_new_tokens=10)
    nothing = RowShare(cost, rows=8, width=1, base=7.0, other_nodes=7)
    nothing.chooser()  # no candidate was ever offered
    assert not nothing.cut_to_root()
    Batch._pace(flight, nothing.cut_to_root())
    assert flight.resting == 0
    declined = RowShare(cost, rows=8, width=1, base=7.0, other_nodes=7)
    assert not declined.chooser().worth_growing(0.9)
    assert declined.cut_to_root()
    for expected in (1, 2, 4):
        Batch._pace(flight, True)
        assert flight.resting == expected
        flight.resting = 0


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl", "llava_onevision", "idefics3", "smolvlm", "internvl",
                                  "gemma3"])
def test_every_family_batches_exactly(get_adapter, arch, tmp_path):
    """The joint prefill (each family's own image inputs, padded and concatenated) and per-row masks and
    positions (Gemma 3's sliding window per row) give every family its batch-1 tokens, with full trees."""
    adapter = get_adapter(arch)
    reqs = stream(arch, tmp_path, 6)
    want = [tokens for _, tokens in run(Session(adapter, "ar"), reqs)]
    assert [tokens for _, tokens in run(Session(adapter, "tr", batch=4), reqs)] == want


@pytest.mark.parametrize("arch", ["qwen", "llava", "text"])
def test_the_static_shape_variant_equals_batch_one(get_adapter, arch, tmp_path):
    """All slots every step, trees padded to buckets, accepted nodes left where they were written: a small
    buffer makes it grow and compact many times over the stream."""
    adapter = get_adapter(arch)
    reqs = stream(arch, tmp_path)
    want = [tokens for _, tokens in run(Session(adapter, "ar"), reqs)]
    for method, knobs, costs in METHODS:
        for n in (2, 5):
            session = Session(adapter, method, batch=n, static=True, **knobs)
            engine = session.batch_engine = StaticBatchEngine(adapter, top_k=session.engine.top_k, max_batch=n,
                                                              capacity=128)
            compactions, compact = [], engine._compact
            engine._compact = lambda: (compactions.append(1), compact())[1]
            if costs == "flat":
                flat_batch_costs(session)
            out = run(session, reqs)
            assert [tokens for _, tokens in out] == want, (method, knobs, costs, n)
            assert engine.capacity > 128  # it grew
            assert compactions or method != "tr"  # 128-node template steps fill the buffer again and again


def test_the_static_variant_refuses_sliding_windows(get_adapter):
    with pytest.raises(ValueError, match="sliding windows"):
        StaticBatchEngine(get_adapter("gemma3"), max_batch=2)


def test_length_groups_bound_every_rows_padding_in_few_groups():
    lengths = [2046, 30, 40, 100, 12, 130, 300, 64, 2000]
    groups = length_groups(lengths)
    assert groups == [[0, 8], [1, 2, 3, 4, 7], [5], [6]]  # in order of their first prompt, each in input order
    for g in groups:
        held = [max(lengths[i], 64) for i in g]  # under 64 tokens a prompt counts as 64
        assert max(held) <= 2 * min(held)
    assert length_groups([50] * 16) == [list(range(16))]  # like prompts: still one prefill
    assert length_groups([10, 500, 20], factor=100.0) == [[0, 1, 2]] and length_groups([]) == []


@pytest.mark.parametrize("method", ["ar", "recap"])
def test_a_long_prompt_prefills_apart_and_every_token_stays(get_adapter, tmp_path, monkeypatch, method):
    """A long prompt first among short ones: no joint prefill pads a short row to its length, and every
    request's tokens equal batch 1's."""
    adapter = get_adapter("text")
    reqs = stream("text", tmp_path, 8)
    reqs[0].turns = ["a very long question " * 15]  # 242 tokens; the others 17-51
    knobs = {"budget": 8} if method == "recap" else {}  # a fixed budget: no costs measured on copies of a prompt
    want = [tokens for _, tokens in run(Session(adapter, method, **knobs), reqs)]
    joined: list[list[int]] = []
    real_join = BatchEngine.join_trees

    def join(self, prompts, trees, want_rows=False):
        joined.append([p.length for p in prompts])
        return real_join(self, prompts, trees, want_rows)

    monkeypatch.setattr(BatchEngine, "join_trees", join)
    out = run(Session(adapter, method, batch=5, **knobs), reqs)
    assert [tokens for _, tokens in out] == want
    assert any(len(g) > 1 for g in joined) and any(max(g) > 200 for g in joined)
    assert all(max(g) <= 2 * max(min(g), 64) for g in joined), joined
