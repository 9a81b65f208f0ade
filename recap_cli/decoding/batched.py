"""Batched decoding: several requests in flight, one forward pass per step for all of their draft trees.

The KV cache is one DynamicCache whose batch dimension holds the requests in flight, each row left-aligned: row
r's committed tokens sit at columns 0..length_r-1, and columns length_r..W-1 (W = the longest row) hold nothing
it may see. A step appends every row's tree, padded to the widest (T nodes), at columns W..W+T-1; after
verification each row's accepted path moves to columns length_r.. and the buffer is cut to the new longest row,
so a row's memory is bounded by the longest row in flight plus one tree. Keys are cached after RoPE, so a
column's index never has to equal its position: each row's positions come from its own length (+ Qwen's rope
delta). Padding nodes see only themselves and nobody sees them.

Joining requests are prefilled together (one right-padded forward pass, into a cache of their own, whose rows
are then appended); a finished one leaves. Drafting stays per row (``Drafter.fork``: per-request memories of
its own, the persistent tables shared), and the step-cost model, learned by rows x width from the steps
themselves (and probe steps, recap_cli/decoding/cost.py), sizes every row's tree for the whole step
(``batch_width``, ``RowShare``), and for the run's end once nothing will join (``Batch._bounding``,
``draining_width``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from ..adapters import Adapter, Prompt
from ..drafters import Drafter
from ..options import DEFAULT_BATCH, default_batch  # noqa: F401 - re-exported (they live where --help reads them)
from ..prefix_cache import Hit, PrefixCache, common_prefix
from . import compat
from .cost import UNKNOWN, BatchCost, OpeningCost, RowShare, batch_width, draining_width
from .engine import (Generation, accept, additive, ancestor_bits, chain_tree_seen, commit, greedy_and_rows, join_rows,
                     text_positions, tree_prompt, unpack_bits)
from .sampling import Picker, choose
from .tree import Rows, Tree, Verified


@dataclass
class Slot:
    """One row of the batch: how many of its tokens the cache holds, and where its text positions continue."""

    length: int
    rope_delta: int = 0
    images: tuple[str, ...] = ()  # its prompt's image hashes and prefill rows: what an entry of its cache needs
    rows: Rows | None = None


class BatchEngine:
    """Verifies one tree per row in one forward pass; rows join after their own prefill and leave when done."""

    def __init__(self, adapter: Adapter, top_k: int = 8, max_batch: int = 8):
        self.adapter, self.model, self.device, self.dtype = adapter, adapter.model, adapter.device, adapter.model.dtype
        self.top_k, self.max_batch = top_k, max_batch
        self._cache_kw = compat.cache_kwarg(self.model)
        self.cache = None
        self.slots: list[Slot] = []
        self.per_row = 128 if self.device.type == "cuda" else 64  # the most nodes one row's tree may have
        self.cost = BatchCost(max_batch, self.per_row)
        self.prefixes: PrefixCache | None = None  # prefix reuse across requests (off without one)
        self.hits: list[int] = []  # prompt tokens each prompt of the last join took from ``prefixes``

    @property
    def width(self) -> int:
        """Cache columns in use: the longest row (the buffer is cut to it after every change)."""
        return max((s.length for s in self.slots), default=0)

    @property
    def drafts_in_prefill(self) -> bool:
        """Whether a joining prompt can carry a draft tree (``join_trees``): see ``Adapter.drafts_in_prefill``."""
        return self.adapter.drafts_in_prefill

    def join(self, prompts: list[Prompt], want_rows: bool = False,
             pickers: list[Picker | None] | None = None) -> list[tuple[int, Rows | None]]:
        """``join_trees`` without drafts: each prompt's first token (greedy, or its picker's choice) and, if
        asked, its top-k rows at every text position."""
        trees = [Tree.root(int(p.input_ids[0, -1])) for p in prompts]
        return [(v.bonus, rows) for v, rows in self.join_trees(prompts, trees, want_rows, pickers)]

    @torch.inference_mode()
    def join_trees(self, prompts: list[Prompt], trees: list[Tree], want_rows: bool = False,
                   pickers: list[Picker | None] | None = None) -> list[tuple[Verified, Rows | None]]:
        """Prefill ``prompts`` together in one forward pass (right-padded), each with a draft tree rooted at its
        last token riding on it (the batch-1 ``Engine.prefill_tree``: an answer's first tokens accepted before any
        step), then add them as the last rows, each holding its prompt and its accepted path. Per prompt: the
        verdict on its tree (a root-only tree: the first token) and, if asked, its prompt's rows. With
        ``prefixes``, prompts that start like an earlier one prefill only their suffixes (``_reuse``)."""
        if any(len(t) > 1 for t in trees) and not self.drafts_in_prefill:
            raise ValueError(f"{self.adapter.arch} prefills under a mask of its own: no draft tree rides on it")
        if any(t.without(self.adapter.image_token_id) is not t for t in trees):
            raise ValueError("a tree at prefill holds the image placeholder: the model would take it for an image "
                             "slot (Tree.without drops it)")
        pickers = pickers or [None] * len(prompts)
        if self.prefixes is None:
            results, cache = self._prefill(prompts, trees, want_rows, pickers)
            self.hits = [0] * len(prompts)
        else:
            results, cache = self._reuse(prompts, trees, want_rows, pickers)
        self._admit(cache, prompts, [p.length + len(v.path) - 1 for p, (v, _) in zip(prompts, results)])
        for slot, prompt, (_, rows) in zip(self.slots[-len(prompts):], prompts, results):
            slot.images, slot.rows = prompt.image_keys, rows
        return results

    def _reuse(self, prompts: list[Prompt], trees: list[Tree], want_rows: bool,
               pickers: list[Picker | None]) -> tuple[list[tuple[Verified, Rows | None]], object]:
        """The joint prefill with prefix reuse, in rounds: prompts with a cached prefix extend copies of it
        (``_extend``), the others are prefilled and offer their reusable part at once. A prompt that an earlier
        prompt of this join would serve (the same image, the same text before it) waits a round to extend that
        one's prefix, rather than encode the image again. The new rows' cache comes out in prompt order."""
        results: list = [None] * len(prompts)
        self.hits = [0] * len(prompts)
        parts, todo = [], list(range(len(prompts)))
        while todo:
            found, fresh, later = {}, [], []
            for i in todo:
                prompt = prompts[i]
                hit = self.prefixes.lookup(prompt.input_ids[0], prompt.image_keys, self.adapter.image_end(prompt))
                if hit is not None:
                    found[i] = hit
                elif any(self._serves(prompts[j], prompt) for j in fresh):
                    later.append(i)
                else:
                    fresh.append(i)
            if fresh:
                out, cache = self._prefill([prompts[i] for i in fresh], [trees[i] for i in fresh], want_rows,
                                           [pickers[i] for i in fresh])
                for j, i in enumerate(fresh):
                    results[i] = out[j]
                    end = min(self.adapter.reusable_end(prompts[i]), prompts[i].length)
                    self.prefixes.offer(prompts[i].input_ids[0, :end], prompts[i].image_keys,
                                        lambda j=j, end=end: compat.row_layers(cache, j, end), out[j][1])
                parts.append((fresh, cache))
            if found:
                chosen = list(found)
                out, cache = self._extend([prompts[i] for i in chosen], [found[i] for i in chosen],
                                          [trees[i] for i in chosen], want_rows, [pickers[i] for i in chosen])
                for j, i in enumerate(chosen):
                    results[i], self.hits[i] = out[j], found[i].length
                parts.append((chosen, cache))
            todo = later
        order = [i for chosen, _ in parts for i in chosen]
        cache = parts[0][1]
        for _, more in parts[1:]:
            compat.append_rows(cache, more)
        if order != sorted(order):
            width = max(p.length + len(v.path) - 1 for p, (v, _) in zip(prompts, results))
            compat.select_rows(cache, [order.index(i) for i in range(len(prompts))], width)
        return results, cache

    def _serves(self, first: Prompt, prompt: Prompt) -> bool:
        """Whether ``first``'s reusable part, once prefilled and offered, would serve ``prompt``."""
        if first.image_keys != prompt.image_keys:
            return False
        common = min(common_prefix(first.input_ids[0], prompt.input_ids[0]), self.adapter.reusable_end(first))
        return self.prefixes.usable(common, prompt.length, self.adapter.image_end(prompt)) > 0

    def _extend(self, prompts: list[Prompt], hits: list[Hit], trees: list[Tree], want_rows: bool,
                pickers: list[Picker | None]) -> tuple[list[tuple[Verified, Rows | None]], object]:
        """Prefill each prompt's suffix over a copy of its cached prefix, all in one forward pass: row r's prefix
        at columns 0..n_r-1, its suffix a chain of text tokens (no image token is left in it) appended after the
        longest prefix like a step's tree, then its draft tree's nodes (``chain_tree_seen``); the chain and the
        accepted path are moved next to the prefix."""
        lengths = [h.length for h in hits]
        cache = self.adapter.new_cache()
        compat.load_prefixes(cache, [h.entry.layers for h in hits], lengths)
        w, dev = max(lengths), self.device
        chains = [p.length - n for p, n in zip(prompts, lengths)]
        t = max(c + len(tree) - 1 for c, tree in zip(chains, trees))
        ids, pos = [], []
        for prompt, tree, n, c in zip(prompts, trees, lengths, chains):
            row = prompt.input_ids[0, n:].tolist() + tree.tokens[1:]
            ids.append(row + [row[-1]] * (t - len(row)))
            depths = list(range(c)) + [c - 1 + d for d in tree.depths()[1:]]
            pos.append([n + prompt.rope_delta + d for d in depths] + [0] * (t - len(row)))
        ids_t, pos_t = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
        seen = torch.zeros((len(prompts), t, w + t), dtype=torch.bool, device=dev)
        sizes = torch.tensor([c + len(tree) - 1 for c, tree in zip(chains, trees)], device=dev)
        real = torch.arange(t, device=dev)[None, :] < sizes[:, None]  # (b, t): padding sees no prefix
        seen[:, :, :w] = (torch.arange(w, device=dev)[None, None, :] < torch.tensor(lengths, device=dev)[:, None, None]
                          ) & real[:, :, None]
        seen[:, :, w:] = chain_tree_seen(chains, [tree.parents for tree in trees], t, dev)
        mask = self.adapter.layer_masks(additive(seen, self.dtype)[:, None], pos_t, w)
        # Per row: its chain's rows (if asked), then the root (the chain's last) and the tree's nodes.
        needed = [list(range(0 if want_rows else c - 1, c - 1 + len(tree))) for c, tree in zip(chains, trees)]
        with compat.attention_kernels(dev):
            out = self.model(input_ids=ids_t, position_ids=pos_t, attention_mask=mask, use_cache=True,
                             logits_to_keep=torch.tensor(sorted(set().union(*needed)), device=dev),
                             **{self._cache_kw: cache})
        logits = self._kept(out.logits, needed)
        positions = [list(range(n, n + c)) if want_rows else None for n, c in zip(lengths, chains)]
        results = self._verdicts(logits, trees, [len(x) for x in needed], positions, pickers)
        results = [(v, join_rows(h.entry.rows_before(n), rows, rows.positions) if rows is not None else None)
                   for (v, rows), h, n in zip(results, hits, lengths)]
        moves = []
        for r, (n, c, (v, _)) in enumerate(zip(lengths, chains, results)):
            if n < w:  # the chain next to the prefix
                moves += [(r, w + i, n + i) for i in range(c)]
            moves += [(r, w + c - 1 + i, n + c - 1 + k) for k, i in enumerate(v.path) if k and (n < w or k != i)]
        self._move(cache, moves, max(n + c + len(v.path) - 1 for n, c, (v, _) in zip(lengths, chains, results)))
        return results, cache

    def offer_row(self, row: int, ids: list[int]) -> None:
        """Offer row ``row``'s cache (it holds ``ids``, a turn's prompt and answer) for the next turn's reuse."""
        if self.prefixes is None:
            return
        slot = self.slots[row]
        n = min(slot.length, len(ids))
        self.prefixes.offer(torch.tensor(ids[:n]), slot.images, lambda: self._row_layers(row, n), slot.rows)

    def _row_layers(self, row: int, n: int):
        return compat.row_layers(self.cache, row, n)

    def _prefill(self, prompts: list[Prompt], trees: list[Tree], want_rows: bool,
                 pickers: list[Picker | None]) -> tuple[list[tuple[Verified, Rows | None]], object]:
        """The joint prefill: each prompt's verdict and rows, and the new rows' own cache. Row r's prompt sits
        at columns 0..L_r-1, its tree's node i at L_r-1+i, its accepted path is moved next to its prompt."""
        drafted = any(len(t) > 1 for t in trees)
        inputs = self._tree_inputs(prompts, trees) if drafted else self.adapter.batch_inputs(prompts)
        # Positions whose logits each row needs (a 7B vocabulary at every position is gigabytes): its prompt's
        # (if asked), then the root (its last) and its tree's nodes.
        needed = [self._needed(p, want_rows) + [p.length - 1 + i for i in range(1, len(t))]
                  for p, t in zip(prompts, trees)]
        cache = self.adapter.new_cache()
        with compat.attention_kernels(self.device):
            out = self.model(**inputs, use_cache=True, logits_to_keep=torch.tensor(sorted(set().union(*needed)),
                                                                                   device=self.device),
                             **{self._cache_kw: cache})
        logits = self._kept(out.logits, needed)
        positions = [x[:len(x) - len(t) + 1] if want_rows else None for x, t in zip(needed, trees)]
        results = self._verdicts(logits, trees, [len(x) for x in needed], positions, pickers)
        if drafted:
            moves = [(r, p.length - 1 + i, p.length - 1 + k) for r, (p, (v, _)) in enumerate(zip(prompts, results))
                     for k, i in enumerate(v.path) if k != i]
            self._move(cache, moves, max(p.length + len(v.path) - 1 for p, (v, _) in zip(prompts, results)))
        return results, cache

    def _tree_inputs(self, prompts: list[Prompt], trees: list[Tree]) -> dict:
        """The joint prefill's inputs with every prompt's tree after it (``tree_prompt``), right-padded, under a
        4-D mask (``chain_tree_seen``) and explicit positions (padding at 0)."""
        whole = [tree_prompt(p, t, self.adapter.token_inputs) for p, t in zip(prompts, trees)]
        inputs = self.adapter.batch_inputs([w for w, _ in whole])  # ids, per-token and image inputs; positions below
        width, dev = inputs["input_ids"].shape[1], self.device
        rows = [pos[:, 0] if pos.dim() == 3 else pos for _, pos in whole]  # (3, L+e) or (1, L+e)
        if len({r.shape[0] for r in rows}) > 1:  # M-RoPE beside a text-only row: its positions, equal on all 3
            rows = [r.expand(3, -1) for r in rows]
        pads = [torch.nn.functional.pad(r, (0, width - r.shape[-1])) for r in rows]  # padding at 0
        inputs["position_ids"] = torch.stack(pads, dim=1) if rows[0].shape[0] == 3 else torch.cat(pads)
        seen = chain_tree_seen([p.length for p in prompts], [t.parents for t in trees], width, dev)
        inputs["attention_mask"] = additive(seen, self.dtype)[:, None]
        return inputs

    def _kept(self, logits: torch.Tensor, needed: list[list[int]]) -> torch.Tensor:
        """The logits at each row's ``needed`` positions, row after row (the forward kept the union's)."""
        column = {c: j for j, c in enumerate(sorted(set().union(*needed)))}
        rows_of = torch.tensor([r for r, cols in enumerate(needed) for _ in cols], device=self.device)
        cols_of = torch.tensor([column[c] for cols in needed for c in cols], device=self.device)
        return logits[rows_of, cols_of]

    def _verdicts(self, logits: torch.Tensor, trees: list[Tree], counts: list[int], positions: list[list[int] | None],
                  pickers: list[Picker | None]) -> list[tuple[Verified, Rows | None]]:
        """Each row's accepted path and prompt rows from its ``counts[r]`` kept logits (its prompt's rows asked
        for, then its tree's root and nodes): greedy, or its picker's choice node by node."""
        argmax, rows = greedy_and_rows(logits, self.top_k)
        results, at = [], 0
        for tree, count, where, picker in zip(trees, counts, positions, pickers):
            root, end = at + count - len(tree), at + count
            if picker is None:
                mine, node_rows = argmax[root:end], Rows(ids=rows.ids[root:end], probs=rows.probs[root:end])
            else:  # its own rule, the prompt its whole history
                mine, node_rows = choose(logits[root:end], [tree], [picker], self.top_k)
            path = accept(tree, mine)
            mine_rows = None
            if where is not None:  # the prompt's, the root's included (its last position)
                mine_rows = Rows(ids=rows.ids[at:root + 1], probs=rows.probs[at:root + 1], positions=where)
            results.append((Verified(path=path, bonus=mine[path[-1]], argmax=mine, rows=node_rows), mine_rows))
            at = end
        return results

    def _move(self, cache, moves: list[tuple[int, int, int]], width: int) -> None:
        """Apply (row, from column, to column) moves to the new rows' cache and cut it to ``width``."""
        moves_t = [torch.tensor(x, device=self.device) for x in zip(*moves)] if moves else [None] * 3
        compat.move_paths(cache, *moves_t, width)

    def _admit(self, cache, prompts: list[Prompt], lengths: list[int]) -> None:
        """The prefilled rows join, appended after the rows in flight, each holding ``lengths[r]`` tokens (its
        prompt and the path its tree had accepted)."""
        if self.cache is None:
            self.cache = cache
        else:
            compat.append_rows(self.cache, cache)
        self.slots += [Slot(n, p.rope_delta) for p, n in zip(prompts, lengths)]

    def _needed(self, prompt: Prompt, want_rows: bool) -> list[int]:
        """The prompt positions whose predictions a joining row needs, ending with its last (the first new
        token): with ``want_rows`` every text position (image placeholders are never keys a drafter meets)."""
        if not want_rows:
            return [prompt.length - 1]
        return text_positions(prompt.input_ids[0], self.adapter.image_token_id).tolist()

    def leave(self, rows: list[int]) -> None:
        """Drop these rows (indices into the batch) and their cache."""
        gone = set(rows)
        if not gone:
            return
        keep = [i for i in range(len(self.slots)) if i not in gone]
        self.slots = [self.slots[i] for i in keep]
        if not keep:
            self.cache = None
            return
        compat.select_rows(self.cache, keep, self.width)

    @torch.inference_mode()
    def verify(self, trees: list[Tree], pickers: list[Picker | None] | None = None) -> list[Verified]:
        """Evaluate every row's tree in one forward pass; accept each row's longest path of chosen tokens (greedy,
        or its picker's); compact."""
        t0 = time.perf_counter()
        sizes = [len(t) for t in trees]
        ids, pos, mask = self.step_inputs(trees)
        b, t = ids.shape
        with compat.attention_kernels(self.device):
            out = self._forward(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                                **{self._cache_kw: self.cache})
        logits = out.logits.reshape(b * t, -1)
        batch_rows = self._batch_rows()
        if batch_rows != list(range(b)) or any(n < t for n in sizes):  # padding's logits never leave the device
            logits = logits[torch.tensor([batch_rows[r] * t + i for r, n in enumerate(sizes) for i in range(n)],
                                         device=logits.device)]
        if pickers is None or not any(pickers):
            argmax, rows = greedy_and_rows(logits, self.top_k)
        else:
            argmax, rows = choose(logits, trees, pickers, self.top_k)
        verified, start = [], 0
        for tree, n in zip(trees, sizes):
            mine = argmax[start:start + n]
            path = accept(tree, mine)
            verified.append(Verified(path=path, bonus=mine[path[-1]], argmax=mine,
                                     rows=Rows(ids=rows.ids[start:start + n], probs=rows.probs[start:start + n])))
            start += n
        self._keep([v.path for v in verified])
        self.cost.observe(b, t, time.perf_counter() - t0)  # the host copy above waited for the device
        return verified

    def _forward(self, **inputs):
        return self.model(**inputs)

    def _batch_rows(self) -> list[int]:
        """The row of the forward pass's batch that each request in flight occupies."""
        return list(range(len(self.slots)))

    def step_inputs(self, trees: list[Tree]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(B, T) token ids and positions and the (B, 1, T, W + T) additive mask of one step.

        Row r's node i sees row r's committed columns (< length_r), its tree ancestors and itself."""
        b, t, w = len(trees), max(len(tr) for tr in trees), self.width
        ids, depths = zip(*(tree.padded(t) for tree in trees))
        base = torch.tensor([[s.length + s.rope_delta] for s in self.slots], device=self.device)
        pos = torch.tensor(depths, device=self.device) + base
        ids_t = torch.tensor(ids, device=self.device)
        if b == 1 and t == 1 and self.slots[0].length == w:
            return ids_t, pos, None  # one token of one row sees everything cached: no mask needed
        # Built where it is used: on a GPU the mask (rows x nodes x positions) is megabytes, the trees' blocks are not.
        dev = self.device
        lengths = torch.tensor([s.length for s in self.slots], device=dev)
        mask = torch.full((b * t, w + t), torch.finfo(self.dtype).min, dtype=self.dtype, device=dev)
        committed = torch.arange(w, device=dev)[None, :] < lengths.repeat_interleave(t)[:, None]
        mask[:, :w].masked_fill_(committed, 0.0)
        mask = mask.view(b, 1, t, w + t)
        mask[:, 0, :, w:].masked_fill_(padded_ancestors(trees, t).to(dev), 0.0)
        return ids_t, pos, self.adapter.layer_masks(mask, pos, w)

    def _keep(self, paths: list[list[int]]) -> None:
        """Move each row's accepted path from the step's columns to the end of its committed tokens."""
        w = self.width
        rows, src, dst = [], [], []
        for r, (slot, path) in enumerate(zip(self.slots, paths)):
            if not (slot.length == w and path == list(range(len(path)))):  # already in place: a cut suffices
                rows.extend([r] * len(path))
                src.extend(w + i for i in path)
                dst.extend(range(slot.length, slot.length + len(path)))
            slot.length += len(path)
        moves = [torch.tensor(x, device=self.device) for x in (rows, src, dst)] if rows else [None] * 3
        compat.move_paths(self.cache, *moves, self.width)

    @torch.inference_mode()
    def measure_costs(self, prompt: Prompt, reps: int = 3) -> float:
        """Time a step of every (rows, width) of the cost grid on this prompt's prefix (median of ``reps``;
        one run where a step takes over 50 ms), for benchmarks: a run learns its costs from its own steps.
        Seconds spent; the batch is left empty."""
        t0 = time.perf_counter()
        assert not self.slots, "measure before any request joins"
        for rows, curve in self.cost.by_rows.items():
            self.join([prompt] * (rows - len(self.slots)))
            timings = []
            for width in curve.sizes:
                tree = Tree.balanced(width)
                runs: list[float] = []
                while len(runs) < reps and (not runs or runs[0] < 0.05):
                    t1 = time.perf_counter()
                    self.verify([tree] * rows)
                    runs.append(time.perf_counter() - t1)
                    for slot in self.slots:  # forget the step: the next one sees the same prefix
                        slot.length = prompt.length
                    compat.move_paths(self.cache, None, None, None, prompt.length)
                timings.append(sorted(runs)[len(runs) // 2])
            curve.set(timings)
        self.cost.probes.reset()
        self.leave(list(range(len(self.slots))))
        return time.perf_counter() - t0


def padded_ancestors(trees: list[Tree], width: int) -> torch.Tensor:
    """(len(trees), width, width) booleans: each tree's ``ancestors``, padded to ``width`` nodes (a padding node
    sees only itself), every tree's rows unpacked together."""
    bits = [row for tree in trees for row in ancestor_bits(tree.parents, width)]
    return unpack_bits(bits, width).view(len(trees), width, width)


