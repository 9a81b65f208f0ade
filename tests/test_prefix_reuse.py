"""Prefix reuse and inputs prepared ahead: the same tokens as transformers' own generate(), whatever is reused.

Streams ask several questions about one image (some differing only after it, some before it), repeat a request
whole, and carry a multi-turn conversation; every method at batch 1 and batched, with and without reuse, must
give ``generate(do_sample=False)``'s tokens on the tiny model of every family (float64), and the reuse must
actually happen (``prefix_hit``). Also: what must never be reused (another image at the same path, a prompt
that differs before its image), the cache's bounds, and preparation errors landing on the right line.
"""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from recap_cli.adapters import Gemma3Adapter
from recap_cli.batch import answer_all
from recap_cli.decoding import compat
from recap_cli.decoding.batched import Batch
from recap_cli.decoding.batched_static import StaticBatchEngine
from recap_cli.decoding.engine import Engine
from recap_cli.prefix_cache import PrefixCache, common_prefix
from recap_cli.records import Request
from recap_cli.session import GenerateSession, Session

from .conftest import make_image

NEEDS_NUM2WORDS = pytest.mark.skipif(importlib.util.find_spec("num2words") is None,
                                     reason="SmolVLMProcessor needs the num2words package")
FAMILIES = ["qwen", "llava", "text", "qwen2_vl", "qwen3_vl", "llava_onevision", "idefics3",
            pytest.param("smolvlm", marks=NEEDS_NUM2WORDS), "internvl", "gemma3"]
METHODS = ["ar", "recap", "tr", "pld"]
SYSTEM = [{"role": "system", "content": "Answer briefly."}]


def stream(arch: str, tmp_path) -> list[Request]:
    """Grouped questions about image 0 (one differing before its image: a system prompt), a repeat, image 1, and
    a three-turn conversation about image 0; text models get the same shapes without images."""
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"{arch}-{i}.png")
        make_image(10 + i, (80 + 8 * i, 60)).save(paths[-1])
    image = (lambda i: paths[i]) if arch != "text" else (lambda i: None)
    ask = [("What colour is the square?", 0, []), ("Describe the picture in one sentence, please.", 0, []),
           ("What colour is the square?", 0, SYSTEM), ("What colour is the square?", 0, []),
           ("hi", 1, []), ("Describe the picture in one sentence, please.", 1, [])]
    reqs = [Request(line=i + 1, id=f"r{i}", image=image(img), turns=[q], history=list(h), max_new_tokens=8 + 2 * i)
            for i, (q, img, h) in enumerate(ask)]
    reqs.insert(4, Request(line=0, id="chat", image=image(0), max_new_tokens=8,
                           turns=["What colour is the square?", "And then?", "Why?"]))
    return reqs


def run(session, reqs, workers=None) -> list[tuple[dict, list[list[int]]]]:
    return list(answer_all(session, reqs, "tiny", 40, workers=workers))


_REFERENCE: dict = {}


def reference(adapter, name: str, reqs: list[Request]) -> list[list[list[int]]]:
    """Each request's turns decoded by transformers' own generate(do_sample=False), one request at a time."""
    key = (name, tuple(r.id for r in reqs))
    if key not in _REFERENCE:
        out = run(GenerateSession(adapter, "hf"), reqs, workers=0)
        assert all(r["error"] is None for r, _ in out)
        _REFERENCE[key] = [tokens for _, tokens in out]
    return _REFERENCE[key]


