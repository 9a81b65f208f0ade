"""The decoding settings people run: the model's own generation config, a repetition penalty, seeded sampling.

What is proved, on tiny float64 models (batched sums cannot flip a token there):
- greedy + repetition penalty (1.05, 1.3) gives ``model.generate()``'s tokens for every family and method, through
  random trees from all-wrong to mostly-right, at batch 1 and 4, multi-turn included; a penalty history that
  forgets a node's own path is caught;
- ``--generation-config model`` on a Qwen2.5-VL twin whose generation config carries the real checkpoint's values
  (do_sample, top_k 1, top_p 0.001, temperature 0.1, repetition_penalty 1.05) gives plain ``generate()``'s tokens;
- seeded sampling gives the same tokens for every method and batch size 1/2/5/8, other seeds other tokens;
- the draws follow the processed distribution: the first token over many seeds (chi-square against transformers'
  own processors), and, given the first token, the second (drawn at a tree's root) and the third (drawn at the
  drafted node the tree proposed, in the same step): where a wrong tree rule would show, and a rule that reuses
  one uniform down the tree is caught.
"""

from __future__ import annotations

import math
from dataclasses import replace

import orjson
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation import logits_process as lp

from recap_cli.batch import answer_all
from recap_cli.decoding import compat, sampling
from recap_cli.decoding.engine import Engine, generate
from recap_cli.decoding.sampling import Picker, Settings, SettingError, request_key
from recap_cli.decoding.tree import Source, Tree
from recap_cli.drafters import Drafter
from recap_cli.models import load
from recap_cli.session import GenerateSession, Session
from recap_cli.tiny_models import build_tiny_qwen2_5_vl

from .conftest import OracleDrafter, request
from .test_cli_run import invoke, jsonl, lines
from .test_batched import flat_batch_costs, stream
from .test_drafters_exact import flat_costs
from .test_families import FAMILIES

QUESTIONS = ["Describe the picture in one sentence, please.", "What colour is the square?"]
TREES = [(1, 0.0), (16, 0.9), (64, 0.6), (33, 0.8), (64, 0.95)]
METHODS = ("ar", "recap", "tr", "pld", "suffix")
SAMPLED = Settings(do_sample=True, temperature=0.7, top_p=0.9, top_k=20, seed=1234)
# The real Qwen2.5-VL-7B-Instruct generation_config.json (besides token ids): sampling with top_k 1 is greedy.
QWEN_CONFIG = dict(do_sample=True, repetition_penalty=1.05, temperature=0.1, top_p=0.001, top_k=1)


def hf_tokens(adapter, messages, images, n: int, **settings) -> list[int]:
    """transformers' own generate() with ``settings`` (none: the checkpoint's generation config), fed by the
    processor directly, not through recap's adapter."""
    proc, model = adapter.tokenizer, adapter.model
    if adapter.arch == "text":
        inputs = proc.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    else:
        text = proc.apply_chat_template(messages, add_generation_prompt=True)
        inputs = proc(text=[text], images=images, return_tensors="pt")
        inputs = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    out = model.generate(**inputs, max_new_tokens=n, **settings)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def picker(settings: Settings, line: int = 1) -> Picker | None:
    return None if settings.plain else Picker(settings.seeded(), request_key(line, f"r{line}"), 0)


def decode(adapter, arch, qi, drafter, settings, n=40, seed=1) -> list[int]:
    msgs, imgs = request(arch, QUESTIONS[qi], seed)
    return generate(Engine(adapter), adapter.build(msgs, imgs), drafter, n, picker(settings)).tokens


def sessions(adapter, settings: Settings, batch: int = 1):
    """One session per method; trees sized as if steps of up to 16 nodes were free (real trees on a tiny model)."""
    for method in METHODS:
        session = Session(adapter, method, batch=batch, sampling=settings)
        if method in ("recap", "pld"):
            flat_batch_costs(session) if batch > 1 else flat_costs(session)
        yield method, session


