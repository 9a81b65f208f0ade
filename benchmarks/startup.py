"""How long `recap` takes to answer when nothing heavy is needed: --help, `recap models`, `recap run --help` and a
missing input file, in fresh processes, interleaved round by round across one or more checkouts.

    python benchmarks/startup.py [--rounds 7] [--trees . /path/to/older/checkout] [--json runs/startup.json]

Each command runs as the `recap` entry point does (``recap_cli.__main__:main``; an older checkout without it:
``recap_cli.cli:app``) with that checkout first on the path, stdout and stderr discarded. Prints the median and
the spread of wall times per command and checkout, and whether the command imported torch or transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = {"--help": ["--help"], "models": ["models"], "run --help": ["run", "--help"],
            "missing file": ["run", "no-such-file.jsonl"]}

ENTRY = """
import atexit, os, sys
if os.environ.get("REPORT_HEAVY"):
    atexit.register(lambda: os.write(2, ("HEAVY " + ",".join(m for m in ("torch", "transformers")
                                                              if m in sys.modules) + "\\n").encode()))
sys.argv = ["recap", *sys.argv[1:]]
try:
    from recap_cli.__main__ import main
except ImportError:
    from recap_cli.cli import app as main
main()
"""


def once(tree: Path, args: list[str], report: bool = False) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)} | ({"REPORT_HEAVY": "1"} if report else {})
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", ENTRY, *args], env=env, cwd=tree, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    heavy = next((line[6:] for line in done.stderr.splitlines() if line.startswith("HEAVY ")), "")
    return wall, heavy


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--trees", type=Path, nargs="+", default=[Path(".")])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    trees = [t.resolve() for t in args.trees]
    heavy = {(t, c): once(t, a, report=True)[1] for t in trees for c, a in COMMANDS.items()}
    times: dict[tuple[Path, str], list[float]] = {(t, c): [] for t in trees for c in COMMANDS}
    for r in range(args.rounds):  # interleaved: load on the machine hits every tree and command alike
        for c, a in COMMANDS.items():
            for t in (trees if r % 2 == 0 else trees[::-1]):
                times[t, c].append(once(t, a)[0])
    print("| checkout | command | median s | min–max s | imports torch/transformers |\n|---|---|---:|---:|---|")
    result = []
    for t in trees:
        for c in COMMANDS:
            xs = times[t, c]
            print(f"| {t.name} | `recap {c}` | {statistics.median(xs):.2f} | {min(xs):.2f}–{max(xs):.2f} | "
                  f"{heavy[t, c] or 'neither'} |")
            result.append({"tree": str(t), "command": c, "median_s": statistics.median(xs), "runs_s": xs,
                           "heavy": heavy[t, c].split(",") if heavy[t, c] else []})
    print(f"\n{args.rounds} rounds, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
