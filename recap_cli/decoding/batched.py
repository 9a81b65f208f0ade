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
(``batch_width``, ``RowShare``).
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
from .cost import UNKNOWN, BatchCost, RowShare, batch_width
from .engine import Generation, accept, commit, first_token, greedy_and_rows, join_rows, text_positions
from .sampling import Picker, choose
from .tree import Rows, Source, Tree, Verified


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

    @torch.inference_mode()
    def join(self, prompts: list[Prompt], want_rows: bool = False,
             pickers: list[Picker | None] | None = None) -> list[tuple[int, Rows | None]]:
        """Prefill ``prompts`` together in one forward pass (right-padded), then add them as the last rows;
        each one's first token (greedy, or its picker's choice) and, if asked, its top-k rows at every text
        position. With ``prefixes``, prompts that start like an earlier one prefill only their suffixes
        (``_reuse``)."""
        if self.prefixes is None:
            results, cache = self._prefill(prompts, want_rows, pickers)
            self.hits = [0] * len(prompts)
        else:
            results, cache = self._reuse(prompts, want_rows, pickers)
        self._admit(cache, prompts)
        for slot, prompt, (_, rows) in zip(self.slots[-len(prompts):], prompts, results):
            slot.images, slot.rows = prompt.image_keys, rows
        return results

    def _reuse(self, prompts: list[Prompt], want_rows: bool,
               pickers: list[Picker | None] | None = None) -> tuple[list[tuple[int, Rows | None]], object]:
        """The joint prefill with prefix reuse, in rounds: prompts with a cached prefix extend copies of it
        (``_extend``), the others are prefilled and offer their reusable part at once. A prompt that an earlier
        prompt of this join would serve (the same image, the same text before it) waits a round to extend that
        one's prefix, rather than encode the image again. The new rows' cache comes out in prompt order."""
        results: list = [None] * len(prompts)
        pickers = pickers or [None] * len(prompts)
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
                out, cache = self._prefill([prompts[i] for i in fresh], want_rows, [pickers[i] for i in fresh])
                for j, i in enumerate(fresh):
                    results[i] = out[j]
                    end = min(self.adapter.reusable_end(prompts[i]), prompts[i].length)
                    self.prefixes.offer(prompts[i].input_ids[0, :end], prompts[i].image_keys,
                                        lambda j=j, end=end: compat.row_layers(cache, j, end), out[j][1])
                parts.append((fresh, cache))
            if found:
                chosen = list(found)
                out, cache = self._extend([prompts[i] for i in chosen], [found[i] for i in chosen], want_rows,
                                          [pickers[i] for i in chosen])
                for j, i in enumerate(chosen):
                    results[i], self.hits[i] = out[j], found[i].length
                parts.append((chosen, cache))
            todo = later
        order = [i for chosen, _ in parts for i in chosen]
        cache = parts[0][1]
        for _, more in parts[1:]:
            compat.append_rows(cache, more)
        if order != sorted(order):
            compat.select_rows(cache, [order.index(i) for i in range(len(prompts))], max(p.length for p in prompts))
        return results, cache

    def _serves(self, first: Prompt, prompt: Prompt) -> bool:
        """Whether ``first``'s reusable part, once prefilled and offered, would serve ``prompt``."""
        if first.image_keys != prompt.image_keys:
            return False
        common = min(common_prefix(first.input_ids[0], prompt.input_ids[0]), self.adapter.reusable_end(first))
        return self.prefixes.usable(common, prompt.length, self.adapter.image_end(prompt)) > 0

    def _extend(self, prompts: list[Prompt], hits: list[Hit], want_rows: bool,
                pickers: list[Picker | None]) -> tuple[list[tuple[int, Rows | None]], object]:
        """Prefill each prompt's suffix over a copy of its cached prefix, all in one forward pass: row r's prefix
        at columns 0..n_r-1, its suffix a chain of text tokens (no image token is left in it) appended after the
        longest prefix like a step's tree, every node kept and moved next to its prefix."""
        lengths = [h.length for h in hits]
        cache = self.adapter.new_cache()
        compat.load_prefixes(cache, [h.entry.layers for h in hits], lengths)
        w, dev = max(lengths), self.device
        chains = [p.input_ids[0, n:] for p, n in zip(prompts, lengths)]
        sizes = [c.numel() for c in chains]
        b, t = len(prompts), max(sizes)
        ids = torch.stack([torch.nn.functional.pad(c, (0, t - c.numel()), value=int(c[-1])) for c in chains])
        start = torch.tensor([n + p.rope_delta for p, n in zip(prompts, lengths)], device=dev)
        steps = torch.arange(t, device=dev)
        pos = start[:, None] + steps[None]
        # Node i of row r sees row r's prefix (columns < n_r), chain nodes 0..i, itself; padding only itself.
        real = steps[None, :] < torch.tensor(sizes, device=dev)[:, None]  # (b, t)
        seen = torch.zeros((b, t, w + t), dtype=torch.bool, device=dev)
        seen[:, :, :w] = (torch.arange(w, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None])[:, None]
        seen[:, :, :w] &= real[:, :, None]
        causal = steps[None, :] <= steps[:, None]  # (t, t): node i sees nodes j <= i
        seen[:, :, w:] = (causal[None] & real[:, None, :] & real[:, :, None]) | torch.eye(t, dtype=torch.bool,
                                                                                            device=dev)[None]
        mask = torch.zeros(seen.shape, dtype=self.dtype, device=dev).masked_fill_(~seen, torch.finfo(self.dtype).min)
        mask = self.adapter.layer_masks(mask[:, None], pos, w)
        needed = [list(range(n)) if want_rows else [n - 1] for n in sizes]
        keep = sorted(set().union(*needed))
        column = {c: j for j, c in enumerate(keep)}
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                         logits_to_keep=torch.tensor(keep, device=dev), **{self._cache_kw: cache})
        rows_of = torch.tensor([r for r, cols in enumerate(needed) for _ in cols], device=dev)
        cols_of = torch.tensor([column[c] for cols in needed for c in cols], device=dev)
        argmax, rows = greedy_and_rows(out.logits[rows_of, cols_of], self.top_k)
        results, at = [], 0
        for prompt, picker, hit, n, size, cols in zip(prompts, pickers, hits, lengths, sizes, needed):
            last = at + len(cols) - 1  # the prompt's last token: its logits choose the first new one
            first = argmax[last]
            if picker is not None:  # its own rule, the prompt its whole history
                first = first_token(out.logits[rows_of[last], cols_of[last]][None], prompt, picker, self.top_k)
            mine = None
            if want_rows:
                mine = join_rows(hit.entry.rows_before(n), Rows(ids=rows.ids[at:at + size],
                                                                probs=rows.probs[at:at + size]),
                                 list(range(n, n + size)))
            results.append((first, mine))
            at += len(cols)
        moves = [(r, w + i, n + i) for r, (n, size) in enumerate(zip(lengths, sizes)) if n < w for i in range(size)]
        moves = [torch.tensor(x, device=dev) for x in zip(*moves)] if moves else [None] * 3
        compat.move_paths(cache, *moves, max(n + size for n, size in zip(lengths, sizes)))
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

    def _prefill(self, prompts: list[Prompt], want_rows: bool,
                 pickers: list[Picker | None] | None = None) -> tuple[list[tuple[int, Rows | None]], object]:
        """The joint prefill: each prompt's first token and rows, and the new rows' own cache."""
        inputs = self.adapter.batch_inputs(prompts)
        needed = [self._needed(p, want_rows) for p in prompts]  # positions whose logits each row needs
        keep = sorted(set().union(*needed))  # logits only there: a 7B vocabulary at every position is gigabytes
        column = {pos: j for j, pos in enumerate(keep)}
        cache = self.adapter.new_cache()
        out = self.model(**inputs, use_cache=True, logits_to_keep=torch.tensor(keep, device=self.device),
                         **{self._cache_kw: cache})
        rows_of = torch.tensor([r for r, positions in enumerate(needed) for _ in positions], device=self.device)
        cols_of = torch.tensor([column[pos] for positions in needed for pos in positions], device=self.device)
        argmax, rows = greedy_and_rows(out.logits[rows_of, cols_of], self.top_k)
        results, start = [], 0
        for prompt, positions in zip(prompts, needed):
            n = len(positions)
            first = argmax[start + n - 1]  # the last position is the prompt's last token
            picker = pickers[len(results)] if pickers else None
            if picker is not None:  # its own rule, the prompt its whole history
                last = start + n - 1
                first = first_token(out.logits[rows_of[last], cols_of[last]][None], prompt, picker, self.top_k)
            mine = None
            if want_rows:
                mine = Rows(ids=rows.ids[start:start + n], probs=rows.probs[start:start + n], positions=positions)
            results.append((first, mine))
            start += n
        return results, cache

    def _admit(self, cache, prompts: list[Prompt]) -> None:
        """The prefilled rows join: appended after the rows in flight."""
        if self.cache is None:
            self.cache = cache
        else:
            compat.append_rows(self.cache, cache)
        self.slots += [Slot(p.length, p.rope_delta) for p in prompts]

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
        ids, depths, rows, cols = [], [], [], []
        for r, tree in enumerate(trees):
            ids.append(tree.tokens + [tree.tokens[0]] * (t - len(tree)))
            depths.append(padded_tree_cells(tree, t, r * t, w, rows, cols))
        base = torch.tensor([[s.length + s.rope_delta] for s in self.slots], device=self.device)
        pos = torch.tensor(depths, device=self.device) + base
        ids_t = torch.tensor(ids, device=self.device)
        if b == 1 and t == 1 and self.slots[0].length == w:
            return ids_t, pos, None  # one token of one row sees everything cached: no mask needed
        # Built where it is used: on a GPU the mask (rows x nodes x positions) is megabytes, its indices are not.
        dev = self.device
        lengths = torch.tensor([s.length for s in self.slots], device=dev)
        mask = torch.full((b * t, w + t), torch.finfo(self.dtype).min, dtype=self.dtype, device=dev)
        committed = torch.arange(w, device=dev)[None, :] < lengths.repeat_interleave(t)[:, None]
        mask[:, :w].masked_fill_(committed, 0.0)
        mask[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = 0.0
        mask = mask.view(b, 1, t, w + t)
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


def padded_tree_cells(tree: Tree, width: int, row: int, column: int, rows: list[int], cols: list[int]) -> list[int]:
    """Append the mask cells of one tree padded to ``width`` nodes, written at columns ``column``..: node i
    (mask row ``row + i``) sees its ancestors and itself, a padding node only itself. Returns the padded depths."""
    depth, lines = [0] * width, []
    for i, parent in enumerate(tree.parents):
        if parent >= 0:
            depth[i] = depth[parent] + 1
        line = (lines[parent] if parent >= 0 else []) + [column + i]
        lines.append(line)
        rows.extend([row + i] * len(line))
        cols.extend(line)
    rows.extend(row + i for i in range(len(tree), width))
    cols.extend(column + i for i in range(len(tree), width))
    return depth


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
Outcome = tuple[Hashable, "Generation | Exception"]  # a turn that left the batch: its tag and result


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
        # Realized / guessed drafted tokens of the steps whose width the rows' last trees chose: a row's next
        # tree is not its last, and the rows whose last trees looked best are the likeliest to fall short.
        self.trust, self._guessed = 1.0, 0.0

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
        drafters = [self.drafter.fork() for _ in turns]
        t0 = time.perf_counter()
        firsts = self.engine.join([prompt for _, prompt, *_ in turns], want_rows=self.drafter.wants_prefill_rows,
                                  **chosen)
        prefill_s = (time.perf_counter() - t0) / len(turns)  # each turn's share of the joint prefill
        start = len(self.flights)
        hits = self.engine.hits if len(self.engine.hits) == len(turns) else [0] * len(turns)
        for (tag, prompt, limit, *_), picker, drafter, hit in zip(turns, pickers, drafters, hits):
            gen = Generation(prefill_s=prefill_s, prompt_tokens=prompt.length, prefix_hit=hit)
            self.flights.append(Flight(tag, drafter, prompt.input_ids[0].tolist(), limit, gen, pause=self.pause,
                                       picker=picker))
        ended, failed = [], {}
        for i, (first, rows) in zip(range(start, len(self.flights)), firsts):
            flight = self.flights[i]
            t1 = time.perf_counter()
            try:
                flight.drafter.start(flight.context, rows)
            except Exception as exc:  # noqa: BLE001 - one turn's failure is its own
                failed[i] = exc
                continue
            flight.gen.prefill_s += time.perf_counter() - t1  # the drafter's start belongs to the turn's set-up
            flight.context.append(first)
            flight.gen.tokens.append(first)
            flight.gen.by_source[Source.BONUS.name] += 1
            if flight.picker is not None:
                flight.picker.extend([first])
            if first in self.eos or flight.max_new_tokens <= 1:
                ended.append(i)
        return self._leave(sorted(ended + list(failed)), failed)

    def step(self) -> list[Outcome]:
        """One verification of every row. A row whose host work raises (its drafter, its bookkeeping) leaves
        with the exception as its result; the others go on unchanged."""
        failed: dict[int, Exception] = {}
        trees, draft_s = self._draft(failed)
        out = self._leave(sorted(failed), failed)
        if not self.flights:
            self.engine.cost.probing = False  # a probe no row is left to take is none
            return out
        trees = [t for i, t in enumerate(trees) if i not in failed]
        draft_s = [d for i, d in enumerate(draft_s) if i not in failed]
        t0 = time.perf_counter()
        pickers = [f.picker for f in self.flights]
        verified = self.engine.verify(trees, pickers) if any(pickers) else self.engine.verify(trees)
        verify_s = time.perf_counter() - t0
        if self.on_step is not None:
            self.on_step(len(self.flights))
        if self._guessed > 0:
            drafted = sum(len(v.path) - 1 for v in verified)
            self.trust = min(1.0, max(0.05, self.trust + TRUST_RATE * (drafted / self._guessed - self.trust)))
        ended, failed = [], {}
        for i, (flight, tree, v) in enumerate(zip(self.flights, trees, verified)):
            try:
                t1 = time.perf_counter()
                flight.drafter.observe(tree, v)
                spent = draft_s[i] + time.perf_counter() - t1
                if flight.drafted:  # a resting row's bookkeeping is no drafting work per node
                    self.engine.cost.observe_host(max(len(tree), flight.drafter.grown), spent)
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
        return out + self._leave(sorted(ended + list(failed)), failed)

    def _draft(self, failed: dict[int, Exception]) -> tuple[list[Tree], list[float]]:
        """Every row's tree. The step's width is chosen first, for all rows together, from the chances each
        row's last growth placed (``batch_width``); then rows draft, those that emitted most last step first,
        each sized for the whole step (``RowShare``): free up to the width so far, paying beyond it.

        A resting row (its last tree was cut to its root) drafts only in a step that is wide anyway: the width
        counts every row's last guess, resting or not, so rows that together pay for a wider step wake up
        together. A probe step (the cost model re-testing a width it believes unprofitable) sets the width
        itself. Before the first step nothing is known about costs: no row drafts (it would be thrown away)."""
        n = len(self.flights)
        trees: list[Tree] = [Tree.root(f.context[-1]) for f in self.flights]
        seconds = [0.0] * n
        width, self._guessed, sized = 1, 0.0, self.drafter.wants_costs
        cost = self.engine.cost
        if sized:
            probe = cost.probe()
            if probe is not None:
                cost.probing, width = True, probe
            elif cost.forward_table(n)[1] == UNKNOWN:  # the first step: an ``ar`` step, timed
                sized = False
            else:
                chances = [f.chances for f in self.flights]
                width = batch_width(cost, chances, self.trust)
                self._guessed = sum(sum(c[:width - 1]) for c in chances)
        expected, nodes = 0.0, 0
        for rank, i in enumerate(sorted(range(n), key=lambda j: -self.flights[j].last)):
            flight = self.flights[i]
            t0 = time.perf_counter()
            share = None
            flight.drafted = not (flight.drafter.wants_costs and (not sized or flight.resting and width == 1))
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
            if self.keeps is not None and i not in failed and self.keeps(self.flights[i].tag):
                self.engine.offer_row(i, self.flights[i].context)
        self.engine.leave(rows)
        gone = set(rows)
        self.flights = [f for i, f in enumerate(self.flights) if i not in gone]
        return out