# --- greedy + repetition penalty equals generate() -------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen", "llava", "text"] + FAMILIES)
def test_penalty_equals_generate_for_every_method_and_tree(get_adapter, family):
    adapter = get_adapter(family)
    for penalty in (1.05, 1.3):
        settings = Settings(repetition_penalty=penalty)
        refs = [hf_tokens(adapter, *request(family, q, 1), 40, do_sample=False, repetition_penalty=penalty)
                for q in QUESTIONS]
        qi = max(range(len(QUESTIONS)), key=lambda i: len(refs[i]))  # the longer answer: more to get wrong
        msgs, imgs, ref = *request(family, QUESTIONS[qi], 1), refs[qi]
        assert len(ref) >= 10
        for method, session in sessions(adapter, settings):
            assert session.answer(msgs, imgs, 40, picker(settings)).tokens == ref, (penalty, method)
        for i, (nodes, p_right) in enumerate(TREES):
            drafter = OracleDrafter(ref, p_right, nodes, seed=i, vocab=adapter.vocab_size)
            assert decode(adapter, family, qi, drafter, settings) == ref, (penalty, nodes, p_right)


@pytest.mark.parametrize("arch", ["text", "llava"])
def test_the_penalty_changes_tokens_and_a_node_needs_its_own_path(get_adapter, monkeypatch, arch):
    """The penalty matters on these models, and a history without the node's own path (the committed text only)
    is caught: deep accepted paths are where it differs."""
    adapter = get_adapter(arch)
    msgs, imgs = request(arch, QUESTIONS[1], 1)
    ref = hf_tokens(adapter, msgs, imgs, 40, do_sample=False, repetition_penalty=1.3)
    assert ref != hf_tokens(adapter, msgs, imgs, 40, do_sample=False)

    def committed_only(trees, pickers):
        real = histories(trees, pickers)
        width = max(p.history.numel() for p in pickers)
        return real[:, :width]

    histories = sampling.histories
    monkeypatch.setattr(sampling, "histories", committed_only)
    wrong = [decode(adapter, arch, 1, OracleDrafter(ref, p, n, seed=i, vocab=adapter.vocab_size),
                    Settings(repetition_penalty=1.3)) != ref for i, (n, p) in enumerate(TREES)]
    assert sum(wrong) >= 2


@pytest.mark.parametrize("arch", ["qwen", "llava", "text"])
def test_penalty_batched_and_multi_turn_equal_generate(get_adapter, arch, tmp_path):
    adapter = get_adapter(arch)
    reqs = stream(arch, tmp_path, 6)  # request 4 has three turns, each seeing the earlier answers
    settings = Settings(repetition_penalty=1.3)
    want = [tokens for _, tokens in answer_all(GenerateSession(adapter, "hf", sampling=settings), reqs, "t", 30)]
    assert len(want[4]) == 3
    for batch in (1, 4):
        for method, session in sessions(adapter, settings, batch):
            out = list(answer_all(session, reqs, "t", 30))
            assert [tokens for _, tokens in out] == want, (method, batch)
            assert out[0][0]["decoding"] == {"do_sample": False, "repetition_penalty": 1.3}


def twin(path, **generation):
    """The tiny Qwen2.5-VL (the same weights as the ``qwen`` one) with these generation config values."""
    build_tiny_qwen2_5_vl(path)
    config = GenerationConfig.from_pretrained(path)
    config.update(**generation)
    config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen_twin(tmp_path_factory):
    """The twin carrying Qwen2.5-VL-7B-Instruct's generation config."""
    return twin(tmp_path_factory.mktemp("twin") / "qwen", **QWEN_CONFIG)


