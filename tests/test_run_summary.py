"""The end-of-run summary counts what was answered: failed lines are no requests served, and a run that answered
nothing has no rates to print; the turns a failed conversation answered before its failure were work all the same."""

from __future__ import annotations

import orjson

from recap_cli.batch import Totals, run_figures

from .test_cli_run import LONG, invoke, jsonl, lines
from .test_safety import said, workdir  # noqa: F401 - a fixture


def record(error: str | None = None) -> dict:
    if error is not None:
        return {"error": error}
    return {"error": None, "new_tokens": 10, "prefill_ms": 5.0, "decode_ms": 45.0, "steps": 6, "turns": 1,
            "tokens_by_source": {"bonus": 6}}


def test_requests_per_hour_counts_answered_requests_only():
    totals = Totals()
    for r in (record(), record("image not found: a.png"), record("line 3: not valid JSON"), record()):
        totals.add(r)
    figures = run_figures(totals, wall_s=2.0, batch=1, occupancy=None)
    assert totals.summary()["answered"] == 2 and figures["requests_per_hour"] == 3600  # 2 answers in 2 s
    assert run_figures(Totals(), wall_s=2.0, batch=1, occupancy=None)["requests_per_hour"] == 0


def test_a_run_that_answers_nothing_prints_no_rates(model_dirs, workdir, tmp_path):
    src, out, summary = workdir / "nothing.jsonl", tmp_path / "out.jsonl", tmp_path / "summary.json"
    src.write_bytes(jsonl({"id": 1, "prompt": "Hello there."}, {"id": 2, "prompt": "And again."}))
    args = ["run", src, "--model", model_dirs["text"], "-o", out, "--max-new-tokens", 3]
    assert invoke(args).exit_code == 0
    again = invoke(args + ["--resume", "--summary", summary])  # everything is already in out.jsonl
    assert again.exit_code == 0
    assert said(again) == "0 items, 0 errors: nothing was answered", again.stderr
    assert orjson.loads(summary.read_bytes())["requests_per_hour"] == 0
    bad = workdir / "all-bad.jsonl"
    bad.write_bytes(b'{"id": 1, "image": "missing.png"}\n{not json\n')
    failed = invoke(["run", bad, "--model", model_dirs["text"], "--max-new-tokens", 3, "--summary", summary])
    assert failed.exit_code == 1 and said(failed) == "2 items, 2 errors: nothing was answered", failed.stderr
    assert "requests/hour" not in said(failed) and "mean accepted" not in said(failed)
    assert orjson.loads(summary.read_bytes())["requests_per_hour"] == 0


def test_a_failed_conversations_earlier_turns_count_in_the_summary(short_model, workdir, tmp_path):
    """Turn 2 of 2 outgrows the model: the record keeps turn 1's answer and its tokens, which the summary left
    out (their time too: the record had none to give). Now the record carries turn 1's figures, and the summary
    counts its tokens, time and steps, though not as an answered request."""
    src, summary = workdir / "turns.jsonl", tmp_path / "summary.json"
    src.write_bytes(jsonl({"id": "alone", "prompt": "Hi."},
                          {"id": "grows", "messages": [{"role": "user", "content": t} for t in ("Hi.", LONG)]}))
    # ``ar``: RECAP's opening can answer turn 1 ("Hi.", as "alone" did) in the prompt's own pass, with no step.
    r = invoke(["run", src, "--model", short_model, "--max-new-tokens", 5, "--batch", 1, "--method", "ar",
                "--summary", summary])
    assert r.exit_code == 1, r.stderr
    alone, grows = lines(r.stdout)
    assert grows["error"].startswith("turn 2 of 2") and grows["new_tokens"] == alone["new_tokens"] > 0
    s = orjson.loads(summary.read_bytes())
    assert s["answered"] == 1 and s["errors"] == 1
    assert s["new_tokens"] == alone["new_tokens"] + grows["new_tokens"]
    assert grows["steps"] > 0 and grows["decode_ms"] > 0 and grows["prefill_ms"] > 0
    seconds = sum(x["prefill_ms"] + x["decode_ms"] for x in (alone, grows)) / 1000
    assert abs(s["tokens_per_s"] - s["new_tokens"] / seconds) < 1e-6 * s["tokens_per_s"]