def hits(out) -> dict[str, int]:
    return {r["id"]: r["prefix_hit"] for r, _ in out}


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_method_with_and_without_reuse_equals_generate(get_adapter, arch, tmp_path):
    """Without reuse (a session's default) every method and batch size is proven in test_engine, test_families
    and test_batched; here the same stream runs once without it, then every method with it."""
    adapter = get_adapter(arch)
    reqs = stream(arch, tmp_path)
    want = reference(adapter, arch, reqs)
    off = run(Session(adapter, "recap", batch=3), reqs)
    assert [tokens for _, tokens in off] == want and not any(hits(off).values())
    for method in METHODS:
        for batch in (1, 3):
            session = Session(adapter, method, batch=batch, prefix_cache=64)
            session.prefixes.min_text_hit = 4  # the tiny models' system prompts are short
            out = run(session, reqs)
            assert [r["id"] for r, _ in out] == [r.id for r in reqs]
            assert [tokens for _, tokens in out] == want, (method, batch)
            reused = hits(out)
            assert reused["r3"] > 0 and reused["chat"] > 0, (method, batch, reused)  # a repeat; its own turns
            if arch != "text":  # (text prompts sharing only a chat header are not worth a pass of their own)
                # Image 0, another question: whichever of the two joins first serves the other. r1 usually
                # follows r0, but a batch does not wait for a slow preparation (under load r1 can be ready and
                # join first; then r0 reuses r1's prefix).
                assert reused["r1"] > 0 or reused["r0"] > 0, (method, batch, reused)
                assert reused["r2"] == 0  # differs before its image: nothing it could reuse


@pytest.mark.parametrize("batch", [1, 3])
def test_no_room_to_keep_a_prefix_costs_only_the_reuse(get_adapter, tmp_path, monkeypatch, batch):
    """Copying a finished turn's rows out of the cache can run a GPU out of memory: that offer is dropped, the
    record stays answered (batch 1) and the run goes on (a batch, where it ended the run with a traceback)."""
    adapter = get_adapter("text")
    reqs = stream("text", tmp_path)
    want = reference(adapter, "text", reqs)

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")

    monkeypatch.setattr(compat, "row_layers", no_room)
    session = Session(adapter, "recap", batch=batch, prefix_cache=64)
    out = run(session, reqs)
    assert [r["error"] for r, _ in out] == [None] * len(reqs)
    assert [tokens for _, tokens in out] == want and len(session.prefixes) == 0


@pytest.mark.parametrize("arch", ["qwen", "llava", "text", "gemma3"])
def test_static_engines_reuse_exactly(get_adapter, arch, tmp_path):
    """The static-cache engine at batch 1 (a cache that must grow, too) and the static-shape batched engine."""
    adapter = get_adapter(arch)
    reqs = stream(arch, tmp_path)
    want = reference(adapter, arch, reqs)
    for batch in (1, 3):
        if batch > 1 and arch == "gemma3":
            continue  # the static-shape batched engine refuses sliding windows
        session = Session(adapter, "recap", batch=batch, static=True, prefix_cache=64)
        session.prefixes.min_text_hit = 4
        if batch > 1:
            session.batch_engine = StaticBatchEngine(adapter, max_batch=batch, capacity=128)
            session.batch_engine.prefixes = session.prefixes
        out = run(session, reqs)
        assert [tokens for _, tokens in out] == want, batch
        assert hits(out)["r3"] > 0 and hits(out)["chat"] > 0


