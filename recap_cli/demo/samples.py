"""Write the committed demo inputs: ``sample_inputs/`` (quick start) and the demo-world benchmark sets.

    python -m recap_cli.demo.samples [--root .]
    python -m recap_cli.demo.samples --bench-to runs/demo-bench-96 --scenes 96  # a larger, held-out set

Images come from seed streams that training never draws from (training uses "<seed>-<step>"). Every request
file's true answers (id -> answers) are in ``truth/`` beside it under the same name, which the tests read; a
folder of their own keeps them out of globs such as ``bench/demo_*.jsonl``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import orjson

from . import world

# A few hand-set scenes, of the same kinds but not drawn at random: one of each kind at the edges of the world.
HAND_SET = {
    "new-circles": world.Scene("shapes", things=[world.Thing("circle", c, cell) for c, cell in
                                                  (("red", 0), ("blue", 2), ("green", 6), ("orange", 8))]),
    "new-sign": world.Scene("sign", sign_text="99", sign_colour="purple"),
    "new-chart": world.Scene("chart", bars=[9, 1, 5, 7], bar_colour="yellow"),
}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def _save(scene: world.Scene, rng: random.Random, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    world.render(scene, rng).save(path, optimize=True)


def _entry(rid: str, image: str, qas: list[world.QA], dataset: str | None = None) -> tuple[dict, dict]:
    """A request asking ``qas`` in order about one image, and its truth line. A caption asked with recap's
    default prompt is written without a question, as a user would."""
    row = {"id": rid} | ({"dataset": dataset} if dataset else {}) | {"image": image}
    if len(qas) > 1:
        row["messages"] = [{"role": "user", "content": qa.question} for qa in qas]
    elif dataset or qas[0].question != world.CAPTION_PROMPTS[0]:
        row["question"] = qas[0].question
    return row, {"id": rid, "answers": [qa.answer for qa in qas], "kinds": [qa.kind for qa in qas]}


def quick_start(root: Path, n: int = 18) -> None:
    """~20 images and one request each: captions, questions of every kind, one multi-turn conversation."""
    rng = random.Random("samples")
    base = root / "sample_inputs"
    entries = []
    scenes = [(f"{world.KINDS[i % 3]}-{i // 3 + 1:02d}", world.sample_scene(rng, world.KINDS[i % 3]))
              for i in range(n)] + list(HAND_SET.items())
    for i, (name, scene) in enumerate(scenes):
        _save(scene, rng, base / "images" / f"{name}.png")
        qas = world.questions(scene, rng)
        if i == 1:  # the multi-turn conversation
            asked = qas[:3]
        else:
            asked = [qas[0] if i % 4 == 0 else rng.choice(qas[1:])]
        entries.append(_entry(name, f"images/{name}.png", asked))
    _write_jsonl(base / "requests.jsonl", [row for row, _ in entries])
    _write_jsonl(base / "truth" / "requests.jsonl", [truth for _, truth in entries])


GROUPED_PER_IMAGE = 5  # questions per image in the grouped VQA set (VQAv2 asks ~5.4 per image)


def grouped_questions(scene: world.Scene, rng: random.Random, n: int = GROUPED_PER_IMAGE) -> list[world.QA]:
    """Up to ``n`` distinct questions about one scene (captions left out), as a VQA set asks them: several
    subjects and wordings, gathered from repeated draws (each draw words every question one way)."""
    found: dict[str, world.QA] = {}
    for _ in range(50):
        for qa in world.questions(scene, rng)[1:]:
            found.setdefault(qa.question, qa)
    picked = list(found.values())
    rng.shuffle(picked)
    return picked[:n]


def bench_sets(base: Path, n: int = 24, seed: str = "bench") -> None:
    """Demo-world captioning, VQA and multi-turn sets (one ``dataset`` each), n images, in ``base``; and a VQA set
    grouped as VQA datasets ship them: several questions about each image, one line each, consecutive (its
    questions come from a stream of their own, so the other sets stay as they were)."""
    rng, grouped_rng = random.Random(seed), random.Random(f"{seed}-grouped")
    sets: dict[str, list[tuple[dict, dict]]] = {"demo_caption": [], "demo_vqa": [], "demo_multiturn": [],
                                                "demo_vqa_grouped": []}
    for i in range(n):
        scene = world.sample_scene(rng, world.KINDS[i % 3])
        name = f"demo-{i + 1:02d}"
        _save(scene, rng, base / "images" / f"{name}.png")
        qas = world.questions(scene, rng)
        image = f"images/{name}.png"
        sets["demo_caption"].append(_entry(f"cap-{name}", image, qas[:1], "demo_caption"))
        sets["demo_vqa"].append(_entry(f"vqa-{name}", image, [rng.choice(qas[1:])], "demo_vqa"))
        turns = rng.sample(qas, min(3, len(qas)))
        sets["demo_multiturn"].append(_entry(f"chat-{name}", image, turns, "demo_multiturn"))
        for k, qa in enumerate(grouped_questions(scene, grouped_rng)):
            sets["demo_vqa_grouped"].append(_entry(f"gvqa-{name}-{k + 1}", image, [qa], "demo_vqa_grouped"))
    for name, entries in sets.items():
        _write_jsonl(base / f"{name}.jsonl", [row for row, _ in entries])
        _write_jsonl(base / "truth" / f"{name}.jsonl", [truth for _, truth in entries])


def main() -> None:
    p = argparse.ArgumentParser(description="write the demo sample inputs and benchmark sets")
    p.add_argument("--root", type=Path, default=Path("."))
    p.add_argument("--bench-to", type=Path, help="only write benchmark sets, to this directory")
    p.add_argument("--scenes", type=int, default=24, help="images in those sets")
    p.add_argument("--seed", default="heldout-drafts", help="their seed stream (the committed sets use 'bench')")
    args = p.parse_args()
    if args.bench_to:
        bench_sets(args.bench_to, args.scenes, args.seed)
        return
    quick_start(args.root)
    bench_sets(args.root / "sample_inputs" / "bench")


if __name__ == "__main__":
    main()
