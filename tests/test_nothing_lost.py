"""Nothing lost at any moment: a resume's cut of a torn tail, a signal during the final memory save, a memory
file reached through a symlink, a failure of recap's own part way through a run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs records.answered() on argv[1] in a fresh process that kills itself with SIGKILL at the first call that
# changes a file (write, truncate), just before it (argv[2] == "before") or just after it returns ("after"):
# wherever the cut happens, whatever way it is done.
KILL_IN_CUT = """
import os, signal, sys
from pathlib import Path
from recap_cli import records

event = {"before": "c_call", "after": "c_return"}[sys.argv[2]]

def profile(frame, what, arg):
    if what == event and getattr(arg, "__name__", "") in ("write", "truncate", "ftruncate", "writelines"):
        os.kill(os.getpid(), signal.SIGKILL)

sys.setprofile(profile)
records.answered(Path(sys.argv[1]))
sys.setprofile(None)
print("the file was never changed")
"""


def python(code: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          timeout=300)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_kill_during_the_cut_of_a_torn_tail_keeps_every_whole_record(tmp_path, when):
    out = tmp_path / "out.jsonl"
    whole = b"".join(orjson.dumps({"id": i, "line": i + 1, "answer": "x" * 200}) + b"\n" for i in range(2000))
    out.write_bytes(whole + b'{"id": 2000, "li')  # a crash mid-line
    done = python(KILL_IN_CUT, out, when)
    assert done.returncode == -signal.SIGKILL, (done.stdout, done.stderr)  # the cut was reached, and killed
    left = out.read_bytes()
    assert left in (whole, whole + b'{"id": 2000, "li'), len(left)  # untouched, or cut to its last whole line


def test_the_cut_reads_each_record_once_and_keeps_the_keys(tmp_path):
    from recap_cli.records import answered

    out = tmp_path / "out.jsonl"
    recs = [{"id": "a", "line": 1}, {"id": 7, "line": 2}, {"id": "old"}, {"id": "b", "line": 4}]
    out.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs) + b"\n" + b'{"id": "c", "line": 5')
    earlier = answered(out)
    assert earlier.done == {(1, b'"a"'), (2, b"7"), (4, b'"b"')} and earlier.unnumbered == 1
    assert out.read_bytes().endswith(orjson.dumps(recs[-1]) + b"\n\n")
    assert answered(out) == earlier  # whole already: nothing more is cut


def test_a_line_is_answered_again_only_where_every_record_of_it_is_an_error_a_rerun_may_fix(tmp_path):
    """Records are only ever appended: a line answered again after an error has both records, and one answer
    among a line's records, or one error for good (``"retry": false``, or no ``retry``: an older recap), keeps it
    from being answered again."""
    from recap_cli.records import answered

    out = tmp_path / "out.jsonl"
    oom, bad = {"error": "OutOfMemoryError: CUDA out of memory", "retry": True}, {"error": "image not found: a.png"}
    recs = [{"line": 1, **oom}, {"line": 1, "error": None},  # retried and answered
            {"line": 2, **oom}, {"line": 2, **oom},  # failed twice: a rerun may still fix it
            {"line": 3, **bad}, {"line": 4, **bad, "retry": False}, {"line": 5, **oom}, {"line": 5, **bad},
            {"line": 6, "error": None}]
    out.write_bytes(b"".join(orjson.dumps({"id": r["line"], **r}) + b"\n" for r in recs))
    earlier = answered(out)
    assert sorted(line for line, _ in earlier.done) == [1, 3, 4, 5, 6]
    assert sorted(line for line, _ in earlier.failed) == [3, 4, 5]
    assert sorted(line for line, _ in earlier.retry) == [2]
    # What --resume (local and --ray alike) does with each line: answer it, or skip it as answered or as failed.
    from recap_cli.records import ANSWERED, FAILED

    said = {line: earlier.skips((line, orjson.dumps(line))) for line in range(1, 8)}
    assert said == {1: ANSWERED, 2: None, 3: FAILED, 4: FAILED, 5: FAILED, 6: ANSWERED, 7: None}
    earlier.retry_every_error()
    assert [line for line in range(1, 8) if earlier.skips((line, orjson.dumps(line))) is not None] == [1, 6]


# --- the final memory save: whatever signal arrives, it finishes, the summary is written, no temp file stays --

# `recap run` in a fresh process whose memory save is hit by a signal (argv[1]) after the temp file is written
# and before the rename: the deterministic middle of the save.
SIGNAL_IN_SAVE = """
import os, signal, sys
import torch

