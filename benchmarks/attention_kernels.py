"""Decoding step times under each choice of attention kernels, `ar` beside recap: why recap's forwards leave out
cuDNN's attention on CUDA (recap_cli/decoding/compat.py, ``attention_kernels``).

    python benchmarks/attention_kernels.py --device cuda            # on a GPU, about a minute
    python benchmarks/attention_kernels.py --device cpu --limit 2   # a smoke test of the script

Each variant runs `ar` and recap (fresh sessions, `recap compare`'s interleaving, one run per input) over the
first ``--limit`` requests of each demo bench set, and prints per method the tokens per second, recap's speedups
over `ar`, and the verification steps' median, mean and slowest milliseconds. Variants: ``torch`` (torch's own
choice: cuDNN first on a Hopper GPU), ``recap`` (what the engine uses: every kernel but cuDNN's), and the same
with the memory-efficient kernel, then flash, also left out (math only, the floor).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recap_cli import compare  # noqa: E402
from recap_cli.decoding import compat, engine  # noqa: E402
from recap_cli.models import freeze_loaded, load, locate  # noqa: E402
from recap_cli.records import read  # noqa: E402

SETS = ("demo_caption", "demo_vqa", "demo_multiturn")
B = SDPBackend
VARIANTS = {
    "torch": None,
    "recap": compat.KERNELS,  # the engine's own list, so this variant is what recap runs
    "flash and math": [B.FLASH_ATTENTION, B.MATH],
    "math only": [B.MATH],
}


def run_variant(adapter, reqs: list, kernels, max_new_tokens: int) -> dict:
    """`ar` and recap over ``reqs`` with the forwards' attention limited to ``kernels`` (None: torch's choice);
    each method's summary with the seconds of its verification steps (the host copy of a step's results waits
    for the device, so a step's time is its whole time)."""
    steps: dict[str, list[float]] = {"ar": [], "recap": []}
    into: list[list[float]] = [[]]
    real_verify = engine.Engine.verify

    def verify(self, tree, *args, **kwargs):
        t0 = time.perf_counter()
        out = real_verify(self, tree, *args, **kwargs)
        into[0].append(time.perf_counter() - t0)
        return out

    def timed_into(times: list[float], decode):
        def decode_timed(*args, **kwargs):
            into[0] = times  # the steps from here on are this method's
            return decode(*args, **kwargs)
        return decode_timed

    sessions = {}
    for method, times in steps.items():
        session = compare.make_session(adapter, method, 1, prefix_cache="auto")
        session.decode = timed_into(times, session.decode)
        sessions[method] = session
    chosen = (lambda device: contextlib.nullcontext()) if kernels is None else (lambda device: sdpa_kernel(kernels))
    saved = compat.attention_kernels, engine.Engine.verify
    compat.attention_kernels, engine.Engine.verify = chosen, verify
    try:
        rows = compare.run(sessions, reqs, "ar", "demo", max_new_tokens, warmup=1)
    finally:
        compat.attention_kernels, engine.Engine.verify = saved
    summary = compare.summarize(rows, "ar")["all"]
    return {m: dict(summary[m], step_ms=[1000 * s for s in steps[m]]) for m in steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--limit", type=int, default=8, help="requests of each demo set")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="which kernel choices, in this order, comma-separated; one may repeat, to see drift")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    adapter = load(locate("demo", offline=True), device=args.device, dtype="bf16" if args.device == "cuda" else "fp32")
    freeze_loaded()
    bench = Path(__file__).resolve().parent.parent / "sample_inputs" / "bench"
    reqs = []
    for name in SETS:
        with open(bench / f"{name}.jsonl", "rb") as source:
            reqs += [r for r in read(source, bench) if r.error is None][:args.limit]
    print(f"{len(reqs)} demo requests, {adapter.device}, {adapter.model.dtype}, torch {torch.__version__}")
    print("| kernels | method | tokens/s | mean x ar | total x ar | p10 | step ms: median | mean | slowest | match |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        for method, row in run_variant(adapter, reqs, VARIANTS[name], args.max_new_tokens).items():
            ms = row["step_ms"]
            print(f"| {name} | {method} | {row['tokens_per_s']:.0f} | {row['mean_speedup']:.2f} | "
                  f"{row['total_speedup']:.2f} | {row['p10']:.2f} | {statistics.median(ms):.2f} | "
                  f"{statistics.mean(ms):.2f} | {max(ms):.1f} | {100 * row['match_rate']:.0f}% |")


if __name__ == "__main__":
    main()
