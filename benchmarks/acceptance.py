"""Mean accepted tokens per step and drafting overhead of each method on a model with real weights.

    python benchmarks/acceptance.py [--model DIR] [--inputs sample_inputs/bench/text_prompts.jsonl ...]
    python benchmarks/acceptance.py --model demo --inputs sample_inputs/bench/demo_*.jsonl --limit 24

Defaults to SmolLM2-135M-Instruct (see benchmarks/smollm2.py). Inputs are ``recap run`` request files (images
and multi-turn conversations included). Every method runs as one session over all requests (RECAP's order-1
memory and TR's matrix carry over, as in ``recap run``) and its tokens are checked against ``ar``. Prints a
table and writes JSON; acceptance is a property of the drafts, not of the clock.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recap_cli.batch import answer_with_tokens  # noqa: E402
from recap_cli.decoding.cost import StepCost  # noqa: E402
from recap_cli.decoding.engine import Generation  # noqa: E402
from recap_cli.models import freeze_loaded, load  # noqa: E402
from recap_cli.records import Request, parse_line  # noqa: E402
from recap_cli.session import Session  # noqa: E402

VARIANTS = {
    "ar": ("ar", {}),
    "recap": ("recap", {"budget": 64}),
    "recap-16": ("recap", {"budget": 16}),
    "tr": ("tr", {}),
    "pld": ("pld", {}),
    "recap-orders1": ("recap", {"budget": 64, "orders": (1,)}),
    "recap-fixed": ("recap", {"budget": 64, "mixing": "fixed"}),
    "recap-nosuffix": ("recap", {"budget": 64, "suffix": False}),
    "recap-raw": ("recap", {"budget": 64, "calibrate": False}),
    "recap-norows": ("recap", {"budget": 64, "prompt_rows": False}),  # no prefill rows at prompt positions
    "recap-16-norows": ("recap", {"budget": 16, "prompt_rows": False}),
    "recap-80": ("recap", {"budget": 80}),
    "recap-80-orders1": ("recap", {"budget": 80, "orders": (1,)}),
    "recap-auto": ("recap", {}),  # sized by this machine's measured step costs: tokens/step depends on them
    "tr-auto": ("tr", {"budget": "auto"}),
    "pld-10": ("pld", {"budget": 10}),
    "suffix": ("suffix", {}),  # SuffixDecoding with vLLM's defaults: sizes its own chains, no cost model
    # The stream memory's depth (the longest match it keeps; a longer continuation re-anchors): 32 by default.
    "recap-16-depth24": ("recap", {"budget": 16, "stream_depth": 24}),
    "recap-16-depth16": ("recap", {"budget": 16, "stream_depth": 16}),
    "recap-auto-depth16": ("recap", {"stream_depth": 16}),
}


# Compiled static-cache step costs at Vicuna-7B shapes on an H200 (measured; 32 interpolated):
# with --costs h200, trees are sized as on that GPU, so tokens/step and nodes/step are what it would see.
H200_BUCKETS = (1, 16, 32, 64, 128)
H200_STEP_S = (5.7e-3, 7.6e-3, 7.9e-3, 8.2e-3, 8.2e-3)


def h200_costs() -> StepCost:
    cost = StepCost(buckets=H200_BUCKETS, alpha=0.0)  # frozen: this machine's timings must not move it
    cost.set(H200_STEP_S)
    return cost


class Recorder:
    """A session that keeps every turn's Generation, so the run path (``answer_with_tokens``) is reused as is."""

    def __init__(self, session: Session):
        self.session, self.adapter, self.method, self.gens = session, session.adapter, session.method, []

    def answer(self, messages, images, max_new_tokens: int) -> Generation:
        gen = self.session.answer(messages, images, max_new_tokens)
        self.gens.append(gen)
        return gen


def read_requests(inputs: list[Path], limit: int, parse=parse_line) -> list[Request]:
    """The first ``limit`` requests of each file; bad lines are an error here (benchmarks need clean inputs).
    ``parse``: the line parser of the code under test (host_time.py runs an older commit's beside this one)."""
    requests = []
    for path in inputs:
        lines = [raw for raw in path.read_bytes().splitlines() if raw.strip()][:limit]
        requests += [parse(raw, i + 1, path.parent) for i, raw in enumerate(lines)]
    bad = [r for r in requests if r.error]
    if bad:
        raise SystemExit(f"bad request: {bad[0].error}")
    return requests


