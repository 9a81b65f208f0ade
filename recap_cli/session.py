"""A session: one model, one drafter, a stream of requests that share the drafter's persistent memory."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

from .adapters import Adapter, Message
from .drafters import make_drafter
from .engine import Engine, Generation, generate


class Session:
    """Loaded once per ``recap run``; per-request memories reset inside the drafter, order 1 carries over."""

    def __init__(self, adapter: Adapter, method: str = "recap", static: bool = False, compile: bool = False,
                 **knobs):
        self.adapter = adapter
        self.method = method
        banned = [adapter.image_token_id] if adapter.image_token_id is not None else []
        self.drafter = make_drafter(method, adapter.vocab_size, banned=banned, **knobs)
        self.engine = Engine(adapter, top_k=getattr(self.drafter, "top_k", 8), static=static, compile=compile,
                             min_capacity=4096 if compile else 0)

    def warm_up(self, messages: list[Message], images: list[Image.Image]) -> float:
        """Compile / capture every step shape before timed work; seconds spent."""
        return self.engine.warm_up(self.adapter.build(messages, images))

    def answer(self, messages: list[Message], images: list[Image.Image], max_new_tokens: int) -> Generation:
        prompt = self.adapter.build(messages, images)
        return generate(self.engine, prompt, self.drafter, max_new_tokens)

    def reset_memory(self) -> None:
        self.drafter.reset()

    def save_memory(self, path: Path) -> bool:
        """Write the persistent memory atomically (temp file + rename); False when the method keeps none."""
        table = _persistent_table(self.drafter)
        if table is None:
            return False
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.")
        os.close(fd)
        try:
            torch.save({"method": self.method, "model": self._fingerprint(), **table.state()}, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return True

    def load_memory(self, path: Path) -> None:
        table = _persistent_table(self.drafter)
        if table is None:
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("model") != self._fingerprint():
            raise ValueError(f"it was saved for model {state.get('model')}, not {self._fingerprint()}")
        table.load_state(state)

    def _fingerprint(self) -> str:
        """Memories hold token ids: they only mean something to a model with the same architecture and vocabulary."""
        return f"{self.adapter.model.config.model_type}/{self.adapter.vocab_size}"


def _persistent_table(drafter):
    """The drafter's memory that outlives a request: RECAP's order-1 table or Token Recycling's matrix."""
    return getattr(drafter, "order1", None) or getattr(drafter, "table", None)


class GenerateSession:
    """transformers' own ``generate(do_sample=False)``: what a user would run instead (``hf``), optionally with
    its prompt lookup (``hf-pld``). Same interface as ``Session`` so the same request code drives both."""

    def __init__(self, adapter: Adapter, method: str = "hf"):
        if method not in ("hf", "hf-pld"):
            raise ValueError(f"unknown generate() method '{method}'")
        self.adapter = adapter
        self.method = method

    def answer(self, messages: list[Message], images: list[Image.Image], max_new_tokens: int) -> Generation:
        prompt = self.adapter.build(messages, images)
        # Pure greedy: checkpoints such as Qwen2.5-VL ship a repetition penalty in their generation config.
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False, repetition_penalty=1.0)
        if self.method == "hf-pld":
            kw["prompt_lookup_num_tokens"] = 10
        model = self.adapter.model
        _sync(self.adapter.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
                                 **prompt.model_inputs, **kw)
        _sync(self.adapter.device)
        # generate() does not split prefill from decoding: its whole time is booked as decoding.
        return Generation(tokens=out[0, prompt.length:].tolist(), verify_s=time.perf_counter() - t0)

    def reset_memory(self) -> None:
        """generate() keeps nothing between requests."""

    def save_memory(self, path: Path) -> bool:
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