def test_a_prompt_that_differs_after_the_image_reuses_exactly_the_common_part(get_adapter, tmp_path):
    """Same image, two wordings that share their first words: the hit is the common token prefix, no more."""
    adapter = get_adapter("qwen")
    make_image(3).save(tmp_path / "a.png")
    reqs = [Request(line=1, id="a", image=tmp_path / "a.png", turns=["What colour is the square?"]),
            Request(line=2, id="b", image=tmp_path / "a.png", turns=["What colour is the circle?"])]
    prompts = [adapter.build([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
                             [make_image(3)]) for q in ("What colour is the square?", "What colour is the circle?")]
    common = common_prefix(prompts[0].input_ids[0], prompts[1].input_ids[0])
    assert adapter.image_end(prompts[1]) < common < prompts[1].length
    want = reference(adapter, "qwen", reqs)
    for batch in (1, 2):
        out = run(Session(adapter, "ar", batch=batch, prefix_cache=64), reqs)
        assert [t for _, t in out] == want
        # Batch 1 continues the cache left by the turn before; the batch reuses its stored part (through the image).
        assert hits(out)["b"] == (common if batch == 1 else adapter.image_end(prompts[1]))


@pytest.mark.parametrize("batch", [1, 3])
def test_a_changed_image_at_the_same_path_is_not_reused(get_adapter, tmp_path, batch):
    adapter = get_adapter("qwen")
    path = tmp_path / "same.png"
    req = Request(line=1, id="x", image=path, turns=["What colour is the square?"])
    session = Session(adapter, "ar", batch=batch, prefix_cache=64)
    make_image(5).save(path)
    first = run(session, [req])
    make_image(6).save(path)  # same size: the same placeholder tokens, other pixels
    second = run(session, [req])
    assert session.prefixes.stored > 0 and first[0][0]["prefix_hit"] == 0 and second[0][0]["prefix_hit"] == 0
    assert [t for _, t in second] == [t for _, t in run(GenerateSession(adapter, "hf"), [req], workers=0)]
    assert second[0][1] != first[0][1]  # the image matters to the tiny model: a stale prefix would show
    again = run(session, [req])  # unchanged since: now it is reused
    assert again[0][0]["prefix_hit"] > 0 and again[0][1] == second[0][1]


def test_a_conversation_reuses_its_whole_cache(get_adapter, tmp_path):
    """Turn 2 takes turn 1's prompt and answer from the cache; turn 3 turn 2's (batch 1: in place; batched:
    offered when the turn leaves); no other request is in the stream, so the hits are its own."""
    adapter = get_adapter("llava")
    make_image(7).save(tmp_path / "c.png")
    req = Request(line=1, id="c", image=tmp_path / "c.png", max_new_tokens=8,
                  turns=["What colour is the square?", "And then?", "Why?"])
    want = reference(adapter, "llava-chat", [req])
    first_prompt = adapter.build([{"role": "user", "content": [{"type": "image"},
                                                               {"type": "text", "text": req.turns[0]}]}],
                                 [make_image(7)])
    for batch in (1, 2):
        out = run(Session(adapter, "recap", batch=batch, prefix_cache=64), [req])
        assert [t for _, t in out] == want
        # Turns 2 and 3 each reuse at least the whole first prompt (and the answers after it).
        assert out[0][0]["prefix_hit"] >= 2 * first_prompt.length, batch


def test_reuse_is_refused_with_a_reason_where_positions_are_dropped(get_adapter, monkeypatch, tmp_path):
    """A cache whose sliding layers keep only a window cannot give a prefix whole: reuse is off, decoding goes on."""
    adapter = get_adapter("gemma3")
    monkeypatch.setattr(Gemma3Adapter, "new_cache", lambda self, capacity=None: compat.new_cache(self.model))
    session = Session(adapter, "ar", prefix_cache=64)
    assert session.prefixes is None and "window" in session.prefix_refusal
    assert Session(get_adapter("qwen"), "ar", prefix_cache=64).prefix_refusal is None


def test_the_cache_keeps_to_its_size_and_drops_the_least_recently_used():
    def layers(n):
        return [(torch.zeros(2, n, 4, dtype=torch.float64), torch.zeros(2, n, 4, dtype=torch.float64))]

    cache = PrefixCache(megabytes=3 * (2 * 2 * 100 * 4 * 8 + 800) / 2**20, min_text_hit=4)
    ids = [torch.arange(100) + 1000 * i for i in range(4)]
    for i in range(3):
        assert cache.offer(ids[i], (), lambda: layers(100), None)
    assert len(cache) == 3 and cache.used <= cache.capacity
    assert cache.lookup(ids[0], (), 0).length == 99  # the last token is always prefilled; entry 0 now recent
    assert cache.offer(ids[3], (), lambda: layers(100), None)
    assert len(cache) == 3 and cache.lookup(ids[1], (), 0) is None  # entry 1 was the least recently used
    assert cache.lookup(ids[0], (), 0) is not None
    # An entry that extends another replaces it; one already held is not stored twice.
    longer = torch.cat([ids[0], torch.arange(20)])
    assert cache.offer(longer, (), lambda: layers(120), None) and len(cache) <= 3
    assert sum(common_prefix(e.ids, ids[0]) == 100 for e in cache.entries.values()) == 1
    assert not cache.offer(ids[0][:50], (), lambda: layers(50), None)
    # Image tokens must be covered: a hit that stops inside the image block (end 60) is none.
    cache.clear()
    cache.offer(ids[0][:50], ("img",), lambda: layers(50), None)
    assert cache.lookup(ids[0], ("img",), 60) is None and cache.lookup(ids[0], ("img",), 40).length == 50
    assert cache.lookup(ids[0], ("other",), 40) is None  # another image's content
    assert cache.lookup(ids[0], (), 40) is None  # image tokens whose content is unknown
    cache.clear()
    cache.offer(ids[0][:3], (), lambda: layers(3), None)
    assert cache.lookup(ids[0], (), 0) is None  # a text hit under min_text_hit is not worth it
    assert not PrefixCache(0.001).offer(ids[0], (), lambda: layers(100), None)  # bigger than the whole cache


@pytest.mark.parametrize("batch", [1, 3])
def test_preparation_errors_land_on_their_own_lines_in_order(get_adapter, tmp_path, batch):
    adapter = get_adapter("qwen")
    reqs = stream("qwen", tmp_path)[:5]
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    reqs.insert(1, Request(line=10, id="missing", image=tmp_path / "nowhere.png", turns=["hi"]))
    reqs.insert(3, Request(line=11, id="corrupt", image=tmp_path / "corrupt.png", turns=["hi"]))
    reqs.insert(4, Request(line=12, id="parsed-bad", error="line 12: not valid JSON"))
    good = [r for r in reqs if r.id not in ("missing", "corrupt", "parsed-bad")]
    want = reference(adapter, "qwen", good)
    out = run(Session(adapter, "recap", batch=batch, prefix_cache=64), reqs, workers=2)
    assert [r["id"] for r, _ in out] == [r.id for r in reqs]
    errors = {r["id"]: r["error"] for r, _ in out if r["error"]}
    assert set(errors) == {"missing", "corrupt", "parsed-bad"}
    assert "image not found" in errors["missing"] and "cannot read image" in errors["corrupt"]
    assert [t for r, t in out if not r["error"]] == want


def test_a_slow_preparation_does_not_stall_the_rows_decoding(get_adapter, tmp_path, monkeypatch):
    """One request's preparation waits until the batch has stepped three times: if the decoding loop waited
    for it, it would never be released (the wait times out and the test fails)."""
    adapter = get_adapter("text")
    reqs = stream("text", tmp_path)[:4]
    session = Session(adapter, "ar", batch=4, prefix_cache=64)
    stepped, released = threading.Event(), []
    real_prepare, real_step, steps = Session.prepare, Batch.step, []

    def prepare(self, messages, images, n):
        if messages[-1]["content"] == reqs[1].turns[0]:  # the only request asking this
            released.append(stepped.wait(timeout=60))
        return real_prepare(self, messages, images, n)

    def step(self):
        steps.append(1)
        if len(steps) == 3:
            stepped.set()
        return real_step(self)

    monkeypatch.setattr(Session, "prepare", prepare)
    monkeypatch.setattr(Batch, "step", step)
    out = run(session, reqs, workers=2)
    assert released == [True] and all(r["error"] is None for r, _ in out)
    assert [t for _, t in out] == [t for _, t in run(Session(adapter, "ar", prefix_cache=0), reqs, workers=0)]


def test_batch_one_engine_reuses_a_held_conversation_in_place(get_adapter):
    """The engine's own cache serves the next turn without a copy; the prefix cache only gets the image part."""
    adapter = get_adapter("qwen")
    engine = Engine(adapter)
    engine.prefixes = PrefixCache(64)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}]
    prompt = adapter.build(msgs, [make_image(9)])
    first, _ = engine.prefill(prompt)
    cache = engine.cache
    engine.hold(prompt, [first])
    entry = next(iter(engine.prefixes.entries.values()))
    assert entry.length == adapter.image_end(prompt)
    follow = adapter.build(msgs + [{"role": "assistant", "content": [{"type": "text", "text": "Yes."}]},
                                   {"role": "user", "content": [{"type": "text", "text": "Why?"}]}], [make_image(9)])
    engine.prefill(follow)
    assert engine.cache is cache and engine.hit == common_prefix(prompt.input_ids[0], follow.input_ids[0])


