"""Write the committed demo inputs: ``sample_inputs/`` (quick start) and the demo-world benchmark sets.

    python -m recap_cli.demo.samples [--root .]

Images come from seed streams that training never draws from (training uses "<seed>-<step>"). Every request
has its true answer in a sibling ``*.truth.jsonl`` (id -> answers), which the accuracy script and tests read.
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


def quick_start(root: Path, n: int = 18) -> None:
    """~20 images and one request each: captions, questions of every kind, one multi-turn conversation."""
    rng = random.Random("samples")
    base = root / "sample_inputs"
    requests, truth = [], []
    scenes = [(f"{world.KINDS[i % 3]}-{i // 3 + 1:02d}", world.sample_scene(rng, world.KINDS[i % 3]))
              for i in range(n)] + list(HAND_SET.items())
    for i, (name, scene) in enumerate(scenes):
        _save(scene, rng, base / "images" / f"{name}.png")
        qas = world.questions(scene, rng)
        image = f"images/{name}.png"
        if i == 1:  # the multi-turn conversation
            turns = qas[:3]
            requests.append({"id": name, "image": image,
                             "messages": [{"role": "user", "content": qa.question} for qa in turns]})
            truth.append({"id": name, "answers": [qa.answer for qa in turns], "kinds": [qa.kind for qa in turns]})
            continue
        qa = qas[0] if i % 4 == 0 else rng.choice(qas[1:])  # captions without a question use recap's default
        row = {"id": name, "image": image}
        if qa.kind != "caption" or qa.question != world.CAPTION_PROMPTS[0]:
            row["question"] = qa.question
        requests.append(row)
        truth.append({"id": name, "answers": [qa.answer], "kinds": [qa.kind]})
    _write_jsonl(base / "requests.jsonl", requests)
    _write_jsonl(base / "requests.truth.jsonl", truth)


def bench_sets(root: Path, n: int = 24) -> None:
    """sample_inputs/bench: demo-world captioning, VQA and multi-turn sets (one ``dataset`` each)."""
    rng = random.Random("bench")
    base = root / "sample_inputs" / "bench"
    sets: dict[str, tuple[list[dict], list[dict]]] = {k: ([], []) for k in ("demo_caption", "demo_vqa",
                                                                               "demo_multiturn")}
    for i in range(n):
        scene = world.sample_scene(rng, world.KINDS[i % 3])
        name = f"demo-{i + 1:02d}"
        _save(scene, rng, base / "images" / f"{name}.png")
        qas = world.questions(scene, rng)
        image = f"images/{name}.png"
        cap = qas[0]
        sets["demo_caption"][0].append({"id": f"cap-{name}", "dataset": "demo_caption", "image": image,
                                        "question": cap.question})
        sets["demo_caption"][1].append({"id": f"cap-{name}", "answers": [cap.answer], "kinds": ["caption"]})
        qa = rng.choice(qas[1:])
        sets["demo_vqa"][0].append({"id": f"vqa-{name}", "dataset": "demo_vqa", "image": image,
                                    "question": qa.question})
        sets["demo_vqa"][1].append({"id": f"vqa-{name}", "answers": [qa.answer], "kinds": [qa.kind]})
        turns = rng.sample(qas, min(3, len(qas)))
        sets["demo_multiturn"][0].append({"id": f"chat-{name}", "dataset": "demo_multiturn", "image": image,
                                          "messages": [{"role": "user", "content": t.question} for t in turns]})
        sets["demo_multiturn"][1].append({"id": f"chat-{name}", "answers": [t.answer for t in turns],
                                          "kinds": [t.kind for t in turns]})
    for name, (rows, truth) in sets.items():
        _write_jsonl(base / f"{name}.jsonl", rows)
        _write_jsonl(base / f"{name}.truth.jsonl", truth)


def main() -> None:
    p = argparse.ArgumentParser(description="write the demo sample inputs and benchmark sets")
    p.add_argument("--root", type=Path, default=Path("."))
    args = p.parse_args()
    quick_start(args.root)
    bench_sets(args.root)


if __name__ == "__main__":
    main()