real, kind = torch.save, getattr(signal, sys.argv[1])

def save(*args, **kw):
    real(*args, **kw)
    os.kill(os.getpid(), kind)

torch.save = save
sys.argv = ["recap", *sys.argv[2:]]
from recap_cli.cli import app
app()
"""


def jsonl(*records) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_during_the_memory_save_waits_for_it_and_the_summary(model_dirs, tmp_path, sig, code):
    src, mem, summary = tmp_path / "in.jsonl", tmp_path / "mem.pt", tmp_path / "summary.json"
    src.write_bytes(jsonl(*[{"id": i, "prompt": f"Question {i}?"} for i in range(3)]))
    done = python(SIGNAL_IN_SAVE, sig, "run", src, "--model", model_dirs["text"], "--memory", mem, "--summary",
                  summary, "--max-new-tokens", 4, "--batch", 2)
    stderr = done.stderr.decode()
    assert done.returncode == code, stderr
    assert [orjson.loads(x)["id"] for x in done.stdout.splitlines()] == [0, 1, 2]
    assert "memory saved" in stderr and "Traceback" not in stderr
    s = orjson.loads(summary.read_bytes())
    assert s["items"] == 3 and s["interrupted"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "mem.pt", "summary.json"]  # no temp file
    from recap_cli.models import load
    from recap_cli.session import Session

    Session(load(model_dirs["text"], device="cpu"), "recap").load_memory(mem)  # a whole memory file


def test_memory_through_a_symlink_updates_its_target_and_the_link_stays(get_adapter, tmp_path):
    from recap_cli import safety
    from recap_cli.session import Session

    (tmp_path / "store").mkdir()
    target, link = tmp_path / "store" / "mem.pt", tmp_path / "mem.pt"
    target.write_bytes(b"an older memory")
    link.symlink_to(target)
    session = Session(get_adapter("text"), "recap")
    session.answer([{"role": "user", "content": "Fill the memory a little."}], [], 8)
    assert safety.unwritable(link, "--memory", atomic=True) is None
    assert session.save_memory(link)
    assert link.is_symlink() and link.resolve() == target
    Session(get_adapter("text"), "recap").load_memory(target)  # the target holds the new memory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mem.pt", "store"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["mem.pt"]  # no temp file beside the target


def test_a_failure_of_recaps_own_keeps_the_records_memory_and_summary(model_dirs, tmp_path, monkeypatch):
    """An exception out of the run loop itself (a bug, not one request's failure) ended the run with a traceback
    that skipped the memory save and the summary; now they are kept and one line names the failure (exit 1)."""
    from recap_cli import batch

    from .test_cli_run import invoke, lines
    from .test_safety import said

    src, out, mem, summary = (tmp_path / n for n in ("in.jsonl", "out.jsonl", "mem.pt", "summary.json"))
    src.write_bytes(jsonl(*[{"id": i, "prompt": f"Question {i}?"} for i in range(3)]))
    real = batch.answer_all

    def broken_after_one(*args, **kw):
        answers = real(*args, **kw)
        yield next(answers)
        answers.close()
        raise RuntimeError("the loop broke")

    monkeypatch.setattr(batch, "answer_all", broken_after_one)
    r = invoke(["run", src, "--model", model_dirs["text"], "-o", out, "--memory", mem, "--summary", summary,
                "--max-new-tokens", 3, "--batch", 1])
    assert r.exit_code == 1, r.stderr
    assert "RuntimeError: the loop broke" in said(r) and "after 1 records" in said(r), r.stderr
    assert "Traceback" not in said(r) and "--resume" in said(r)
    assert [x["id"] for x in lines(out.read_text())] == [0]  # the record written is whole
    assert mem.is_file() and "memory saved" in said(r)
    s = orjson.loads(summary.read_bytes())
    assert s["items"] == 1 and s["interrupted"] is True