def test_the_model_generation_config_equals_plain_generate(qwen_twin, tmp_path):
    adapter = load(str(qwen_twin), device="cpu", dtype="fp64", attn="sdpa")
    settings = sampling.resolve(adapter.model.generation_config, "model")
    assert settings == Settings(do_sample=True, temperature=0.1, top_k=1, top_p=0.001, repetition_penalty=1.05)
    assert not settings.sampling and sampling.sentence(settings) == ("greedy (top-k 1 leaves one token), "
                                                                     "repetition penalty 1.05")
    changed = 0
    for qi in (0, 1):
        msgs, imgs = request("qwen", QUESTIONS[qi], 2)
        ref = hf_tokens(adapter, msgs, imgs, 40)  # generate() as a user calls it: the checkpoint's settings
        changed += ref != hf_tokens(adapter, msgs, imgs, 40, do_sample=False, repetition_penalty=1.0)
        for method, session in sessions(adapter, settings):
            assert session.answer(msgs, imgs, 40, picker(settings)).tokens == ref, method
    assert changed  # the checkpoint's penalty changes this model's answers: the test can fail
    reqs = stream("qwen", tmp_path, 6)
    want = [tokens for _, tokens in answer_all(GenerateSession(adapter, "hf", sampling=settings), reqs, "t", 30)]
    for method, session in sessions(adapter, settings, 4):
        assert [tokens for _, tokens in answer_all(session, reqs, "t", 30)] == want, method


# --- seeded sampling: the same tokens whatever the method and batch --------------------------------------------

@pytest.mark.parametrize("arch, penalty", [("qwen", 1.0), ("llava", 1.3), ("text", 1.0), ("text", 1.3),
                                           pytest.param("qwen", 1.3, marks=pytest.mark.slow),
                                           pytest.param("llava", 1.0, marks=pytest.mark.slow)])
def test_seeded_sampling_is_identical_for_every_method_and_batch_size(get_adapter, arch, penalty, tmp_path):
    adapter = get_adapter(arch)
    settings = replace(SAMPLED, repetition_penalty=penalty)
    reqs = stream(arch, tmp_path, 8)
    want = [tokens for _, tokens in answer_all(Session(adapter, "ar", sampling=settings), reqs, "t", 20)]
    for batch in (1, 2, 5, 8):
        for method, session in sessions(adapter, settings, batch):
            if method == "ar" and batch == 1:
                continue
            out = list(answer_all(session, reqs, "t", 20))
            assert [tokens for _, tokens in out] == want, (method, batch)
    assert out[0][0]["decoding"]["seed"] == 1234 and out[0][0]["decoding"]["temperature"] == 0.7
    static = Session(adapter, "recap", batch=5, static=True, sampling=settings)  # the CUDA-graph engine's path
    assert [tokens for _, tokens in answer_all(static, reqs, "t", 20)] == want
    other = [tokens for _, tokens in answer_all(Session(adapter, "ar", sampling=replace(settings, seed=99)), reqs,
                                                "t", 20)]
    assert sum(a != b for a, b in zip(other, want)) >= len(reqs) - 1  # another seed, other answers
    greedy = [tokens for _, tokens in answer_all(Session(adapter, "ar"), reqs, "t", 20)]
    assert greedy != want


@pytest.mark.parametrize("arch", ["qwen", "llava", "text"])
def test_seeded_sampling_through_random_trees(get_adapter, arch):
    """Trees around the sampled answer, from all-wrong to mostly-right: deep accepted paths of drawn tokens."""
    adapter = get_adapter(arch)
    for penalty in (1.0, 1.3):
        settings = replace(SAMPLED, repetition_penalty=penalty)
        answers = [decode(adapter, arch, qi, Drafter(), settings) for qi in (0, 1)]
        qi = max((0, 1), key=lambda i: len(answers[i]))  # the longer answer: more to get wrong
        ref = answers[qi]
        assert len(ref) >= 10
        for i, (nodes, p_right) in enumerate(TREES):
            drafter = OracleDrafter(ref, p_right, nodes, seed=i, vocab=adapter.vocab_size)
            assert decode(adapter, arch, qi, drafter, settings) == ref, (penalty, nodes, p_right)
        static = Session(adapter, "recap", static=True, sampling=settings)  # batch 1's CUDA-graph path
        assert static.answer(*request(arch, QUESTIONS[qi], 1), 40, picker(settings)).tokens == ref


