"""Exact-match accuracy of the demo model on held-out generated questions, per question type, and caption quality.

    python benchmarks/demo_accuracy.py [--model demo] [--scenes 60] [--json runs/demo_accuracy.json]

Scenes come from a seed stream neither training nor sample_inputs draws from. Every question a scene supports
is asked in its own single-turn request and decoded greedily (the engine, one token per step). Caption quality:
captions are sentences of facts, so precision = generated sentences that are true of the image, recall =
reference sentences the model produced.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recap_cli.demo import world  # noqa: E402
from recap_cli.models import load  # noqa: E402
from recap_cli.records import as_parts, user_message  # noqa: E402
from recap_cli.session import Session  # noqa: E402

GOALS = {"colour": 0.90, "count": 0.90, "position": 0.90, "sign": 0.70}


def sentences(text: str) -> list[str]:
    return [s.strip() for s in text.replace("\n", " ").split(".") if s.strip()]


def evaluate(model: str, scenes: int, max_new_tokens: int = 96) -> dict:
    adapter = load(model, device="cpu", dtype="fp32")
    session = Session(adapter, "ar")
    rng = random.Random("heldout")
    hits: dict[str, list[int]] = {}
    precision, recall, wrong = [0, 0], [0, 0], []
    t0 = time.perf_counter()
    for i in range(scenes):
        scene = world.sample_scene(rng, world.KINDS[i % 3])
        image = world.render(scene, rng)
        for qa in world.questions(scene, rng):
            gen = session.answer([as_parts(user_message(qa.question, True))], [image], max_new_tokens)
            text = adapter.decode(gen.tokens).strip()
            h = hits.setdefault(qa.kind, [0, 0])
            h[0] += text == qa.answer
            h[1] += 1
            if text != qa.answer and len(wrong) < 12:
                wrong.append({"question": qa.question, "expected": qa.answer, "got": text})
            if qa.kind == "caption":
                got, ref = sentences(text), sentences(qa.answer)
                precision[0] += sum(s in ref for s in got)
                precision[1] += len(got)
                recall[0] += sum(s in got for s in ref)
                recall[1] += len(ref)
    return {
        "model": model, "scenes": scenes, "seconds": round(time.perf_counter() - t0, 1),
        "exact_match": {k: {"accuracy": round(h / n, 3), "questions": n} for k, (h, n) in sorted(hits.items())},
        "caption_fact_precision": round(precision[0] / max(1, precision[1]), 3),
        "caption_fact_recall": round(recall[0] / max(1, recall[1]), 3),
        "examples_wrong": wrong,
    }


def print_table(result: dict) -> None:
    print("| question type | questions | exact match | goal |\n|---|---:|---:|---:|")
    for kind, row in result["exact_match"].items():
        goal = f"{GOALS[kind]:.0%}" if kind in GOALS else ""
        print(f"| {kind} | {row['questions']} | {row['accuracy']:.1%} | {goal} |")
    print(f"\ncaption facts: precision {result['caption_fact_precision']:.1%}, "
          f"recall {result['caption_fact_recall']:.1%} ({result['seconds']} s)")


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default="demo")
    p.add_argument("--scenes", type=int, default=60)
    p.add_argument("--json", type=Path, default=Path("runs/demo_accuracy.json"))
    args = p.parse_args()
    torch.set_num_threads(2)
    result = evaluate(args.model, args.scenes)
    print_table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
