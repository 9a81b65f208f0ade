"""`recap run` through the real CLI on the tiny models: pipelines, schema, bad input, resume, memory."""

from __future__ import annotations

import gc
import os
import threading
import time

import orjson
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from recap_cli import batch as batch_module
from recap_cli import cli, models
from recap_cli.decoding.batched import Batch, BatchEngine
from recap_cli.session import Session

from .conftest import make_image

RESULT_KEYS = {"id", "answer", "method", "model", "new_tokens", "prefill_ms", "decode_ms", "tokens_per_s", "steps",
               "mean_accepted", "accepted_hist", "tokens_by_source", "error"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    make_image(1).save(d / "a.png")
    make_image(2, (96, 72)).save(d / "b.png")
    (d / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    Image.new("1", (8000, 6000)).save(d / "huge.png")  # 48 Mpx, over the 40 Mpx limit
    return d


def jsonl(*records) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


def invoke(args, input: bytes | None = None):
    result = CliRunner().invoke(cli.app, [str(a) for a in args], input=input)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def lines(text: str) -> list[dict]:
    return [orjson.loads(x) for x in text.splitlines()]


GOOD = [{"id": "cap", "image": "a.png"},
        {"id": "vqa", "image": "b.png", "question": "What colour is the square?"},
        {"id": "txt", "image": None, "prompt": "Summarise the passage: the quick brown fox."}]


def test_the_loaded_model_is_out_of_the_collectors_scans(model_dirs, workdir, monkeypatch):
    """A full collection walks every object it tracks, inside whichever step set it off: the model's, alive for
    the whole run, are frozen after loading, so one never walks them."""
    monkeypatch.chdir(workdir)
    loaded = []
    monkeypatch.setattr(models, "load", lambda *a, real=models.load, **k: loaded.append(real(*a, **k)) or loaded[-1])
    gc.unfreeze()
    result = invoke(["run", "-", "--model", model_dirs["qwen"], "--max-new-tokens", 4], jsonl(GOOD[0]))
    assert result.exit_code == 0, result.stderr
    model = loaded[0].model
    layer = next(model.modules())
    assert gc.get_freeze_count() > 0
    assert not any(o is model or o is layer for o in gc.get_objects())  # tracked objects, frozen ones left out
    gc.unfreeze()
    assert any(o is model for o in gc.get_objects())


def test_stdin_to_stdout_pipeline_carries_only_jsonl(model_dirs, workdir, monkeypatch):
    monkeypatch.chdir(workdir)  # relative image paths of stdin resolve against the working directory
    result = invoke(["run", "-", "--model", model_dirs["qwen"], "--max-new-tokens", 12], jsonl(*GOOD))
    assert result.exit_code == 0, result.stderr
    out = lines(result.stdout)
    assert [r["id"] for r in out] == ["cap", "vqa", "txt"]
    for r in out:
        assert RESULT_KEYS <= set(r) and r["error"] is None and r["method"] == "recap"
        assert r["new_tokens"] == 12 or r["answer"] is not None
        assert sum(r["tokens_by_source"].values()) == r["new_tokens"]
    assert "3 items, 0 errors" in result.stderr


def test_dash_output_is_stdout_not_a_file_named_dash(model_dirs, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    result = invoke(["run", "-", "--model", model_dirs["qwen"], "--max-new-tokens", 3, "-o", "-"], jsonl(GOOD[0]))
    assert result.exit_code == 0, result.stderr
    assert [r["id"] for r in lines(result.stdout)] == ["cap"]
    assert not (workdir / "-").exists()
    result = invoke(["run", "-", "--model", model_dirs["qwen"], "-o", "-", "--resume"], jsonl(GOOD[0]))
    assert result.exit_code == 2 and "not stdout" in result.stderr


def test_every_bad_line_yields_one_error_record_and_the_run_goes_on(model_dirs, workdir):
    bad = [b'{"id": "ok", "image": "a.png", "question": "Which colour?"}',
           b"{not json",
           b"[1, 2]",
           b'{"id": "missing", "image": "nope.png", "question": "x"}',
           b'{"id": "corrupt", "image": "corrupt.png"}',
           b'{"id": "huge", "image": "huge.png"}',
           b'{"id": "empty", "image": "a.png", "question": "   "}',
           b'{"id": "type", "image": 5}',
           b'{"id": "tokens", "image": "a.png", "max_new_tokens": "many"}',
           b'{"id": "nothing"}',
           b'{"id": "ok2", "image": null, "question": "Still running?", "max_new_tokens": 3}']
    path = workdir / "bad.jsonl"
    path.write_bytes(b"\n".join(bad) + b"\n")
    result = invoke(["run", path, "--model", model_dirs["llava"], "--max-new-tokens", 6])
    assert result.exit_code == 1
    out = lines(result.stdout)
    assert len(out) == len(bad)
    by_id = {str(r["id"]): r for r in out}
    assert by_id["ok"]["error"] is None and by_id["ok2"]["new_tokens"] == 3
    assert "not valid JSON" in by_id["2"]["error"] and "JSON object" in by_id["3"]["error"]
    assert "image not found" in by_id["missing"]["error"]
    assert "cannot read image" in by_id["corrupt"]["error"]
    assert "too large" in by_id["huge"]["error"]
    assert "empty" in by_id["empty"]["error"]
    assert "'image'" in by_id["type"]["error"] and "max_new_tokens" in by_id["tokens"]["error"]
    assert "nothing to answer" in by_id["nothing"]["error"]
    assert "9 errors" in result.stderr


def test_text_model_turns_images_into_record_errors(model_dirs, workdir):
    path = workdir / "mixed.jsonl"
    path.write_bytes(jsonl({"id": 1, "image": "a.png"}, {"id": 2, "prompt": "hello"}))
    result = invoke(["run", path, "--model", model_dirs["text"], "--max-new-tokens", 4])
    out = lines(result.stdout)
    assert result.exit_code == 1 and "text only" in out[0]["error"] and out[1]["error"] is None


def test_usage_errors_exit_2_with_one_sentence(model_dirs, workdir):
    r = invoke(["run", workdir / "none.jsonl", "--model", model_dirs["text"]])
    assert r.exit_code == 2 and "input file not found" in r.stderr
    (workdir / "one.jsonl").write_bytes(jsonl({"prompt": "x"}))
    r = invoke(["run", workdir / "one.jsonl", "--model", "no-such-model"])
    assert r.exit_code == 2 and "unknown model 'no-such-model'" in r.stderr and "Traceback" not in r.stderr
    r = invoke(["run", workdir / "one.jsonl", "--model", model_dirs["text"], "--method", "fast"])
    assert r.exit_code == 2 and "unknown method" in r.stderr
    r = invoke(["run", workdir / "one.jsonl", "--model", model_dirs["text"], "--method", "tr", "--depth", "4"])
    assert r.exit_code == 2 and "recap only" in r.stderr
    r = invoke(["run", workdir / "one.jsonl", "--model", model_dirs["text"], "--method", "tr", "--budget", "4"])
    assert r.exit_code == 2 and "template" in r.stderr


def test_resume_skips_answered_ids_and_repairs_a_torn_line(model_dirs, workdir):
    path, out = workdir / "resume.jsonl", workdir / "resume.out.jsonl"
    recs = [{"id": f"r{i}", "prompt": f"Question number {i}?"} for i in range(4)]
    path.write_bytes(jsonl(*recs[:2]))
    assert invoke(["run", path, "--model", model_dirs["text"], "-o", out, "--max-new-tokens", 4]).exit_code == 0
    with open(out, "ab") as f:
        f.write(b'{"id": "r2", "answ')  # a crash mid-line
    path.write_bytes(jsonl(*recs))
    r = invoke(["run", path, "--model", model_dirs["text"], "-o", out, "--resume", "--max-new-tokens", 4])
    assert r.exit_code == 0
    ids = [x["id"] for x in lines(out.read_text())]
    assert ids == ["r0", "r1", "r2", "r3"]


# --- resume after errors: a line is answered again only where its records are errors a rerun may fix ----------

def unwrapped(result) -> str:
    """stderr with line wrapping undone (rich wraps at 80 columns when stderr is not a terminal)."""
    return " ".join(result.stderr.split())


def outcome(record: dict) -> tuple:
    """What a line's record says, without its timings."""
    return record["line"], record["id"], record["answer"], record.get("new_tokens"), record["error"]


def prompts(n: int) -> list[dict]:
    return [{"id": f"q{i}", "prompt": f"Question number {i}?"} for i in range(n)]


OOM = "OutOfMemoryError: CUDA out of memory. Tried to allocate 9 GiB"


@pytest.mark.parametrize("batch", [1, 3])
def test_resume_answers_again_the_lines_that_ran_out_of_memory(model_dirs, workdir, monkeypatch, batch):
    """Out of memory is no fault of the line (at batch 1 one decode, in a batch the shared step, which fails
    every row in it): its record says ``"retry": true`` and ``--resume`` answers it again, appending the answer
    after the error record (the file is never rewritten); a line's last record is what a run without the failure
    writes, and a second resume has nothing left to do."""
    path, out = workdir / f"oom{batch}.jsonl", workdir / f"oom{batch}.out.jsonl"
    path.write_bytes(jsonl(*prompts(4)))
    args = ["run", path, "--model", model_dirs["text"], "-o", out, "--max-new-tokens", 4, "--batch", batch]
    assert invoke(args).exit_code == 0
    want = [outcome(r) for r in lines(out.read_text())]
    target = (Session, "decode") if batch == 1 else (BatchEngine, "verify")
    real, calls = getattr(*target), []

    def out_of_memory_once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError(OOM.removeprefix("OutOfMemoryError: "))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(*target, out_of_memory_once)
    assert invoke(args).exit_code == 1
    first = lines(out.read_text())
    failed = [r["line"] for r in first if r["error"]]
    assert failed and all(r["error"] == OOM and r["retry"] is True for r in first if r["error"])
    monkeypatch.undo()
    r = invoke(args + ["--resume"])
    assert r.exit_code == 0, r.stderr
    n = len(failed)
    assert f"{n} line{'s' * (n > 1)} of {out} failed with errors a rerun may fix" in unwrapped(r)
    after = lines(out.read_text())
    assert after[:4] == first and [x["line"] for x in after[4:]] == failed
    last = {x["line"]: x for x in after}  # a line's last record is the one that counts
    assert [outcome(last[n]) for n in sorted(last)] == want
    assert invoke(args + ["--resume"]).exit_code == 0 and lines(out.read_text()) == after


def test_resume_skips_an_error_a_rerun_would_repeat_and_says_so(model_dirs, workdir, tmp_path):
    """A missing image fails the same way on every run: ``"retry": false``, skipped by --resume, which says on
    stderr that the output still holds only errors for that line and exits 1 (as the run that wrote it did);
    --summary counts it apart from this run's errors."""
    path, out, summary = workdir / "gone.jsonl", workdir / "gone.out.jsonl", tmp_path / "summary.json"
    path.write_bytes(jsonl({"id": "ok", "prompt": "Hello?"}, {"id": "gone", "image": "nope.png"}))
    args = ["run", path, "--model", model_dirs["text"], "-o", out, "--max-new-tokens", 3]
    assert invoke(args).exit_code == 1
    first = out.read_bytes()
    assert [r.get("retry") for r in lines(first.decode())] == [None, False]  # an answer has no retry
    r = invoke(args + ["--resume", "--summary", summary])
    assert out.read_bytes() == first  # nothing answered again, nothing appended
    assert r.exit_code == 1, r.stderr
    assert f"{out} holds only error records for 1 line of the input (2), from earlier runs" in unwrapped(r)
    assert "--resume skipped it" in unwrapped(r)
    s = orjson.loads(summary.read_bytes())
    assert s["errors"] == 0 and s["errors_before"] == 1


def test_retry_errors_answers_again_a_line_fixed_since_its_error(model_dirs, workdir):
    """An error for good is skipped by --resume until someone fixes its cause, which recap cannot see: with
    --retry-errors the line is answered again, its answer appended after the error record; without --resume the
    flag is a usage error."""
    path, out = workdir / "fixed.jsonl", workdir / "fixed.out.jsonl"
    path.write_bytes(jsonl({"id": "ok", "prompt": "Hello?"}, {"id": "empty", "prompt": ""}))
    args = ["run", path, "--model", model_dirs["text"], "-o", out, "--max-new-tokens", 3]
    assert invoke(args).exit_code == 1
    assert [r["error"] is None for r in lines(out.read_text())] == [True, False]
    path.write_bytes(jsonl({"id": "ok", "prompt": "Hello?"}, {"id": "empty", "prompt": "Hello again?"}))
    r = invoke(args + ["--resume"])
    assert r.exit_code == 1 and len(lines(out.read_text())) == 2  # skipped, as before
    assert "once fixed, --resume --retry-errors answers it again" in unwrapped(r)
    r = invoke(args + ["--resume", "--retry-errors"])
    assert r.exit_code == 0, r.stderr
    after = lines(out.read_text())
    assert [(x["line"], x["error"] is None) for x in after] == [(1, True), (2, False), (2, True)]
    assert invoke(args + ["--resume", "--retry-errors"]).exit_code == 0 and lines(out.read_text()) == after
    r = invoke(args + ["--retry-errors"])
    assert r.exit_code == 2 and "--retry-errors goes with --resume" in unwrapped(r)


def test_resume_never_answers_again_a_line_that_has_an_answer(model_dirs, workdir):
    """However a line's records lie in the output, one answer among them is enough: only the line whose records
    are all errors a rerun may fix is answered again."""
    path, out = workdir / "kept.jsonl", workdir / "kept.out.jsonl"
    path.write_bytes(jsonl(*prompts(3)))
    oom = {"answer": None, "method": "recap", "model": "m", "error": OOM, "retry": True}
    ok = {"answer": "kept", "method": "recap", "model": "m", "error": None}
    out.write_bytes(jsonl({"id": "q0", "line": 1, **ok}, {"id": "q0", "line": 1, **oom},  # in either order
                          {"id": "q1", "line": 2, **oom}, {"id": "q1", "line": 2, **ok},
                          {"id": "q2", "line": 3, **oom}))
    args = ["run", path, "--model", model_dirs["text"], "-o", out, "--max-new-tokens", 3, "--resume"]
    r = invoke(args)
    assert r.exit_code == 0, r.stderr
    after = lines(out.read_text())
    assert len(after) == 6 and after[-1]["line"] == 3 and after[-1]["error"] is None
    assert invoke(args).exit_code == 0 and lines(out.read_text()) == after


def test_an_error_record_of_an_older_recap_stays_skipped(model_dirs, workdir):
    """Records written before errors said whether a rerun may fix them carry no ``retry``: even one that ran out
    of memory is skipped, as it always was, but the run says the output still holds it and exits 1."""
    path, out = workdir / "older.jsonl", workdir / "older.out.jsonl"
    path.write_bytes(jsonl(*prompts(2)))
    older = jsonl({"id": "q0", "line": 1, "answer": None, "method": "recap", "model": "m", "error": OOM})
    out.write_bytes(older)
    r = invoke(["run", path, "--model", model_dirs["text"], "-o", out, "--max-new-tokens", 3, "--resume"])
    assert r.exit_code == 1, r.stderr
    assert [x["line"] for x in lines(out.read_text())] == [1, 2] and out.read_bytes().startswith(older)
    assert f"{out} holds only error records for 1 line of the input (1), from earlier runs" in unwrapped(r)


@pytest.mark.parametrize("batch", [1, 3])
def test_ctrl_c_keeps_the_output_valid(model_dirs, workdir, monkeypatch, batch):
    """Interrupted while the second request decodes: the first (done at its first token in a batch) is out,
    whole; nothing after it."""
    path, out = workdir / "intr.jsonl", workdir / "intr.out.jsonl"
    path.write_bytes(jsonl(*[{"id": i, "prompt": "Tell me more.", "max_new_tokens": 1 if i == 0 else 8}
                             for i in range(3)]))
    target = (Session, "prepare") if batch == 1 else (Batch, "step")
    real = getattr(*target)
    calls = []

    def interrupt_second(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(*target, interrupt_second)
    make_record = batch_module.result_record

    def slow_record(*args, **kw):  # a busy machine: a finished request's record must still be out before a step
        time.sleep(0.3)
        return make_record(*args, **kw)

    monkeypatch.setattr(batch_module, "result_record", slow_record)
    r = invoke(["run", path, "--model", model_dirs["text"], "-o", out, "--max-new-tokens", 8, "--batch", batch])
    assert r.exit_code == 130 and "interrupted" in r.stderr
    assert [x["id"] for x in lines(out.read_text())] == [0]


def test_memory_round_trip_makes_a_warm_start(model_dirs, workdir):
    """A run that loads the saved order-1 memory accepts more tokens on the same inputs than a cold run."""
    path, mem = workdir / "mem.jsonl", workdir / "memory.pt"
    path.write_bytes(jsonl(*[{"id": i, "image": "a.png", "question": q}
                             for i, q in enumerate(["Describe it.", "What colour is the square?"])]))
    args = ["run", path, "--model", model_dirs["qwen"], "--max-new-tokens", 24, "--orders", "1", "--no-suffix"]
    cold = invoke(args + ["--memory", mem])
    assert cold.exit_code == 0 and mem.is_file()
    warm = invoke(args + ["--memory", mem])
    cold_out, warm_out = lines(cold.stdout), lines(warm.stdout)
    assert [r["answer"] for r in warm_out] == [r["answer"] for r in cold_out]
    assert sum(r["mean_accepted"] for r in warm_out) > sum(r["mean_accepted"] for r in cold_out)
    r = invoke(["run", path, "--model", model_dirs["llava"], "--memory", mem, "--max-new-tokens", 2])
    assert r.exit_code == 2 and "cannot load memory" in r.stderr  # another vocabulary


def test_answers_are_identical_across_methods(model_dirs, workdir):
    path = workdir / "methods.jsonl"
    multi = {"id": "mt", "image": "a.png", "messages": [{"role": "user", "content": "What is this?"},
                                                        {"role": "user", "content": "And its colour?"}]}
    path.write_bytes(jsonl(*GOOD[:2], multi))
    answers = {}
    runs = {m: ["--method", m] for m in ("ar", "recap", "tr", "pld")}
    runs["recap-ablated"] = ["--method", "recap", "--no-calibrate", "--mixing", "fixed"]
    for name, flags in runs.items():
        r = invoke(["run", path, "--model", model_dirs["llava"], *flags, "--max-new-tokens", 16])
        assert r.exit_code == 0, r.stderr
        out = lines(r.stdout)
        answers[name] = [(x["answer"], x.get("answers")) for x in out]
        assert all(x["method"] == flags[1] for x in out)
    assert answers["recap"] == answers["ar"] == answers["tr"] == answers["pld"] == answers["recap-ablated"]
    assert len(answers["ar"][2][1]) == 2  # both turns answered


def test_options_no_model_can_take_are_refused_before_the_model_is_looked_for(workdir):
    """The model named does not exist: an option checked only after looking for it would say that instead (and
    with a real name, only after a download)."""
    (workdir / "one.jsonl").write_bytes(jsonl({"prompt": "x"}))
    base = ["run", workdir / "one.jsonl", "--model", "no-such-model"]
    for extra, said in ((["--dtype", "fp8"], "--dtype takes"), (["--attn", "flash"], "--attn takes"),
                        (["--device", "tpu"], "--device takes"), (["--mixing", "foo"], "--mixing takes"),
                        (["--orders", "4"], "--orders takes"), (["--budget", "100000"], "from 0 to 512"),
                        (["--top-k", str(10 ** 21)], "--top-k must be"),
                        (["--method", "tr", "--depth", "4"], "--depth applies to --method recap only")):
        r = invoke(base + extra)
        assert r.exit_code == 2 and said in " ".join(r.stderr.split()), (extra, r.stderr)


def test_help_shows_the_defaults_it_names():
    r = CliRunner().invoke(cli.app, ["run", "--help"], env={"COLUMNS": "250"})
    # rich (which drew --help before click's plain layout) read "[default: ...]" as a tag and dropped it
    assert "[default: 16 on CPU, 32 on CUDA]" in " ".join(r.stdout.split())


def test_a_pipe_is_an_input_and_unknown_keys_are_warned_of_once(model_dirs, workdir):
    fifo = workdir / "requests.fifo"
    os.mkfifo(fifo)
    records = jsonl({"id": 1, "Prompt": "Hi", "prompt": "Hello"}, {"id": 2, "prompt": "Hey", "Prompt": "x"})
    writer = threading.Thread(target=fifo.write_bytes, args=(records,))
    writer.start()
    r = invoke(["run", fifo, "--model", model_dirs["text"], "--max-new-tokens", 3])
    writer.join()
    assert r.exit_code == 0, r.stderr
    assert [x["id"] for x in lines(r.stdout)] == [1, 2]
    warned = " ".join(r.stderr.split())
    assert warned.count("key 'Prompt' is not one recap reads") == 1 and "did you mean 'prompt'?" in warned


def test_a_messages_unknown_keys_are_warned_of_once_naming_the_message(model_dirs, workdir):
    def said(index):
        return {"role": "user", "content": f"Say {index}", "name": "ann"}

    records = jsonl({"id": 1, "messages": [said(1)]}, {"id": 2, "messages": [said(2), {"role": "assistant",
                                                                                          "content": "2"}, said(3)]})
    r = invoke(["run", "-", "--model", model_dirs["text"], "--max-new-tokens", 3], input=records)
    assert r.exit_code == 0, r.stderr
    assert [x["error"] for x in lines(r.stdout)] == [None, None]
    warned = " ".join(r.stderr.split())
    assert "warning: line 1: key 'name' in messages[0] is not one recap reads: ignored" in warned
    assert warned.count("key 'name' in messages[") == 1  # once a run, as a record's own keys


def test_image_goes_to_the_first_user_turn_and_later_turns_see_answers(get_adapter, workdir):
    from recap_cli.batch import answer
    from recap_cli.records import Request
    from recap_cli.session import Session

    session = Session(get_adapter("llava"), "ar")
    seen = []
    real = session.answer
    session.answer = lambda messages, images, n: seen.append(messages) or real(messages, images, n)
    history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"}]
    rec = answer(session, Request(1, "h", image=workdir / "a.png", history=history, turns=["Colour?", "Size?"]),
                 "m", 5)
    assert rec["error"] is None and len(rec["answers"]) == 2
    first, second = seen
    assert first[0]["content"][0] == {"type": "image"} and first[1]["content"] == [{"type": "text", "text": "Hello!"}]
    assert not any(p.get("type") == "image" for m in first[1:] for p in m["content"])
    assert second[3]["content"] == [{"type": "text", "text": rec["answers"][0]}]  # the first answer, seen


def test_a_runtime_failure_fails_only_its_record(get_adapter):
    from recap_cli.batch import answer
    from recap_cli.records import Request
    from recap_cli.session import Session

    session = Session(get_adapter("text"), "ar")

    def oom(*args):
        raise RuntimeError("CUDA out of memory. Tried to allocate 9 GiB")

    session.answer = oom
    rec = answer(session, Request(1, "x", turns=["hi"]), "m", 4)
    assert rec["answer"] is None and rec["error"].startswith("RuntimeError: CUDA out of memory")


def test_a_failed_compile_falls_back_to_eager(model_dirs, workdir, monkeypatch):
    from recap_cli.session import Session

    def broken(self, messages, images):
        raise RuntimeError("graph capture failed")

    monkeypatch.setattr(Session, "warm_up", broken)
    path = workdir / "compile.jsonl"
    path.write_bytes(jsonl({"id": 1, "prompt": "Hello?"}))
    r = invoke(["run", path, "--model", model_dirs["text"], "--compile", "on", "--max-new-tokens", 3])
    assert r.exit_code == 0 and "decoding eagerly" in r.stderr
    assert lines(r.stdout)[0]["new_tokens"] == 3


# --- a conversation whose later turn fails keeps the turns before it ---------------------------------------------

LONG = "word " * 100  # about 400 tokens: past the 64 positions below, with or without the turns before it


def conversations() -> list:
    from recap_cli.records import Request

    return [Request(1, "alone", turns=["Hi."], max_new_tokens=5),  # turn 1's answer, asked on its own
            Request(2, "grows", turns=["Hi.", LONG, "And then?"], max_new_tokens=5),
            Request(3, "fits", turns=["Hi.", "Thanks."], max_new_tokens=5),
            Request(4, "first", turns=[LONG, "Hi."], max_new_tokens=5)]


def test_a_later_turn_that_outgrows_the_context_keeps_the_answers_before_it(get_adapter, monkeypatch):
    """Turn 2 of 3 outgrows the model's 64 positions: the error record names the turn and keeps turn 1's answer,
    token for token what that question gets alone, and its count; the same record at batch 1 (the run's loop and
    ``answer``) and in flight with others, where the requests beside it answer as ever."""
    from recap_cli.batch import answer, answer_all

    adapter = get_adapter("text")
    monkeypatch.setattr(adapter.model.config, "max_position_embeddings", 64)
    for method in ("ar", "recap"):
        want = None
        for batch in (1, 2, 4):
            out = list(answer_all(Session(adapter, method, batch=batch), conversations(), "m", 5))
            (alone, alone_tokens), (grows, grows_tokens), (fits, _), (first, _) = out
            assert alone["error"] is None and fits["error"] is None and len(fits["answers"]) == 2
            assert grows["error"].startswith("turn 2 of 3: the prompt is") and "reads at most 64" in grows["error"]
            assert grows["answer"] is None and grows["answers"] == [alone["answer"]] and grows_tokens == []
            assert grows["turns"] == 1 and grows["new_tokens"] == len(alone_tokens[0]) == alone["new_tokens"]
            assert grows["decoding"] == alone["decoding"]
            assert first["error"].startswith("turn 1 of 2: the prompt is") and "answers" not in first
            want = want or [kept(grows), kept(first)]
            assert [kept(grows), kept(first)] == want, (method, batch)
        assert [kept(answer(Session(adapter, method), r, "m", 5)) for r in conversations()[1::2]] == want, method


def kept(record: dict) -> dict:
    """What a failed conversation's record keeps whatever the batch: its times, steps and drafts may differ."""
    return {k: record.get(k) for k in ("id", "line", "answer", "method", "model", "error", "retry", "answers",
                                       "turns", "new_tokens", "decoding")}


def test_a_runtime_failure_at_a_later_turn_keeps_the_turns_before_it(get_adapter, monkeypatch):
    """Out of memory while turn 2 decodes, at batch 1 (``answer`` and the run's loop alike)."""
    from recap_cli.batch import answer, answer_all
    from recap_cli.records import Request

    session = Session(get_adapter("text"), "ar")
    alone = answer(session, Request(1, "alone", turns=["Hi."]), "m", 4)
    real, calls = Session.decode, []

    def oom_at_the_second(self, *args):
        calls.append(1)
        if len(calls) % 2 == 0:
            raise RuntimeError("CUDA out of memory. Tried to allocate 9 GiB")
        return real(self, *args)

    monkeypatch.setattr(Session, "decode", oom_at_the_second)
    req = Request(2, "two", turns=["Hi.", "And then?"])
    for rec in (answer(session, req, "m", 4), next(answer_all(session, [req], "m", 4))[0]):
        assert rec["error"] == "turn 2 of 2: RuntimeError: CUDA out of memory. Tried to allocate 9 GiB"
        assert rec["answers"] == [alone["answer"]] and rec["new_tokens"] == alone["new_tokens"]


def test_an_unexpected_failure_at_batch_1_fails_its_record_not_the_run(get_adapter, monkeypatch):
    """A bug that raises (an IndexError in a drafter) fails one record and the run goes on, at batch 1 as in a
    batch (tests/test_batched.py): a run over thousands of inputs must not end on one of them."""
    from recap_cli.batch import answer_all
    from recap_cli.records import Request

    session = Session(get_adapter("text"), "recap")
    reqs = [Request(i, f"r{i}", turns=[q]) for i, q in enumerate(["Hi.", "Why?", "And then?"], 1)]
    want = [tokens for _, tokens in answer_all(session, reqs, "m", 6)]
    real, calls = type(session.drafter).propose, []

    def propose(self, context, room):
        calls.append(1)
        if len(calls) == 2:
            raise IndexError("drafter bug")
        return real(self, context, room)

    monkeypatch.setattr(type(session.drafter), "propose", propose)
    out = list(answer_all(Session(get_adapter("text"), "recap"), reqs, "m", 6))
    failed = [i for i, (record, _) in enumerate(out) if record["error"]]
    assert len(failed) == 1 and out[failed[0]][0]["error"] == "IndexError: drafter bug"
    assert [tokens for i, (_, tokens) in enumerate(out) if i not in failed] == [
        tokens for i, tokens in enumerate(want) if i not in failed]


@pytest.mark.parametrize("batch", [1, 4])
def test_recap_run_keeps_the_turns_answered_before_one_that_fails(short_model, workdir, batch):
    """Through the command line: the record keeps turn 1's answer and names turn 2; the run exits 1, and so does
    ``--resume``, which skips the line (no rerun fixes it): the output still lacks its answer."""
    path, out = workdir / f"turns{batch}.jsonl", workdir / f"turns{batch}.out.jsonl"
    path.write_bytes(jsonl({"id": "alone", "prompt": "Hi."},
                           {"id": "grows", "messages": [{"role": "user", "content": t} for t in ("Hi.", LONG)]}))
    args = ["run", path, "--model", short_model, "-o", out, "--max-new-tokens", 5, "--batch", batch]
    r = invoke(args)
    alone, grows = lines(out.read_text())
    assert r.exit_code == 1 and alone["error"] is None
    assert grows["error"].startswith("turn 2 of 2: the prompt is") and grows["answers"] == [alone["answer"]]
    assert grows["new_tokens"] == alone["new_tokens"] and grows["turns"] == 1 and grows["answer"] is None
    assert grows["retry"] is False  # the prompt outgrows the model: no rerun fixes that
    r = invoke(args + ["--resume"])
    assert r.exit_code == 1 and len(lines(out.read_text())) == 2  # nothing left to answer
