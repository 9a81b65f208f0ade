"""`recap compare`: statistics from known timings, rotation, mismatch reporting, memory resets per dataset."""

from __future__ import annotations

import math

import orjson
import pytest
from PIL import Image
from typer.testing import CliRunner

from recap_cli import cli
from recap_cli import compare as comparison
from recap_cli.batch import answer_with_tokens
from recap_cli.compare import Measurement, failures, parse_method, quantile, run, summarize
from recap_cli.decoding.engine import Generation
from recap_cli.records import Request
from recap_cli.report import markdown

from .conftest import make_image


def m(id, method, tokens, seconds, steps=0, emitted=0, match=True, draft=0.0, dataset="d"):
    return Measurement(id=id, dataset=dataset, method=method, new_tokens=tokens, seconds=seconds, steps=steps,
                       emitted=emitted, draft_s=draft, decode_s=seconds, match=match)


def test_statistics_from_known_timings():
    rows = [m("a", "ar", 100, 10.0, 99, 99), m("b", "ar", 50, 2.0, 49, 49),
            m("a", "x", 100, 5.0, 33, 99, draft=0.5), m("b", "x", 50, 4.0, 25, 49, match=False, draft=0.3)]
    s = summarize(rows, "ar")["d"]["x"]
    # per-input speedups: a: 20/10 = 2.0, b: 12.5/25 = 0.5
    assert s["speedups"] == [2.0, 0.5]
    assert s["mean_speedup"] == pytest.approx(1.25)
    assert s["total_speedup"] == pytest.approx((150 / 9.0) / (150 / 12.0))
    assert s["p50"] == pytest.approx(1.25) and s["p10"] == pytest.approx(0.65) and s["p90"] == pytest.approx(1.85)
    assert s["mean_accepted"] == pytest.approx(148 / 58)
    assert s["draft_share"] == pytest.approx(0.8 / 9.0)
    assert s["match_rate"] == 0.5 and s["mismatches"] == ["b"]
    assert summarize(rows, "ar")["d"]["ar"]["mean_speedup"] == 1.0


def test_first_difference_names_the_turn_position_and_both_tokens():
    first = comparison.first_difference
    assert first([[1, 2, 3]], [[1, 2, 3]]) is None
    assert first([[1, 5, 3]], [[1, 2, 3]]) == {"turn": 0, "position": 1, "token": 5, "expected": 2}
    assert first([[1, 2]], [[1, 2, 3]]) == {"turn": 0, "position": 2, "token": None, "expected": 3}  # ended early
    assert first([[7], [4, 4, 8]], [[7], [4, 4]]) == {"turn": 1, "position": 2, "token": 8, "expected": None}
    assert first([[7]], [[7], [1]]) == {"turn": 1, "position": 0, "token": None, "expected": 1}


def test_quantile_interpolates_like_numpy():
    assert quantile([1, 2, 3, 4], 0.5) == 2.5
    assert quantile([3, 1, 2], 0.1) == pytest.approx(1.2)
    assert math.isnan(quantile([], 0.5))


def test_errors_are_counted_and_left_out_of_ratios():
    rows = [m("a", "ar", 10, 1.0), m("a", "x", 10, 0.5), m("b", "ar", 10, 1.0),
            Measurement(id="b", dataset="d", method="x", error="boom")]
    s = summarize(rows, "ar")["d"]["x"]
    assert s["errors"] == 1 and s["speedups"] == [2.0]