# A joint prefill pads every prompt to the group's longest: a row pays at most PAD_FACTOR times its own length
# (prompts under PAD_FLOOR tokens count as PAD_FLOOR: that short, one pass costs about the same whatever the
# length, and fewer passes are what saves time).
PAD_FACTOR, PAD_FLOOR = 2.0, 64


def length_groups(lengths: list[int], factor: float = PAD_FACTOR, floor: int = PAD_FLOOR) -> list[list[int]]:
    """Indices of prompts grouped for joint prefills: in each group the longest is at most ``factor`` times the
    shortest (both held to at least ``floor``), in as few groups as that allows (cut greedily along the sorted
    lengths). Groups come in the order of their first prompt, each in input order."""
    groups: list[list[int]] = []
    shortest = 0.0
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        size = max(lengths[i], floor)
        if not groups or size > factor * shortest:
            groups.append([])
            shortest = size
        groups[-1].append(i)
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


@dataclass
class Flight:
    """One request turn decoding in the batch."""

    tag: Hashable
    drafter: Drafter
    context: list[int]
    max_new_tokens: int
    gen: Generation = field(default_factory=Generation)
    last: int = 1  # tokens its last step emitted: rows that emit more draft first (they set the width)
    resting: int = 0  # steps left without drafting
    drafted: bool = False  # its tree of this step was drafted (not a rest)
    pause: int = 1  # how long the next rest lasts
    chances: list[float] = field(default_factory=list)  # path chances its last growth placed, best first
    picker: Picker | None = None  # its token-choice rule when not plain greedy


