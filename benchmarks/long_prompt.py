"""One long prompt in a stream of short ones: does batching still beat one request at a time?

    python benchmarks/long_prompt.py --model demo --batches 1,16 --methods ar,recap --rounds 3

The stream: one text prompt of ``--long-tokens`` tokens (2,046 by default: the demo model reads 2,048 positions)
first, then 64 short requests (the demo VQA, caption and multi-turn sets). Every run starts a fresh session, as
``recap run`` does, so what a batch pays to start (its step-cost timing) is inside the time. Each round runs
every (method, batch) with and without the long prompt, methods side by side and their order rotating from round
to round, so machine drift hits all alike. Reported: the median seconds (and every run), the ratio to batch 1,
the start-up timing's share, and what the joint prefills padded (prefill tokens computed over real prompt tokens:
a load-independent measure of what one long prompt costs the short ones), and whether every request's tokens
equal ``ar`` at batch 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from recap_cli.adapters import Adapter
from recap_cli.batch import answer_all
from recap_cli.compare import parse_method
from recap_cli.models import freeze_loaded, load, locate
from recap_cli.records import Request, read
from recap_cli.session import Session

BENCH = Path(__file__).resolve().parent.parent / "sample_inputs" / "bench"
SHORT_SETS = ("demo_vqa", "demo_caption", "demo_multiturn")
FILLER = "the quick brown fox jumps over the lazy dog while the red square waits beside a blue circle "


def short_requests(n: int) -> list[Request]:
    out: list[Request] = []
    for name in SHORT_SETS:
        with open(BENCH / f"{name}.jsonl", "rb") as source:
            out += [r for r in read(source, BENCH) if r.error is None]
    return out[:n]


def long_request(adapter: Adapter, tokens: int) -> tuple[Request, int]:
    """A text request whose prompt (chat template included) is ``tokens`` long, or as close below as words and
    then single characters get it."""
    words = FILLER.split()

    def length(text: str) -> int:
        return adapter.build([{"role": "user", "content": [{"type": "text", "text": text}]}]
                             if adapter.supports_images else [{"role": "user", "content": text}], []).length

    def prose(n: int) -> str:
        return " ".join(words[i % len(words)] for i in range(n))

    lo, hi = 1, 2 * tokens  # the most words that keep the prompt within ``tokens``
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if length(prose(mid)) <= tokens else (lo, mid - 1)
    text = prose(lo)
    for _ in range(tokens):  # top up one character at a time while that still fits
        if length(text) == tokens or length(text + " x") > tokens:
            break
        text += " x"
    return Request(line=0, id="long", turns=[text]), length(text)


def timed(adapter: Adapter, spec: str, batch: int, reqs: list[Request], max_new_tokens: int) -> dict:
    """One fresh session over the stream: seconds (start-up included), the start-up timing's seconds, the joint
    prefills' padded and real prompt tokens, and every request's tokens."""
    name, knobs = parse_method(spec)
    t0 = time.perf_counter()
    session = Session(adapter, name, batch=batch, **knobs)
    startup, measuring, joins = [0.0], [False], []
    if session.batch_engine is not None:
        engine = session.batch_engine
        measure, join = engine.measure_costs, engine.join_trees

        def measured(*args, **kw):
            t1, measuring[0] = time.perf_counter(), True
            try:
                return measure(*args, **kw)
            finally:
                startup[0] += time.perf_counter() - t1
                measuring[0] = False

        def joined(prompts, *args, **kw):
            if not measuring[0]:  # the start-up timing's own joins are not the stream's
                joins.append([p.length for p in prompts])
            return join(prompts, *args, **kw)

        engine.measure_costs, engine.join_trees = measured, joined
    results = list(answer_all(session, reqs, "bench", max_new_tokens))
    seconds = time.perf_counter() - t0
    errors = [r["id"] for r, _ in results if r["error"] is not None]
    if errors:
        raise SystemExit(f"{spec} batch {batch}: requests failed: {errors}")
    return {"seconds": seconds, "startup_s": startup[0], "passes": len(joins),
            "padded": sum(len(g) * max(g) for g in joins), "real": sum(sum(g) for g in joins),
            "tokens": [t for _, t in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", default="demo")
    ap.add_argument("--short", type=int, default=64, help="short requests after the long prompt")
    ap.add_argument("--long-tokens", type=int, default=2046)
    ap.add_argument("--methods", default="ar,recap")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    adapter = load(locate(args.model, offline=True), device="cpu", dtype=args.dtype)
    freeze_loaded()  # as recap run does: no full collection walks the model mid-run
    short = short_requests(args.short)
    long, long_tokens = long_request(adapter, args.long_tokens)
    streams = {"long first": [long, *short], "short only": short}
    methods, batches = args.methods.split(","), [int(b) for b in args.batches.split(",")]
    timed(adapter, methods[0], batches[-1], short[:4], args.max_new_tokens)  # warm-up: first-call costs
    runs: dict[tuple[str, int, str], list[dict]] = {}
    for r in range(args.rounds):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for stream in streams:
            for b in batches:
                for method in order:
                    run = timed(adapter, method, b, streams[stream], args.max_new_tokens)
                    runs.setdefault((method, b, stream), []).append(run)
                    print(f"round {r + 1} {method} batch {b} {stream}: {run['seconds']:.1f} s", file=sys.stderr)
    reference = {stream: runs[(methods[0], batches[0], stream)][0]["tokens"] for stream in streams}
    rows = []
    for (method, b, stream), results in runs.items():
        differ = sorted({str(req.id) for res in results
                         for req, got, want in zip(streams[stream], res["tokens"], reference[stream]) if got != want})
        rows.append({"method": method, "batch": b, "stream": stream,
                     "seconds": statistics.median(x["seconds"] for x in results),
                     "seconds_runs": [round(x["seconds"], 2) for x in results],
                     "startup_s": statistics.median(x["startup_s"] for x in results),
                     "prefill_passes": results[0]["passes"],
                     "prefill_padding": results[0]["padded"] / results[0]["real"] if results[0]["real"] else None,
                     "match_vs_reference": 1 - len(differ) / len(streams[stream]), "differ": differ})
    one = {(row["method"], row["stream"]): row["seconds"] for row in rows if row["batch"] == batches[0]}
    print(f"\n{len(short)} short requests, one {long_tokens}-token prompt first; max {args.max_new_tokens} new "
          f"tokens, {torch.get_num_threads()} threads, {args.dtype}, {args.rounds} rounds (median; runs in "
          "brackets); a fresh session every run")
    print(f"| method | batch | stream | seconds | speed x batch {batches[0]} | start-up s | prefill passes "
          "| padded/real prefill tokens | match |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in sorted(rows, key=lambda x: (x["stream"] != "long first", x["method"], x["batch"])):
        pad = f"{row['prefill_padding']:.2f}" if row["prefill_padding"] else "–"
        print(f"| {row['method']} | {row['batch']} | {row['stream']} | {row['seconds']:.1f} "
              f"({', '.join(f'{x:.1f}' for x in row['seconds_runs'])}) | "
              f"{one[(row['method'], row['stream'])] / row['seconds']:.2f} | {row['startup_s']:.1f} | "
              f"{row['prefill_passes']} | {pad} | {100 * row['match_vs_reference']:.1f}% |")
    for row in rows:
        if row["differ"]:
            print(f"{row['method']} batch {row['batch']} {row['stream']}: tokens differ from {methods[0]} batch "
                  f"{batches[0]} on {row['differ']}")
    if args.json:
        args.json.write_text(json.dumps({"short": len(short), "long_tokens": long_tokens,
                                         "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