def test_demo_model_gives_the_same_tokens_with_reuse(tmp_path):
    """The shipped demo model in float32, the grouped VQA set (ten lines: two images) and two conversations: with
    reuse, at batch 1 and 4, the tokens of the run without it (fp32 sums in another order could flip a near-tie:
    none does here), and the reuse happens."""
    from pathlib import Path

    from recap_cli.models import load
    from recap_cli.records import read

    bench = Path(__file__).resolve().parent.parent / "sample_inputs" / "bench"
    reqs = []
    for name, n in (("demo_vqa_grouped.jsonl", 10), ("demo_multiturn.jsonl", 2)):
        with open(bench / name, "rb") as f:
            reqs += list(read(f, bench))[:n]
    demo = load("demo", device="cpu", dtype="fp32")
    want = [t for _, t in answer_all(Session(demo, "ar"), reqs, "demo", 24)]
    for method, batch in [("ar", 1), ("recap", 1), ("ar", 4), ("recap", 4), ("tr", 4), ("pld", 4)]:
        out = list(answer_all(Session(demo, method, batch=batch, prefix_cache=64), reqs, "demo", 24))
        assert [t for _, t in out] == want, (method, batch)
        reused = hits(out)
        assert all(reused[f"gvqa-demo-0{i}-{k}"] > 0 for i in (1, 2) for k in (2, 3, 4, 5)), reused
        assert reused["chat-demo-01"] > 0 and reused["chat-demo-02"] > 0


