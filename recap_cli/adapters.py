"""Model adapters: turn a conversation (+ images) into model inputs, and say where text positions continue.

Everything that differs between architectures lives here: the processor and chat template, the extra forward
inputs (pixels, grids, image sizes), the image placeholder token, and positions. The engine only sees a
``Prompt`` and an ``Adapter`` and knows nothing about tokenization.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from .decoding import compat
from .prefix_cache import image_key

Message = dict[str, Any]  # {"role": "user"|"assistant"|"system", "content": str | list of parts}


@dataclass
class Prompt:
    """One request's prefill inputs.

    ``position_ids`` is None for 1-D RoPE models (positions are 0..L-1). Qwen2.5-VL's M-RoPE gives image tokens
    2-D grid positions, so after the prompt text positions continue at ``L + rope_delta`` rather than ``L``.
    """

    input_ids: torch.Tensor  # (1, L)
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # pixels, grids, image sizes, ...
    position_ids: torch.Tensor | None = None  # (3, 1, L) for M-RoPE
    rope_delta: int = 0
    image_keys: tuple[str, ...] = ()  # content hash of each image (prefix reuse matches on them)

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


def text_only(messages: list[Message]) -> list[Message]:
    """Flatten list-of-parts contents to strings, for templates that only know strings."""
    out = []
    for m in messages:
        content = m["content"]
        if not isinstance(content, str):
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        out.append({"role": m["role"], "content": content})
    return out


def count_images(messages: list[Message]) -> int:
    return sum(1 for m in messages if not isinstance(m["content"], str)
               for p in m["content"] if p.get("type") == "image")


class Adapter:
    """Base adapter: a causal LM with a tokenizer and chat template (SmolLM2 and other text models)."""

    arch = "text"
    supports_images = False
    token_inputs = ("mm_token_type_ids", "token_type_ids")  # model inputs that hold one value per prompt token
    # Whether a draft tree may ride on the prompt's forward pass (Engine.prefill_tree) under a plain 4-D mask:
    # causal over the prompt, by ancestry over the nodes. Not where prefill needs a mask of the model's own.
    drafts_in_prefill = True

    def __init__(self, model: torch.nn.Module, tokenizer: Any):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.image_token_id: int | None = None
        self.eos_token_ids = _eos_ids(model, tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def build(self, messages: list[Message], images: list[Image.Image]) -> Prompt:
        if images:
            raise ValueError("this model reads text only; drop the image or pick a vision-language model")
        ids = self.tokenizer.apply_chat_template(text_only(messages), add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)["input_ids"]
        return Prompt(input_ids=ids.to(self.device))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def batch_inputs(self, prompts: list[Prompt]) -> dict[str, Any]:
        """One forward pass's inputs for several prompts, right-padded: row r's tokens at columns 0..L_r-1, as
        the batched cache keeps them. Padding comes after every real token of its row, so no real token sees it
        (attention is causal): no mask hides it. Nor may one: padding hidden from padding leaves a padding token
        under a sliding window (Gemma 3) nothing to see, eager attention makes its output NaN, and the next
        layer's zero weights on NaN values poison the real tokens too. Image inputs are concatenated in row
        order (models fill image placeholders in order across the batch); where their shapes differ they are
        zero-padded along their own dimensions (LLaVA-NeXT's patch counts: the model cuts each image's back
        off)."""
        width = max(p.length for p in prompts)
        ids = torch.stack([_pad_row(p.input_ids[0], width, int(p.input_ids[0, -1])) for p in prompts])
        inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if any(p.position_ids is not None for p in prompts):  # M-RoPE: each row's own (3, L_r) grid positions
            rows = [p.position_ids[:, 0] if p.position_ids is not None
                    else torch.arange(p.length, device=self.device).expand(3, -1) for p in prompts]
            inputs["position_ids"] = torch.stack([_pad_row(r, width, 0) for r in rows], dim=1)
        for key in dict.fromkeys(k for p in prompts for k in p.model_inputs):
            if key in self.token_inputs:  # one value per token: padded like input_ids
                inputs[key] = torch.stack([_pad_row(p.model_inputs[key][0], width, 0) if key in p.model_inputs
                                           else torch.zeros_like(ids[0]) for p in prompts])
            else:
                inputs[key] = _cat_padded([p.model_inputs[key] for p in prompts if key in p.model_inputs])
        return inputs

    # Prefix reuse (recap_cli/prefix_cache.py).

    def image_end(self, prompt: Prompt) -> int:
        """The index after the prompt's last image token (0 without images): a reused prefix reaches at least
        this far, so the suffix prefilled over it is text only."""
        if self.image_token_id is None:
            return 0
        where = (prompt.input_ids[0] == self.image_token_id).nonzero()
        return int(where[-1]) + 1 if where.numel() else 0

    def reusable_end(self, prompt: Prompt) -> int:
        """How much of a prompt later requests are likely to share, kept when its turn ends: through the last
        image (questions about the same image differ after it), or all of a text prompt (the question cannot be
        told from a system prompt here; a later lookup takes the common part)."""
        return self.image_end(prompt) or prompt.length

    def reuse_refusal(self) -> str | None:
        """Why a suffix cannot follow a cached prefix exactly on this model (None: it can). Every family recap
        adapts can: attention is causal past the image blocks (Gemma 3's bidirectional block lies whole in the
        prefix), keys are cached after RoPE, and text positions after the last image continue one by one (Qwen's
        M-RoPE delta comes with the prompt). What cannot be copied is a cache that drops positions."""
        if not compat.holds_every_position(self.new_cache()):
            return (f"{self.arch} caches only a window of positions in some layers, so a prefix cannot be copied "
                    "whole")
        return None

    # Hooks for architectures whose layers differ (default: one mask serves every layer).

    def new_cache(self, capacity: int | None = None):
        """A dynamic KV cache, or a static one of ``capacity`` positions."""
        if capacity is None:
            return compat.new_cache(self.model)
        return compat.new_static_cache(self.model, capacity)

    def prefill_mask(self, mask: torch.Tensor, prompt: Prompt) -> torch.Tensor | dict[str, torch.Tensor]:
        """The static-cache prefill mask(s), given the causal (1, 1, L, capacity) one."""
        return mask

    def layer_masks(self, mask: torch.Tensor, positions: torch.Tensor,
                    length: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """The tree-step mask(s), given the (B, 1, T, K) ancestry mask and the nodes' ``positions`` (B, T). Cached
        column c < ``length`` holds position c (1-D positions); the step's nodes sit at columns ``length``.."""
        return mask