def run(model: str, inputs: list[Path], variants: list[str], max_new_tokens: int, limit: int,
        costs: str = "measured") -> dict:
    adapter = load(model, device="cpu", dtype="fp32")
    freeze_loaded()  # as recap run does: no full collection walks the model mid-run
    requests = read_requests(inputs, limit)
    results, reference = {}, None
    for name in variants:
        method, knobs = VARIANTS[name]
        session = Recorder(Session(adapter, method, **knobs))
        step_costs = []
        if costs == "h200":  # every method: auto trees are sized by it, fixed ones are only costed by it
            session.session.engine.cost = h200_costs()
            step_costs = _modelled_step_costs(session.session.engine)
        t0 = time.perf_counter()
        tokens = []
        for req in requests:
            record, turns = answer_with_tokens(session, req, model, max_new_tokens)
            if record["error"]:
                raise SystemExit(f"{req.id}: {record['error']}")
            tokens.append(turns)
        wall = time.perf_counter() - t0
        gens = session.gens
        reference = reference or tokens
        steps = sum(g.steps for g in gens)
        emitted = sum(len(g.tokens) - g.prefill_tokens for g in gens)  # the prefills' tokens come from no step
        after_first = sum(len(g.tokens) - 1 for g in gens)  # what the steps and the prefills' drafts gave
        rates = [(len(g.tokens) - 1) / g.decode_s for g in gens if g.decode_s]
        results[name] = {  # nan where no step ran (short answers the prefill's own draft gave whole)
            "tokens_per_step": _per(emitted, steps),
            "prefill_drafted": after_first - emitted,  # drafted tokens a prefill verified (RECAP's first tree)
            "draft_ms_per_step": _per(1000 * sum(g.draft_s for g in gens), steps),
            "verify_ms_per_step": _per(1000 * sum(g.verify_s for g in gens), steps),
            "nodes_per_step": _per(sum(g.tree_nodes for g in gens), steps),
            "modelled_step_ms": _per(1000 * sum(step_costs), len(step_costs)) if costs == "h200" else None,
            "median_decode_tok_s": statistics.median(rates) if rates else math.nan,
            "wall_s": wall,
            "matches_ar": tokens == reference,
            "by_source": dict(sum((g.by_source for g in gens), start=type(gens[0].by_source)())),
        }
        r = results[name]
        if costs == "h200":  # the GPU's steps + this machine's drafting time, per token after each turn's first;
            # a tree verified by a prefill is charged what it adds to a step there (rows of a pass of hundreds)
            cost = session.session.engine.cost
            rows = sum(cost(g.prefill_nodes) - cost(1) for g in gens)
            total = sum(step_costs) + rows + sum(g.draft_s for g in gens)
            r["projected_ms_per_token"] = 1000 * total / after_first
            r["prefill_tree_ms"] = 1000 * rows / len(gens)
            print(f"{name:15s} projected on an H200: step {r['modelled_step_ms']:.2f} ms + drafting "
                  f"{r['draft_ms_per_step']:.3f} ms, prefill trees {r['prefill_tree_ms']:.2f} ms a turn "
                  f"-> {r['projected_ms_per_token']:.2f} ms/token")
        print(f"{name:15s} tok/step {r['tokens_per_step']:.3f}  nodes {r['nodes_per_step']:5.1f}  "
              f"draft {r['draft_ms_per_step']:.3f} ms  verify {r['verify_ms_per_step']:.1f} ms  "
              f"median {r['median_decode_tok_s']:.1f} tok/s  same-as-ar {r['matches_ar']}", flush=True)
    return {"model": model, "inputs": [str(p) for p in inputs], "requests": len(requests),
            "max_new_tokens": max_new_tokens, "threads": torch.get_num_threads(), "results": results}


def _per(total: float, count: int) -> float:
    return total / count if count else math.nan


def _modelled_step_costs(engine) -> list[float]:
    """What the engine's cost model says each verification step costs, appended as the steps happen."""
    out, verify = [], engine.verify

    def timed_verify(tree):
        out.append(engine.cost(engine._bucket(len(tree))))
        return verify(tree)

    engine.verify = timed_verify
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct, converted)")
    ap.add_argument("--inputs", type=Path, nargs="+", default=[Path("sample_inputs/bench/text_prompts.jsonl")])
    ap.add_argument("--methods", default=",".join(VARIANTS))
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=12, help="requests per input file")
    ap.add_argument("--json", type=Path, default=Path("runs/acceptance.json"))
    ap.add_argument("--costs", choices=("measured", "h200"), default="measured",
                    help="step costs that size auto trees: this machine's, or an H200's (measured at 7B shapes)")
    args = ap.parse_args()
    if args.model is None:
        from smollm2 import prepare

        args.model = str(prepare())
    report = run(args.model, args.inputs, args.methods.split(","), args.max_new_tokens, args.limit, args.costs)
    report["costs"] = args.costs
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
