"""Host time per decoding step: drafting (propose + observe) and building the step's inputs (ids, positions,
the tree mask), for trees of a given size with the memories of a real run.

    python benchmarks/host_time.py --model demo --budget 64 [--json runs/host_time.json]
    python benchmarks/host_time.py --budget 64,auto --before 6263fbe   # this tree against an older commit
    python benchmarks/host_time.py --budget auto --costs fixed --before 6263fbe   # same sizing on both sides

With ``--before REF`` the same measurement runs on the drafter code of git commit REF (imported beside this tree's
as a package of its own) and on this tree, in this one process: each side records its own run, then the sides'
replays take turns, ``--rounds`` x ``--reps`` each, so a machine that gets busier slows both alike; the table gives
both (medians and the fastest replay), before and after from one run of the script.

Runs ``recap`` over the demo bench sets once to fill its memories, recording every drafter call of the second
half with the cost model as each step found it (the run's pace and step costs move with every step); then replays
those calls ``--reps`` times (the run's own trees, the memories as they were; a tree that comes out otherwise is
counted and reported) and reports the median per-step time of each part, and per request the time of ``start``
and ``end`` (the prompt, and the answer's last tokens, written into the memories: host work at the prefill and
after the last step, not at a step). Replaying the recorded calls times the host's work alone: the model runs
once, so the figures do not depend on how busy the machine's cores are with the forward passes. Everything the
host does between two forwards counts against the step (the design budget: at most 0.4 ms at 64 nodes).

At ``--budget auto`` the tree sizes follow the run's cost model, which learns from timings: two processes on a
busy machine size trees differently and their host times are not comparable. ``--costs fixed`` freezes the cost
model at the demo model's step costs on a 2-core CPU and the drafting cost per node, so both sides see the same
costs and any difference in size comes from the drafting code itself.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import importlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import orjson
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.environ.get("RECAP_CODE", str(ROOT)))  # host_instructions.py records an older commit's

from acceptance import read_requests  # noqa: E402
from recap_cli.decoding.cost import StepCost  # noqa: E402

BEFORE = "recap_before"  # the package name an older commit's recap_cli is imported under, beside this tree's

# The demo model's verification step on 2 idle CPU cores, fp32, by tree size (a chain tree per size, medians of
# 7 steps): milliseconds for 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64 nodes; drafting 20 us per node.
FIXED_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
FIXED_STEP_MS = (5.6, 6.8, 7.0, 7.5, 7.6, 7.6, 8.5, 8.6, 10.0, 11.0, 13.0, 15.0)
FIXED_HOST_PER_NODE_S = 20e-6


def fixed_costs(step_cost: type = StepCost, sizes: tuple[int, ...] = FIXED_SIZES,
                step_ms: tuple[float, ...] = FIXED_STEP_MS) -> StepCost:
    """A frozen cost model: no timing moves it, so the same calls size the same trees in any process
    (``step_cost``: the class of the code under test; ``sizes``, ``step_ms``: another model's step costs)."""
    cost = step_cost(sizes, alpha=0.0)
    cost.set([ms / 1000 for ms in step_ms])
    cost.host_per_node = FIXED_HOST_PER_NODE_S
    cost.observe_host = _not_learned
    return cost


def _not_learned(nodes: int, seconds: float) -> None:
    """The fixed cost model's drafting cost per node stays as given."""


class Recorder:
    """Wraps a drafter and logs every call with its arguments, so the run can be replayed without the model."""

    def __init__(self, drafter):
        self.inner, self.calls = drafter, []
        self.wants_prefill_rows, self.wants_costs = drafter.wants_prefill_rows, drafter.wants_costs

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self, prompt, rows):
        self.calls.append(("start", (list(prompt), rows)))
        return self.inner.start(prompt, rows)

    def prompt_rows(self, prompt, rows):  # a drafter that drafts at prefill gets the prompt's rows after start
        self.calls.append(("prompt_rows", (list(prompt), rows)))
        return self.inner.prompt_rows(prompt, rows)

    def propose(self, context, room):
        # The cost model as this step found it: the run's pace and learned step costs moved with every step the
        # engine took, and a replay without the model must size the trees the run sized.
        self.calls.append(("cost", (copy.deepcopy(self.inner.cost),)))
        self.calls.append(("propose", (list(context), room)))
        return self.inner.propose(context, room)

    def end(self, context):
        self.calls.append(("end", (list(context),)))
        return self.inner.end(context)

    def observe(self, tree, verified):
        self.calls.append(("observe", (tree, verified)))
        return self.inner.observe(tree, verified)


