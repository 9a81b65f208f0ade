"""The newer VLM families, each a tiny random-init model loaded the real way, decode exactly like generate().

Every family gets the same proof as Qwen2.5-VL and LLaVA-NeXT in test_engine.py: random trees from all-wrong to
mostly-right and every drafter reproduce ``generate(do_sample=False)`` over 50 new tokens, and a wrong tree mask
or wrong tree positions are caught for that family.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from recap_cli.decoding import compat
from recap_cli.adapters import Gemma3Adapter
from recap_cli.decoding.engine import Engine
from recap_cli.session import Session
from recap_cli.decoding.tree import Tree

from .conftest import OracleDrafter, request
from .test_engine import EARLY_TREES, NEW_TOKENS, QUESTIONS, TREES, _any_mismatch, decode, decode_early, reference

# SmolVLM's processor needs num2words (a transformers soft dependency recap does not pull in); Idefics3, the same
# model design under another name, carries the proof where it is missing.
NEEDS_NUM2WORDS = pytest.mark.skipif(importlib.util.find_spec("num2words") is None,
                                     reason="SmolVLMProcessor needs the num2words package")
FAMILIES = ["qwen2_vl", "qwen3_vl", "llava_onevision", "idefics3", pytest.param("smolvlm", marks=NEEDS_NUM2WORDS),
            "internvl", "gemma3"]
MROPE = {"qwen2_vl", "qwen3_vl"}


@pytest.mark.parametrize("family", FAMILIES)
def test_trees_equal_generate(get_adapter, family):
    adapter = get_adapter(family)
    assert adapter.arch == family
    for i, (nodes, p_right) in enumerate(TREES):
        qi, seed = i % 2, 1 + i % 2
        ref = reference(adapter, family, qi, seed)
        assert len(ref) >= 10
        drafter = OracleDrafter(ref, p_right, nodes, seed=i, vocab=adapter.vocab_size)
        assert decode(adapter, family, qi, seed, drafter) == ref, (nodes, p_right)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tree_verified_at_prefill_equals_generate(get_adapter, family):
    """The first tree rides on the prompt's forward pass where the family allows it (not Gemma 3, whose prefill
    mask is the model's own): generate()'s tokens either way."""
    adapter = get_adapter(family)
    engine = Engine(adapter)
    assert engine.drafts_in_prefill == (family != "gemma3")
    for i, (nodes, p_right) in enumerate(EARLY_TREES):
        gen = decode_early(engine, adapter, family, i, nodes, p_right)
        assert (gen.prefill_tokens > 1) == (p_right > 0 and engine.drafts_in_prefill), (nodes, p_right)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_drafter_equals_generate(get_adapter, family):
    """One session per method over a repeated stream (warm memory drafts), and the static-cache path."""
    adapter = get_adapter(family)
    stream = [(0, 1), (1, 2)] * 2
    for method, static in [("ar", False), ("recap", False), ("tr", False), ("pld", False), ("suffix", False),
                           ("recap", True)]:
        session = Session(adapter, method, static=static)
        for qi, seed in stream:
            gen = session.answer(*request(family, QUESTIONS[qi], seed), NEW_TOKENS)
            assert gen.tokens == reference(adapter, family, qi, seed), (method, static)


@pytest.mark.parametrize("family", FAMILIES)
def test_wrong_masks_and_positions_are_caught(get_adapter, monkeypatch, family):
    assert not _any_mismatch(get_adapter, family)
    with monkeypatch.context() as m:
        def causal(self, parents):  # every node sees every earlier node, ancestors or not
            n, p = len(parents), self.length
            tree = torch.full((n, n), torch.finfo(self.dtype).min, dtype=self.dtype).triu(1)
            return torch.cat([torch.zeros(n, p, dtype=self.dtype), tree], 1)[None, None]

        m.setattr(Engine, "_tree_mask", causal)
        assert _any_mismatch(get_adapter, family)
    with monkeypatch.context() as m:
        m.setattr(Tree, "depths", lambda self: list(range(len(self.tokens))))
        assert _any_mismatch(get_adapter, family)
    if family in MROPE:
        assert get_adapter(family).build(*request(family, "hi", 1)).rope_delta != 0
        real = Engine.prefill_tree

        def no_delta(self, prompt, *args, **kw):
            out = real(self, prompt, *args, **kw)
            self.rope_delta = 0
            return out

        monkeypatch.setattr(Engine, "prefill_tree", no_delta)
        assert _any_mismatch(get_adapter, family)


# --- Gemma 3: sliding-window layers and bidirectional image blocks ------------------------------------------------

def test_gemma3_sliding_layers_need_their_own_mask(get_adapter, monkeypatch):
    """The tiny model's window (8) is far shorter than prompt + answer, so one mask for all layers is wrong."""
    assert get_adapter("gemma3").window < 20
    monkeypatch.setattr(Gemma3Adapter, "layer_masks", lambda self, mask, positions, length: mask)
    assert _any_mismatch(get_adapter, "gemma3")


def test_gemma3_cache_keeps_every_position(get_adapter, monkeypatch):
    """A sliding layer's ring-buffer cache cannot be compacted by absolute position: wrong tokens or an error."""
    monkeypatch.setattr(Gemma3Adapter, "new_cache", lambda self, capacity=None: compat.new_cache(self.model))
    with pytest.raises((AssertionError, RuntimeError)):
        assert not _any_mismatch(get_adapter, "gemma3")


def test_gemma3_static_prefill_sees_image_blocks_whole(get_adapter, monkeypatch):
    """The static path builds the prefill masks itself: its top-k rows equal the model's own (dynamic) prefill,
    and a plain causal mask (image tokens not seeing later tokens of their image) moves them."""
    adapter = get_adapter("gemma3")
    prompt = adapter.build(*request("gemma3", QUESTIONS[0], 1))

    def rows(static):
        first, r = Engine(adapter, static=static).prefill(prompt, want_rows=True)
        return first, r.probs

    (first, want), (first_static, got) = rows(False), rows(True)
    assert first == first_static and torch.allclose(got, want, atol=1e-9)
    monkeypatch.setattr(Gemma3Adapter, "prefill_mask", lambda self, mask, prompt: self._by_layer(
        mask, torch.arange(prompt.length)[None], torch.arange(mask.shape[-1])[None]))
    assert (rows(True)[1] - want).abs().max() > 1e-4