def test_method_specs():
    assert parse_method("recap:mixing=fixed:orders=12:suffix=off:budget=16") == (
        "recap", {"mixing": "fixed", "orders": (1, 2), "suffix": False, "budget": 16})
    assert parse_method("recap:calibrate=off") == ("recap", {"calibrate": False})
    assert parse_method("recap:trust_decay=1") == ("recap", {"trust_decay": 1.0})
    assert parse_method("recap:prompt_rows=off:early=off") == ("recap", {"prompt_rows": False, "early": False})
    assert parse_method("hf-pld") == ("hf-pld", {})
    assert parse_method("tr:budget=auto") == ("tr", {"budget": "auto"})
    assert parse_method("pld:budget=10") == ("pld", {"budget": 10})
    assert parse_method("recap:budget=auto") == ("recap", {"budget": "auto"})
    assert parse_method("recap:budget=512:top_k=1:width=1:depth=1") == (
        "recap", {"budget": 512, "top_k": 1, "width": 1, "depth": 1})
    assert parse_method("ar:prefix=0") == ("ar", {"prefix_cache": 0.0})
    for bad in ("warp", "recap:speed=9", "tr:budget=3", "recap:suffix=maybe", "tr:depth=3", "ar:budget=4",
                "recap:budget=many"):
        with pytest.raises(ValueError):
            parse_method(bad)
    # Values no drafter can take are refused here, each naming its key, not found mid-run as a traceback.
    for bad, said in (("recap:top_k=0", "top_k takes"), ("recap:top_k=-1", "top_k takes"),
                      ("recap:depth=0", "depth takes"), ("recap:width=0", "width takes"),
                      ("recap:stream_depth=0", "stream_depth takes an integer from 1 to 63"),
                      ("recap:orders=", "orders takes"), ("recap:orders=4", "orders takes"),
                      ("recap:mixing=foo", "mixing takes"), ("recap:trust_decay=0", "trust_decay takes"),
                      ("recap:budget=100000", "from 0 to 512"), ("pld:budget=513", "from 0 to 512"),
                      ("ar:prefix=-1", "prefix takes"), ("recap:budget=", "budget takes auto or"),
                      ("recap:budget=16:budget=8", "sets budget twice")):
        with pytest.raises(ValueError, match=said):
            parse_method(bad)
    # Every error starts with the spec it came from, once: --methods takes several.
    for bad, said in (("recap:budget=-3", "recap:budget=-3: budget takes auto or a number of draft nodes"),
                      ("tr:budget=abc", "tr:budget=abc: tr drafts its fixed 80-node template"),
                      ("pld:budget=x", "pld:budget=x: budget takes auto or"),
                      ("recap:top_k=0", "recap:top_k=0: top_k takes"), ("warp", "warp: unknown method: use ar"),
                      ("warp:budget=3", "warp:budget=3: unknown method 'warp'"),
                      ("recap:speed=9", "recap:speed=9: 'speed=9': variants take"),
                      ("hf:prefix=1", "hf:prefix=1: generate() keeps no prefix cache")):
        with pytest.raises(ValueError) as caught:
            parse_method(bad)
        assert str(caught.value).startswith(said) and str(caught.value).count(bad) == 1, (bad, caught.value)


class FakeAdapter:
    supports_images = False

    def decode(self, ids):
        return " ".join(map(str, ids))


class FakeSession:
    """Answers with preset tokens and timings (an injected clock), logging calls and memory resets."""

    def __init__(self, method, log, seconds, wrong_on=()):
        self.method, self.log, self.seconds, self.wrong_on = method, log, seconds, set(wrong_on)
        self.adapter = FakeAdapter()
        self.resets = 0

    def prepare(self, messages, images, max_new_tokens):
        return messages[-1]["content"], max_new_tokens

    def answer(self, messages, images, max_new_tokens, picker=None):
        return self.decode(*self.prepare(messages, images, max_new_tokens), picker)

    def decode(self, q, max_new_tokens, picker=None):
        self.log.append((self.method, q))
        tokens = [1, 2, 3, 4] if q not in self.wrong_on else [1, 2, 9, 4]
        steps = 3 if self.method == "ar" else 1
        return Generation(tokens=tokens, steps=steps, prefill_s=0.0, verify_s=self.seconds)

    def reset_memory(self):
        self.resets += 1


def requests(*pairs):
    return [Request(line=i, id=f"r{i}", turns=[q], dataset=d) for i, (d, q) in enumerate(pairs)]