class VisionAdapter(Adapter):
    """A vision-language model driven through its own processor (chat template + image preprocessing)."""

    supports_images = True
    image_token_attr = "image_token_id"  # where the config keeps the image placeholder id

    def __init__(self, model: torch.nn.Module, processor: Any):
        super().__init__(model, processor)
        self.arch = model.config.model_type
        self.image_token_id = getattr(model.config, self.image_token_attr)

    def build(self, messages: list[Message], images: list[Image.Image]) -> Prompt:
        inputs = self._processor_inputs(messages, images)
        return Prompt(input_ids=inputs.pop("input_ids"), model_inputs=inputs,
                      image_keys=tuple(image_key(i) for i in images))

    def _processor_inputs(self, messages: list[Message], images: list[Image.Image]) -> dict[str, torch.Tensor]:
        if count_images(messages) != len(images):
            raise ValueError(f"{count_images(messages)} image slots in the messages but {len(images)} images")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        batch = self.tokenizer(text=[text], images=images or None, return_tensors="pt")
        dtype = self.model.dtype
        return {k: (v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device))
                for k, v in batch.items() if k != "attention_mask"}


class LlavaNextAdapter(VisionAdapter):
    """LLaVA-1.6 (LLaVA-NeXT) and LLaVA-OneVision: the processor expands <image> into one token per feature
    (anyres tiles and row newlines included); positions are 1-D."""

    arch = "llava_next"
    image_token_attr = "image_token_index"


