"""Prefix reuse and inputs prepared ahead, end to end: requests/hour with reuse on vs off.

    python benchmarks/reuse.py --batches 1,16 --rounds 3            # the three sets, reuse on vs off
    python benchmarks/reuse.py --batches 16 --workers 0,2 --sets grouped  # preparation inline vs ahead
    python benchmarks/reuse.py --rss 2000                           # peak RSS of 2,000 requests, cache vs none
    python benchmarks/reuse.py --project                            # the H200 projection alone

Sets (``sample_inputs/bench``): grouped VQA (five questions per image, consecutive lines, as VQA sets ship them),
multi-turn (three turns per image, each seeing the answers before it) and captions (one request per image:
nothing repeats, so reuse can only cost). For every set and batch size, one session with the prefix cache at its
default size and one without run back to back, their order rotating from round to round, memories cleared before
each run. Reported: median requests/hour and wall tokens/s, the ratio on/off, CPU seconds of the process (a
steadier measure of work on a shared machine) and their ratio, the share of prompt tokens reused, prefill's share
of wall time, preparation's share of wall time (``wait``: the decoding thread waited for it or ran it; ``work``:
the jobs' own time, on other threads) and whether the tokens of every run equal those of the first run without
reuse.

``--rss N`` runs N grouped-VQA requests about N/5 fresh demo images (written to a temporary folder) at the
default batch in a child process per setting, sampling its resident memory every 0.2 s: peak, and the level at
each tenth of the run (flat once the cache is full). ``--project`` prints what reuse saves for Qwen2.5-VL-7B on
an H200 at a typical image size: a cost model (prefill tokens x a prefill cost, vision tokens x an encoder cost,
decoding steps x a step cost), labelled projected, not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from recap_cli.batch import answer_all
from recap_cli.compare import parse_method
from recap_cli.decoding.batched import default_batch
from recap_cli.models import freeze_loaded, load, locate
from recap_cli.prepare import Preparer
from recap_cli.records import read
from recap_cli.session import Session

BENCH = Path(__file__).resolve().parent.parent / "sample_inputs" / "bench"
SETS = {"grouped": "demo_vqa_grouped.jsonl", "multiturn": "demo_multiturn.jsonl", "caption": "demo_caption.jsonl"}


def requests(path: Path) -> list:
    with open(path, "rb") as source:
        reqs = list(read(source, path.resolve().parent))
    assert all(r.error is None for r in reqs), path
    return reqs


def cpu_s() -> float:
    """CPU seconds of this process, all threads: on a shared machine a steadier measure of work than wall time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(session: Session, reqs: list, max_new_tokens: int, workers: int) -> dict:
    session.reset_memory()  # drafter memories and the prefix cache: every run starts alike
    session.steps = session.rows_stepped = 0
    preparer = Preparer(workers)
    t0, c0 = time.perf_counter(), cpu_s()
    with preparer:
        out = list(answer_all(session, reqs, "bench", max_new_tokens, preparer=preparer))
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    records = [r for r, _ in out]
    assert all(r["error"] is None for r in records), [r["error"] for r in records if r["error"]]
    return {"wall": wall, "cpu": cpu, "tokens": [t for _, t in out],
            "new_tokens": sum(r["new_tokens"] for r in records),
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "prefix_hit": sum(r["prefix_hit"] for r in records),
            "prefill_s": sum(r["prefill_ms"] for r in records) / 1000,
            "wait_share": preparer.waited_s / wall, "work_share": preparer.busy_s / wall}