# --- the draws follow the model's processed distribution ------------------------------------------------------

def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs``: bins expecting fewer than 5 draws are pooled."""
    expected = probs * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    expected = torch.cat([expected[big], expected[~big].sum()[None]]).double()
    if expected[-1] < 5:  # the pooled bin is too small to test on its own: back into the smallest big bin
        observed, expected = observed[:-1], expected[:-1]
        observed[-1] += counts[~big].sum()
    stat = ((observed - expected) ** 2 / expected).sum()
    df = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def processed_probs(model, settings: Settings, history: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The next-token distribution generate() samples from: transformers' own processor list for ``settings``."""
    config = GenerationConfig(**{k: v for k, v in settings.generate_kwargs().items() if v is not None})
    processors = model._get_logits_processor(config, input_ids_seq_length=history.numel(), device="cpu")
    return torch.softmax(processors(history[None], logits.float()[None].clone())[0], -1)


@pytest.mark.parametrize("settings", [SAMPLED, replace(SAMPLED, repetition_penalty=1.3),
                                      Settings(do_sample=True, temperature=1.3, top_k=0, top_p=0.8, seed=0),
                                      Settings(do_sample=True, temperature=1.3, top_k=0, min_p=0.01, typical_p=0.95,
                                               epsilon_cutoff=1e-3, eta_cutoff=1e-3, seed=0)])
def test_first_token_frequencies_match_the_processed_distribution(get_adapter, settings):
    """2000 seeds: the first token's frequencies against transformers' processed softmax (deterministic). Top-k
    candidates, the top-p nucleus without top-k, and the whole vocabulary through every other warper recap
    honours."""
    adapter = get_adapter("text")
    prompt = adapter.build(*request("text", QUESTIONS[0]))
    logits = adapter.model(input_ids=prompt.input_ids).logits[0, -1:].detach()
    want = processed_probs(adapter.model, settings, prompt.input_ids[0], logits[0])
    assert (want > 0).sum() >= 5  # a real distribution, not one token
    counts = torch.zeros_like(want)
    root = Tree.root(int(prompt.input_ids[0, -1]))
    for seed in range(2000):
        p = Picker(replace(settings, seed=seed), request_key(1, 1))
        p.start(prompt.input_ids[0])
        counts[sampling.choose(logits, [root], [p], 8)[0][0]] += 1
    assert counts[want == 0].sum() == 0  # nothing the filters removed is ever drawn
    assert chi_square_p(counts, want) > 1e-3
    flat = processed_probs(adapter.model, replace(settings, temperature=2.5 * settings.temperature),
                           prompt.input_ids[0], logits[0])
    assert chi_square_p(counts, flat) < 1e-6  # the test tells a wrong distribution apart