def test_run_rotates_order_checks_tokens_and_resets_memory_per_dataset():
    log = []
    sessions = {"ar": FakeSession("ar", log, 2.0), "fast": FakeSession("fast", log, 1.0, wrong_on={"q3"}),
                "slow": FakeSession("slow", log, 4.0)}
    reqs = requests(("A", "q0"), ("A", "q1"), ("B", "q2"), ("B", "q3"))
    rows = run(sessions, reqs, "ar", "fake", 8, warmup=1)
    timed = log[3:]  # the first three calls are the warm-up
    assert [meth for meth, _ in timed[:3]] == ["ar", "fast", "slow"]
    assert [meth for meth, _ in timed[3:6]] == ["fast", "slow", "ar"]  # rotated for the next input
    assert [meth for meth, _ in timed[6:9]] == ["ar", "fast", "slow"]  # a new dataset starts over
    assert all(s.resets == 2 for s in sessions.values())  # once before each dataset
    summary = summarize(rows, "ar")
    assert summary["all"]["fast"]["mean_speedup"] == pytest.approx(2.0)
    assert summary["all"]["slow"]["total_speedup"] == pytest.approx(0.5)
    assert summary["B"]["fast"]["mismatches"] == ["r3"] and summary["A"]["fast"]["match_rate"] == 1.0
    where = {"turn": 0, "position": 2, "token": 9, "expected": 3}  # [1, 2, 9, 4] where ar gave [1, 2, 3, 4]
    assert summary["B"]["fast"]["first_differences"] == [{"id": "r3", **where}]
    assert [r.first_difference for r in rows if r.method == "fast"] == [None, None, None, where]
    assert summary["all"]["fast"]["mean_accepted"] == 3.0 and summary["all"]["ar"]["mean_accepted"] == 1.0
    kept = {"ar": FakeSession("ar", [], 2.0)}
    run(kept, reqs, "ar", "fake", 8, warmup=0, keep_memory=True)
    assert kept["ar"].resets == 1


class RepeatedSession(FakeSession):
    """Each run takes the next of ``clock``'s seconds; ``mark``/``rewind`` are logged (the memories they keep)."""

    def __init__(self, method, log, clock, wrong_on_run=None):
        super().__init__(method, log, 0.0)
        self.clock, self.runs, self.wrong_on_run, self.marks = iter(clock), 0, wrong_on_run, []

    def decode(self, q, max_new_tokens, picker=None):
        self.seconds, self.runs = next(self.clock), self.runs + 1
        gen = super().decode(q, max_new_tokens, picker)
        if self.runs == self.wrong_on_run:
            gen.tokens = [1, 2, 9, 4]
        return gen

    def mark(self):
        self.marks.append(("mark", self.runs))
        return self.runs

    def rewind(self, mark):
        self.marks.append(("rewind", mark))


def test_repeats_keep_each_methods_fastest_run_from_the_same_memories_and_report_a_repeat_that_differs():
    log = []
    sessions = {"ar": RepeatedSession("ar", log, [3.0, 1.0, 2.0, 4.0, 4.0, 5.0]),
                "fast": RepeatedSession("fast", log, [2.0, 0.5, 0.25, 1.0, 1.0, 1.0], wrong_on_run=5)}
    rows = run(sessions, requests(("A", "q0"), ("A", "q1")), "ar", "fake", 8, warmup=0, repeats=3)
    assert [meth for meth, _ in log] == ["ar", "fast"] * 3 + ["fast", "ar"] * 3  # methods take turns
    # Every run of an input starts from the mark taken before its first run.
    assert sessions["ar"].marks == [("mark", 0), ("rewind", 0), ("rewind", 0), ("mark", 3), ("rewind", 3),
                                    ("rewind", 3)]
    seconds = {(r.input, r.method): r.seconds for r in rows}
    assert seconds == {(0, "ar"): 1.0, (0, "fast"): 0.25, (1, "ar"): 4.0, (1, "fast"): 1.0}
    assert [(r.input, r.match) for r in rows if r.method == "fast"] == [(0, True), (1, False)]
    with pytest.raises(ValueError, match="batch"):
        batched = {"ar": FakeSession("ar", [], 1.0)}
        batched["ar"].batch = 4
        run(batched, requests(("A", "q0")), "ar", "fake", 8, repeats=2)


