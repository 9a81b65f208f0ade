"""Nothing lost at any moment: a resume's cut of a torn tail, a signal during the final memory save, a memory
file reached through a symlink."""

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
    keys, unnumbered = answered(out)
    assert keys == {(1, b'"a"'), (2, b"7"), (4, b'"b"')} and unnumbered == 1
    assert out.read_bytes().endswith(orjson.dumps(recs[-1]) + b"\n\n")
    assert answered(out) == (keys, unnumbered)  # whole already: nothing more is cut