def test_a_drafted_token_is_drawn_from_its_conditional_distribution(get_adapter, monkeypatch):
    """Given the first token, one step verifies the tree [first -> a -> b], a and b the likeliest continuation (a
    plain forward): the second token (drawn at the root) follows the model's conditional distribution given the
    first, and the third, drawn at the drafted node a when the second is a, follows it given the first two (a plain
    forward on that prefix, processed with the prefix as its penalty history). 1500 seeds; reusing one uniform
    down the tree is caught."""
    adapter = get_adapter("text")
    settings = Settings(do_sample=True, temperature=0.5, top_k=20, repetition_penalty=1.3)
    prompt = adapter.build(*request("text", QUESTIONS[0]))
    ids = prompt.input_ids[0]

    def forward(prefix: list[int]) -> tuple[int, torch.Tensor]:
        """The likeliest next token and the processed next-token distribution after prompt + prefix."""
        history = torch.cat([ids, torch.tensor(prefix, dtype=ids.dtype)])
        logits = adapter.model(input_ids=history[None]).logits[0, -1]
        return int(logits.argmax()), processed_probs(adapter.model, settings, history, logits)

    def steps(seeds: range) -> list[tuple[int, int]]:
        engine = Engine(adapter)
        engine.prefill(prompt)  # the prompt's K/V rows; ``first`` is the root, not yet in the cache
        out = []
        for seed in seeds:
            p = Picker(replace(settings, seed=seed), request_key(1, 1))
            p.start(ids)
            p.extend([first])
            v = engine.verify(tree, p)
            out.append((v.argmax[0], v.argmax[1] if v.path[1:2] == [1] else -1))
            compat.keep_rows(engine.cache, prompt.length, None, prompt.length)  # forget the step
            engine.length = prompt.length
        return out

    def p_values(samples: list[tuple[int, int]], least: int) -> list[float]:
        seconds = [s for s, _ in samples]
        thirds = [t for s, t in samples if s == a]
        assert len(thirds) >= least, len(thirds)
        return [chi_square_p(torch.bincount(torch.tensor(tokens), minlength=want.numel()).double(), want)
                for tokens, want in ((seconds, given_first), (thirds, given_two))]

    with torch.inference_mode():
        first, _ = forward([])
        a, given_first = forward([first])
        b, given_two = forward([first, a])
        tree = Tree([first, a, b], [-1, 0, 1], [Source.ROOT, Source.OTHER, Source.OTHER])
        assert min(p_values(steps(range(1500)), 600)) > 1e-3
        real = Picker.uniforms
        monkeypatch.setattr(Picker, "uniforms", lambda self, depths: real(self, [0] * len(depths)))
        assert p_values(steps(range(400)), 150)[1] < 1e-6


# --- settings: resolution, refusal, records ------------------------------------------------------------------

def test_settings_resolve_as_transformers_does():
    assert sampling.resolve(None, "model") == sampling.resolve(None, "greedy")
    base = sampling.resolve(GenerationConfig(), "model")
    assert base.plain and base.top_k == 50  # transformers' default top-k, used once a temperature is given
    hot = sampling.resolve(None, "greedy", temperature=0.7)
    assert hot.sampling and (hot.top_k, hot.top_p, hot.temperature) == (50, 1.0, 0.7)
    qwen = GenerationConfig(**QWEN_CONFIG)
    assert sampling.resolve(qwen, "greedy").plain
    assert sampling.resolve(qwen, "model", temperature=0).describe() == {"do_sample": False,
                                                                         "repetition_penalty": 1.05}
    assert sampling.resolve(qwen, "model", top_k=20).sampling  # then top_p 0.001 and temperature 0.1 still act
    assert not sampling.resolve(GenerationConfig(temperature=0.3, top_k=5), "model").sampling  # no do_sample
    for field, value in [("num_beams", 2), ("no_repeat_ngram_size", 3), ("bad_words_ids", [[5]]),
                         ("min_new_tokens", 4), ("suppress_tokens", [3]), ("forced_eos_token_id", 2),
                         ("sequence_bias", {(5,): 1.0})]:
        with pytest.raises(SettingError, match=field):
            sampling.resolve(GenerationConfig(**{field: value}), "model")
        assert sampling.resolve(GenerationConfig(**{field: value}), "greedy").plain  # not the checkpoint's
    with pytest.raises(ValueError, match="top_p"):
        sampling.resolve(None, "model", top_p=1.5)