def replay(drafter, calls, engine, flush: torch.Tensor | None = None) -> dict[str, list[float]]:
    """Per-step seconds of propose, observe and input building, replaying ``calls`` on ``drafter``; ``differ``
    counts the trees that are not the ones the run verified (a faithful replay has none). ``flush``: a buffer
    written through, untimed, before each ``observe``, where a run's forward pass has just gone through the
    model's weights and activations (the drafter's memories and code are no longer in the caches; ``propose``
    follows ``observe`` with no forward pass between them)."""
    out = {"propose": [], "observe": [], "inputs": [], "nodes": [], "start": [], "differ": []}
    proposed = None
    for kind, args in calls:
        if kind in ("start", "end"):  # a request's set-up and close: its prompt, and its answer's last tokens,
            t0 = time.perf_counter()  # written to the stream memory (at its prefill, after its last step)
            getattr(drafter, kind)(*args)
            out["start"].append(time.perf_counter() - t0)
        elif kind == "prompt_rows":
            drafter.prompt_rows(*args)
        elif kind == "cost":
            drafter.cost = args[0]
        elif kind == "propose":
            t0 = time.perf_counter()
            tree = drafter.propose(*args)
            out["propose"].append(time.perf_counter() - t0)
            out["nodes"].append(len(tree))
            proposed = tree.without(engine.adapter.image_token_id)  # as the engine verifies an opening
            t0 = time.perf_counter()
            engine.step_inputs(tree)
            out["inputs"].append(time.perf_counter() - t0)
        else:
            if flush is not None:
                flush.add_(1.0)
            ran = args[0]
            if proposed is not None:
                out["differ"].append((proposed.tokens, proposed.parents) != (ran.tokens, ran.parents))
            proposed = None
            t0 = time.perf_counter()
            drafter.observe(*args)
            out["observe"].append(time.perf_counter() - t0)
    return out


def package(name: str) -> SimpleNamespace:
    """What a run needs from the package ``name``: this tree's recap_cli, or an older commit's (``import_before``)."""
    models = importlib.import_module(f"{name}.models")
    return SimpleNamespace(answer_with_tokens=importlib.import_module(f"{name}.batch").answer_with_tokens,
                           load=models.load, freeze_loaded=getattr(models, "freeze_loaded", lambda: None),
                           Session=importlib.import_module(f"{name}.session").Session,
                           StepCost=importlib.import_module(f"{name}.decoding.cost").StepCost,
                           parse_line=importlib.import_module(f"{name}.records").parse_line)


def record(model: str, inputs: list[Path], budget: str, max_new_tokens: int, limit: int, method: str = "recap",
           costs: str = "measured", code: str = "recap_cli") -> tuple:
    """Fill the memories over the first half of the requests and record the second half's drafter calls, with
    the package ``code``: the drafter as the second half found it, the calls, the session."""
    run = package(code)
    adapter = run.load(model, device="cpu", dtype="fp32")
    run.freeze_loaded()  # as recap run does: no full collection walks the model mid-run
    requests = read_requests(inputs, limit, run.parse_line)  # the requests as that code reads them
    knobs = {} if method == "suffix" else {"budget": budget if budget == "auto" else int(budget)}
    session = run.Session(adapter, method, **knobs)
    if costs == "fixed":
        session.engine.cost = fixed_costs(run.StepCost)
    half = len(requests) // 2
    for req in requests[:half]:  # fill the memories as a real run does
        run.answer_with_tokens(session, req, model, max_new_tokens)
    frozen = copy.deepcopy(session.drafter)
    session.drafter = Recorder(session.drafter)
    for req in requests[half:]:
        run.answer_with_tokens(session, req, model, max_new_tokens)
    return frozen, session.drafter.calls, session


def measure(model: str, inputs: list[Path], budget: str, max_new_tokens: int, limit: int, reps: int,
            sides: dict[str, str], method: str = "recap", costs: str = "measured", flush_mb: int = 0) -> list[dict]:
    """Record each side's run (``sides``: side -> package), then replay every side's calls ``reps`` times, the
    sides taking turns in this one process (a busy machine slows both alike): per side, the median and the
    fastest per-step milliseconds of each part."""
    runs = {side: record(model, inputs, budget, max_new_tokens, limit, "recap" if side == "before" else method,
                         costs, code) for side, code in sides.items()}
    per_rep: dict[str, list[dict]] = {side: [] for side in sides}
    flush = torch.zeros(flush_mb << 18) if flush_mb else None  # float32: 2^18 of them a MiB
    for rep in range(reps):
        for side in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
            frozen, calls, session = runs[side]
            per_rep[side].append(replay(copy.deepcopy(frozen), calls, session.engine, flush))
    rows = []
    for side, reps_of in per_rep.items():
        calls = runs[side][1]
        steps, starts = len(reps_of[0]["propose"]), sum(kind == "start" for kind, _ in calls)
        ms = {part: [1000 * sum(r[part]) / steps for r in reps_of] for part in ("propose", "observe", "inputs")}
        ms["start_per_request"] = [1000 * sum(r["start"]) / starts for r in reps_of]
        drafting = [a + b for a, b in zip(ms["propose"], ms["observe"])]
        rows.append({"side": side, "method": "recap" if side == "before" else method, "budget": budget,
                     "costs": costs, "steps": steps, "nodes_per_step": statistics.mean(reps_of[0]["nodes"]),
                     "ms_per_step": {part: statistics.median(v) for part, v in ms.items()},
                     "fastest_ms_per_step": {part: min(v) for part, v in ms.items()},
                     "drafting_ms": statistics.median(drafting), "fastest_drafting_ms": min(drafting),
                     "reps": reps, "flush_mb": flush_mb, "trees_differing": sum(reps_of[0]["differ"]),
                     "threads": torch.get_num_threads()})
    return rows