def _state_bytes(session) -> bytes:
    return orjson.dumps(session.drafter.state(), option=orjson.OPT_SERIALIZE_NUMPY, default=lambda t: t.tolist())


def test_a_rewound_session_runs_a_request_again_as_it_ran_the_first_time(get_adapter):
    """A repeat that saw its own earlier run (its answer in the stream memory, its whole prompt in the prefix
    cache) would draft and prefill differently, and leave other memories. (A fixed budget: at ``auto`` the trees,
    and so the rows they leave, follow the step timings.)"""
    session = comparison.make_session(get_adapter("text"), "recap:budget=16", prefix_cache=64)
    story = "the cat sat on the mat and looked at the dog " * 3
    first, second = requests(("A", story), ("A", story + "what did the cat do next?"))
    answer_with_tokens(session, first, "fake", 12)
    mark = session.mark()
    runs = []
    for _ in range(2):
        record, tokens = answer_with_tokens(session, second, "fake", 12)
        runs.append((tokens, record["prefix_hit"], record["steps"], _state_bytes(session), len(session.prefixes)))
        session.rewind(mark)
    assert runs[0] == runs[1]
    assert 0 < runs[0][1] < record["prompt_tokens"] - 8  # the story came from the first request, both times


def test_repeated_comparisons_leave_the_memories_one_run_leaves(get_adapter):
    """``run`` with repeats: every repeat gives ar's tokens, and the drafter ends as after one run of each."""
    states = []
    adapter = get_adapter("text")
    reqs = requests(("A", "the cat sat on"), ("A", "the cat sat on the mat and"), ("A", "a dog ran"))
    for repeats in (1, 3):
        sessions = {label: comparison.make_session(adapter, label) for label in ("ar", "recap:budget=16")}
        rows = run(sessions, reqs, "ar", "fake", 12, warmup=0, repeats=repeats)
        assert len(rows) == 6 and all(r.match for r in rows if r.method != "ar")
        states.append(_state_bytes(sessions["recap:budget=16"]))
    assert states[0] == states[1]