class QwenVLAdapter(VisionAdapter):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: M-RoPE positions computed once here, with the delta that text positions
    carry afterwards.

    Text positions are equal on all three M-RoPE rows, so tree nodes pass 1-D positions ``P + delta + depth`` and
    each family's text model spreads them over its rows (Qwen3-VL interleaves the rows' frequencies, which changes
    nothing for equal rows). Qwen3-VL's deepstack features are added at image positions only, all in the prompt.
    ``mm_token_type_ids`` must reach ``get_rope_index``, or it silently falls back to 1-D positions.
    """

    arch = "qwen2_5_vl"

    def build(self, messages: list[Message], images: list[Image.Image]) -> Prompt:
        inputs = self._processor_inputs(messages, images)
        input_ids = inputs.pop("input_ids")
        keys = tuple(image_key(i) for i in images)
        # Kept in model_inputs so generate() can derive the same positions; the engine's forward ignores it.
        type_ids = inputs.setdefault("mm_token_type_ids", (input_ids == self.image_token_id).int())
        if "image_grid_thw" not in inputs:  # text-only request: plain positions
            return Prompt(input_ids=input_ids, model_inputs=inputs, image_keys=keys)
        positions, delta = self.model.model.get_rope_index(
            input_ids, mm_token_type_ids=type_ids, image_grid_thw=inputs["image_grid_thw"])
        return Prompt(input_ids=input_ids, model_inputs=inputs, position_ids=positions, rope_delta=int(delta.item()),
                      image_keys=keys)


class Gemma3Adapter(VisionAdapter):
    """Gemma 3: image tokens attend to each other both ways in prefill, and sliding-window layers alternate with
    global ones.

    Prefill runs through the model's own mask builder (``token_type_ids`` marks the image blocks). Tree steps are
    causal by ancestry for every layer, and sliding layers also drop keys ``window`` or more positions back: a user
    4-D mask would reach them unchanged, so the step passes a dict of masks by layer type. The cache keeps every
    position in every layer (a sliding ring buffer cannot be compacted by absolute position).
    """

    drafts_in_prefill = False  # its prefill mask opens image blocks both ways and has sliding windows

    def __init__(self, model: torch.nn.Module, processor: Any):
        super().__init__(model, processor)
        self.window = model.config.get_text_config().sliding_window

    def new_cache(self, capacity: int | None = None):
        if capacity is None:
            return compat.new_cache(self.model, keep_all=True)
        return compat.new_static_cache(self.model, capacity, keep_all=True)

    def prefill_mask(self, mask: torch.Tensor, prompt: Prompt) -> dict[str, torch.Tensor]:
        from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

        n = prompt.length
        types = prompt.model_inputs.get("token_type_ids")
        if types is not None:  # each image block sees itself whole: OR(causal, same block)
            block = get_block_sequence_ids_for_mask(types, device=mask.device)[0]
            same = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
            mask = mask.clone()
            mask[0, 0, :, :n].masked_fill_(same, 0.0)
        keys = torch.arange(mask.shape[-1], device=mask.device)
        return self._by_layer(mask, keys[None, :n], keys[None])

    def layer_masks(self, mask: torch.Tensor, positions: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
        # Cached rows 0..length-1 sit at their positions (a batched row's columns past its own length are
        # masked anyway), the step's nodes at theirs.
        keys = torch.arange(mask.shape[-1], device=mask.device).repeat(positions.shape[0], 1)
        keys[:, length:length + positions.shape[1]] = positions
        return self._by_layer(mask, positions, keys)

    def _by_layer(self, mask: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sliding layers also drop keys ``window`` or more positions behind the query (masking_utils'
        ``sliding_window_overlay``: k > q - window); queries (B, T), keys (B, K)."""
        near = (queries[:, :, None] - keys[:, None, :]) < self.window
        sliding = mask.masked_fill(~near[:, None], torch.finfo(mask.dtype).min)
        return {"full_attention": mask, "sliding_attention": sliding}


def _pad_row(row: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """``row`` (..., L) padded with ``fill`` to (..., width) along its last dimension."""
    extra = width - row.shape[-1]
    return row if extra == 0 else torch.nn.functional.pad(row, (0, extra), value=fill)


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0, zero-padding every other dimension to the largest."""
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        pad: list[int] = []
        for d in reversed(range(1, t.dim())):
            pad += [0, shape[d - 1] - t.shape[d]]
        padded.append(torch.nn.functional.pad(t, pad) if any(pad) else t)
    return torch.cat(padded)


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """EOS ids exactly as greedy generate() uses them: the generation config's (none when it names none:
    generate() then never stops early, whatever the tokenizer says); the tokenizer's only for a model without
    a generation config."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if config is None:
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        eos = tok.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