def test_candidates_keep_what_transformers_warpers_keep():
    """Top-k over the candidates keeps exactly TopKLogitsWarper's tokens, ties at the k-th score included (logits
    rounded to bf16 tie often), and the nucleus TopPLogitsWarper's up to float32 rounding at the boundary."""
    torch.manual_seed(0)
    tied = (torch.randn(64, 5000) * 2).bfloat16().float()
    for k_top in (1, 20, 50):
        values, ids = sampling.top_k(tied, k_top, 8)
        want = lp.TopKLogitsWarper(k_top)(None, tied)
        assert (torch.isfinite(want).sum(-1) > k_top).any() or k_top == 1  # ties at the k-th did occur
        kept = torch.full_like(tied, -math.inf).scatter(-1, ids, values)
        assert torch.equal(kept, want)
    scores = torch.randn(64, 5000) * 3
    ranked = scores.double().softmax(-1).sort(-1, descending=True)
    above = torch.empty_like(scores, dtype=torch.float64).scatter(-1, ranked.indices,
                                                                   ranked.values.cumsum(-1) - ranked.values)
    for top_p in (0.001, 0.5, 0.9, 0.99):
        values, ids = sampling.nucleus(scores, top_p, 8)
        kept = torch.full_like(scores, -math.inf).scatter(-1, ids, values)
        differ = torch.isfinite(kept) != torch.isfinite(lp.TopPLogitsWarper(top_p)(None, scores))
        # transformers sums float32 from the least likely token up: only a token whose probability above it is
        # within that rounding of top_p may be judged otherwise
        assert ((above[differ] - top_p).abs() < 1e-5).all() and differ.sum() <= 3, top_p


def test_top_p_0_keeps_the_best_token_as_transformers_does(model_dirs, tmp_path):
    """top_p 0 (a value the options accept) without top-k: TopPLogitsWarper keeps the best token alone; the nucleus
    masked every token and each request failed with an index error."""
    scores = torch.randn(4, 300) * 3
    values, ids = sampling.nucleus(scores, 0.0, 8)
    kept = torch.full_like(scores, -math.inf).scatter(-1, ids, values)
    assert torch.equal(torch.isfinite(kept), torch.isfinite(lp.TopPLogitsWarper(0.0)(None, scores)))
    inputs = tmp_path / "in.jsonl"
    inputs.write_bytes(jsonl({"id": 1, "prompt": "Tell me about the sea."}))
    common = ["run", inputs, "--model", model_dirs["text"], "--max-new-tokens", "8", "--method", "ar"]
    sampled, greedy = (invoke([*common, *extra]) for extra in (["--top-k", "0", "--top-p", "0", "--seed", "3"], []))
    assert sampled.exit_code == 0, sampled.stdout
    assert lines(sampled.stdout)[0]["answer"] == lines(greedy.stdout)[0]["answer"]


def test_uniforms_depend_on_seed_request_turn_and_position_only():
    u = sampling.uniform
    assert u(1, b"k", 0, 3) == u(1, b"k", 0, 3)
    draws = {u(s, k, turn, t) for s in (1, 2) for k in (b"a", b"b") for turn in (0, 1) for t in (0, 1)}
    assert len(draws) == 16 and all(0 <= x < 1 for x in draws)
    p = Picker(SAMPLED, b"k", 1)
    p.start(torch.tensor([1, 2]))
    p.extend([5, 6, 7])
    assert p.uniforms([0, 2, 0]) == [u(1234, b"k", 1, 3), u(1234, b"k", 1, 5), u(1234, b"k", 1, 3)]


# --- the command line --------------------------------------------------------------------------------------------