MAX_REST = 32  # steps a row whose trees keep being cut to the root goes without drafting, at most
TRUST_RATE = 0.1  # how fast the batch learns what the rows' guesses are worth
# What the rows' guesses can turn out to be worth, at least and at most. Above 1 where rows deliver more than their
# last trees guessed: a row's guess ends one node past where its last growth stopped paying at that step's width
# (``RowShare.grown_chances``), so at a wider step it fills nodes that were never guessed (the demo's sets and
# held-out scenes at batch 16: 1.26-1.38 drafted tokens accepted per guessed one before that node was guessed;
# docs/benchmarks.md, thirty-third session). Held at 1, the trust could only fall.
TRUST_RANGE = (0.05, 2.0)
YIELD_RATE = 0.1  # how fast the batch learns the tokens a drafting row emits per step
PROBE_WAIT = 16  # busy steps a probe due waits for a quiet one, at most (``Batch._probe``)
Outcome = tuple[Hashable, "Generation | Exception"]  # a turn that left the batch: its tag and result


def learned_trust(trust: float, guessed: float, drafted: int) -> float:
    """The batch's trust after a step whose width was chosen for ``guessed`` drafted tokens and that accepted
    ``drafted``: a moving average of the two's ratio, within TRUST_RANGE."""
    low, high = TRUST_RANGE
    return min(high, max(low, trust + TRUST_RATE * (drafted / guessed - trust)))


