"""The synthetic world and the training data path: what the demo model learns from must be right."""

from __future__ import annotations

import random

import pytest
import torch

from recap_cli.demo import train, world


@pytest.fixture(scope="module")
def tok():
    return train.build_tokenizer()


def test_patchify_matches_the_qwen_image_processor():
    from transformers import Qwen2VLImageProcessor

    rng = random.Random(3)
    images = [world.render(world.sample_scene(rng, k), rng) for k in world.KINDS]
    area = world.SIZE * world.SIZE
    ref = Qwen2VLImageProcessor(min_pixels=area, max_pixels=area)(images=images, return_tensors="pt")
    mine, thw = train.patchify(images)
    assert torch.equal(thw, ref["image_grid_thw"])
    torch.testing.assert_close(mine, ref["pixel_values"], rtol=0, atol=1e-5)


def test_training_sequences_start_like_inference_prompts(tok):
    """Turn one of a training conversation is token for token what recap sends for that question."""
    rng = random.Random(4)
    scene = world.sample_scene(rng, "shapes")
    qas = world.conversation(scene, rng, 3)
    ids, spans = train.encode(tok, qas)
    prompt = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                   {"type": "text", "text": qas[0].question}]}],
                                     tokenize=False, add_generation_prompt=True)
    prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * train.IMAGE_TOKENS)
    prefix = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[:len(prefix)] == prefix and spans[0][0] == len(prefix)
    assert [tok.decode(ids[a:b]) for a, b, _ in spans] == [qa.answer + "<|im_end|>" for qa in qas]
    assert [k for _, _, k in spans] == [qa.kind for qa in qas]


def test_answers_follow_the_scene():
    scene = world.Scene("shapes", things=[world.Thing("circle", "red", 0), world.Thing("circle", "blue", 5),
                                          world.Thing("square", "green", 8)])
    answers = {qa.question: qa.answer for _ in range(40)
               for qa in world.questions(scene, random.Random(_))}
    assert answers["How many circles are there?"] == "There are two circles."
    assert answers["How many shapes are there?"] == "There are three shapes."
    colour = {answers.get("What colour is the square?"), answers.get("Which colour is the square?")}
    assert colour <= {"The square is green.", "It is green.", None} and colour != {None}
    assert "What colour is the circle?" not in answers  # two circles: the question would be ambiguous
    red, blue, green = scene.things
    assert world._relation(red, green) == "left of" and world._relation(green, blue) == "below"
    assert world._relation(blue, red) == "right of"
    cap = world.caption(scene, 0)
    assert cap == ("The picture shows three shapes. A red circle is at the top left. A blue circle is at the "
                   "middle right. A green square is at the bottom right.")


def test_question_mix_weights_the_draw_and_rejects_unknown_kinds():
    import argparse

    scene = world.Scene("shapes", things=[world.Thing("circle", "red", 0), world.Thing("square", "green", 8)])
    first = [world.conversation(scene, random.Random(seed), 1, {"position": 1e6})[0].kind for seed in range(30)]
    plain = [world.conversation(scene, random.Random(seed), 1)[0].kind for seed in range(30)]
    assert first == ["position"] * 30 and plain.count("position") < 15
    with pytest.raises(argparse.ArgumentTypeError):
        train.mix_parser(world.QUESTION_KINDS)("positon=3")
    with pytest.raises(argparse.ArgumentTypeError):
        train.mix_parser(world.QUESTION_KINDS)("position=0")
    assert train.mix_parser(world.KINDS)("shapes=3") == {"shapes": 3.0}


def test_chart_and_sign_facts():
    chart = world.Scene("chart", bars=[3, 8, 1], bar_colour="orange")
    assert "Bar B is the tallest and bar C is the shortest." in world.caption(chart, 1)
    sign = world.Scene("sign", sign_text="42", sign_colour="orange")
    assert world.caption(sign, 0) == "The picture shows an orange sign on a post. The sign reads 42. It shows a number."


def test_local_fact_targets_mark_the_token_under_each_object():
    thing = world.Thing("triangle", "blue", 8, dx=5.0, dy=5.0)  # centre (98.3, 98.3): last token of 4 x 4
    _, local = train.fact_targets(world.Scene("shapes", things=[thing]))
    marked = [i for i, row in enumerate(local) if row[0] != 0]
    assert marked == [15]
    assert local[15] == [1 + world.SHAPES.index("triangle"), 1 + list(world.COLOURS).index("blue"), 8]


def test_batches_are_reproducible_from_the_seed(tok):
    a = train.make_batch(tok, random.Random("0-7"), 4, 3)
    b = train.make_batch(tok, random.Random("0-7"), 4, 3)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.pixels, b.pixels) and torch.equal(a.facts, b.facts)
    assert (a.labels[a.mask == 0] == -100).all()


def test_training_tokenizer_is_the_shipped_one(tok):
    """Retraining or resuming starts from the vocabulary the shipped checkpoint was trained with."""
    import json

    from recap_cli.models import DEMO_MODEL

    shipped = json.loads((DEMO_MODEL / "tokenizer.json").read_text())["model"]
    built = json.loads(tok.backend_tokenizer.to_str())["model"]
    assert built["vocab"] == shipped["vocab"] and built["merges"] == shipped["merges"]


def test_bench_globs_match_request_files_only(tmp_path):
    """`sample_inputs/bench/demo_*.jsonl` (what the docs feed `recap compare` and `recap run`) is requests only:
    the true answers live in truth/ under the same names, committed and freshly written alike."""
    from pathlib import Path

    import orjson

    from recap_cli.demo import samples

    samples.bench_sets(tmp_path, n=3)
    committed = Path(__file__).resolve().parents[1] / "sample_inputs" / "bench"
    for base in (committed, tmp_path):
        found = sorted(base.glob("demo_*.jsonl"))
        assert found and all((base / "truth" / p.name).is_file() for p in found), base
        for path in found:
            rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
            assert rows and all("image" in r and "answers" not in r for r in rows), path
            truth = [orjson.loads(line) for line in (base / "truth" / path.name).read_bytes().splitlines()]
            assert [t["id"] for t in truth] == [r["id"] for r in rows]
    assert not list(committed.parent.glob("**/*.truth.jsonl"))
