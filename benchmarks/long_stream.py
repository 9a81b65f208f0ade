"""A long stream: does recap keep its speed, its host time and its memory over thousands of requests?

    python benchmarks/long_stream.py --scenes 1000 --window 250 [--json runs/long_stream.json]

``recap run`` over thousands of images is what the tool is for, and RECAP's memories live that long: the stream
memory holds the last 1,000 requests (``stream_requests``) and evicts the oldest past them, the learned chances
keep learning. The committed sets are 72 requests. This writes ``--scenes`` fresh demo scenes (a caption, a VQA
and a conversation each, shuffled into one stream), and answers each request with ``ar`` and ``recap`` in turn,
one session each, the order alternating from request to request so that machine drift hits both alike. Per window
of ``--window`` requests: recap's speed over ``ar`` (mean of per-request ratios, p10, total), tokens a step,
drafting milliseconds a step (propose + observe, as recap's records report it), the process's peak resident
memory, how many sequences and nodes the stream memory holds, and how many answers differ from ``ar`` (none may).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from recap_cli.batch import answer_with_tokens
from recap_cli.demo.samples import bench_sets
from recap_cli.models import freeze_loaded, load
from recap_cli.records import Request
from recap_cli.session import Session

from batching import requests  # a sibling script: benchmarks/ is the script's own folder

SETS = ("demo_caption", "demo_vqa", "demo_multiturn")


def stream(scenes: int, seed: str, folder: Path) -> list[Request]:
    """Every scene's caption, VQA and conversation requests, shuffled into one stream."""
    bench_sets(folder, scenes, seed)
    out = requests([folder / f"{name}.jsonl" for name in SETS], None)
    random.Random(seed).shuffle(out)
    return out


def window_row(upto: int, timed: list[dict], session: Session, differ: int) -> dict:
    """One window's figures: recap over ``ar`` per request and in total, and what recap's drafting cost."""
    ratios = sorted(t["ar"] / t["recap"] for t in timed)
    steps = sum(t["steps"] for t in timed) or 1
    tree = session.drafter.stream.tree
    return {"requests": upto, "mean_x": statistics.mean(ratios), "p10_x": ratios[len(ratios) // 10],
            "total_x": sum(t["ar"] for t in timed) / sum(t["recap"] for t in timed),
            "tokens_per_step": sum(t["tokens"] for t in timed) / steps,
            "draft_ms_per_step": sum(t["draft_ms"] for t in timed) / steps,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "stream_sequences": len(tree.seqs), "stream_nodes": len(tree.count) - len(tree.free),
            "differ_from_ar": differ}


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", default="demo")
    ap.add_argument("--scenes", type=int, default=1000, help="demo scenes: three requests each")
    ap.add_argument("--seed", default="long-stream", help="the scenes' seed stream")
    ap.add_argument("--window", type=int, default=250, help="requests a reported window")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="recap-long-") as folder:
        reqs = stream(args.scenes, args.seed, Path(folder))
        adapter = load(args.model, device="cpu", dtype="fp32")
        freeze_loaded()
        sessions = {"ar": Session(adapter, "ar"), "recap": Session(adapter, "recap")}
        rows, timed, differ = [], [], 0
        print(f"{len(reqs)} requests, ar and recap alternating; a row per {args.window}", file=sys.stderr)
        for i, req in enumerate(reqs):
            seconds, answered = {}, {}
            for method in ("ar", "recap") if i % 2 == 0 else ("recap", "ar"):
                t0 = time.perf_counter()
                answered[method] = answer_with_tokens(sessions[method], req, args.model, args.max_new_tokens)
                seconds[method] = time.perf_counter() - t0
            differ += answered["ar"][1] != answered["recap"][1]
            record = answered["recap"][0]
            timed.append({**seconds, "steps": record.get("steps", 0), "tokens": record.get("new_tokens", 0),
                          "draft_ms": record.get("draft_ms", 0.0)})
            if (i + 1) % args.window == 0 or i + 1 == len(reqs):
                rows.append(window_row(i + 1, timed, sessions["recap"], differ))
                timed = []
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}),
                      flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "scenes": args.scenes, "seed": args.seed,
                                         "windows": rows}, indent=1))


if __name__ == "__main__":
    main()