def test_run_says_its_settings_and_a_seed_reproduces_it(model_dirs, tmp_path):
    inputs = tmp_path / "in.jsonl"
    inputs.write_bytes(jsonl({"id": "a", "prompt": "Summarise: the quick brown fox jumps over the lazy dog."},
                             {"id": "b", "prompt": "Hello there, how are you?", "temperature": 0},
                             {"id": "c", "prompt": "Hi", "top_k": -1},
                             {"id": "d", "prompt": "Hello there, how are you?", "seed": 7, "top_k": 0}))
    base = ["run", inputs, "--model", model_dirs["text"], "--max-new-tokens", 12, "--batch", 2]
    first = invoke(base + ["--temperature", 0.7, "--summary", tmp_path / "s.json"])
    assert first.exit_code == 1  # the bad line's record failed; the others are answered
    a, b, c, d = lines(first.stdout)
    seed = a["decoding"]["seed"]
    assert a["decoding"] == {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 1.0,
                             "repetition_penalty": 1.0, "seed": seed}
    assert b["decoding"] == {"do_sample": False, "repetition_penalty": 1.0}  # its own temperature 0: greedy
    assert c["error"] == "'top_k' must be an integer from 0 (off) to 2**31 - 1"
    assert d["decoding"]["seed"] == 7 and d["decoding"]["top_k"] == 0
    summary = orjson.loads((tmp_path / "s.json").read_bytes())
    assert summary["decoding"] == a["decoding"] and f"seed {seed}" in first.stderr
    again = lines(invoke(base + ["--temperature", 0.7, "--seed", seed, "--batch", 1]).stdout)
    assert [r["answer"] for r in again] == [r["answer"] for r in (a, b, c, d)]
    other = lines(invoke(base + ["--temperature", 0.7, "--seed", seed + 1]).stdout)
    assert other[0]["answer"] != a["answer"] and other[3]["answer"] == d["answer"]  # d brings its own seed


def test_run_follows_the_model_config_and_refuses_what_it_cannot_honour(qwen_twin, tmp_path):
    inputs = tmp_path / "in.jsonl"
    inputs.write_bytes(jsonl({"id": 1, "prompt": "What colour is the square?"}))
    own = invoke(["run", inputs, "--model", qwen_twin, "--max-new-tokens", 8])
    assert own.exit_code == 0 and "repetition penalty 1.05" in own.stderr
    assert lines(own.stdout)[0]["decoding"] == {"do_sample": False, "top_k": 1, "repetition_penalty": 1.05}
    plain = invoke(["run", inputs, "--model", qwen_twin, "--max-new-tokens", 8, "--generation-config", "greedy"])
    assert lines(plain.stdout)[0]["decoding"] == {"do_sample": False, "repetition_penalty": 1.0}
    beams = twin(tmp_path / "beams", num_beams=3)
    refused = invoke(["run", inputs, "--model", beams, "--max-new-tokens", 8])
    assert refused.exit_code == 2 and not refused.stdout
    assert "num_beams 3 (beam search)" in refused.stderr
    assert invoke(["run", inputs, "--model", beams, "--generation-config", "greedy", "--max-new-tokens", 2]
                  ).exit_code == 0
    for bad, says in [(["--top-p", 2], "--top-p must be"), (["--generation-config", "beam"], "takes model or greedy")]:
        r = invoke(["run", inputs, "--model", qwen_twin] + bad)
        assert r.exit_code == 2 and says in r.stderr and "Traceback" not in r.stderr


def test_compare_samples_every_method_alike(model_dirs, tmp_path):
    inputs = tmp_path / "in.jsonl"
    inputs.write_bytes(jsonl(*({"id": i, "prompt": q} for i, q in enumerate(QUESTIONS))))
    r = invoke(["compare", inputs, "--model", model_dirs["text"], "--methods", "recap,pld,tr,hf",
                "--max-new-tokens", 16, "--temperature", 0.7, "--seed", 3, "--json", tmp_path / "c.json"])
    assert r.exit_code == 0, r.stderr  # hf's other draws are shown, not failures
    summary = orjson.loads((tmp_path / "c.json").read_bytes())
    stats = summary["summary"]["in"]
    assert all(stats[m]["match_rate"] == 1.0 for m in ("recap", "pld", "tr"))
    assert stats["hf"]["match_rate"] < 1.0 and "seed 3" in summary["setup"]
