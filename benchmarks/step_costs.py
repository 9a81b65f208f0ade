"""What a verification step costs by tree size, and a prefill by prompt length, with MKL in its default mode and
in the conditional-reproducibility mode recap_cli sets (``MKL_CBWR=AUTO``, recap_cli/__init__.py).

    python benchmarks/step_costs.py --model ~/.cache/recap/smollm2-135m-instruct [--json runs/step_costs.json]

Each mode runs in its own process (MKL reads the variable once, at its first call), alternating ``--rounds``
times; the table gives each size's median over rounds of the per-round median of ``--reps`` steps, and each
size against a one-token step of the same mode. What matters to drafting is that ratio: a tree of n nodes pays
when its expected extra tokens beat it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
RECAP_MODE = "MKL_CBWR=AUTO (recap)"  # the mode recap_cli runs in
MODES = {"MKL default": "", RECAP_MODE: "AUTO"}  # an empty value leaves MKL in its default mode
PROMPT = "the cat sat on the mat and looked at the dog "  # ten words


def prompt_of(adapter, words: int):
    """A user turn of about ``words`` words (PROMPT repeated), built as the model's chat template frames it."""
    return adapter.build([{"role": "user", "content": PROMPT * max(1, words // 10)}], [])


def measure(model: str, sizes: list[int], lengths: list[int], reps: int, prefix_words: int = 60) -> dict:
    """Median seconds of a chain-tree step per size (after a prompt of ``prefix_words`` words: 60 are ~75 tokens)
    and of a prefill per length. The sizes take turns, one step each, in an order that rotates by a size each
    rep: timed one size after another, every step of a size fell in one stretch of a machine that drifts
    (another process, a clock) and the sizes' ratios carried the drift."""
    sys.path.insert(0, str(ROOT))
    from recap_cli.decoding.engine import Engine
    from recap_cli.decoding.tree import Tree
    from recap_cli.models import freeze_loaded, load

    adapter = load(model, device="cpu", dtype="fp32")
    freeze_loaded()
    engine = Engine(adapter, top_k=8)

    def timed(run) -> float:
        seconds = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds)

    prompt = prompt_of(adapter, prefix_words)
    engine.prefill(prompt, reserve=sum(sizes) * reps + 1)  # room for every step's tokens, were all accepted
    seconds: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(reps):
        for n in sizes[rep % len(sizes):] + sizes[:rep % len(sizes)]:
            tree = Tree([5] * n, [-1] + list(range(n - 1)))
            t0 = time.perf_counter()
            engine.verify(tree)
            seconds[n].append(time.perf_counter() - t0)
    steps = {n: statistics.median(s) for n, s in seconds.items()}
    prefills = {}
    for words in lengths:
        long = prompt_of(adapter, words)
        prefills[long.length] = timed(lambda: engine.prefill(long, reserve=8))
    return {"steps": steps, "prefills": prefills}


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", default="demo")
    ap.add_argument("--sizes", default="1,2,3,4,6,8,12,16,32,64")
    ap.add_argument("--prefill-words", default="40,400,1500", help="prompt lengths to prefill, in words")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prefix-words", type=int, default=60, help="the prompt the steps follow, in words")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    lengths = [int(s) for s in args.prefill_words.split(",")]
    if args.inner:
        print(orjson.dumps(measure(args.model, sizes, lengths, args.reps, args.prefix_words),
                           option=orjson.OPT_NON_STR_KEYS).decode())
        return
    argv = [sys.executable, __file__, "--inner", "--model", args.model, "--sizes", args.sizes,
            "--prefill-words", args.prefill_words, "--reps", str(args.reps), "--prefix-words", str(args.prefix_words)]
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, value in MODES.items():
            out = subprocess.run(argv, env={**os.environ, "MKL_CBWR": value}, check=True, capture_output=True)
            runs[mode].append(orjson.loads(out.stdout.splitlines()[-1]))
    results = {}
    print(f"model {args.model}, {os.cpu_count()} CPUs, fp32; ms (x a one-token step), median of {args.rounds} rounds")
    print("| mode | " + " | ".join(f"{n} nodes" for n in sizes) + " | prefills |")
    print("| --- |" + " ---: |" * (len(sizes) + 1))
    for mode, got in runs.items():
        steps = {n: statistics.median(r["steps"][str(n)] for r in got) for n in sizes}
        prefills = {k: statistics.median(r["prefills"][k] for r in got) for k in got[0]["prefills"]}
        results[mode] = {"steps_s": steps, "prefills_s": prefills}
        cells = " | ".join(f"{1000 * s:.1f} ({s / steps[sizes[0]]:.2f})" for s in steps.values())
        pre = ", ".join(f"{k} tokens {1000 * s:.0f}" for k, s in prefills.items())
        print(f"| {mode} | {cells} | {pre} |")
    recap = results[RECAP_MODE]["steps_s"]
    print("to price benchmarks/calibration.py --costs fixed at these costs: --step-ms "
          + ",".join(map(str, recap)) + ":" + ",".join(f"{1000 * s:.1f}" for s in recap.values()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps({"model": args.model, "rounds": args.rounds, "results": results},
                                           option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


if __name__ == "__main__":
    main()