def test_compare_cli_on_a_tiny_model_writes_every_report(model_dirs, tmp_path):
    make_image(1).save(tmp_path / "a.png")
    make_image(2).save(tmp_path / "b.png")
    vqa = [{"id": f"v{i}", "image": img, "question": "What colour is the square?"} for i, img in
           enumerate(["a.png", "b.png"])]
    cap = [{"id": f"c{i}", "image": img} for i, img in enumerate(["a.png", "b.png"])]
    (tmp_path / "vqa.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in vqa))
    (tmp_path / "cap.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in cap))
    result = CliRunner().invoke(cli.app, [
        "compare", str(tmp_path / "vqa.jsonl"), str(tmp_path / "cap.jsonl"), "--model", str(model_dirs["qwen"]),
        "--methods", "recap,tr,hf,hf-pld,recap:orders=1", "--max-new-tokens", "12", "--warmup", "1",
        "--report", str(tmp_path / "rep"), "--json", str(tmp_path / "cmp.json")])
    assert result.exit_code == 0, result.stderr
    rows = [orjson.loads(x) for x in result.stdout.splitlines()]
    assert len(rows) == 4 * 6 and {r["dataset"] for r in rows} == {"vqa", "cap"}
    assert all(r["match"] for r in rows)
    data = orjson.loads((tmp_path / "cmp.json").read_bytes())
    assert set(data["summary"]) == {"vqa", "cap", "all"}
    assert data["summary"]["all"]["recap:orders=1"]["match_rate"] == 1.0
    assert "| recap |" in (tmp_path / "rep" / "report.md").read_text()
    assert Image.open(tmp_path / "rep" / "speedups.png").size[0] == 900


# --- pairs by input, never by id; failures named and fatal ------------------------------------------------------

STATS = ("mean_speedup", "total_speedup", "wall_speedup", "p10", "p50", "p90")


class TimedSession(FakeSession):
    """Each question takes its own time (seconds[q]), scaled per method: inputs differ, methods by a factor."""

    def __init__(self, method, times, scale=1.0):
        super().__init__(method, [], 0.0)
        self.times, self.scale = times, scale

    def answer(self, messages, images, max_new_tokens):
        self.seconds = self.times[messages[-1]["content"]] * self.scale
        return super().answer(messages, images, max_new_tokens)


def test_repeated_ids_pair_each_input_with_the_baselines_measurement_of_the_same_input():
    times = {"q0": 1.0, "q1": 3.0, "q2": 0.5, "q3": 7.0}
    reqs = [Request(line=1, id="same", turns=["q0"], dataset="A"), Request(line=2, id="same", turns=["q1"],
                                                                            dataset="A"),
            Request(line=1, id="same", turns=["q2"], dataset="B"), Request(line=2, id=2, turns=["q3"], dataset="B")]
    sessions = {"ar": TimedSession("ar", times), "fast": TimedSession("fast", times, scale=0.5)}
    rows = run(sessions, reqs, "ar", "fake", 8, warmup=0)
    assert [r.input for r in rows if r.method == "ar"] == [0, 1, 2, 3]
    summary = summarize(rows, "ar")
    for dataset in ("A", "B", "all"):
        assert all(summary[dataset]["ar"][k] == 1.0 for k in STATS), summary[dataset]["ar"]
        assert summary[dataset]["fast"]["speedups"] == [2.0] * (4 if dataset == "all" else 2)


def test_failures_name_the_methods_that_failed_where_another_answered():
    rows = [m("a", "ar", 10, 1.0), m("a", "x", 10, 0.5), Measurement(id="bad", dataset="d", method="ar", error="e"),
            Measurement(id="bad", dataset="d", method="x", error="e"), m("c", "ar", 10, 1.0),
            Measurement(id="c", dataset="d", method="x", error="boom")]
    failed, uneven = failures(rows)
    assert {k: [r.id for r in v] for k, v in failed.items()} == {"ar": ["bad"], "x": ["bad", "c"]}
    assert uneven == {"x": 1}
    assert failures(rows[:4])[1] == {}  # a line every method failed on is no method's fault


def test_compare_cli_names_a_failed_input_exits_1_and_scores_the_baseline_1_with_repeated_ids(
        model_dirs, tmp_path, monkeypatch):
    real = comparison.make_session

    def make(adapter, spec, *args, **kwargs):  # recap fails on one input that ar answers
        session = real(adapter, spec, *args, **kwargs)
        if spec == "recap":
            answer = session.answer

            def failing(messages, images, n, *args, **kwargs):
                if "boom" in str(messages[-1]["content"]):
                    raise RuntimeError("out of memory (injected)\nsecond line")
                return answer(messages, images, n, *args, **kwargs)

            session.answer = failing
        return session

    monkeypatch.setattr(comparison, "make_session", make)
    # Repeated ids within a file and across files; the bad line takes its number (2) as id, which line 3 repeats.
    a = [b'{"id": 2, "prompt": "Tell me about the sea."}', b"{not json", b'{"id": 2, "prompt": "Why boom today?"}',
         b'{"id": 7, "prompt": "Name three colours and a shape."}']
    b = [b'{"id": 2, "prompt": "Count to five slowly."}', b'{"id": 7, "prompt": "Describe a quiet morning."}']
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(a) + b"\n")
    (tmp_path / "b.jsonl").write_bytes(b"\n".join(b) + b"\n")
    args = ["compare", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--model", str(model_dirs["text"]),
            "--methods", "recap", "--max-new-tokens", "8", "--json", str(tmp_path / "cmp.json")]
    result = CliRunner().invoke(cli.app, args)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 1, result.stderr
    assert "recap failed on 2 of 6 inputs (1 answered by another method)" in said
    assert "a line 3 (id 2): RuntimeError: out of memory (injected)" in said and "second line" not in said
    assert "ar failed on 1 of 6 inputs (every method failed on them)" in said and "a line 2 (id 2): line 2" in said
    assert "speedup over ar" in said  # the table is printed all the same
    data = orjson.loads((tmp_path / "cmp.json").read_bytes())
    for dataset in ("a", "b", "all"):
        assert all(data["summary"][dataset]["ar"][k] == 1.0 for k in STATS), data["summary"][dataset]["ar"]
    assert [r["input"] for r in data["rows"] if r["method"] == "ar"] == [0, 1, 2, 3, 4, 5]
    allowed = CliRunner().invoke(cli.app, [*args, "--allow-failures"])
    assert allowed.exit_code == 0 and "speedup over ar" in allowed.stderr, allowed.stderr
    assert "recap failed on 2 of 6 inputs" in " ".join(allowed.stderr.split())


def test_the_markdown_report_counts_failed_inputs():
    rows = [m("a", "ar", 10, 1.0), m("a", "x", 10, 0.5), m("b", "ar", 10, 1.0),
            Measurement(id="b", dataset="d", method="x", error="boom")]
    assert "- `x` failed on 1 of 2 inputs (left out of the statistics)" in markdown(summarize(rows, "ar"), "ar")


def test_compare_resolves_images_from_root_and_an_empty_comparison_exits_1(model_dirs, tmp_path):
    """Relative image paths start from --root as in ``recap run``; where every input fails for every method
    (here: the images are not beside the input file) nothing was compared, which is not a success."""
    (tmp_path / "imgs").mkdir()
    make_image(3).save(tmp_path / "imgs" / "a.png")
    (tmp_path / "in.jsonl").write_bytes(orjson.dumps({"id": "a", "image": "a.png", "question": "Colour?"}) + b"\n")
    args = ["compare", str(tmp_path / "in.jsonl"), "--model", str(model_dirs["qwen"]), "--methods", "recap",
            "--max-new-tokens", "4", "--warmup", "0"]
    lost = CliRunner().invoke(cli.app, args + ["--allow-failures"])
    assert lost.exit_code == 1 and "nothing was compared" in " ".join(lost.stderr.split()), lost.stderr
    assert all("image not found" in orjson.loads(x)["error"] for x in lost.stdout.splitlines())
    found = CliRunner().invoke(cli.app, args + ["--root", str(tmp_path / "imgs")])
    assert found.exit_code == 0, found.stderr
    rows = [orjson.loads(x) for x in found.stdout.splitlines()]
    assert len(rows) == 2 and all(r["error"] is None and r["match"] for r in rows)
    missing = CliRunner().invoke(cli.app, args + ["--root", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "is not a folder" in missing.stderr
    (tmp_path / "empty.jsonl").write_bytes(b"")
    empty = CliRunner().invoke(cli.app, ["compare", str(tmp_path / "empty.jsonl"), "--model", "no-such-model"])
    assert empty.exit_code == 2 and "nothing to compare" in " ".join(empty.stderr.split()), empty.stderr


def test_compare_usage_errors_come_before_the_model(tmp_path):
    """An empty method list, and a dataset named as the table of every dataset is, are refused before any model
    is looked for (the model named here does not exist: reaching it would say so instead)."""
    rec = {"id": "a", "prompt": "Hi"}
    (tmp_path / "x.jsonl").write_bytes(orjson.dumps(rec) + b"\n" + orjson.dumps({**rec, "dataset": "all"}) + b"\n")
    base = ["compare", str(tmp_path / "x.jsonl"), "--model", "no-such-model"]
    for methods in ("", ",", "ar"):
        r = CliRunner().invoke(cli.app, base + ["--methods", methods])
        assert r.exit_code == 2 and "nothing to compare it with" in " ".join(r.stderr.split()), r.stderr
    r = CliRunner().invoke(cli.app, base + ["--methods", "recap"])
    assert r.exit_code == 2 and "a dataset is named 'all'" in " ".join(r.stderr.split()), r.stderr
    r = CliRunner().invoke(cli.app, base + ["--methods", "recap:top_k=0"])
    assert r.exit_code == 2 and "top_k takes" in r.stderr and "Traceback" not in r.stderr
    r = CliRunner().invoke(cli.app, base + ["--methods", "recap,tr:budget=x"])
    assert r.exit_code == 2 and "error: tr:budget=x: tr drafts" in " ".join(r.stderr.split()), r.stderr
    r = CliRunner().invoke(cli.app, base + ["--methods", "recap:orders=1,2"])
    assert r.exit_code == 2 and "as digits (recap:orders=12)" in " ".join(r.stderr.split()), r.stderr
    r = CliRunner().invoke(cli.app, base + ["--methods", "recap,hf", "--batch", "3"])
    assert r.exit_code == 2 and "compare it at --batch 1" in " ".join(r.stderr.split()), r.stderr
    r = CliRunner().invoke(cli.app, base + ["--methods", "recap", "--dtype", "fp8"])
    assert r.exit_code == 2 and "--dtype takes" in r.stderr
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.jsonl").write_bytes(orjson.dumps(rec) + b"\n")
    r = CliRunner().invoke(cli.app, base[:2] + [str(tmp_path / "b" / "x.jsonl")] + base[2:] + ["--methods", "recap"])
    assert r.exit_code == 2 and "are one dataset, 'x'" in " ".join(r.stderr.split()), r.stderr


def test_an_interrupted_comparison_still_reports_the_inputs_it_measured(model_dirs, tmp_path, monkeypatch):
    """Ctrl-C after the first input: its rows, the tables and --json are kept, marked interrupted, exit 130."""
    real = comparison.run

    def first_then_ctrl_c(sessions, requests, *args):
        emit = args[5]

        def interrupt_after_one(batch):
            emit(batch)
            raise KeyboardInterrupt

        return real(sessions, requests, *args[:5], interrupt_after_one, *args[6:])

    monkeypatch.setattr(comparison, "run", first_then_ctrl_c)
    (tmp_path / "in.jsonl").write_bytes(b"".join(orjson.dumps({"id": f"t{i}", "prompt": f"Say {i}"}) + b"\n"
                                                for i in range(3)))
    r = CliRunner().invoke(cli.app, ["compare", str(tmp_path / "in.jsonl"), "--model", str(model_dirs["text"]),
                                     "--methods", "recap", "--max-new-tokens", "4", "--warmup", "0",
                                     "--json", str(tmp_path / "c.json")])
    assert r.exit_code == 130, r.stderr
    assert "interrupted after 1 of 3 inputs" in " ".join(r.stderr.split())
    assert [orjson.loads(x)["id"] for x in r.stdout.splitlines()] == ["t0", "t0"]
    data = orjson.loads((tmp_path / "c.json").read_bytes())
    assert data["interrupted"] is True and data["summary"]["in"]["recap"]["inputs"] == 1
    assert "1 inputs of 3 (interrupted)" in data["setup"]


# --- hf's sampled tokens: shown, never a fault, and never what recap's methods are checked against --------------

def test_with_hf_as_baseline_recaps_methods_are_checked_against_each_other():
    sessions = {"hf": FakeSession("hf", [], 1.0, wrong_on={"q0"}), "ar": FakeSession("ar", [], 2.0),
                "recap": FakeSession("recap", [], 1.0, wrong_on={"q1"})}
    assert comparison.reference(list(sessions), "hf") == "ar"
    assert comparison.reference(["hf", "hf-pld"], "hf") == "hf" and comparison.reference(["ar", "hf"], "ar") == "ar"
    rows = run(sessions, requests(("A", "q0"), ("A", "q1")), "hf", "fake", 8, warmup=0)
    assert {(r.method, r.input) for r in rows if not r.match} == {("hf", 0), ("recap", 1)}
    summary = summarize(rows, "hf")["A"]
    assert summary["hf"]["mean_speedup"] == 1.0 and summary["ar"]["mean_speedup"] == pytest.approx(0.5)


def test_the_method_tokens_are_checked_against_is_found_once_and_passed_on(model_dirs, tmp_path, monkeypatch):
    """The comparison and its reports check against one method, found once (``run`` takes it from the CLI)."""
    real, calls = comparison.reference, []
    monkeypatch.setattr(comparison, "reference", lambda *args: calls.append(args) or real(*args))
    (tmp_path / "s.jsonl").write_bytes(b'{"id": 1, "prompt": "Tell me about the sea."}\n')
    r = CliRunner().invoke(cli.app, ["compare", str(tmp_path / "s.jsonl"), "--model", str(model_dirs["text"]),
                                     "--baseline", "hf", "--methods", "ar,recap", "--max-new-tokens", "4",
                                     "--warmup", "0", "--json", str(tmp_path / "c.json")])
    assert r.exit_code == 0, r.stderr
    assert calls == [(["hf", "ar", "recap"], "hf")]
    assert orjson.loads((tmp_path / "c.json").read_bytes())["checked_against"] == "ar"
    sessions = {"hf": FakeSession("hf", [], 1.0), "ar": FakeSession("ar", [], 2.0, wrong_on={"q0"}),
                "recap": FakeSession("recap", [], 1.0)}
    rows = run(sessions, requests(("A", "q0")), "hf", "fake", 8, warmup=0, checked="recap")
    assert {r.method for r in rows if not r.match} == {"ar"}  # checked against recap, as given


def test_only_hfs_mismatches_on_sampled_inputs_are_expected():
    rows = [Measurement(id="a", dataset="d", method="hf", match=False, sampled=True),
            Measurement(id="b", dataset="d", method="hf", match=False),  # greedy: hf must match
            Measurement(id="a", dataset="d", method="recap:budget=8", match=False, sampled=True),
            Measurement(id="a", dataset="d", method="hf-pld", match=True, sampled=True)]
    assert [(r.method, r.id) for r in comparison.unexpected(rows)] == [("hf", "b"), ("recap:budget=8", "a")]


def test_compare_cli_exits_0_when_only_hfs_sampled_tokens_differ(model_dirs, tmp_path):
    """A record that samples in a greedy run, and hf as the baseline of a sampled run: hf's tokens are torch's
    draws, so its differences are shown but are no fault (they exited 1), and recap is checked against ar."""
    (tmp_path / "s.jsonl").write_bytes(b'{"id": 1, "prompt": "Tell me about the sea."}\n'
                                       b'{"id": 2, "prompt": "Name three colours.", "temperature": 0.9, "seed": 4}\n')
    args = ["compare", str(tmp_path / "s.jsonl"), "--model", str(model_dirs["text"]), "--max-new-tokens", "12",
            "--json", str(tmp_path / "cmp.json")]
    own = CliRunner().invoke(cli.app, [*args, "--methods", "recap,hf"])
    assert own.exit_code == 0, own.stderr
    assert "hf: tokens differ from ar on 1 input(s): 2" in " ".join(own.stderr.split())
    under_hf = CliRunner().invoke(cli.app, [*args, "--baseline", "hf", "--methods", "recap,ar", "--temperature",
                                            "0.8", "--seed", "1"])
    assert under_hf.exit_code == 0, under_hf.stderr
    data = orjson.loads((tmp_path / "cmp.json").read_bytes())
    assert data["checked_against"] == "recap" and data["summary"]["s"]["ar"]["match_rate"] == 1.0
    assert all(r["sampled"] for r in data["rows"]) and "tokens differ from recap" in under_hf.stderr