def checkout(ref: str) -> Path:
    """recap_cli as it was at commit ``ref``, in a temporary folder removed when the script ends (an error and
    Ctrl-C included): the callers import from it or run processes on it until then, so it cannot go sooner."""
    where = Path(tempfile.mkdtemp(prefix="recap-before-"))
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "recap_cli"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    return where


def import_before(ref: str) -> str:
    """Commit ``ref``'s recap_cli made importable beside this tree's, as the package BEFORE. Its modules import
    each other relatively; one that names recap_cli would run this tree's code on the before side."""
    where = checkout(ref)
    shutil.move(where / "recap_cli", where / BEFORE)
    named = [p.name for p in (where / BEFORE).rglob("*.py")
             if re.search(r"^\s*(from|import) recap_cli\b", p.read_text(), re.M)]
    if named:
        raise SystemExit(f"{ref}'s recap_cli imports itself by name ({', '.join(named)}): not measurable here")
    sys.path.insert(0, str(where))
    return BEFORE


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", default="demo")
    ap.add_argument("--inputs", type=Path, nargs="+",
                    default=[Path(f"sample_inputs/bench/demo_{s}.jsonl") for s in ("caption", "vqa", "multiturn")])
    ap.add_argument("--budget", default="64", help="draft nodes per step, or auto; several: comma-separated")
    ap.add_argument("--method", default="recap", help="recap, or suffix (its own sizes; no budget)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=1000, help="requests per input file")
    ap.add_argument("--reps", type=int, default=5, help="replays per side (per round)")
    ap.add_argument("--costs", choices=("measured", "fixed"), default="measured",
                    help="fixed: a frozen cost model, so trees at --budget auto are sized alike on both sides")
    ap.add_argument("--before", default=None, help="git commit whose recap_cli to measure beside this tree's")
    ap.add_argument("--rounds", type=int, default=2, help="with --before: replays per side = rounds x reps")
    ap.add_argument("--flush", type=int, default=0, metavar="MB",
                    help="write a buffer of MB MiB before each observe, as a forward pass sweeps the caches")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sides = {"after": "recap_cli"} if args.before is None else {"before": import_before(args.before),
                                                                 "after": "recap_cli"}
    reps = args.reps * (args.rounds if args.before else 1)
    results = []
    for budget in args.budget.split(","):
        for row in measure(args.model, args.inputs, budget, args.max_new_tokens, args.limit, reps, sides,
                           args.method, args.costs, args.flush):
            row["ref"] = args.before if row["side"] == "before" else "this tree"
            results.append(row)
            ms = row["ms_per_step"]
            print(f"{row['side']:6s} {row['method']:6s} budget {budget:4s}: {row['steps']} steps, "
                  f"{row['nodes_per_step']:.1f} nodes/step; propose {ms['propose']:.3f} + observe "
                  f"{ms['observe']:.3f} = drafting {row['drafting_ms']:.3f} ms/step (fastest "
                  f"{row['fastest_drafting_ms']:.3f}); inputs (ids, positions, mask) {ms['inputs']:.3f} ms; start "
                  f"and end (the prompt, the answer's end into the memories) {ms['start_per_request']:.3f} ms/request"
                  + (f"; {row['trees_differing']} trees NOT the run's" if row["trees_differing"] else ""), flush=True)
        if len(sides) == 2:
            before, after = results[-2], results[-1]
            print(f"budget {budget:4s} after / before, drafting: {after['drafting_ms'] / before['drafting_ms']:.3f} "
                  f"(median), {after['fastest_drafting_ms'] / before['fastest_drafting_ms']:.3f} (fastest)",
                  flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps({"model": args.model, "results": results}, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
