"""Throughput of batched decoding: requests/hour and tokens/s of wall time, per method and batch size.

    python benchmarks/batching.py --model demo --inputs sample_inputs/bench/demo_caption.jsonl \
        sample_inputs/bench/demo_vqa.jsonl sample_inputs/bench/demo_multiturn.jsonl --batches 1,4,8,16

One session per (method, batch size), each warmed up once (first requests untimed: the step-cost model has
learned this machine); then every round runs every session over all inputs with its memory cleared first, the
methods back to back at each batch size in an order that rotates from one round to the next, so machine drift hits
all alike. With ``--fresh`` every round starts new sessions instead, untimed only while the model loads: what one
``recap run`` costs, the cost model's learning (its start-up) included. Reported: the median over rounds (and the
spread), the share of wall time spent drafting (every row's propose and observe: host time the step's other rows
wait for), each round's wall and CPU seconds (CPU time of this process: steadier than wall time on a machine
others share, though not free of them), mean rows in flight, tokens per step, and the share of requests whose
tokens equal ``ar`` at batch 1 (batched matrix products may round differently from batch 1: any difference is
listed, never hidden). Prompt prefixes are reused across requests as ``recap run`` reuses them (``--prefix-cache
auto``, its default; ``--prefix-cache 0``: none, as this script ran before).

    python benchmarks/batching.py --model demo --fresh --rounds 3 --batches 16,1 --methods ar,recap \
        --inputs sample_inputs/bench/demo_caption.jsonl sample_inputs/bench/demo_vqa.jsonl \
        sample_inputs/bench/demo_multiturn.jsonl

``--costs h200`` sizes every tree with the step costs projected for Qwen2.5-VL-7B on an H200 instead of this
machine's (eager steps measured on an H200 at 7B shapes, frozen) and reports projected decoding throughput: emitted
tokens over the modelled step times plus this machine's drafting time (prefill left out). Acceptance is a
property of the drafts, not of the clock, so tokens per step are what that GPU would see. On a GPU itself,
``--device cuda --dtype bf16`` measures it instead (benchmarks/gpu_session.sh).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import recap_cli
from recap_cli.batch import answer_all
from recap_cli.compare import parse_method
from recap_cli.models import freeze_loaded, load, locate
from recap_cli.records import read
from recap_cli.session import Session


def requests(paths: list[Path], limit: int | None) -> list:
    out = []
    for path in paths:
        with open(path, "rb") as source:
            reqs = [r for r in read(source, path.resolve().parent) if r.error is None]
        out += reqs[:limit]
    return out


# Projected eager step on an H200 at the Qwen2.5-VL-7B shape: launch-bound, 21-26 ms for 1 to 128 tokens
# (measured on an H200; this project's own lease, docs/benchmarks.md: `ar` 22.7 ms a token, a one-row batched
# step 18.5 ms); beyond, compute at ~2 x 7.6e9 FLOP per token and ~700 TFLOP/s (projected).
H200_EAGER_S, H200_PER_TOKEN_S = 23e-3, 2 * 7.6e9 / 700e12


def h200_step(tokens: int) -> float:
    return max(H200_EAGER_S, tokens * H200_PER_TOKEN_S)


def project_h200(session: Session) -> list[float]:
    """Freeze the session's step costs at the projected H200 ones; the list fills with each step's modelled
    seconds as it runs."""
    modelled: list[float] = []
    if session.batch_engine is None:
        cost = session.engine.cost
        cost.set([h200_step(n) for n in cost.sizes])
        cost.alpha = 0.0
        engine = session.engine
        real = engine.verify
        engine.verify = lambda tree: (modelled.append(h200_step(len(tree))), real(tree))[1]
        return modelled
    batched = session.batch_engine
    for rows, curve in batched.cost.by_rows.items():
        curve.set([h200_step(rows * w) for w in curve.sizes])
        curve.alpha = 0.0
    real_batched = batched.verify
    batched.verify = lambda trees: (modelled.append(h200_step(len(trees) * max(len(t) for t in trees))),
                                    real_batched(trees))[1]
    return modelled


def timed(session: Session, reqs: list, max_new_tokens: int,
          workers: int | None = None) -> tuple[float, list, list, float]:
    """Wall seconds, records, tokens and this process's CPU seconds of one pass over ``reqs`` (``workers``:
    preparation threads, as ``answer_all`` takes them; None: its default)."""
    session.reset_memory()
    session.steps = session.rows_stepped = 0
    c0, t0 = time.process_time(), time.perf_counter()
    results = list(answer_all(session, reqs, "bench", max_new_tokens, workers))
    return time.perf_counter() - t0, [r for r, _ in results], [t for _, t in results], time.process_time() - c0


def megabytes(text: str) -> str | float:
    """``--prefix-cache``: 'auto' or a size in MB, 0 or more."""
    if text == "auto":
        return text
    try:
        size = float(text)
    except ValueError:
        size = -1.0
    if size < 0:
        raise argparse.ArgumentTypeError("'auto' or a size in MB, 0 or more")
    return size


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", default="demo")
    ap.add_argument("--inputs", nargs="+", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=None, help="requests per input file")
    ap.add_argument("--methods", default="ar,recap")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, ... (a GPU's step costs are its own)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--costs", choices=("measured", "h200"), default="measured")
    ap.add_argument("--prefix-cache", default="auto", type=megabytes, help="MB of prefill results kept for "
                    "reuse, as recap run's --prefix-cache ('auto', its default: a tenth of the weights; 0: none)")
    ap.add_argument("--prepare-workers", type=int, default=None, metavar="N",
                    help="threads preparing the next requests' inputs (0: each on the decoding thread as it joins; "
                         "default: recap run's)")
    ap.add_argument("--fresh", action="store_true", help="new sessions every round, nothing warmed up: what a "
                    "`recap run` costs, the cost model's start-up included")
    args = ap.parse_args()
    if args.fresh and args.costs == "h200":
        ap.error("--fresh times a run's own start-up; --costs h200 replaces it with projected costs")
    torch.set_num_threads(torch.get_num_threads())
    adapter = load(locate(args.model, offline=True), device=args.device, dtype=args.dtype)
    freeze_loaded()  # as recap run does: no full collection walks the model mid-run
    reqs = requests(args.inputs, args.limit)
    methods, batches = args.methods.split(","), [int(b) for b in args.batches.split(",")]
    sessions = {}
    modelled: dict[tuple[str, int], list[float]] = {}

    def new_session(method: str, b: int) -> Session:
        name, knobs = parse_method(method)
        return Session(adapter, name, batch=b, prefix_cache=args.prefix_cache, **knobs)

    for method in methods:
        for b in batches:
            session = new_session(method, b)
            if args.costs == "h200":
                modelled[(method, b)] = project_h200(session)
            # Warm-up: torch's first calls at these shapes, and (unless --fresh) the cost model's learning.
            answer_all_list = list(answer_all(session, reqs[: 2 * b], "bench", args.max_new_tokens,
                                              args.prepare_workers))
            assert all(r["error"] is None for r, _ in answer_all_list)
            sessions[(method, b)] = session
    runs: dict[tuple[str, int], list[tuple[float, list, list, float | None]]] = {k: [] for k in sessions}
    cpu: dict[tuple[str, int], list[float]] = {k: [] for k in sessions}
    projected: dict[tuple[str, int], list[float]] = {k: [] for k in sessions}
    for r in range(args.rounds):
        # Methods side by side at each batch size, their order rotating from round to round.
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for key in [(method, b) for b in batches for method in order]:
            start = len(modelled.get(key, []))
            if args.fresh:
                sessions[key] = new_session(*key)
            seconds, records, tokens, cpu_s = timed(sessions[key], reqs, args.max_new_tokens, args.prepare_workers)
            runs[key].append((seconds, records, tokens, sessions[key].occupancy))
            cpu[key].append(cpu_s)
            if key in modelled:  # decoding on the GPU: modelled steps + this machine's drafting
                emitted = sum(rec["new_tokens"] - rec["turns"] for rec in records)
                busy = sum(modelled[key][start:]) + sum(rec["draft_ms"] for rec in records) / 1000 / (
                    sessions[key].occupancy or 1.0)  # rows draft one after another within a step
                projected[key].append(emitted / busy)
            print(f"round {r + 1} {key[0]} batch {key[1]}: {seconds:.2f} s wall, {cpu_s:.2f} s CPU", file=sys.stderr)
    reference = runs[(methods[0], batches[0])][0][2]  # the first method at the first batch size (ar at 1)
    rows = []
    for (method, b), results in runs.items():
        rates = [len(reqs) * 3600 / s for s, _, _, _ in results]
        tokens = sum(rec["new_tokens"] for rec in results[0][1])
        steps = sum(rec["steps"] for rec in results[0][1])
        emitted = tokens - sum(rec["turns"] for rec in results[0][1])
        nodes = sum(rec["mean_nodes"] * rec["steps"] for rec in results[0][1])
        differ = [rec["id"] for res in results for rec, t, want in zip(res[1], res[2], reference) if t != want]
        rows.append({
            "method": method, "batch": b, "requests_per_hour": statistics.median(rates),
            "requests_per_hour_runs": [round(x) for x in rates],
            "tokens_per_s": statistics.median(tokens / s for s, _, _, _ in results),
            "mean_rows_in_flight": results[0][3] or 1.0,
            "tokens_per_step": emitted / steps if steps else 0.0, "nodes_per_step": nodes / steps if steps else 0.0,
            "match_vs_reference": 1 - len(set(differ)) / len(reqs), "differ": sorted(set(map(str, differ))),
            "projected_h200_decode_tokens_per_s": statistics.median(projected[(method, b)]) if projected[(method, b)]
            else None,
            # Rows draft one after another, each between the step's forward passes: the records' drafting
            # seconds add up to host time every row of the run waited for.
            "drafting_share": statistics.median(sum(rec["draft_ms"] for rec in recs) / 1000 / s
                                                for s, recs, _, _ in results),
            "wall_s_runs": [round(s, 3) for s, _, _, _ in results],
            "cpu_s_runs": [round(c, 3) for c in cpu[(method, b)]],
        })
    base = {row["method"]: row["requests_per_hour"] for row in rows if row["batch"] == batches[0]}
    ar = {row["batch"]: row["requests_per_hour"] for row in rows if row["method"] == methods[0]}
    print(f"\n{len(reqs)} requests, max {args.max_new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"{args.dtype}, {args.rounds} rounds (median; runs in brackets), preparation threads: "
          f"{'default' if args.prepare_workers is None else args.prepare_workers}")
    # Which code was timed: an A/B of two checkouts must point each at its own (PYTHONPATH); a script's
    # directory, not the working directory, leads sys.path, so an editable install's code is imported otherwise.
    print(f"recap_cli from {Path(recap_cli.__file__).parent}")
    print(f"| method | batch | requests/hour | tokens/s | x batch {batches[0]} | x {methods[0]} | rows in flight "
          "| tokens/step | nodes/step | drafting | match |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['method']} | {row['batch']} | {row['requests_per_hour']:,.0f} "
              f"({', '.join(f'{x:,}' for x in row['requests_per_hour_runs'])}) | {row['tokens_per_s']:.1f} | "
              f"{row['requests_per_hour'] / base[row['method']]:.2f} | {row['requests_per_hour'] / ar[row['batch']]:.2f} | "
              f"{row['mean_rows_in_flight']:.1f} | {row['tokens_per_step']:.2f} | {row['nodes_per_step']:.1f} | "
              f"{100 * row['drafting_share']:.1f}% | {100 * row['match_vs_reference']:.1f}% |")
    if args.costs == "h200":
        ar_h200 = {row["batch"]: row["projected_h200_decode_tokens_per_s"] for row in rows if row["method"] == methods[0]}
        print("\nprojected on an H200, Qwen2.5-VL-7B, eager steps (decoding only, prefill left out)")
        print(f"| method | batch | tokens/s | x {methods[0]} | tokens/step a row | nodes/step a row |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for row in rows:
            tps = row["projected_h200_decode_tokens_per_s"]
            print(f"| {row['method']} | {row['batch']} | {tps:,.0f} | {tps / ar_h200[row['batch']]:.2f} | "
                  f"{row['tokens_per_step']:.2f} | {row['nodes_per_step']:.1f} |")
    # Each round's wall (and CPU) seconds against the first method's in the same round, at the same batch size:
    # the pairs that ran back to back.
    first = {row["batch"]: row for row in rows if row["method"] == methods[0]}
    print(f"\nper round, {'fresh sessions (start-up included)' if args.fresh else 'warm sessions'}: "
          f"seconds, and x {methods[0]} (its time / this one's)")
    print(f"| method | batch | wall s per round | x {methods[0]} wall | CPU s per round | x {methods[0]} CPU |")
    print("| --- | ---: | --- | --- | --- | --- |")
    for row in rows:
        base_row = first[row["batch"]]
        wall_x = [b / s for b, s in zip(base_row["wall_s_runs"], row["wall_s_runs"])]
        cpu_x = [b / s for b, s in zip(base_row["cpu_s_runs"], row["cpu_s_runs"])]
        print(f"| {row['method']} | {row['batch']} | {', '.join(f'{x:.2f}' for x in row['wall_s_runs'])} | "
              f"{', '.join(f'{x:.3f}' for x in wall_x)} | {', '.join(f'{x:.2f}' for x in row['cpu_s_runs'])} | "
              f"{', '.join(f'{x:.3f}' for x in cpu_x)} |")
    for row in rows:
        if row["differ"]:
            print(f"{row['method']} batch {row['batch']}: tokens differ from the reference on {row['differ']}")
    if args.json:
        args.json.write_text(json.dumps({"requests": len(reqs), "max_new_tokens": args.max_new_tokens,
                                         "fresh": args.fresh, "prepare_workers": args.prepare_workers,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
