"""The few places where transformers 5.x versions differ, kept in one file.

Checked on 5.17 and 5.24: 5.24 renamed the forward kwarg ``past_key_values`` to ``cache`` (the old name warns);
``DynamicCache.crop`` takes a negative count since 5.17 (a positive length is an error in 5.24), so recap cuts
layers itself; every 5.x cache holds per-layer ``keys``/``values`` tensors of shape (batch, kv_heads, length,
head_dim), and static layers keep their own write counter ``cumulative_length``.
"""

from __future__ import annotations

import copy
import inspect

import torch
from transformers import DynamicCache


def cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the forward argument that takes the KV cache in this transformers version."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model: torch.nn.Module, keep_all: bool = False) -> DynamicCache:
    return DynamicCache(config=_all_full(model) if keep_all else model.config)


def new_static_cache(model: torch.nn.Module, capacity: int, keep_all: bool = False):
    """A preallocated cache of ``capacity`` positions (allocated on the first write, in the model's dtype)."""
    from transformers import StaticCache

    return StaticCache(config=_all_full(model) if keep_all else model.config, max_cache_len=capacity)


def _all_full(model: torch.nn.Module):
    """The text config with every layer typed full attention, so the cache keeps every position in every layer.

    A config's sliding layers get ring-buffer caches (the last ``window`` positions only), whose rows tree
    compaction cannot address by absolute position; the window is then applied by the mask instead."""
    config = copy.deepcopy(model.config.get_text_config(decoder=True))
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    return config


def is_static(layer) -> bool:
    """Static layers write at their own counter (``cumulative_length``), ignoring any cache_position."""
    return hasattr(layer, "cumulative_length")


def set_length(cache, length: int) -> None:
    """Point a static cache's write counters at ``length`` (a rewind; stale rows beyond it stay masked)."""
    for layer in cache.layers:
        if is_static(layer):
            layer.cumulative_length.fill_(length)


def keep_rows(cache: DynamicCache, start: int, rows: torch.Tensor | None, new_length: int) -> None:
    """Make cache positions start.. hold the rows ``start + rows`` (in order), then cut the cache to new_length.

    ``rows`` is None when the kept rows already sit in place (the accepted path was a contiguous prefix of the
    tree, the common case), so only the cut remains.
    """
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None:
            continue
        if rows is not None:
            n = rows.numel()
            # The right-hand side is gathered into a new tensor before the write, so overlaps are safe.
            layer.keys[:, :, start:start + n] = layer.keys[:, :, start + rows]
            layer.values[:, :, start:start + n] = layer.values[:, :, start + rows]
        if is_static(layer):  # preallocated: move the write counter back, the rows beyond stay masked
            layer.cumulative_length.fill_(new_length)
        else:
            layer.keys = layer.keys[:, :, :new_length]
            layer.values = layer.values[:, :, :new_length]


def hub_network_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "the hub could not be reached": huggingface_hub 1.x talks through httpx, 2.x through
    httpx2, and both raise their TransportError (connect, read, timeout, proxy) when the network fails."""
    import importlib

    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)