def throughput(args: argparse.Namespace) -> None:
    torch.set_num_threads(torch.get_num_threads())
    adapter = load(locate(args.model, offline=True), device="cpu", dtype=args.dtype)
    freeze_loaded()  # as recap run does: no full collection walks the model mid-run
    name, knobs = parse_method(args.method)
    batches = [int(b) for b in args.batches.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    sets = {s: requests(BENCH / SETS[s])[: args.limit] for s in args.sets.split(",")}
    keys = [(b, mb, w) for b in batches for mb in ("auto", 0) for w in workers]
    sessions = {}
    for b, mb in dict.fromkeys((b, mb) for b, mb, _ in keys):
        sessions[(b, mb)] = Session(adapter, name, batch=b, prefix_cache=mb, **knobs)
        warm = next(iter(sets.values()))[: 2 * b]
        list(answer_all(sessions[(b, mb)], warm, "bench", args.max_new_tokens))  # step costs measured here
    runs: dict[tuple, list[dict]] = {(s, *k): [] for s in sets for k in keys}
    for r in range(args.rounds):
        for s, reqs in sets.items():
            for b in batches:
                at = [k for k in keys if k[0] == b]
                for key in at[r % len(at):] + at[: r % len(at)]:  # on and off back to back, order rotating
                    run = timed(sessions[key[:2]], reqs, args.max_new_tokens, key[2])
                    runs[(s, *key)].append(run)
                    print(f"round {r + 1} {s} batch {b} reuse {'off' if key[1] == 0 else 'on'} workers {key[2]}: "
                          f"{run['wall']:.1f} s", file=sys.stderr)
    rows = []
    for (s, b, mb, w), results in runs.items():
        n = len(sets[s])
        reference = runs[(s, batches[0], 0, workers[0])][0]["tokens"]
        rows.append({
            "set": s, "batch": b, "reuse": mb != 0, "workers": w, "requests": n,
            "requests_per_hour": statistics.median(3600 * n / x["wall"] for x in results),
            "requests_per_hour_runs": [round(3600 * n / x["wall"]) for x in results],
            "wall_tokens_per_s": statistics.median(x["new_tokens"] / x["wall"] for x in results),
            "cpu_s": statistics.median(x["cpu"] for x in results),
            "prefix_reuse": results[0]["prefix_hit"] / results[0]["prompt_tokens"],
            "prefill_share": statistics.median(x["prefill_s"] / x["wall"] for x in results),
            "prepare_wait_share": statistics.median(x["wait_share"] for x in results),
            "prepare_work_share": statistics.median(x["work_share"] for x in results),
            "match": all(x["tokens"] == reference for x in results),
        })
    off = {(r["set"], r["batch"], r["workers"]): r for r in rows if not r["reuse"]}
    print(f"\n{args.method}, max {args.max_new_tokens} new tokens, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{args.rounds} rounds (median; runs in brackets)")
    print("| set | batch | reuse | prep threads | requests/hour | wall tokens/s | x off | CPU s (x off) "
          "| prompt reused | prefill | prep wait | prep work | tokens equal |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        base = off[(row["set"], row["batch"], row["workers"])]
        ratio = row["requests_per_hour"] / base["requests_per_hour"]
        print(f"| {row['set']} | {row['batch']} | {'on' if row['reuse'] else 'off'} | {row['workers']} | "
              f"{row['requests_per_hour']:,.0f} ({', '.join(f'{x:,}' for x in row['requests_per_hour_runs'])}) | "
              f"{row['wall_tokens_per_s']:.1f} | {ratio:.2f} | "
              f"{row['cpu_s']:.1f} ({base['cpu_s'] / row['cpu_s']:.2f}) | "
              f"{100 * row['prefix_reuse']:.0f}% | {100 * row['prefill_share']:.0f}% | "
              f"{100 * row['prepare_wait_share']:.1f}% | {100 * row['prepare_work_share']:.1f}% | "
              f"{'yes' if row['match'] else 'NO'} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


# --- peak memory over a long run ----------------------------------------------------------------------------------

def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_child(args: argparse.Namespace) -> None:
    """One long run at the default batch, its resident memory sampled; prints one JSON line."""
    from recap_cli.demo import samples

    with tempfile.TemporaryDirectory() as tmp:
        samples.bench_sets(Path(tmp), n=-(-args.rss_child // samples.GROUPED_PER_IMAGE), seed="rss")
        reqs = requests(Path(tmp) / SETS["grouped"])[: args.rss_child]
        adapter = load(locate(args.model, offline=True), device="cpu", dtype=args.dtype)
        freeze_loaded()  # as recap run does: no full collection walks the model mid-run
        name, knobs = parse_method(args.method)
        batch = default_batch("cpu")
        megabytes = "auto" if args.prefix_cache == "auto" else int(args.prefix_cache)
        session = Session(adapter, name, batch=batch, prefix_cache=megabytes, **knobs)
        list(answer_all(session, reqs[: 2 * batch], "bench", args.max_new_tokens))  # warm: step costs measured
        start, samples_mb, done = rss_mb(), [], threading.Event()

        def sample() -> None:
            while not done.wait(0.2):
                samples_mb.append(rss_mb())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        levels, t0 = [], time.perf_counter()
        for i, _ in enumerate(answer_all(session, reqs, "bench", args.max_new_tokens), start=1):
            if i % max(1, len(reqs) // 10) == 0:
                levels.append(round(rss_mb()))
        done.set()
        sampler.join()
        cache = session.prefixes
        print(json.dumps({"prefix_cache_mb": None if cache is None else round(cache.capacity / 2**20),
                          "requests": len(reqs), "wall_s": time.perf_counter() - t0, "start_mb": round(start),
                          "peak_mb": round(max(samples_mb + [rss_mb()])), "levels_mb": levels,
                          "cache_used_mb": 0 if cache is None else round(cache.used / 2**20, 1),
                          "entries": 0 if cache is None else len(cache)}))


def rss(args: argparse.Namespace) -> None:
    results = []
    for setting in ("auto", "0"):
        cmd = [sys.executable, __file__, "--rss-child", str(args.rss), "--model", args.model, "--method", args.method,
               "--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype]
        if setting != "auto":
            cmd += ["--prefix-cache", setting]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(
            Path(__file__).resolve().parent.parent)})
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"\n{args.rss} grouped-VQA requests at batch {default_batch('cpu')}, resident memory (MB)")
    print("| prefix cache | start | peak | at each tenth of the run | cache held | entries | wall s |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for r in results:
        name = "none" if r["prefix_cache_mb"] is None else f"{r['prefix_cache_mb']} MB (default)"
        print(f"| {name} | {r['start_mb']} | {r['peak_mb']} | {', '.join(map(str, r['levels_mb']))} | "
              f"{r['cache_used_mb']} | {r['entries']} | {r['wall_s']:.0f} |")
    print(f"peak with the default cache / without: {results[0]['peak_mb'] / results[1]['peak_mb']:.2f}")


# --- H200 projection ----------------------------------------------------------------------------------------------

# Qwen2.5-VL-7B in bf16 on an H200 (projected): an eager forward costs 23 ms up to ~1,000 tokens (measured for 1-128,
# launch-bound), beyond that ~2 x 7.6e9 FLOP per language-model token at ~700 TFLOP/s (benchmarks/batching.py); the
# 0.67e9-parameter vision tower runs over 4 patches per visual token (2x2 merge), its own eager floor assumed 8 ms.
EAGER_S, LM_TOKEN_S = 23e-3, 2 * 7.6e9 / 700e12
VISION_FLOOR_S, VISION_TOKEN_S = 8e-3, 4 * 2 * 0.67e9 / 700e12
# A typical image: 896 x 896 px -> 1,024 visual tokens; the chat template's system prompt and markers ~24 tokens
# before it, a question ~16 after it; short VQA answers ~10 tokens, conversation answers ~25.
IMAGE, BEFORE, QUESTION = 1024, 24, 16


def forward_s(tokens: int) -> float:
    return max(EAGER_S, tokens * LM_TOKEN_S)


def vision_s(images: float) -> float:
    return max(VISION_FLOOR_S, images * IMAGE * VISION_TOKEN_S) if images else 0.0


def join_s(batch: int, per_image: int, turn: int, answer: int, reuse: bool) -> float:
    """The prefill of one join of ``batch`` turns number ``turn``, about images that ``per_image`` consecutive
    requests share. Without reuse every turn sends its image and its whole conversation; with it, the first
    request about an image prefills it once (a pass of its own when the join is batched), the others and every
    later turn only their suffixes."""
    full = BEFORE + IMAGE + QUESTION + turn * (answer + QUESTION + 6)  # earlier turns, with their markers
    if not reuse or (turn == 0 and per_image == 1):
        return forward_s(batch * full) + vision_s(batch)
    suffix = QUESTION + 6 + (answer if turn else 0)
    if turn > 0:  # a conversation goes on from its own cache
        return forward_s(batch * suffix)
    if batch == 1:  # one request in k prefills the image
        return (forward_s(full) + vision_s(1)) / per_image + forward_s(suffix) * (1 - 1 / per_image)
    fresh = batch / per_image
    return forward_s(round(fresh * full)) + forward_s(round((batch - fresh) * suffix)) + vision_s(fresh)


def project(batch: int, per_image: int, turns: int, answer: int, reuse: bool) -> float:
    """Requests/hour for ``batch`` requests in flight, each of ``turns`` turns; plain greedy steps (one token a
    step; a step of ``batch`` rows is one forward)."""
    seconds = sum(join_s(batch, per_image, turn, answer, reuse) + answer * forward_s(batch) for turn in range(turns))
    return 3600 * batch / seconds


def projection() -> None:
    print("\nprojected (a cost model, not a measurement): Qwen2.5-VL-7B, H200, bf16, eager, 1,024-token images")
    print("| workload | batch | requests/hour, no reuse | with reuse | x |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, per_image, turns, answer in (("VQA, 5 questions an image", 5, 1, 10),
                                            ("3-turn conversations", 1, 3, 25), ("captions", 1, 1, 60)):
        for batch in (1, 32):
            off, on = project(batch, per_image, turns, answer, False), project(batch, per_image, turns, answer, True)
            print(f"| {label} | {batch} | {off:,.0f} | {on:,.0f} | {on / off:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", default="demo")
    ap.add_argument("--method", default="recap")
    ap.add_argument("--sets", default="grouped,multiturn,caption")
    ap.add_argument("--limit", type=int, default=None, help="requests per set")
    ap.add_argument("--batches", default=f"1,{default_batch('cpu')}")
    ap.add_argument("--workers", default="2", help="preparation threads to compare, e.g. 0,2 (0: inline)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--rss", type=int, default=None, help="peak RSS of this many requests, default cache vs none")
    ap.add_argument("--rss-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prefix-cache", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--project", action="store_true", help="only the H200 projection")
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args)
    elif args.rss:
        rss(args)
    elif not args.project:
        throughput(args)
    projection() if not args.rss_child else None


if __name__ == "__main__":
    main()
