"""What decoding settings cost each method: speed over ``ar`` and tokens per step, greedy vs penalty vs sampling.

    python benchmarks/sampling.py --model demo --inputs sample_inputs/bench/demo_*.jsonl --batch 1
    python benchmarks/sampling.py --model DIR --inputs sample_inputs/bench/text_prompts.jsonl --max-new-tokens 64

Each setting (``model``: the checkpoint's own generation config; ``key=value,...``: recap's options on top of it,
e.g. ``temperature=0.7`` or ``repetition_penalty=1.05``) is one ``recap compare`` run: every method on every
input, interleaved per input (whole datasets per method at --batch > 1), memories cleared per dataset, tokens
checked against ``ar`` under the same settings and seed. Prints a table (stderr: progress) and writes JSON.
Tokens per step and nodes per step do not depend on the clock when budgets are fixed (``recap:budget=16``, tr's
template, ``pld:budget=10``); cost-sized trees (the defaults) follow this machine's measured step costs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recap_cli import compare  # noqa: E402
from recap_cli.decoding import sampling  # noqa: E402
from recap_cli.models import freeze_loaded, load, locate  # noqa: E402
from recap_cli.records import read  # noqa: E402


def parse_setting(spec: str) -> dict:
    """``model`` or ``temperature=0.7,top_k=0``: recap's options over the checkpoint's generation config."""
    if spec == "model":
        return {}
    out = {}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        out[key] = int(value) if key in ("top_k", "seed") else float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", default="demo")
    ap.add_argument("--inputs", nargs="+", type=Path, required=True)
    ap.add_argument("--methods", default="recap,recap:budget=16,tr,pld,pld:budget=10")
    ap.add_argument("--settings", nargs="+", default=["model", "temperature=0.7", "repetition_penalty=1.05"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    adapter = load(locate(args.model), device="cpu", dtype=args.dtype)
    freeze_loaded()  # as recap run does: no full collection walks the model mid-run
    requests = []
    for path in args.inputs:
        for req in read(open(path, "rb"), path.resolve().parent):
            req.dataset = req.dataset or path.stem
            requests.append(req)
    labels = ["ar"] + [m for m in args.methods.split(",") if m and m != "ar"]
    results = {}
    for spec in args.settings:
        settings = sampling.resolve(adapter.model.generation_config, "model",
                                    **{"seed": args.seed, **parse_setting(spec)})
        print(f"{spec}: {sampling.sentence(settings)}", file=sys.stderr, flush=True)
        sessions = {label: compare.make_session(adapter, label, args.batch, settings) for label in labels}
        t0 = time.perf_counter()
        rows = compare.run(sessions, requests, "ar", args.model, args.max_new_tokens)
        summary = compare.summarize(rows, "ar")
        results[spec] = {"settings": settings.describe(), "seconds": time.perf_counter() - t0, "summary": summary}

    speed = "wall_speedup" if args.batch > 1 else "mean_speedup"
    datasets = list(next(iter(results.values()))["summary"])
    print(f"model {args.model}, {len(requests)} inputs, batch {args.batch}, max {args.max_new_tokens} new tokens; "
          f"{'wall×' if args.batch > 1 else 'mean×'} over ar, tokens/step, nodes/step, match")
    print("| dataset | method | " + " | ".join(args.settings) + " |")
    print("| --- | --- |" + " ---: |" * len(args.settings))
    for dataset in datasets:
        for label in labels[1:]:
            cells = []
            for spec in args.settings:
                s = results[spec]["summary"][dataset][label]
                if s["mean_accepted"] is None:  # no input of the dataset answered (a bad image path): no figures
                    cells.append(f"no answers ({s['errors']} errors)")
                    continue
                cells.append(f"{s[speed]:.2f}× · {s['mean_accepted']:.2f} · {s['nodes_per_step']:.1f} · "
                             f"{100 * s['match_rate']:.0f}%")
            print(f"| {dataset} | {label} | " + " | ".join(cells) + " |")
    if args.json is not None:
        for r in results.values():
            for methods in r["summary"].values():
                for s in methods.values():
                    s.pop("speedups", None)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                            "results": results}, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
