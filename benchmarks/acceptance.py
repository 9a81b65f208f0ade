"""Mean accepted tokens per step and drafting overhead of each method on a model with real weights.

    python benchmarks/acceptance.py [--model DIR] [--inputs sample_inputs/bench/text_prompts.jsonl]

Defaults to SmolLM2-135M-Instruct (see benchmarks/smollm2.py). Every method runs as one session over all
prompts (RECAP's order-1 memory and TR's matrix carry over, as in ``recap run``) and its tokens are checked
against ``ar``. Prints a table and writes JSON; acceptance is a property of the drafts, not of the clock.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recap_cli.models import load  # noqa: E402
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
}


def run(model: str, inputs: Path, variants: list[str], max_new_tokens: int, limit: int) -> dict:
    adapter = load(model, device="cpu", dtype="fp32")
    records = [orjson.loads(line) for line in inputs.read_bytes().splitlines() if line.strip()][:limit]
    messages = [[{"role": "user", "content": r["prompt"]}] for r in records]
    results, reference = {}, None
    for name in variants:
        method, knobs = VARIANTS[name]
        session = Session(adapter, method, **knobs)
        gens, t0 = [], time.perf_counter()
        for m in messages:
            gens.append(session.answer(m, [], max_new_tokens))
        wall = time.perf_counter() - t0
        tokens = [g.tokens for g in gens]
        reference = reference or tokens
        steps = sum(g.steps for g in gens)
        emitted = sum(len(g.tokens) - 1 for g in gens)  # the first token comes from prefill, not a step
        results[name] = {
            "tokens_per_step": emitted / steps,
            "draft_ms_per_step": 1000 * sum(g.draft_s for g in gens) / steps,
            "verify_ms_per_step": 1000 * sum(g.verify_s for g in gens) / steps,
            "nodes_per_step": sum(g.tree_nodes for g in gens) / steps,
            "median_decode_tok_s": statistics.median((len(g.tokens) - 1) / g.decode_s for g in gens if g.decode_s),
            "wall_s": wall,
            "matches_ar": tokens == reference,
            "by_source": dict(sum((g.by_source for g in gens), start=type(gens[0].by_source)())),
        }
        r = results[name]
        print(f"{name:15s} tok/step {r['tokens_per_step']:.3f}  nodes {r['nodes_per_step']:5.1f}  "
              f"draft {r['draft_ms_per_step']:.3f} ms  verify {r['verify_ms_per_step']:.1f} ms  "
              f"median {r['median_decode_tok_s']:.1f} tok/s  same-as-ar {r['matches_ar']}", flush=True)
    return {"model": model, "inputs": str(inputs), "prompts": len(records), "max_new_tokens": max_new_tokens,
            "threads": torch.get_num_threads(), "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct, converted)")
    ap.add_argument("--inputs", type=Path, default=Path("sample_inputs/bench/text_prompts.jsonl"))
    ap.add_argument("--methods", default=",".join(VARIANTS))
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=12, help="number of prompts")
    ap.add_argument("--json", type=Path, default=Path("runs/acceptance.json"))
    args = ap.parse_args()
    if args.model is None:
        from smollm2 import prepare

        args.model = str(prepare())
    report = run(args.model, args.inputs, args.methods.split(","), args.max_new_tokens, args.limit)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
