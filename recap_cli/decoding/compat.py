"""The few places where transformers 5.x versions differ, kept in one file.

Checked on 5.17 and 5.24: 5.24 renamed the forward kwarg ``past_key_values`` to ``cache`` (the old name warns);
``DynamicCache.crop`` takes a negative count since 5.17 (a positive length is an error in 5.24), so recap cuts
layers itself; every 5.x cache holds per-layer ``keys``/``values`` tensors of shape (batch, kv_heads, length,
head_dim), and static layers keep their own write counter ``cumulative_length``. One difference is torch's, not
transformers': which attention kernels a forward pass on CUDA may use (``attention_kernels``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

# Every kernel of scaled-dot-product attention but cuDNN's (see ``attention_kernels``).
KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """Where a forward pass runs on CUDA: attention without cuDNN's kernel, which torch picks first on a Hopper
    GPU. It builds an execution plan for each new shape, and decoding makes a new one every step (the keys grow
    by the tokens it accepts). On an H200 (torch 2.11, the demo model in bf16) steps then took 3 ms to 0.8 s:
    `ar` ran at 118 tokens/s and recap at 0.69x `ar`; without it, steps took 3.5-6 ms, `ar` 263 tokens/s and
    recap 1.64x (docs/benchmarks.md). Elsewhere nothing changes."""
    return sdpa_kernel(KERNELS) if device.type == "cuda" else contextlib.nullcontext()


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


# Batched rows (recap_cli/decoding/batched.py): one DynamicCache whose batch dimension holds the requests in flight, each
# row left-aligned (its committed tokens at columns 0..length-1, nothing it may see beyond). Only the per-layer
# ``keys``/``values`` tensors are touched, so any 5.x DynamicCache works.

def _layers(cache):
    return [layer for layer in cache.layers if getattr(layer, "is_initialized", True) and layer.keys is not None]


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - t.shape[2]
    return t if extra <= 0 else torch.nn.functional.pad(t, (0, 0, 0, extra))


def append_rows(cache, rows) -> None:
    """Add the rows of cache ``rows`` after those of ``cache``; the narrower is padded with zeros (columns
    their masks hide)."""
    for big, small in zip(_layers(cache), _layers(rows)):
        width = max(big.keys.shape[2], small.keys.shape[2])
        big.keys = torch.cat([_pad_to(big.keys, width), _pad_to(small.keys, width)])
        big.values = torch.cat([_pad_to(big.values, width), _pad_to(small.values, width)])


def select_rows(cache, keep: list[int], width: int) -> None:
    """Keep only the rows ``keep`` (in that order), cut to ``width`` columns."""
    index = torch.tensor(keep, device=_layers(cache)[0].keys.device)
    for layer in _layers(cache):
        layer.keys = layer.keys[index, :, :width]
        layer.values = layer.values[index, :, :width]


def move_paths(cache, rows: torch.Tensor | None, src: torch.Tensor | None, dst: torch.Tensor | None,
               width: int) -> None:
    """Copy column ``src[i]`` of row ``rows[i]`` to column ``dst[i]`` (each row's accepted path to the end of its
    committed tokens), then cut every row to ``width`` columns. The right-hand side is gathered before the
    write, so overlapping moves are safe."""
    for layer in _layers(cache):
        if rows is not None:
            layer.keys[rows, :, dst] = layer.keys[rows, :, src]
            layer.values[rows, :, dst] = layer.values[rows, :, src]
        layer.keys = layer.keys[:, :, :width]
        layer.values = layer.values[:, :, :width]


# Grouped-query attention for tree steps. transformers' sdpa path copies every cached key and value once per query
# head of its group (``repeat_kv``) whenever a step has a mask and more than one query token, i.e. every tree
# step; for one query token it folds the group's heads into the query instead (``pack_gqa``). Folding works for T
# tokens too: the group's n heads become n * T query rows against the group's one key/value head, each row
# under its token's mask row. Same dot products, no cache copies (2 CPU cores, demo model, 16 rows of 4 nodes:
# 14.4 -> 10.7 ms a step). Registered as an attention implementation, the public way to plug one in.
TREE_SDPA = "recap_sdpa"


def attention_name(attn: str) -> str:
    """The implementation to load a model with: recap's grouped-query sdpa for ``sdpa``, else ``attn``."""
    if attn != "sdpa":
        return attn
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(TREE_SDPA, _grouped_sdpa)
    AttentionMaskInterface.register(TREE_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return TREE_SDPA


def _grouped_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, dropout=0.0,
                  scaling=None, is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups, t = getattr(module, "num_key_value_groups", 1), query.shape[2]
    plain = (groups == 1 or t == 1 or dropout or kwargs.get("position_bias") is not None
             or not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4
             or attention_mask.shape[1] != 1 or key.shape[1] * groups != query.shape[1])
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    b, heads, _, dim = query.shape
    # Head g * n + r of query -> row r * T + t of group g; the mask's T rows repeat once per head of the group.
    folded = query.reshape(b, key.shape[1], groups * t, dim)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value,
                                                           attn_mask=_repeated(attention_mask, groups),
                                                           scale=scaling)
    return out.reshape(b, heads, t, dim).transpose(1, 2).contiguous(), None


