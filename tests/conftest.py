"""Tiny random-init models of both architectures (and a text LM), saved to disk and loaded the real way."""

from __future__ import annotations

import gc
import json
import random
import shutil

import pytest
import torch
from PIL import Image

from recap_cli.drafters import Drafter
from recap_cli.models import load
from recap_cli.tiny_models import (build_tiny_gemma3, build_tiny_idefics3, build_tiny_internvl, build_tiny_llama,
                                   build_tiny_llava_next, build_tiny_llava_onevision, build_tiny_qwen2_5_vl,
                                   build_tiny_qwen2_vl, build_tiny_qwen3_vl, build_tiny_smolvlm)
from recap_cli.decoding.tree import Source, Tree

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _collector_sees_everything_again():
    """The commands take what is alive after loading out of the garbage collector's scans (freeze_loaded); many
    commands run in this one process, so each test gives the collector everything back when it ends."""
    yield
    gc.unfreeze()


BUILDERS = {"qwen": build_tiny_qwen2_5_vl, "llava": build_tiny_llava_next, "text": build_tiny_llama,
            # the newer families, tested in test_families.py
            "qwen2_vl": build_tiny_qwen2_vl, "qwen3_vl": build_tiny_qwen3_vl,
            "llava_onevision": build_tiny_llava_onevision, "idefics3": build_tiny_idefics3,
            "smolvlm": build_tiny_smolvlm, "internvl": build_tiny_internvl, "gemma3": build_tiny_gemma3}


class _ModelDirs(dict):
    """Each tiny model is built on first use, once per session (a filtered run builds only what it needs)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, name):
        self[name] = BUILDERS[name](self.root / name)
        return self[name]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    return _ModelDirs(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def short_model(model_dirs, tmp_path_factory):
    """The tiny text model, told it has 64 positions (RoPE weights do not depend on it): prompts outgrow it."""
    d = tmp_path_factory.mktemp("short") / "model"
    shutil.copytree(model_dirs["text"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (d / "config.json").write_text(json.dumps(cfg))
    return d


_ADAPTERS: dict = {}


@pytest.fixture(scope="session")
def get_adapter(model_dirs):
    """Adapters by (arch, attention), float64 so tree and one-token logits agree far below any top-2 gap."""

    def get(arch: str, attn: str = "sdpa", dtype: str = "fp64"):
        key = (arch, attn, dtype)
        if key not in _ADAPTERS:
            _ADAPTERS[key] = load(str(model_dirs[arch]), device="cpu", dtype=dtype, attn=attn)
        return _ADAPTERS[key]

    return get


def make_image(seed: int, size: tuple[int, int] = (80, 60)) -> Image.Image:
    rng = random.Random(seed)
    img = Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3))
    for _ in range(3):
        x, y = rng.randrange(size[0] - 10), rng.randrange(size[1] - 10)
        img.paste((rng.randrange(256), rng.randrange(256), rng.randrange(256)), (x, y, x + 10, y + 10))
    return img


def request(arch: str, question: str, seed: int = 0, size=(80, 60)):
    """(messages, images) for one single-turn request; text models get no image."""
    if arch == "text":
        return [{"role": "user", "content": question}], []
    content = [{"type": "image"}, {"type": "text", "text": question}]
    return [{"role": "user", "content": content}], [make_image(seed, size)]


class OracleDrafter(Drafter):
    """Arbitrary trees around a known reference continuation: each node is the reference token with
    probability ``p_right`` (so depth-d nodes on a right path are accepted), otherwise a random token. ``early``:
    the first tree is verified in the prompt's forward pass (``Drafter.drafts_at_prefill``)."""

    name = "oracle"

    def __init__(self, reference: list[int], p_right: float, nodes: int, seed: int, vocab: int, early: bool = False):
        self.reference, self.p_right, self.nodes, self.vocab = reference, p_right, nodes, vocab
        self.rng = random.Random(seed)
        self.drafts_at_prefill = early

    def start(self, prompt, rows):
        self.prompt_len = len(prompt)

    def propose(self, context, room):
        tree = Tree.root(context[-1])
        done = len(context) - self.prompt_len  # reference index of the root's successor
        depth = [0]
        for i in range(1, self.nodes):
            parent = i - 1 if self.rng.random() < 0.6 else self.rng.randrange(i)
            d = depth[parent] + 1
            k = done + d - 1
            right = k < len(self.reference) and self.rng.random() < self.p_right
            tree.tokens.append(self.reference[k] if right else self.rng.randrange(self.vocab))
            tree.parents.append(parent)
            tree.sources.append(Source.OTHER)
            depth.append(d)
        return tree
