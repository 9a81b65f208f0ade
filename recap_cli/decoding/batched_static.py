"""The static-shape batched engine, for CUDA graphs: fixed (slots x width bucket) steps over one preallocated cache.

Every step runs all ``max_batch`` slots (a free slot verifies one padding node) and pads every tree to a width
bucket, so a step has one of a few shapes. The cache is a StaticCache of ``capacity`` positions per slot: each
step writes every slot's tree at the same columns P..P+T-1 (the cache's own write counter), and a slot's accepted
nodes stay where they were written: its row of ``valid`` marks the columns it may see (keys carry their RoPE
positions, so columns need not be in order). Nothing moves until the buffer fills; then every slot's valid
columns are gathered to its left and the counter drops to the longest slot. Joining requests are prefilled
together (dynamically) and copied into free slots.
"""

from __future__ import annotations

import time

import torch

from ..adapters import Adapter, Prompt
from . import compat
from .batched import BatchEngine, Slot, padded_ancestors
from .cost import BatchCost
from .engine import BUCKETS, bucket
from .tree import Tree


class StaticBatchEngine(BatchEngine):
    def __init__(self, adapter: Adapter, top_k: int = 8, max_batch: int = 8, compile: bool = False,
                 buckets: tuple[int, ...] = BUCKETS, capacity: int = 1024):
        if type(adapter).layer_masks is not Adapter.layer_masks:
            raise ValueError(f"{adapter.arch} masks some layers by position (sliding windows), which columns out of "
                             "order cannot follow: batch it without --compile")
        super().__init__(adapter, top_k, max_batch)
        self.buckets, self.per_row = buckets, max(buckets)
        self.cost = BatchCost(max_batch, self.per_row, buckets=buckets)
        self.capacity = capacity
        self.cache = adapter.new_cache(capacity)  # allocated at the first join, when the shapes are known
        self.valid = torch.zeros((max_batch, capacity), dtype=torch.bool, device=self.device)
        self.place: list[int] = []  # the slot of each request in flight (Batch's order)
        self.top = 0  # the write counter: columns below it have been written
        self._step = torch.compile(self.model, mode="reduce-overhead", dynamic=False) if compile else self.model

    @property
    def width(self) -> int:
        return self.top

    def _forward(self, **inputs):
        return self._step(**inputs)

    def _batch_rows(self) -> list[int]:
        return self.place

    def _admit(self, cache, prompts: list[Prompt], lengths: list[int]) -> None:
        """Copy the prefilled rows into free slots; the counter moves past the longest so no step overwrites them."""
        need = max(lengths)
        compat.allocate_static(self.cache, cache, self.max_batch)
        if need + max(self.buckets) > self.capacity:
            self._grow(need + max(self.buckets))
        if self.top + max(self.buckets) > self.capacity:
            self._compact()
        free = [s for s in range(self.max_batch) if s not in self.place]
        for j, (prompt, n, slot) in enumerate(zip(prompts, lengths, free)):
            compat.copy_row(self.cache, slot, cache, j, n)
            self.valid[slot] = False
            self.valid[slot, :n] = True
            self.place.append(slot)
            self.slots.append(Slot(n, prompt.rope_delta))
        self.top = max(self.top, need)
        compat.set_length(self.cache, self.top)

    def _row_layers(self, row: int, n: int):
        """A slot's valid columns, in column order (= position order: columns are written in step order and a
        path's nodes in depth order)."""
        slot = self.place[row]
        return compat.row_layers(self.cache, slot, n, self.valid[slot].nonzero().flatten())

    @torch.inference_mode()
    def leave(self, rows: list[int]) -> None:
        gone = set(rows)
        for i in gone:
            self.valid[self.place[i]] = False
        self.place = [s for i, s in enumerate(self.place) if i not in gone]
        self.slots = [s for i, s in enumerate(self.slots) if i not in gone]

    def step_inputs(self, trees: list[Tree]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots, T) ids and positions, T the bucket, and the (slots, 1, T, capacity) mask: a node sees its
        slot's valid columns, its ancestors (written at P + index) and itself; a free slot's nodes see themselves."""
        t = bucket(max(len(tr) for tr in trees), self.buckets)
        if self.top + t > self.capacity:
            self._compact()
            if self.top + t > self.capacity:
                self._grow(self.top + t)
        n, p, dev = self.max_batch, self.top, self.device
        ids, depths = [[0] * t for _ in range(n)], [[0] * t for _ in range(n)]
        base = [0] * n
        slots = [Tree(tokens=[], parents=[])] * n  # a free slot's nodes are padding only
        for tree, slot, state in zip(trees, self.place, self.slots):
            ids[slot], depths[slot] = tree.padded(t)
            base[slot] = state.length + state.rope_delta
            slots[slot] = tree
        pos = torch.tensor(depths, device=dev) + torch.tensor(base, device=dev)[:, None]
        mask = torch.full((n * t, self.capacity), torch.finfo(self.dtype).min, dtype=self.dtype, device=dev)
        mask[:, :p].masked_fill_(self.valid[:, :p].repeat_interleave(t, 0), 0.0)
        mask.view(n, t, self.capacity)[:, :, p:p + t].masked_fill_(padded_ancestors(slots, t).to(dev), 0.0)
        return torch.tensor(ids, device=dev), pos, mask.view(n, 1, t, self.capacity)

    def _keep(self, paths: list[list[int]]) -> None:
        """Accepted nodes stay where they were written: their columns become valid for their slot."""
        for slot, state, path in zip(self.place, self.slots, paths):
            self.valid[slot, torch.tensor([self.top + i for i in path], device=self.device)] = True
            state.length += len(path)
        self.top = int(self.cache.layers[0].cumulative_length)  # the step advanced it by its width

    def _compact(self) -> None:
        """Gather every slot's valid columns to its left (in column order); the counter drops to the longest."""
        lengths = [0] * self.max_batch
        for slot in self.place:
            columns = self.valid[slot].nonzero().flatten()
            compat.gather_row(self.cache, slot, columns)
            lengths[slot] = columns.numel()
        self.valid.zero_()
        for slot in self.place:
            self.valid[slot, :lengths[slot]] = True
        self.top = max(lengths)
        compat.set_length(self.cache, self.top)

    def _grow(self, need: int) -> None:
        """A bigger buffer (a new shape: compiled graphs are captured again), the rows in flight copied over."""
        capacity = -(-2 * need // 256) * 256
        cache = self.adapter.new_cache(capacity)
        compat.allocate_static(cache, self.cache, self.max_batch)
        for slot in self.place:
            compat.copy_row(cache, slot, self.cache, slot, self.top)
        valid = torch.zeros((self.max_batch, capacity), dtype=torch.bool, device=self.device)
        valid[:, :self.capacity] = self.valid
        self.cache, self.valid, self.capacity = cache, valid, capacity
        compat.set_length(self.cache, self.top)

    @torch.inference_mode()
    def measure_costs(self, prompt: Prompt, reps: int = 3) -> float:
        """Time a full-slot step of every width bucket (every step runs every slot, so rows do not change its
        cost); the first run of each shape is untimed (compilation, graph capture): the warm-up of a compiled
        run. Seconds spent."""
        t0 = time.perf_counter()
        self.join([prompt] * self.max_batch)
        start = self.top
        timings = []
        for width in self.buckets:
            tree = Tree.balanced(width)
            runs = []
            for _ in range(reps + 1):
                t1 = time.perf_counter()
                self.verify([tree] * self.max_batch)
                runs.append(time.perf_counter() - t1)
                self.valid[:, start:] = False  # forget the step: the next one sees the same prefix
                for state in self.slots:
                    state.length = prompt.length
                self.top = start
                compat.set_length(self.cache, start)
            timings.append(sorted(runs[1:])[len(runs[1:]) // 2])
        self.cost.set_all(timings)
        self.leave(list(range(len(self.slots))))
        return time.perf_counter() - t0
