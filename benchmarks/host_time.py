"""Host time per decoding step: drafting (propose + observe) and building the step's inputs (ids, positions,
the tree mask), for trees of a given size with the memories of a real run.

    python benchmarks/host_time.py --model demo --budget 64 [--json runs/host_time.json]

Runs ``recap`` over the demo bench sets once to fill its memories, recording every drafter call of the second
half; then replays those calls (same trees, the memories as they were) ``--reps`` times and reports the median
per-step time of each part. Replaying the recorded calls times the host's work alone: the model runs once, so
the figures do not depend on how busy the machine's cores are with the forward passes. Everything the host does
between two forwards counts against the step (DESIGN.md section 6: budget <= 0.4 ms at 64 nodes).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recap_cli.batch import answer_with_tokens  # noqa: E402
from recap_cli.models import load  # noqa: E402
from recap_cli.session import Session  # noqa: E402

from acceptance import read_requests  # noqa: E402


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

    def propose(self, context, room):
        self.calls.append(("propose", (list(context), room)))
        return self.inner.propose(context, room)

    def observe(self, tree, verified):
        self.calls.append(("observe", (tree, verified)))
        return self.inner.observe(tree, verified)


def replay(drafter, calls, engine) -> dict[str, list[float]]:
    """Per-step seconds of propose, observe and input building, replaying ``calls`` on ``drafter``."""
    out = {"propose": [], "observe": [], "inputs": [], "nodes": []}
    for kind, args in calls:
        if kind == "start":
            drafter.start(*args)
        elif kind == "propose":
            t0 = time.perf_counter()
            tree = drafter.propose(*args)
            out["propose"].append(time.perf_counter() - t0)
            out["nodes"].append(len(tree))
            t0 = time.perf_counter()
            engine.step_inputs(tree)
            out["inputs"].append(time.perf_counter() - t0)
        else:
            t0 = time.perf_counter()
            drafter.observe(*args)
            out["observe"].append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--inputs", type=Path, nargs="+",
                    default=[Path(f"sample_inputs/bench/demo_{s}.jsonl") for s in ("caption", "vqa", "multiturn")])
    ap.add_argument("--budget", default="64", help="draft nodes per step, or auto")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=1000, help="requests per input file")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    adapter = load(args.model, device="cpu", dtype="fp32")
    requests = read_requests(args.inputs, args.limit)
    budget = args.budget if args.budget == "auto" else int(args.budget)
    session = Session(adapter, "recap", budget=budget)
    half = len(requests) // 2
    for req in requests[:half]:  # fill the memories as a real run does
        answer_with_tokens(session, req, args.model, args.max_new_tokens)
    frozen = copy.deepcopy(session.drafter)
    session.drafter = Recorder(session.drafter)
    for req in requests[half:]:
        answer_with_tokens(session, req, args.model, args.max_new_tokens)
    calls = session.drafter.calls
    per_rep = []
    for _ in range(args.reps):
        per_rep.append(replay(copy.deepcopy(frozen), calls, session.engine))
    steps = len(per_rep[0]["propose"])
    ms = {part: 1000 * statistics.median(sum(r[part]) / steps for r in per_rep)
          for part in ("propose", "observe", "inputs")}
    nodes = statistics.mean(per_rep[0]["nodes"])
    total = sum(ms.values())
    print(f"budget {args.budget}: {steps} steps, {nodes:.1f} nodes/step; per step: propose {ms['propose']:.3f} ms, "
          f"observe {ms['observe']:.3f} ms, inputs (ids, positions, mask) {ms['inputs']:.3f} ms; "
          f"host total {total:.3f} ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps({"model": args.model, "budget": args.budget, "steps": steps,
                                            "nodes_per_step": nodes, "ms_per_step": ms, "host_ms": total,
                                            "threads": torch.get_num_threads()}, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