def test_run_and_compare_switch_reuse_on_the_command_line(model_dirs, tmp_path):
    """``recap run`` reuses by default (records and summary say how much) and not with --prefix-cache 0, same
    answers; ``recap compare`` runs reuse on and off side by side as methods, each checked against the baseline."""
    import orjson
    from typer.testing import CliRunner

    from recap_cli import cli

    make_image(1).save(tmp_path / "a.png")
    rows = [{"id": f"q{i}", "image": "a.png", "question": q} for i, q in
            enumerate(["What colour is the square?", "Describe the picture in one sentence, please.", "hi"])]
    (tmp_path / "in.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    out = {}
    for setting in ([], ["--prefix-cache", "0"]):
        summary = tmp_path / f"summary{len(setting)}.json"
        result = CliRunner().invoke(cli.app, ["run", str(tmp_path / "in.jsonl"), "--model", str(model_dirs["qwen"]),
                                              "--max-new-tokens", "8", "--batch", "2", "--summary", str(summary),
                                              *setting])
        assert result.exit_code == 0, result.stderr
        out[bool(setting)] = [orjson.loads(x) for x in result.stdout.splitlines()]
        reuse = orjson.loads(summary.read_bytes())["prefix_reuse"]
        assert (reuse == 0) if setting else (reuse > 0 and "of prompt tokens reused" in result.stderr)
    assert [r["answer"] for r in out[False]] == [r["answer"] for r in out[True]]
    assert sum(r["prefix_hit"] for r in out[False]) > 0 and not any(r["prefix_hit"] for r in out[True])
    result = CliRunner().invoke(cli.app, ["compare", str(tmp_path / "in.jsonl"), "--model", str(model_dirs["qwen"]),
                                          "--methods", "ar:prefix=0,recap,recap:prefix=0", "--max-new-tokens", "8",
                                          "--json", str(tmp_path / "cmp.json")])
    assert result.exit_code == 0, result.stderr
    summary = orjson.loads((tmp_path / "cmp.json").read_bytes())["summary"]["in"]
    assert all(s["match_rate"] == 1.0 for s in summary.values())
    assert summary["ar"]["prefix_reuse"] > 0 and summary["recap"]["prefix_reuse"] > 0
    assert summary["ar:prefix=0"]["prefix_reuse"] == 0 == summary["recap:prefix=0"]["prefix_reuse"]