_last_repeat: tuple = (None, 0, None)  # (mask, groups, the mask repeated): the step's last layer's


def _repeated(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """The mask's rows repeated once per head of a group. Every layer of a step gets the same mask tensor, so
    it is repeated once per step, not once per layer (20 us a layer on the demo model, on 2 CPU cores). The last
    one is held until the next step's mask replaces it: the tensor itself is the key, so a new mask can never be
    mistaken for it. Inside torch.compile nothing is kept across calls (a captured graph's tensors are its own)."""
    global _last_repeat
    if torch.compiler.is_compiling():  # one traced graph: the layers' repeats of its one mask input are one op
        return mask.repeat(1, 1, groups, 1)
    source, times, out = _last_repeat
    if source is not mask or times != groups:
        out = mask.repeat(1, 1, groups, 1)
        _last_repeat = (mask, groups, out)
    return out


# The static-shape batched engine (recap_cli/decoding/batched_static.py): one StaticCache whose slots are rows.

def allocate_static(cache, like, rows: int) -> None:
    """Allocate a static cache's buffers for ``rows`` slots, shaped like the (initialized) cache ``like``."""
    for layer, model in zip(cache.layers, _layers(like)):
        if not getattr(layer, "is_initialized", False):
            shape = (rows, model.keys.shape[1], 1, model.keys.shape[3])
            layer.lazy_initialization(model.keys.new_zeros(shape), model.values.new_zeros(shape))


def copy_row(cache, slot: int, source, row: int, length: int) -> None:
    """Columns 0..length-1 of ``source``'s row ``row`` into slot ``slot`` of the static ``cache``."""
    for layer, src in zip(cache.layers, _layers(source)):
        layer.keys[slot, :, :length] = src.keys[row, :, :length]
        layer.values[slot, :, :length] = src.values[row, :, :length]


def gather_row(cache, slot: int, columns: torch.Tensor) -> None:
    """Slot ``slot``'s columns ``columns`` (in order) to its columns 0..n-1."""
    n = columns.numel()
    for layer in cache.layers:
        layer.keys[slot, :, :n] = layer.keys[slot, :, columns]
        layer.values[slot, :, :n] = layer.values[slot, :, columns]


def generation_defaults() -> dict:
    """transformers' global generation defaults, what an unset generation config field means (top_k 50, ...):
    newer versions keep them apart (fields default to None), older ones set them in ``GenerationConfig()``."""
    from transformers import GenerationConfig

    known = getattr(GenerationConfig, "_get_default_generation_params", None)
    if known is not None:
        return dict(known())
    return {k: v for k, v in GenerationConfig().to_dict().items() if v is not None}


# Prefix reuse (recap_cli/prefix_cache.py): one row's keys and values copied out of a live cache, and prefixes
# written into a new one.

def holds_every_position(cache) -> bool:
    """Whether every layer of a (new) cache keeps the keys and values of every position: full-attention dynamic
    or static layers, not sliding-window ring buffers or recurrent states."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    return all(isinstance(layer, (DynamicLayer, StaticLayer)) and not getattr(layer, "is_sliding", False)
               for layer in cache.layers)


def row_layers(cache, row: int, length: int, columns: torch.Tensor | None = None):
    """Copies of row ``row``'s first ``length`` cached positions in every layer (or of its ``columns``, in that
    order), each (kv_heads, length, head_dim); None when a layer does not hold every position (a sliding-window
    ring buffer) or is not a key/value layer."""
    out = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is None or not getattr(layer, "is_initialized", True) or getattr(layer, "is_sliding", False):
            return None
        if columns is not None:  # advanced indexing copies
            out.append((layer.keys[row, :, columns[:length]], layer.values[row, :, columns[:length]]))
        elif keys.shape[2] < length:
            return None
        else:
            out.append((layer.keys[row, :, :length].clone(), layer.values[row, :, :length].clone()))
    return out


def load_prefixes(cache, prefixes: list, lengths: list[int]) -> None:
    """Write row r's prefix (the first ``lengths[r]`` positions of ``prefixes[r]``, from ``row_layers``) into a
    cache that holds nothing yet (a static one rewound to 0), the rows zero-padded to the longest: columns their
    masks hide. The cache's length is then the longest prefix."""
    width = max(lengths)
    for i, layer in enumerate(cache.layers):
        parts = [(p[i][0][:, :n], p[i][1][:, :n]) for p, n in zip(prefixes, lengths)]
        keys = torch.stack([torch.nn.functional.pad(k, (0, 0, 0, width - k.shape[1])) for k, _ in parts])
        values = torch.stack([torch.nn.functional.pad(v, (0, 0, 0, width - v.shape[1])) for _, v in parts])
        layer.update(keys, values)
