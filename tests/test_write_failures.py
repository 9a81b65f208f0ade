"""A file the user named that cannot take what recap writes at the end or part way (a full disk, a report folder
under a file) is one sentence and exit 2, never a traceback that drops the memory and the summary; `recap
compare | head` exits 141 as `recap run | head` does, not click's 1 (which means mismatched tokens)."""

from __future__ import annotations

import errno

import orjson

from recap_cli import cli
from recap_cli.session import Session

from .test_cli_run import invoke, jsonl, lines
from .test_safety import no_model_load, said


def _full_after(n: int, error: type[OSError] = OSError):
    """cli._write that takes n records, then fails as a full disk (or a closed pipe) does."""
    real, calls = cli._write, [0]

    def write(sink, record):
        calls[0] += 1
        if calls[0] > n:
            raise error(errno.EPIPE if error is BrokenPipeError else errno.ENOSPC,
                        "Broken pipe" if error is BrokenPipeError else "No space left on device")
        real(sink, record)

    return write


def test_a_full_disk_stops_the_run_in_one_sentence_with_memory_and_summary_kept(model_dirs, tmp_path, monkeypatch):
    src, out, mem, summary = (tmp_path / n for n in ("in.jsonl", "out.jsonl", "mem.pt", "summary.json"))
    src.write_bytes(jsonl(*({"id": i, "prompt": f"Say {i}."} for i in range(4))))
    monkeypatch.setattr(cli, "_write", _full_after(1))
    r = invoke(["run", src, "--model", model_dirs["text"], "-o", out, "--memory", mem, "--summary", summary,
                "--max-new-tokens", 3, "--batch", 1])
    assert r.exit_code == 2, r.stderr
    assert "No space left on device" in said(r) and "--resume" in said(r) and "Traceback" not in said(r)
    assert [x["id"] for x in lines(out.read_text())] == [0]
    assert mem.is_file() and "memory saved" in said(r)
    assert orjson.loads(summary.read_bytes())["interrupted"] is True


def test_a_failed_memory_save_is_one_sentence_the_summary_still_printed(model_dirs, tmp_path, monkeypatch):
    src, out, mem = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "mem.pt"
    src.write_bytes(jsonl({"id": 1, "prompt": "Hello there."}))

    def full_disk(self, path):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 22336 vs 22288")

    monkeypatch.setattr(Session, "save_memory", full_disk)
    r = invoke(["run", src, "--model", model_dirs["text"], "-o", out, "--memory", mem, "--max-new-tokens", 3])
    assert r.exit_code == 2, r.stderr
    assert "cannot save the drafter memory" in said(r) and "1 items, 0 errors" in said(r)
    assert "Traceback" not in said(r) and len(lines(out.read_text())) == 1


def test_a_summary_that_cannot_be_written_is_one_sentence(model_dirs, tmp_path, monkeypatch):
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl({"id": 1, "prompt": "Hello there."}))
    summary, model = tmp_path / "summary.json", model_dirs["text"]  # built before write_bytes refuses

    def refuse(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(summary), "write_bytes", refuse)
    r = invoke(["run", src, "--model", model, "--summary", summary, "--max-new-tokens", 3])
    assert r.exit_code == 2 and "--summary" in said(r) and "No space left" in said(r), r.stderr
    assert len(lines(r.stdout)) == 1


def test_a_report_folder_under_a_file_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    src = tmp_path / "c.jsonl"
    src.write_bytes(jsonl({"id": 1, "prompt": "hi"}))
    r = invoke(["compare", src, "--methods", "recap", "--report", src / "sub" / "dir"])
    assert r.exit_code == 2 and "--report" in said(r) and "is a file, not a folder" in said(r), r.stderr


def test_compare_into_a_closed_stdout_exits_141_and_keeps_its_json(model_dirs, tmp_path, monkeypatch):
    src, out = tmp_path / "in.jsonl", tmp_path / "c.json"
    src.write_bytes(jsonl(*({"id": f"t{i}", "prompt": f"Say {i}"} for i in range(3))))
    monkeypatch.setattr(cli, "_write", _full_after(2, BrokenPipeError))  # the first input's two rows, then `| head`
    r = invoke(["compare", src, "--model", model_dirs["text"], "--methods", "recap", "--max-new-tokens", 3,
                "--warmup", 0, "--json", out])
    assert r.exit_code == 141, r.stderr
    assert "stdout closed after" in said(r) and "Traceback" not in said(r)
    assert orjson.loads(out.read_bytes())["interrupted"] is True
