"""Are RECAP's chances what they turn out to be? Predicted vs observed acceptance, per chance bucket and source.

    python benchmarks/calibration.py [--model demo] [--inputs ...] [--before 6263fbe] [--json runs/calibration.json]

Runs ``recap`` (batch 1, auto-sized trees unless --budget) over each input file as its own stream (memories
cleared between files, as ``recap compare`` does) and, for every drafted node whose parent the verifier
accepted, compares the chance the drafter gave it (conditional: its path chance over its parent's) with whether
it was accepted. A node's path chance is what the cost model sums into expected tokens per step, so a bucket
whose observed rate falls short of its prediction means trees bigger than they should be. Acceptance does not
depend on the clock, but at ``--budget auto`` the trees' sizes do (the run's step costs): ``--costs fixed`` sizes
them by host_time.py's frozen costs, the same in every run, for a before/after that differs only by the code.
``--before REF`` runs the same on commit REF's recap_cli in a second process, for a before/after table.

With ``--costs fixed`` the run is also a deterministic stand-in for a timed one: each request is priced at the
frozen costs (a step at its tree's size, plus 20 µs of drafting a node; a prefill at two one-token steps plus what
its tree's nodes add), against `ar` priced alike (a prefill, then one one-token step a token), and the report
gives ms a token over all requests and the mean of per-request speedups. ``--step-ms`` freezes another model's
step costs, by tree size (SmolLM2-135M on 2 CPU cores: ``1,2,4,8,16,32,64:84,82,95,109,124,158,248``).
``--methods recap,suffix,pld`` prices the other methods' runs alike (each in a process of its own, its drafting
at the same 20 µs a node) and tabulates recap's mean speedup over each: the issue's ratios, without a clock.
``--orders N`` runs each side over N orders of each file's requests (as given, then shuffled by seeds 1, 2, ...)
and prices it by the mean over orders: what a stream's first requests teach it shapes every later tree, and one
order's mean of per-request speedups moves by a tenth from one order to another (docs/benchmarks.md).

Sizing does not take the chances as they are: a request's trust (recap_cli/drafters/recap.py ``Trust``) scales
them by how its trees have kept their promises so far. Besides the chances, the report gives what sizing believed
(path chances times that trust: "sized") against what was accepted, in all and per depth, where a few points too
hopeful at each level of a path compound.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.environ.get("RECAP_CODE", str(ROOT)))

EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01)


def bucket(p: float) -> str:
    for lo, hi in zip(EDGES, EDGES[1:]):
        if p < hi:
            return f"{lo:.1f}-{min(hi, 1.0):.1f}"
    return "0.9-1.0"


def step_ms(spec: str | None) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """``SIZES:MS`` (comma-separated, as many of each) as (sizes, milliseconds); None for None."""
    if spec is None:
        return None
    try:
        sizes, ms = spec.split(":")
        out = tuple(int(n) for n in sizes.split(",")), tuple(float(t) for t in ms.split(","))
    except ValueError:
        out = ((), ())
    if not out[0] or len(out[0]) != len(out[1]) or out[0][0] != 1 or list(out[0]) != sorted(set(out[0])):
        raise SystemExit("--step-ms is SIZES:MS, increasing sizes from 1 and one time for each")
    return out


def priced(forwards: list[tuple[bool, int]], turns: int, new_tokens: int, cost) -> tuple[float, float]:
    """(the method's, ar's) milliseconds for one request, at the frozen cost model that sized its trees (its forward
    pass by tree size, linear between timed sizes, and its drafting per node): ``forwards`` are its prefills
    (True) and steps with their trees' sizes; a prefill is two one-token steps, plus what its tree's nodes add."""
    one = 1000 * cost(1)
    spent = sum(1000 * (cost(n) + cost.host_per_node * n) + (one if prefill else 0.0) for prefill, n in forwards)
    spent += 2 * one * (turns - sum(prefill for prefill, _ in forwards))  # prefills no tree rode on
    return spent, turns * 2 * one + (new_tokens - turns) * one


def measure(model: str, inputs: list[Path], limit: int, max_new_tokens: int, budget: str,
            costs: str = "measured", frozen: tuple[tuple[int, ...], tuple[float, ...]] | None = None,
            method: str = "recap", order: int = 0) -> dict:
    import recap_cli.drafters.recap as recap_module
    from recap_cli.batch import answer_with_tokens
    from recap_cli.decoding.tree import Source
    from recap_cli.models import load
    from recap_cli.session import Session

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from acceptance import read_requests

    adapter = load(model, device="cpu", dtype="fp32")
    name, knobs = ("recap", {}) if method == "recap" else parse_spec(method)  # an older commit's: recap alone
    if name == "recap" and budget != "auto" and "budget" not in knobs:  # a spec's own budget holds
        knobs["budget"] = int(budget)
    session = Session(adapter, name, **knobs)
    if costs == "fixed":  # sized alike in any process: the frozen step costs of host_time.py (or ``frozen``'s)
        from host_time import fixed_costs

        session.engine.cost = fixed_costs(**({"sizes": frozen[0], "step_ms": frozen[1]} if frozen else {}))
    drafter = session.drafter
    captured: dict[str, list[float]] = {}
    if name == "recap" and not hasattr(drafter, "chances"):  # an older drafter: its layout sees node chances
        layout = recap_module._layout

        def logged(nodes):
            tree, where = layout(nodes)
            chances = [0.0] * len(tree)
            for i, node in enumerate(nodes):
                if i in where:
                    chances[where[i]] = node[3]
            captured["chances"] = chances
            return tree, where

        recap_module._layout = logged
    tally: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0])  # tried, predicted, accepted
    paths: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    # Nodes, predicted, sized, accepted by (tree size, depth; 4: 4+), summed over sizes for the depth table: a big
    # tree is grown where its first nodes look best (a winner's curse the per-node tables cannot show), and at a
    # steep step-cost curve it is the costly choice.
    sized_by: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])
    verify, engine = session.engine.verify, session.engine
    forwards: list[tuple[bool, int]] = []  # this request's prefills (True) and steps, by tree size

    def graded(tree):
        forwards.append((False, len(tree)))
        verified = verify(tree)
        chances = getattr(drafter, "chances", None) or captured.get("chances") or [1.0]
        if len(chances) == len(tree):
            accepted = set(verified.path)
            # What sizing believed: the path chances scaled by the trust the tree was sized with (a request's, or
            # the openings'), where the drafter keeps one.
            trust = getattr(drafter, "opening_trust" if getattr(drafter, "_opening", False) else "trust", None)
            factor, level = getattr(trust, "factor", 1.0), tree.depths()
            size = size_bucket(len(tree))
            for i in range(1, len(tree)):
                parent = tree.parents[i]
                at = sized_by[(size, min(level[i], 4))]
                at[0] += 1
                at[1] += chances[i]
                at[2] += chances[i] * factor
                at[3] += i in accepted
                source = Source(tree.sources[i]).name
                path = paths[bucket(chances[i])]
                path[0] += 1
                path[1] += chances[i]
                path[2] += i in accepted
                if parent in accepted:  # a fair test of the node's own chance
                    row = tally[(source, bucket(chances[i] / chances[parent]))]
                    row[0] += 1
                    row[1] += chances[i] / chances[parent]
                    row[2] += i in accepted
        return verified

    session.engine.verify = graded
    if hasattr(engine, "prefill_tree"):  # every prefill, the tree riding on it (prefill_from is called from it)
        engine.prefill_tree = logged_prefill(engine.prefill_tree, forwards)
    steps = nodes = emitted = 0
    spent: list[tuple[float, float, int]] = []  # per request: the method's ms, ar's, tokens
    for path in inputs:
        session.reset_memory()
        for req in ordered(read_requests([path], limit), order):
            forwards.clear()
            record, _ = answer_with_tokens(session, req, model, max_new_tokens)
            if costs == "fixed":  # priced only where sized at frozen costs
                spent.append((*priced(forwards, record["turns"], record["new_tokens"], session.engine.cost),
                               record["new_tokens"]))
            steps += record["steps"]
            nodes += record["mean_nodes"] * record["steps"]
            emitted += record["new_tokens"] - record["turns"]
    rows = [{"source": s, "bucket": b, "tested": t, "predicted": p / t, "observed": a / t}
            for (s, b), (t, p, a) in sorted(tally.items()) if t]
    path_rows = [{"bucket": b, "nodes": t, "predicted": p / t, "observed": a / t}
                 for b, (t, p, a) in sorted(paths.items()) if t]
    total = sum(r["tested"] for r in rows)
    gap = sum(abs(r["predicted"] - r["observed"]) * r["tested"] for r in rows) / total if total else 0.0
    depths: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])
    for (_, d), tallied in sized_by.items():
        depths[d] = [x + y for x, y in zip(depths[d], tallied)]
    depth_rows = [{"depth": d, "nodes": n, "predicted": p / n, "sized": z / n, "observed": a / n}
                  for d, (n, p, z, a) in sorted(depths.items()) if n]
    size_rows = [{"size": s, "depth": d, "nodes": n, "predicted": p / n, "sized": z / n, "observed": a / n}
                 for (s, d), (n, p, z, a) in sorted(sized_by.items(), key=lambda kv: (SIZES.index(kv[0][0]), kv[0][1]))
                 if n]
    path_total = sum(t for t, _, _ in paths.values())
    expected = sum(p for _, p, _ in paths.values())
    return {"steps": steps, "nodes_per_step": nodes / max(steps, 1), "tokens_per_step": emitted / max(steps, 1),
            "conditional": rows, "path": path_rows, "depth": depth_rows, "by_size": size_rows, "weighted_gap": gap,
            "sized_drafted_per_step": sum(z for _, _, z, _ in depths.values()) / max(steps, 1),
            "predicted_drafted_per_step": expected / max(steps, 1),
            "observed_drafted_per_step": sum(a for _, _, a in paths.values()) / max(steps, 1),
            "path_nodes": path_total, **(_prices(spent) if spent else {})}


def ordered(requests: list, order: int) -> list:
    """The stream's requests in order number ``order``: 0 as the file gives them, else shuffled by that seed.
    What a stream learns, and so every later tree, depends on which requests came first."""
    if order:
        requests = requests[:]
        random.Random(order).shuffle(requests)
    return requests


def _prices(spent: list[tuple[float, float, int]]) -> dict:
    return {"ms_per_token": sum(ms for ms, _, _ in spent) / sum(n for _, _, n in spent),
            "mean_speedup": sum(ar / ms for ms, ar, _ in spent) / len(spent),
            "per_request_speedup": [ar / ms for ms, ar, _ in spent]}


SIZES = ("2-3", "4-7", "8-15", "16+")  # a tree's nodes, root included (a root alone drafts nothing)


def size_bucket(nodes: int) -> str:
    return SIZES[0] if nodes <= 3 else SIZES[1] if nodes <= 7 else SIZES[2] if nodes <= 15 else SIZES[3]


def parse_spec(method: str) -> tuple[str, dict]:
    """A method as ``recap compare`` reads it (``tr:budget=auto``), for a Session: drafters only."""
    from recap_cli.compare import HF_METHODS, parse_method

    name, knobs = parse_method(method)
    if name in HF_METHODS:
        raise ValueError(f"'{method}' decodes with generate(), not a drafter: the proxy prices drafters' trees")
    return name, knobs


def logged_prefill(prefill, forwards: list[tuple[bool, int]]):
    """``Engine.prefill_tree`` that first logs the size of the tree riding on it (its second argument)."""
    def run(*args, **kwargs):
        forwards.append((True, len(kwargs["tree"] if "tree" in kwargs else args[1])))
        return prefill(*args, **kwargs)
    return run


def over_orders(runs: list[dict]) -> dict:
    """One side's runs over several orders of its requests: the first order's tables, and its prices as the mean
    over orders, each order's kept in ``orders``. A stream's later trees depend on what its first requests taught
    it: one order's mean of per-request speedups moved by a tenth between orders of the same requests (SmolLM2's
    prompts, docs/benchmarks.md), more than most drafting changes move it."""
    out = dict(runs[0])
    if len(runs) > 1 and "ms_per_token" in out:
        out["orders"] = [{"ms_per_token": r["ms_per_token"], "mean_speedup": r["mean_speedup"],
                          "per_request_speedup": r["per_request_speedup"]} for r in runs]
        for key in ("ms_per_token", "mean_speedup"):
            out[key] = statistics.fmean(r[key] for r in runs)
        del out["per_request_speedup"]  # by request of the first order only: the orders' lists have them all
    return out


def show(label: str, out: dict) -> None:
    graded = bool(out["conditional"])  # False: a method without recap's chances, its steps and price alone
    print(f"== {label}: {out['steps']} steps, {out['tokens_per_step']:.3f} tokens/step at {out['nodes_per_step']:.1f} "
          "nodes" + (f"; drafted tokens per step predicted {out['predicted_drafted_per_step']:.3f}, observed "
                     f"{out['observed_drafted_per_step']:.3f}; mean |predicted - observed| (conditional) "
                     f"{out['weighted_gap']:.3f}" if graded else ""))
    if "ms_per_token" in out:
        print(f"priced at the frozen costs: {out['ms_per_token']:.3f} ms a token, mean of per-request speedups over "
              f"`ar` {out['mean_speedup']:.3f}")
        if "orders" in out:  # the tables above and below are the first order's
            print(f"  the mean over {len(out['orders'])} orders of the requests; by order: " + ", ".join(
                f"{o['ms_per_token']:.3f} / {o['mean_speedup']:.3f}" for o in out["orders"]))
    if not graded:
        return
    print(f"{'source':8s} {'chance':8s} {'tested':>7s} {'predicted':>9s} {'observed':>9s}")
    for r in out["conditional"]:
        print(f"{r['source']:8s} {r['bucket']:8s} {r['tested']:7d} {r['predicted']:9.3f} {r['observed']:9.3f}")
    print(f"{'path chance':17s} {'nodes':>7s} {'predicted':>9s} {'observed':>9s}  (every drafted node: accepted?)")
    for r in out["path"]:
        print(f"{r['bucket']:17s} {r['nodes']:7d} {r['predicted']:9.3f} {r['observed']:9.3f}")
    print(f"drafted tokens per step sized on (path chances x trust) {out['sized_drafted_per_step']:.3f}")
    print(f"{'depth (4: 4+)':13s} {'nodes':>7s} {'predicted':>9s} {'sized':>9s} {'observed':>9s}  (path chances)")
    for r in out["depth"]:
        print(f"{r['depth']:<13d} {r['nodes']:7d} {r['predicted']:9.3f} {r['sized']:9.3f} {r['observed']:9.3f}")
    print(f"{'tree size':9s} {'depth':>5s} {'nodes':>7s} {'sized':>9s} {'observed':>9s}  (path chances x trust)")
    for r in out.get("by_size", ()):
        print(f"{r['size']:9s} {r['depth']:5d} {r['nodes']:7d} {r['sized']:9.3f} {r['observed']:9.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", default="demo")
    ap.add_argument("--inputs", type=Path, nargs="+",
                    default=[Path(f"sample_inputs/bench/demo_{s}.jsonl") for s in ("caption", "vqa", "multiturn")])
    ap.add_argument("--limit", type=int, default=1000, help="requests per input file")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--budget", default="auto")
    ap.add_argument("--costs", choices=("measured", "fixed"), default="measured",
                    help="fixed: the frozen step costs of host_time.py, so trees at --budget auto are sized alike "
                         "in every run (measured: this machine's, as a run learns them)")
    ap.add_argument("--step-ms", default=None, help="with --costs fixed: another model's step costs, SIZES:MS "
                    "(milliseconds by tree size; default: the demo model's, host_time.py's)")
    ap.add_argument("--before", default=None, help="git commit whose recap_cli to measure too")
    ap.add_argument("--methods", default="recap", help="with --costs fixed: other methods priced alike beside recap "
                    "(comma-separated, e.g. recap,suffix,pld: the goal's ratios on the proxy); chances are recap's")
    ap.add_argument("--orders", type=int, default=1, help="with --costs fixed: run each side over this many orders "
                    "of each file's requests (the first as given, the others shuffled by seeds 1, 2, ...) and price "
                    "it by the mean over orders; the table gives each order's ratio too")
    ap.add_argument("--order", type=int, default=0, help=argparse.SUPPRESS)  # --inner: which order
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    frozen = step_ms(args.step_ms)  # a malformed one fails here, before any run
    if args.step_ms and args.costs != "fixed":
        ap.error("--step-ms freezes the step costs: it goes with --costs fixed")
    methods = args.methods.split(",")
    if args.orders < 1 or args.orders > 1 and args.costs != "fixed":
        ap.error("--orders is a number >= 1, and more than one goes with --costs fixed (it prices each order)")
    if methods != ["recap"] and args.costs != "fixed":
        ap.error("--methods prices methods at frozen step costs: it goes with --costs fixed")
    try:
        for method in methods:
            if method != "recap":
                parse_spec(method)
    except ValueError as exc:
        ap.error(str(exc))
    if args.inner:
        print(orjson.dumps(measure(args.model, args.inputs, args.limit, args.max_new_tokens, args.budget,
                                   args.costs, frozen, methods[0], args.order)).decode())
        return
    report = {}
    sides = {"after": (ROOT, "recap")}
    if args.before is not None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from host_time import checkout

        sides = {"before": (checkout(args.before), "recap"), "after": (ROOT, "recap")}
    sides.update({method: (ROOT, method) for method in methods if method != "recap"})  # this tree's, priced alike
    for side, (code, method) in sides.items():
        cmd = [sys.executable, __file__, "--inner", "--model", args.model, "--limit", str(args.limit),
               "--max-new-tokens", str(args.max_new_tokens), "--budget", args.budget, "--costs", args.costs,
               "--methods", method, "--inputs", *map(str, args.inputs),
               *(["--step-ms", args.step_ms] if args.step_ms else [])]
        runs = []
        for order in range(args.orders):
            out = subprocess.run([*cmd, "--order", str(order)], env={**os.environ, "RECAP_CODE": str(code)},
                                 check=True, capture_output=True)
            runs.append(orjson.loads(out.stdout.splitlines()[-1]))
        report[side] = over_orders(runs)
        show(f"{side} ({args.before if side == 'before' else 'this tree'})" if method == "recap" else method,
             report[side])
    if len(sides) > 1 and "ms_per_token" in report["after"]:
        w = max(map(len, report))
        print(f"{'side':{w}s} {'ms a token':>10s} {'mean speedup':>12s} {'recap / it (mean)':>17s}"
              + ("  recap / it, order by order" if args.orders > 1 else ""))
        for side, out in report.items():
            print(f"{side:{w}s} {out['ms_per_token']:10.3f} {out['mean_speedup']:12.3f} "
                  f"{report['after']['mean_speedup'] / out['mean_speedup']:17.3f}"
                  + ("  " + " ".join(f"{a['mean_speedup'] / b['mean_speedup']:.3f}"
                                     for a, b in zip(report["after"]["orders"], out["orders"]))
                     if args.orders > 1 else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps({"model": args.model, "inputs": [str(p) for p in args.inputs],
                                            "budget": args.budget, **report}, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
