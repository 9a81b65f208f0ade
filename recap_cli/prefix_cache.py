"""Prefix reuse: the KV rows of prompts already prefilled, kept for later requests that start the same way.

VQA sets ask several questions about one image, each a line of its own, and a multi-turn request sends its whole
conversation again at every turn. Both repeat a long prefix (chat template + image + earlier turns) whose keys
and values do not depend on what follows it: attention is causal past the image block (Gemma 3's bidirectional
block lies whole inside the prefix), and keys are cached after RoPE, so they carry their positions with them.
One prefill can serve them all; a later request prefills only its own suffix over a copy of the prefix.

Entries are keyed by token ids *and* the content hash of every image of the prompt: the same path with a changed
file, or another image the processor expands to the same placeholder tokens, never matches. A lookup takes the
longest common token prefix among the entries with the same images. The reused part must cover every image token
of the prompt (the suffix is then plain text: no vision encoder, no image masks, positions that simply continue)
and leave at least one token to prefill (its logits give the first new token). Memory-bounded, least recently
used out first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from PIL import Image

from .decoding.tree import Rows

# A text-only hit shorter than this is not worth a copy and, in a batch, a forward pass of its own. A hit that
# covers an image is always worth it: it skips the vision encoder and the image's tokens.
MIN_TEXT_HIT = 16
# --prefix-cache auto: a tenth of the model's weights, at least 64 MB. Bounded by what the process already holds,
# so memory grows by about a tenth at most; at Qwen2.5-VL-7B shapes in bf16 (57 KB of keys and values a token)
# 1.5 GB holds ~20 prompts of a 1,000-token image, more than the distinct images a batch of 32 has in flight.
AUTO_SHARE, AUTO_FLOOR_MB = 0.1, 64


def auto_megabytes(model: torch.nn.Module) -> int:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(AUTO_FLOOR_MB, round(AUTO_SHARE * weights / 2**20))


def image_key(image: Image.Image) -> str:
    """The content of an image as the processor sees it (mode, size, pixels after EXIF orientation)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


Layers = list[tuple[torch.Tensor, torch.Tensor]]  # each layer's keys and values, (kv_heads, length, head_dim)


@dataclass
class Entry:
    ids: torch.Tensor  # (L,) int64 on the CPU: the tokens whose keys and values ``layers`` hold
    images: tuple[str, ...]
    layers: Layers
    rows: Rows | None  # prefill predictions at text positions below L (what drafters seed from), if computed
    nbytes: int

    @property
    def length(self) -> int:
        return self.ids.numel()

    def rows_before(self, n: int) -> Rows | None:
        return rows_before(self.rows, n)


@dataclass
class Hit:
    entry: Entry
    length: int  # prompt tokens taken from the entry


class PrefixCache:
    """Entries by least recent use, within ``megabytes``; counts lookups, hits and reused tokens."""

    def __init__(self, megabytes: float, min_text_hit: int = MIN_TEXT_HIT):
        self.capacity = int(megabytes * 2**20)
        self.min_text_hit = min_text_hit
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.used = 0
        self.lookups = self.hits = self.reused = self.stored = self.evicted = 0

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.used = 0

    def mark(self) -> dict:
        """What ``rewind`` returns to: the entries (whose keys and values are never changed in place, so they are
        shared, not copied), their order and the counters."""
        return vars(self) | {"entries": OrderedDict(self.entries)}

    def rewind(self, mark: dict) -> None:
        vars(self).update(mark | {"entries": OrderedDict(mark["entries"])})

    def lookup(self, ids: torch.Tensor, images: tuple[str, ...], image_end: int) -> Hit | None:
        """The longest usable prefix of ``ids`` (1-D) held for these images. ``image_end`` is the index after
        the prompt's last image token (0 without images): a hit must reach it, or no image token would be
        left out of the copy and the suffix would need the vision encoder."""
        self.lookups += 1
        ids = ids.cpu()
        if image_end and len(images) == 0:  # image tokens of unknown content: nothing can vouch for them
            return None
        best, found = 0, None
        for key, entry in self.entries.items():
            if entry.images == images:
                n = common_prefix(entry.ids, ids)
                if n > best:
                    best, found = n, key
        n = self.usable(best, ids.numel(), image_end)
        if found is None or not n:
            return None
        self.entries.move_to_end(found)
        self.hits += 1
        self.reused += n
        return Hit(self.entries[found], n)

    def usable(self, common: int, length: int, image_end: int) -> int:
        """How much of a ``length``-token prompt a cached prefix sharing its first ``common`` tokens serves (0:
        nothing): all but the last token at most (its logits give the first new token), every image token, and
        for a text prompt at least ``min_text_hit`` tokens."""
        n = min(common, length - 1)
        return n if n > 0 and n >= image_end and (image_end or n >= self.min_text_hit) else 0

    def offer(self, ids: torch.Tensor, images: tuple[str, ...], take: Callable[[], Layers | None],
              rows: Rows | None) -> bool:
        """Keep the keys and values of ``ids`` (``take()`` copies them out of a live cache) unless an entry for
        these images already starts with all of ``ids``; entries that ``ids`` extends are dropped (the new one
        serves every lookup they would). False when nothing was stored."""
        ids = ids.cpu()
        superseded = []
        for key, entry in self.entries.items():
            if entry.images != images:
                continue
            n = common_prefix(entry.ids, ids)
            if n == ids.numel():  # already held
                self.entries.move_to_end(key)
                return False
            if n == entry.length:  # a prefix of the new one
                superseded.append(key)
        try:
            layers = take()
        except torch.OutOfMemoryError:  # no room on the device to copy the rows: reuse is a saving, never worth
            return False  # the turn that just ended (batch 1) or the whole run (a batch leaves its rows here)
        if layers is None:
            return False
        rows = rows_before(rows, ids.numel())
        if rows is not None:
            rows = Rows(ids=rows.ids.clone(), probs=rows.probs.clone(), positions=list(rows.positions))
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        nbytes += ids.numel() * 8 + (0 if rows is None else rows.ids.numel() * 12)
        if nbytes > self.capacity:
            return False
        for key in superseded:
            self._drop(key)
        while self.used + nbytes > self.capacity:
            self._drop(next(iter(self.entries)))
            self.evicted += 1
        entry = Entry(ids=ids.clone(), images=images, layers=layers, rows=rows, nbytes=nbytes)
        self.entries[id(entry)] = entry
        self.used += nbytes
        self.stored += 1
        return True

    def _drop(self, key: int) -> None:
        self.used -= self.entries.pop(key).nbytes


def rows_before(rows: Rows | None, n: int) -> Rows | None:
    """Prefill rows of the positions below n (positions ascend)."""
    if rows is None or rows.positions is None:
        return None
    k = sum(1 for p in rows.positions if p < n)
    return Rows(ids=rows.ids[:k], probs=rows.probs[:k], positions=rows.positions[:k])


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n