class Batch:
    """Continuous batching: up to ``size`` turns decode together; ``add`` prefills turns together into free
    rows, ``step`` advances every row by one verification and returns the turns that ended (or failed)."""

    def __init__(self, engine: BatchEngine, drafter: Drafter, size: int,
                 on_step: Callable[[int], None] | None = None, keeps: Callable[[Hashable], bool] | None = None):
        self.engine, self.drafter, self.size = engine, drafter, size
        self.eos = engine.adapter.eos_token_ids
        self.flights: list[Flight] = []
        self.on_step = on_step  # told the rows of every step (occupancy statistics)
        self.keeps = keeps  # keeps(tag): that turn's conversation goes on; its cache is offered when it leaves
        self.pause = 1  # the rest a joining turn starts from: the last one to leave had reached it
        # Realized / guessed drafted tokens of the steps whose width the rows' last trees chose (``learned_trust``):
        # a row's next tree is not its last, grown for another width.
        self.trust, self._guessed = 1.0, 0.0
        # Joining rows' first trees ride on the joint prefill (a drafter that drafts there, an engine that can):
        # what such a tree costs and earns.
        self.early = drafter.drafts_at_prefill and engine.drafts_in_prefill
        self.opening = OpeningCost(engine.per_row)
        # Set by whoever feeds the batch. ``draining``: no turn will join before every row has ended, so the run
        # lasts as long as its slowest row (``_bounding``). ``busy``: other work shares the cores (the next turns
        # being prepared); ``_draft`` reads it once a step into ``cost.busy`` where the forward pass runs on those
        # cores (a CPU's), and only there is a step's timing an upper bound and a due probe put off (``_probe``).
        self.draining = False
        self.busy = False
        self._waited = 0  # busy steps the probe due has waited
        self.yields = 1.0  # tokens a drafting row emits per step (moving average over the batch's steps)

    def __len__(self) -> int:
        return len(self.flights)

    def add(self, turns: list[tuple]) -> list[Outcome]:
        """Prefill these turns, (tag, prompt, max new tokens[, picker]), and let them join (at most the free rows),
        those of like prompt lengths together (``length_groups``: one long prompt prefills alone, never padding the
        short ones to its length). Turns whose first token already ends them leave at once, and are returned; so
        are turns that failed. If a joint prefill fails (one huge input out of memory), each of its turns is
        tried alone, so only the
        culprit fails."""
        if len(turns) > self.size - len(self.flights):
            raise ValueError(f"{len(turns)} turns cannot join: {self.size - len(self.flights)} rows are free")
        if not turns:
            return []
        groups = length_groups([prompt.length for _, prompt, *_ in turns])
        return [out for group in groups for out in self._add_group([turns[i] for i in group])]

    def _add_group(self, turns: list[tuple]) -> list[Outcome]:
        try:
            return self._join(turns)
        except Exception as exc:  # noqa: BLE001 - see add()
            if len(turns) == 1:
                return [(turns[0][0], exc)]
            return [out for turn in turns for out in self._add_group([turn])]

    def _join(self, turns: list[tuple]) -> list[Outcome]:
        for _, _, limit, *_ in turns:
            if limit < 1:
                raise ValueError("max_new_tokens must be at least 1")
        pickers = [picker[0] if picker else None for _, _, _, *picker in turns]
        for (_, prompt, *_), picker in zip(turns, pickers):
            if picker is not None:
                picker.start(prompt.input_ids[0])
        chosen = {"pickers": pickers} if any(pickers) else {}  # plain greedy calls stay as they always were
        flights = [Flight(tag, self.drafter.fork(), prompt.input_ids[0].tolist(), limit,
                          Generation(prompt_tokens=prompt.length), pause=self.pause, picker=picker)
                   for (tag, prompt, limit, *_), picker in zip(turns, pickers)]
        start = len(self.flights)
        early = self.early
        failed: dict[int, Exception] = {}
        trees = [self._opening(i, flight, failed) if early else Tree.root(flight.context[-1])
                 for i, flight in enumerate(flights, start)]
        t0 = time.perf_counter()
        try:
            joined = self.engine.join_trees([prompt for _, prompt, *_ in turns], trees,
                                            want_rows=self.drafter.wants_prefill_rows, **chosen)
        except Exception:
            for flight in flights:  # these turns never ran (``add`` retries each alone, with a new drafter)
                flight.drafter.withdraw()
            raise
        seconds = time.perf_counter() - t0
        prefill_s = seconds / len(turns)  # each turn's share of the joint prefill
        self.flights += flights
        hits = self.engine.hits if len(self.engine.hits) == len(turns) else [0] * len(turns)
        if early:
            self.opening.observe_prefill(sum(p.length - hit + len(tree) - 1 for (_, p, *_), hit, tree in
                                             zip(turns, hits, trees)), seconds)
        ended = []
        for i, flight, tree, (verified, rows), hit in zip(range(start, len(self.flights)), flights, trees, joined,
                                                        hits):
            flight.gen.prefill_s += prefill_s
            flight.gen.prefix_hit = hit
            if i in failed:
                continue
            t1 = time.perf_counter()
            try:
                if early:
                    flight.drafter.prompt_rows(flight.context, rows)
                    flight.drafter.observe(tree, verified)
                else:
                    flight.drafter.start(flight.context, rows)
            except Exception as exc:  # noqa: BLE001 - one turn's failure is its own
                failed[i] = exc
                continue
            flight.gen.prefill_s += time.perf_counter() - t1  # the drafter's set-up belongs to the turn's
            added, done = commit(flight.gen, tree, verified, self.eos, flight.max_new_tokens, step=False)
            flight.gen.prefill_tokens, flight.gen.prefill_nodes = len(added), len(tree)
            flight.context.extend(added)
            if flight.picker is not None:
                flight.picker.extend(added)
            if done:
                ended.append(i)
        return self._leave(sorted(ended + list(failed)), failed)

    def _opening(self, i: int, flight: Flight, failed: dict[int, Exception]) -> Tree:
        """A joining turn's first tree, drafted before its prompt runs and verified by its prefill (as at batch
        1, decoding/engine.py ``generate``). Its nodes are tokens of a pass that runs anyway, so it is sized by
        what a prefill token costs against what a step spends per token (``OpeningCost``), not as a step's tree:
        none before the run has timed both."""
        drafter, context = flight.drafter, flight.context
        try:
            t0 = time.perf_counter()
            drafter.start(context, None)  # the drafter's set-up belongs to the turn's prefill, as at batch 1
            flight.gen.prefill_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            if drafter.wants_costs:
                if not self.opening.known:
                    return drafter.rest(context)
                self.opening.host_s = self.engine.cost.host_per_node
                drafter.cost = self.opening
            return drafter.propose(context, flight.max_new_tokens - 1).without(self.engine.adapter.image_token_id)
        except Exception as exc:  # noqa: BLE001 - one turn's failure is its own; it joins, then leaves
            failed[i] = exc
            return Tree.root(context[-1])
        finally:
            flight.gen.draft_s += time.perf_counter() - t0

    def step(self) -> list[Outcome]:
        """One verification of every row. A row whose host work raises (its drafter, its bookkeeping) leaves
        with the exception as its result; the others go on unchanged. A forward pass that raises (out of memory
        as the rows' caches grow) fails every row it verified, as a failed decode fails its request at batch 1:
        the run goes on with the next requests, never ends on the batch's shared step (``_verify_or_fail``)."""
        failed: dict[int, Exception] = {}
        started = time.perf_counter()
        trees, draft_s = self._draft(failed)
        out = self._leave(sorted(failed), failed)
        if not self.flights:
            self.engine.cost.probing = False  # a probe no row is left to take is none
            return out
        trees = [t for i, t in enumerate(trees) if i not in failed]
        draft_s = [d for i, d in enumerate(draft_s) if i not in failed]
        t0 = time.perf_counter()
        verified = self._verify_or_fail(trees)
        if isinstance(verified, Exception):
            everyone = list(range(len(self.flights)))
            return out + self._leave(everyone, dict.fromkeys(everyone, verified))
        verify_s = time.perf_counter() - t0
        if self.on_step is not None:
            self.on_step(len(self.flights))
        if self._guessed > 0:
            drafted = sum(len(v.path) - 1 for v in verified)
            self.trust = learned_trust(self.trust, self._guessed, drafted)
        ended, failed = [], {}
        for i, (flight, tree, v) in enumerate(zip(self.flights, trees, verified)):
            try:
                t1 = time.perf_counter()
                flight.drafter.observe(tree, v)
                spent = draft_s[i] + time.perf_counter() - t1
                if flight.drafted:  # a resting row's bookkeeping is no drafting work per node
                    self.engine.cost.observe_host(len(tree), spent)
                flight.gen.draft_s += spent
                flight.gen.verify_s += verify_s  # the shared forward pass is part of every row's latency
                added, done = commit(flight.gen, tree, v, self.eos, flight.max_new_tokens)
                flight.context.extend(added)
                if flight.picker is not None:
                    flight.picker.extend(added)
                flight.last = len(added)
            except Exception as exc:  # noqa: BLE001 - one row's failure must not end the others
                failed[i] = exc
                continue
            if done:
                ended.append(i)
        if self.early:
            self.opening.observe_step(sum(f.last for i, f in enumerate(self.flights) if i not in failed),
                                      time.perf_counter() - started)
        drafting = [f.last for i, f in enumerate(self.flights) if f.drafted and i not in failed]
        if drafting:
            self.yields += YIELD_RATE * (sum(drafting) / len(drafting) - self.yields)
        return out + self._leave(sorted(ended + list(failed)), failed)

    def _verify_or_fail(self, trees: list[Tree]) -> list[Verified] | Exception:
        """The step's verdicts, or the exception its forward pass raised: that is every row's result. No row can
        go on: the pass may have written some layers' cache columns and not others; every row leaving empties
        the cache (``BatchEngine.leave``), so the next turns join a clean one."""
        pickers = [f.picker for f in self.flights]
        try:
            return self.engine.verify(trees, pickers) if any(pickers) else self.engine.verify(trees)
        except Exception as exc:  # noqa: BLE001 - see step()
            self.engine.cost.probing = False  # a probe that never ran measured nothing
            return exc

    def _draft(self, failed: dict[int, Exception]) -> tuple[list[Tree], list[float]]:
        """Every row's tree. The step's width is chosen first, for all rows together, from the chances each
        row's last growth placed (``batch_width``); then rows draft, those that emitted most last step first,
        each sized for the whole step (``RowShare``): free up to the width so far, paying beyond it.

        A resting row (its last tree was cut to its root) drafts only in a step that is wide anyway: the width
        counts every row's last guess, resting or not, so rows that together pay for a wider step wake up
        together. A probe step (the cost model re-testing a width it believes unprofitable) sets the width
        itself (a busy batch puts it off: ``_probe``); a draining one takes none: a probe buys knowledge for the
        steps after it, and there nothing joins and the run ends with its slowest row (SmolLM2's 16 prompts at
        batch 16, which drain from their first step: five probes of width 2-4 added a second to ar's 15, and
        shortened nothing). Before the first step nothing is known about costs: no row drafts (it would be thrown
        away). In a draining batch only the rows that bound the run draft (``_bounding``)."""
        n = len(self.flights)
        bounding = self._bounding()
        trees: list[Tree] = [Tree.root(f.context[-1]) for f in self.flights]
        seconds = [0.0] * n
        width, self._guessed, sized = 1, 0.0, self.drafter.wants_costs
        cost = self.engine.cost
        # A busy step's timing is an upper bound (``BatchCost.observe``), where the preparation's threads share the
        # cores the forward pass runs on: a CPU's.
        cost.busy = self.busy and self.engine.device.type == "cpu"
        if sized:
            probe = self._probe(cost)
            if probe is not None:
                cost.probing, width = True, probe
            elif cost.forward_table(n)[1] == UNKNOWN:  # the first step: an ``ar`` step, timed
                sized = False
            else:
                chances = [f.chances if bound else [] for f, bound in zip(self.flights, bounding)]
                width = (draining_width(cost, chances, bounding, self.trust) if self.draining else
                         batch_width(cost, chances, self.trust))
                self._guessed = sum(sum(c[:width - 1]) for c in chances)
        expected, nodes = 0.0, 0
        for rank, i in enumerate(sorted(range(n), key=lambda j: -self.flights[j].last)):
            flight = self.flights[i]
            t0 = time.perf_counter()
            share = None
            flight.drafted = not (flight.drafter.wants_costs and
                                  (not sized or not bounding[i] or flight.resting and width == 1))
            try:
                if not flight.drafted:
                    flight.resting -= flight.resting > 0
                    trees[i] = flight.drafter.rest(flight.context)
                elif flight.drafter.wants_costs:
                    rest = n - rank - 1  # rows still to draft: counted as their root alone
                    share = RowShare(cost, n, width, expected + rest, nodes + rest)
                    flight.drafter.cost = share
                    trees[i] = flight.drafter.propose(flight.context, self._room(flight))
                    flight.chances = share.grown_chances()
                    self._pace(flight, share.cut_to_root())
                else:
                    trees[i] = flight.drafter.propose(flight.context, self._room(flight))
            except Exception as exc:  # noqa: BLE001 - see step()
                failed[i] = exc
            seconds[i] = time.perf_counter() - t0
            width = max(width, len(trees[i]))
            expected += share.chosen_expected() if share is not None else 1.0
            nodes += len(trees[i])
        return trees, seconds

    def _probe(self, cost: BatchCost) -> int | None:
        """The width a probe due steps at now, or None. A draining batch takes none; one whose step shares the
        cores with other work (``cost.busy``: the preparation's threads, on a CPU's forward pass) puts it off, up
        to PROBE_WAIT steps (work that never idles cannot put re-testing off for good). A fresh run's first steps
        share 2 cores with the look-ahead's images and processor runs: 14-81 ms where quiet ones took 6-10, and
        its first width-2 probe, 20-50 ms (7-10 quiet), was believed whole: nothing was drafted until the next
        probe, ten steps on (docs/benchmarks.md, thirty-first session). A GPU's pass does not share those cores:
        it probes when due."""
        probe = None if self.draining else cost.probe()
        if probe is None:
            return None
        if cost.busy and self._waited < PROBE_WAIT:
            self._waited += 1
            return None
        self._waited = 0
        return probe

    def _bounding(self) -> list[bool]:
        """Which rows may bound a draining batch's run: it ends when its last row does, so a token drafted for a
        row that ends sooner anyway shortens nothing (it only lets that row leave a step earlier: one row's share
        of a step, where a wider step costs every row). The row with the most tokens left to its limit needs
        about ``room / yields`` more steps while it drafts; a row whose whole room, one token a step, fits in
        that does not draft. Re-decided every step: a bounding row that ends early (its answer's end) hands the
        bound on, and the rows with the most room are always among those that may, so nothing locks drafting out
        (a probe still re-tests widths the costs ruled out). Rows ending by their answer's end rather than their
        limit make room an upper bound: they may rest a step or two more than they needed to."""
        if not self.draining:
            return [True] * len(self.flights)
        rooms = [self._room(f) for f in self.flights]
        most = max(rooms, default=0)
        return [room * self.yields >= most for room in rooms]

    @staticmethod
    def _room(flight: Flight) -> int:
        return flight.max_new_tokens - len(flight.gen.tokens) - 1

    @staticmethod
    def _pace(flight: Flight, cut_to_root: bool) -> None:
        """A row whose cost-sized tree was cut to its root rests (drafts nothing, costs no drafting) for 1, 2,
        4, ... up to MAX_REST steps before it drafts again, and a turn joining the batch starts where the last
        one to leave had got to: at a wide batch a node seldom pays for a wider forward pass, and drafting only
        to throw the tree away is host time every row of the step waits for."""
        if cut_to_root:
            flight.resting, flight.pause = flight.pause, min(2 * flight.pause, MAX_REST)
        else:
            flight.pause = 1

    def _leave(self, rows: list[int], failed: dict[int, Exception] | None = None) -> list[Outcome]:
        """Rows that are done (or failed) leave the batch; their outcomes, in row order."""
        failed = failed or {}
        out = [(self.flights[i].tag, failed.get(i, self.flights[i].gen)) for i in rows]
        if rows:
            self.pause = self.flights[rows[-1]].pause
        for i in rows:
            if i not in failed:
                self.flights[i].drafter.end(self.flights[i].context)
            if self.keeps is not None and i not in failed and self.keeps(self.flights[i].tag):
                self.engine.offer_row(i, self.flights[i].context)
        self.engine.leave(rows)
        gone = set(rows)
        self.flights = [f for i, f in enumerate(self.flights) if i not in gone]
        return out
