"""Host work per decoding step in instructions (valgrind's callgrind), this tree against an older commit.

    python benchmarks/host_instructions.py --budgets 2,auto,64 --before 6263fbe [--json runs/host_instructions.json]

A step's drafting is a few hundred microseconds of Python; on a shared 2-core machine its timings moved by half
between identical runs (benchmarks/host_time.py), while an instruction count of the same work is the same to the
thousand. Each side records its own run of ``recap`` over the demo sets as host_time.py does (the first half
fills the memories, the second half's drafter calls are recorded; always host_time.py's ``--costs fixed``: the
same frozen step costs on both sides, so trees at ``auto`` are sized by the drafting code alone), then replays
those calls under callgrind in a child process, and once more without replaying them (loading alone): the
difference is the drafting's. The child never imports torch (the drafters touch it only to save their memories,
so a stand-in takes its place): torch's own start-up under valgrind would take minutes and count nothing of ours.

Reported per budget and side: steps, requests, and instructions per step of everything the drafter did (propose
and observe at each step, start and end at each request: its prompt and its answer's last tokens written into the
memories), and after / before.
"""

from __future__ import annotations

import argparse
import copy
import os
import pickle
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent


class PlainRows:
    """The verifier's rows as lists, with the one method drafters call on them (no torch in the replay)."""

    class Column:
        def __init__(self, values: list):
            self.values = values

        def tolist(self) -> list:
            return self.values

    def __init__(self, ids: list, probs: list):
        self.ids, self.probs, self.positions = self.Column(ids), self.Column(probs), None


def record(code: Path, budget: str, out: Path, model: str, inputs: list[str]) -> None:
    """Child process: this side's run, its calls saved with plain rows (and no function of host_time.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    os.environ["RECAP_CODE"] = str(code)
    import host_time
    from recap_cli.decoding.tree import Verified

    frozen, calls, _ = host_time.record(model, [Path(p) for p in inputs], budget, 96, 1000, costs="fixed")
    plain = []
    for kind, args in calls:
        if kind == "observe":
            tree, v = args
            args = (tree, Verified(v.path, v.bonus, v.argmax, PlainRows(v.rows.ids.tolist(), v.rows.probs.tolist())))
        elif kind in ("start", "prompt_rows") and args[1] is not None:
            raise SystemExit("prompt rows are not replayed here (recap:prompt_rows=on)")
        plain.append((kind, args))
    for cost in [frozen.cost] + [args[0] for kind, args in plain if kind == "cost"]:
        if cost is not None:
            vars(cost).pop("observe_host", None)  # host_time's frozen cost learns nothing: an instance function
    out.write_bytes(pickle.dumps((frozen, plain)))
    out.with_suffix(".json").write_bytes(orjson.dumps([sum(k == "propose" for k, _ in plain),
                                                       sum(k == "start" for k, _ in plain)]))


def replay(code: Path, path: Path, run: bool) -> None:
    """Child process under callgrind: load the calls (and replay them, if ``run``) with ``code``'s recap_cli."""
    stand_in = types.ModuleType("torch")
    stand_in.__getattr__ = lambda name: object  # only annotations and memory files reach for it
    sys.modules["torch"] = stand_in
    sys.path.insert(0, str(code))
    frozen, calls = pickle.loads(path.read_bytes())
    drafter = copy.deepcopy(frozen)
    if run:
        for kind, args in calls:
            if kind == "cost":  # the cost model as the run's step found it (host_time.Recorder)
                drafter.cost = args[0]
            else:
                getattr(drafter, kind)(*args)


def instructions(code: Path, path: Path, run: bool) -> int:
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
           "--replay", str(path), "--code", str(code)] + (["--run"] if run else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    return int(re.search(r"Collected : (\d+)", out.stderr).group(1))


def measure(args: argparse.Namespace, sides: dict[str, Path], work: Path) -> list[dict]:
    """Record each side's calls at each budget into ``work``, and count the instructions of replaying them."""
    rows = []
    for budget in args.budgets.split(","):
        for side, code in sides.items():
            calls = work / f"{side}-{budget}.pkl"
            subprocess.run([sys.executable, __file__, "--record", str(calls), "--code", str(code), "--budget", budget,
                            "--model", args.model, "--inputs", *args.inputs], check=True, cwd=ROOT)
            steps, requests = orjson.loads(calls.with_suffix(".json").read_bytes())
            total = instructions(code, calls, True) - instructions(code, calls, False)
            row = {"budget": budget, "side": side, "ref": args.before if side == "before" else "this tree",
                   "steps": steps, "requests": requests, "instructions": total, "per_step": total / steps}
            rows.append(row)
            print(f"budget {budget:4s} {side:6s}: {steps} steps, {requests} requests; {total / 1e6:,.0f} M "
                  f"instructions, {row['per_step'] / 1e6:.3f} M a step", flush=True)
        if len(sides) == 2:
            before, after = rows[-2]["per_step"], rows[-1]["per_step"]
            print(f"budget {budget:4s} after / before: {after / before:.2f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", default="demo")
    ap.add_argument("--inputs", nargs="+",
                    default=[f"sample_inputs/bench/demo_{s}.jsonl" for s in ("caption", "vqa", "multiturn")])
    ap.add_argument("--budgets", default="2,auto,64", help="draft nodes per step, or auto: comma-separated")
    ap.add_argument("--before", default=None, help="git commit whose recap_cli to count beside this tree's")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--replay", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--code", type=Path, default=ROOT, help=argparse.SUPPRESS)
    ap.add_argument("--budget", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record:
        return record(args.code, args.budget, args.record, args.model, args.inputs)
    if args.replay:
        return replay(args.code, args.replay, args.run)
    sides = {"after": ROOT}
    if args.before is not None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from host_time import checkout

        sides = {"before": checkout(args.before), "after": ROOT}
    with tempfile.TemporaryDirectory(prefix="recap-calls-") as folder:  # the recorded calls go when it ends
        rows = measure(args, sides, Path(folder))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps({"model": args.model, "inputs": args.inputs, "rows": rows},
                                           option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
