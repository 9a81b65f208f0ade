"""The decoding engine: prefill, verify a draft tree in one forward pass, compact the KV cache.

Lossless by construction: a drafted token is kept only if it equals the model's argmax at its parent, and every
step appends the model's own argmax after the accepted path, so the output is greedy decoding's token for token.
With a ``Picker`` (a penalty, sampling: decoding/sampling.py) "the model's argmax" becomes the token its rule
chooses at each node, a function of the node's own path and output position only, and the same holds.
The engine knows nothing about tokenization; adapters build the prompt, drafters build the trees.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from ..adapters import Adapter, Prompt
from ..prefix_cache import Layers, PrefixCache, common_prefix, rows_before
from . import compat
from .cost import STEP_SIZES, StepCost
from .sampling import Picker, choose
from .tree import Rows, Source, Tree, Verified


BUCKETS = (1, 16, 32, 64, 128)


class Engine:
    """One request at a time (batch 1). ``length`` counts the tokens whose K/V rows sit in the cache.

    ``static=True`` preallocates the KV cache and pads every step to a node-count bucket, so each step has one
    of a few fixed shapes: what CUDA graphs need (``compile=True`` captures them with torch.compile).
    ``cost`` is what a step costs here, learned from the steps themselves (and probes: recap_cli/decoding/cost.py);
    drafters read it. ``measure_costs`` times every size up front instead, for benchmarks.
    """

    def __init__(self, adapter: Adapter, top_k: int = 8, static: bool = False, compile: bool = False,
                 buckets: tuple[int, ...] = BUCKETS, min_capacity: int = 0):
        self.adapter = adapter
        self.model = adapter.model
        self.top_k = top_k
        self.device = adapter.device
        self.dtype = self.model.dtype
        self._cache_kw = compat.cache_kwarg(self.model)
        self.static, self.buckets = static or compile, buckets
        self._step = torch.compile(self.model, mode="reduce-overhead", dynamic=False) if compile else self.model
        self.cache = None
        self.capacity = 0
        self.min_capacity = min_capacity  # a cache that never has to grow keeps captured graphs valid
        self.length = 0
        self.rope_delta = 0
        self.prefixes: PrefixCache | None = None  # prefix reuse across requests (off without one)
        self.hit = 0  # prompt tokens the last prefill took from ``prefixes``
        self.prompt_rows: Rows | None = None  # the last prefill's rows, kept for the entry its turn leaves
        self.held: tuple[torch.Tensor, tuple[str, ...]] | None = None  # what ``hold`` left for the next turn
        self.cost = self.new_cost()

    def new_cost(self) -> StepCost:
        """A cost model that knows nothing yet: over the buckets (static shapes), else the sizes up to the largest
        tree (128 nodes on a GPU, where a wide step costs about what a narrow one does; 64 on a CPU)."""
        if self.static:
            return StepCost(buckets=self.buckets)
        max_size = 128 if self.device.type == "cuda" else 64
        return StepCost([s for s in STEP_SIZES if s <= max_size])

    def _new_cache(self, need: int) -> None:
        if not self.static:
            self.cache = self.adapter.new_cache()
            return
        if self.cache is None or self.capacity < need:  # reused across requests while it is big enough
            self.capacity = -(-max(need, self.min_capacity) // 256) * 256
            self.cache = self.adapter.new_cache(self.capacity)
        compat.set_length(self.cache, 0)

    @property
    def drafts_in_prefill(self) -> bool:
        """Whether a draft tree can ride on the prompt's forward pass: not where the adapter builds its own prefill
        mask (Gemma 3's image blocks and windows)."""
        return self.adapter.drafts_in_prefill

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, want_rows: bool = False, reserve: int = 256,
                picker: Picker | None = None) -> tuple[int, Rows | None]:
        """Run the prompt; return the first token (greedy, or ``picker``'s choice) and, if asked, the raw top-k
        rows at every text position.

        ``reserve`` is the room a static cache keeps after the prompt (new tokens + the largest tree). With
        ``prefixes``, a prompt that starts like an earlier one prefills only its suffix (``prefill_from``)."""
        verified, rows = self.prefill_tree(prompt, Tree.root(int(prompt.input_ids[0, -1])), want_rows, reserve,
                                           picker)
        return verified.bonus, rows

    @torch.inference_mode()
    def prefill_tree(self, prompt: Prompt, tree: Tree, want_rows: bool = False, reserve: int = 256,
                     picker: Picker | None = None) -> tuple[Verified, Rows | None]:
        """``prefill``, with a draft tree rooted at the prompt's last token verified in the same forward pass: its
        nodes sit after the prompt, each seeing the whole prompt and its ancestors, so an answer's first tokens
        can be accepted before any step, for the cost of a few more rows in a pass that runs anyway. The root
        alone is a plain prefill (``bonus`` is the first token)."""
        if len(tree) > 1 and not self.drafts_in_prefill:
            raise ValueError(f"{self.adapter.arch} prefills under a mask of its own: no draft tree rides on it")
        if tree.without(self.adapter.image_token_id) is not tree:
            raise ValueError("a tree at prefill holds the image placeholder: the model would take it for an image "
                             "slot (Tree.without drops it)")
        if self.prefixes is not None and (reuse := self._reusable(prompt, reserve, len(tree))) is not None:
            return self.prefill_from(prompt, *reuse, tree, want_rows=want_rows, reserve=reserve, picker=picker)
        self.hit, self.prompt_rows, self.held = 0, None, None
        self._new_cache(self._room(prompt.length, reserve, len(tree)))
        self.rope_delta, self.length = prompt.rope_delta, 0
        extra = len(tree) - 1
        keep: int | torch.Tensor = extra + 1  # the root's logits (the prompt's last) and the nodes'
        if want_rows:  # rows at image placeholders are never keys a drafter could meet again
            text = text_positions(prompt.input_ids[0], self.adapter.image_token_id)
            keep = torch.cat([text[text < prompt.length - 1], torch.arange(prompt.length - 1, prompt.length + extra,
                                                                         device=text.device)])
        mask = self._chain_tree_mask(prompt.length, tree.parents) if extra or self.static else None
        if self.static:  # the mask spans the cache's capacity (a static prefill is never one of the step shapes)
            mask = self.adapter.prefill_mask(mask, prompt)
        ids, pos, inputs = self._with_tree(prompt, tree)
        with compat.attention_kernels(self.device):
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                             logits_to_keep=keep, **{self._cache_kw: self.cache}, **inputs)
        positions = keep.tolist() if want_rows else None
        return self._prefilled(prompt, tree, out.logits[0], positions, None, picker)

    def _with_tree(self, prompt: Prompt, tree: Tree) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """The prompt's ids, positions and per-token inputs followed by the tree's nodes (``tree_prompt``); a
        root-only tree leaves the prompt as it is, its positions to the model."""
        if len(tree) == 1:
            return prompt.input_ids, prompt.position_ids, prompt.model_inputs
        whole, pos = tree_prompt(prompt, tree, self.adapter.token_inputs)
        return whole.input_ids, pos, whole.model_inputs

    def _prefilled(self, prompt: Prompt, tree: Tree, logits: torch.Tensor, positions: list[int] | None,
                   prefix_rows: Rows | None, picker: Picker | None) -> tuple[Verified, Rows | None]:
        """From the prefill's kept logits (the prompt rows asked for, then the root's and the nodes'): the
        accepted path, the cache cut to the prompt and that path, and the prompt's rows."""
        n = len(tree)
        top = logits.shape[0] - n  # rows before the root's
        if picker is None:
            argmax, rows = greedy_and_rows(logits if positions is not None else logits[top:], self.top_k)
            argmax = argmax[top:] if positions is not None else argmax
            node_rows = Rows(ids=rows.ids[-n:], probs=rows.probs[-n:])
        else:
            argmax, node_rows = choose(logits[top:], [tree], [picker], self.top_k)
            if positions is not None:
                rows = greedy_and_rows(logits, self.top_k)[1]
        path = accept(tree, argmax)
        end = prompt.length  # the root sits at end - 1, node i at end - 1 + i
        if n > 1:  # the accepted nodes' rows next to the prompt's, the rest dropped
            contiguous = path == list(range(len(path)))
            moved = None if contiguous else torch.tensor([i - 1 for i in path[1:]], device=self.device)
            compat.keep_rows(self.cache, end, moved, end + len(path) - 1)
        self.length = end + len(path) - 1
        verified = Verified(path=path, bonus=argmax[path[-1]], argmax=argmax, rows=node_rows)
        if positions is None:
            return verified, None
        prompt_rows = Rows(ids=rows.ids[:top + 1], probs=rows.probs[:top + 1], positions=positions[:top + 1])
        self.prompt_rows = join_rows(prefix_rows, prompt_rows, prompt_rows.positions)
        return verified, self.prompt_rows

    def _reusable(self, prompt: Prompt, reserve: int, nodes: int = 1) -> tuple[int, Layers | None, Rows | None] | None:
        """The longest prefix of ``prompt`` already computed: in this cache, if it holds the turn before this one
        of the same conversation (``hold``), or in ``prefixes``; (tokens, a copy to load or None, their rows)."""
        held, self.held = self.held, None
        hit = self.prefixes.lookup(prompt.input_ids[0], prompt.image_keys, self.adapter.image_end(prompt))
        best = hit.length if hit is not None else 0
        if held is not None and held[1] == prompt.image_keys:
            n = self.prefixes.usable(common_prefix(held[0], prompt.input_ids[0].cpu()), prompt.length,
                                     self.adapter.image_end(prompt))
            if n > best:
                rows = rows_before(self.prompt_rows, n)
                if not self.static or self.capacity >= self._room(prompt.length, reserve, nodes):
                    return n, None, rows
                return n, compat.row_layers(self.cache, 0, n), rows  # a static cache too small: copied over
        return (best, hit.entry.layers, hit.entry.rows_before(best)) if hit is not None else None

    @torch.inference_mode()
    def prefill_from(self, prompt: Prompt, n: int, prefix: Layers | None, rows: Rows | None, tree: Tree,
                     want_rows: bool = False, reserve: int = 256,
                     picker: Picker | None = None) -> tuple[Verified, Rows | None]:
        """``prefill_tree`` over the keys and values of the prompt's first ``n`` tokens, already computed:
        ``prefix`` (a copy, loaded into a new cache), or the first ``n`` positions of this cache (``prefix``
        None). Only the suffix runs, as a chain of text tokens (no image token is left in it) at positions n..
        (+ the rope delta), each seeing the prefix and the tokens before it, then the tree's nodes; ``rows``, the
        prefix's stored prefill rows, and the suffix's make the rows a full prefill gives."""
        total, extra = prompt.length, len(tree) - 1
        if prefix is None:
            compat.keep_rows(self.cache, n, None, n)
        else:
            self._new_cache(self._room(total, reserve, len(tree)))
            compat.load_prefixes(self.cache, [prefix], [n])
        self.rope_delta, self.length = prompt.rope_delta, n
        ids = torch.cat([prompt.input_ids[:, n:], torch.tensor([tree.tokens[1:]], dtype=prompt.input_ids.dtype,
                                                               device=self.device)], dim=1)
        depths = torch.tensor(tree.depths()[1:], dtype=torch.long, device=self.device) + (total - 1)
        pos = torch.cat([torch.arange(n, total, device=self.device), depths])[None] + self.rope_delta
        mask = self.adapter.layer_masks(self._chain_tree_mask(total - n, tree.parents), pos, n)
        with compat.attention_kernels(self.device):
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                             logits_to_keep=0 if want_rows else extra + 1, **{self._cache_kw: self.cache})
        self.hit, self.prompt_rows = n, None
        return self._prefilled(prompt, tree, out.logits[0], list(range(n, total + extra)) if want_rows else None,
                               rows, picker)

    def _room(self, length: int, reserve: int, nodes: int = 1) -> int:
        """A static cache's capacity for a prompt of ``length``: ``reserve`` new tokens, then room for a step of the
        largest bucket, or for ``nodes`` (the tree verified with the prompt) where that is wider."""
        return length + reserve + max(max(self.buckets), nodes)

    def _grow(self, need: int) -> None:
        """A static cache too small for the next step (a tree wider than the largest bucket: a fixed budget above
        it) is replaced by a bigger one, the cached rows copied over (a new shape: compiled graphs are captured
        again, as when a longer prompt comes)."""
        rows = compat.row_layers(self.cache, 0, self.length)
        self._new_cache(self.length + need)
        compat.load_prefixes(self.cache, [rows], [self.length])

    def hold(self, prompt: Prompt, tokens: list[int]) -> None:
        """After a turn: the cache holds its prompt and answer, which the conversation's next turn starts with;
        the next ``prefill`` reuses them in place when its prompt does. Then offer the prompt's reusable part
        to ``prefixes`` for later requests."""
        if self.prefixes is None:
            return
        ids = prompt.input_ids[0].cpu()
        ids = torch.cat([ids, torch.tensor(tokens, dtype=ids.dtype)])[:self.length]
        self.held = (ids, prompt.image_keys)
        n = min(self.length, self.adapter.reusable_end(prompt))
        self.prefixes.offer(ids[:n], prompt.image_keys, lambda: compat.row_layers(self.cache, 0, n),
                            self.prompt_rows)

    def _chain_tree_mask(self, t: int, parents: list[int]) -> torch.Tensor:
        """Additive (1, 1, t+e, P+t+e) mask of t tokens appended in order after the cache's P, then a tree's e
        nodes under the last of them (``chain_tree_seen``), every one of them seeing the prefix (over a static
        cache the mask spans its capacity)."""
        p, e = self.length, len(parents) - 1
        seen = torch.zeros((t + e, self.capacity if self.static else p + t + e), dtype=torch.bool, device=self.device)
        seen[:, :p] = True
        seen[:, p:p + t + e] = chain_tree_seen([t], [parents], t + e, self.device)[0]
        return additive(seen, self.dtype)[None, None]

    @torch.inference_mode()
    def verify(self, tree: Tree, picker: Picker | None = None) -> Verified:
        """Evaluate root + draft nodes in one forward pass, accept the longest path of chosen tokens (greedy, or
        ``picker``'s), compact the cache."""
        t0 = time.perf_counter()
        n = len(tree)
        ids, pos, mask = self.step_inputs(tree)
        with compat.attention_kernels(self.device):
            out = self._step(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                             **{self._cache_kw: self.cache})
        if picker is None:
            argmax, rows = greedy_and_rows(out.logits[0, :n], self.top_k)
        else:
            argmax, rows = choose(out.logits[0, :n], [tree], [picker], self.top_k)
        path = accept(tree, argmax)
        self._keep(path)
        self.cost.observe(ids.shape[1], time.perf_counter() - t0)  # the host copy above waited for the device
        return Verified(path=path, bonus=argmax[path[-1]], argmax=argmax, rows=rows)

    def step_inputs(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Token ids, positions (P + depth) and the additive tree mask of one step, padded to its bucket."""
        n = len(tree)
        size = self._bucket(n)
        if self.static and self.length + size > self.capacity:
            self._grow(size + max(self.buckets))
        pad = size - n  # padding nodes hang off nothing: they see the prefix and themselves, no node sees them
        tokens, depths = tree.padded(size)
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.tensor([depths], device=self.device) + (self.length + self.rope_delta)
        # Node i attends to the whole prefix, its ancestors and itself; one token needs no mask at all.
        mask = self._tree_mask(tree.parents + [-1] * pad) if size > 1 or self.static else None
        mask = self.adapter.layer_masks(mask, pos, self.length) if mask is not None else None
        return ids, pos, mask

    def warm_up(self, prompt: Prompt) -> float:
        """Run one step of every bucket once, so compilation / graph capture happens before timed work (and is
        not taken for what those steps cost)."""
        t0 = time.perf_counter()
        for size in self.buckets:
            self.prefill(prompt, reserve=max(self.buckets))
            self.verify(Tree(tokens=[0] * size, parents=[-1] + [0] * (size - 1)))
        self.cost = self.new_cost()
        return time.perf_counter() - t0

    @torch.inference_mode()
    def measure_costs(self, prompt: Prompt, reps: int = 3) -> float:
        """Time a step of every grid size on this prompt's prefix (median of ``reps``) to start the cost model;
        seconds spent. Trees are balanced binary trees (depth log2 n), shaped like real drafts for the mask."""
        t0 = time.perf_counter()
        self.prefill(prompt, reserve=self.cost.max_tokens)
        start, timings = self.length, []
        for size in self.cost.sizes:
            tree = Tree.balanced(size)
            runs = []
            for _ in range(reps):
                t1 = time.perf_counter()
                self.verify(tree)
                runs.append(time.perf_counter() - t1)
                compat.keep_rows(self.cache, start, None, start)  # forget the step: the next one sees the same prefix
                self.length = start
            timings.append(sorted(runs)[len(runs) // 2])
        self.cost.set(timings)
        return time.perf_counter() - t0

    def _bucket(self, n: int) -> int:
        return bucket(n, self.buckets) if self.static else n

    def _tree_mask(self, parents: list[int]) -> torch.Tensor:
        """Additive (1, 1, T, P+T) mask in the model dtype. Additive, not bool: eager attention adds the mask.
        Over a static cache the mask spans its whole capacity; positions past P+T stay masked."""
        n, p = len(parents), self.length
        width = self.capacity if self.static else p + n
        mask = torch.full((n, width), torch.finfo(self.dtype).min, dtype=self.dtype)
        mask[:, :p] = 0.0
        mask[:, p:p + n].masked_fill_(ancestors(parents), 0.0)
        return mask.to(self.device)[None, None]

    def _keep(self, path: list[int]) -> None:
        """Keep the K/V rows of the accepted path at positions P.., drop the rest of the tree."""
        contiguous = path == list(range(len(path)))
        rows = None if contiguous else torch.tensor(path, device=self.device)
        compat.keep_rows(self.cache, self.length, rows, self.length + len(path))
        self.length += len(path)


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest static step shape that holds ``n`` nodes (``n`` itself past the largest)."""
    return next((b for b in buckets if b >= n), n)


def tree_prompt(prompt: Prompt, tree: Tree, token_inputs: tuple[str, ...]) -> tuple[Prompt, torch.Tensor]:
    """The prompt followed by the tree's nodes, as one prompt, and explicit positions for all its tokens: node i
    at the prompt's last position + its depth (+ the rope delta), a text token (0 in every per-token input).
    Positions are (1, L+e) for 1-D RoPE, (3, 1, L+e) for M-RoPE; they come back beside the prompt, whose own
    ``position_ids`` are None (callers pass these, or pad them for a batch)."""
    extra, dev = len(tree) - 1, prompt.input_ids.device
    tail = torch.tensor([tree.depths()[1:]], dtype=torch.long, device=dev) + (prompt.length - 1 + prompt.rope_delta)
    if prompt.position_ids is None:
        pos = torch.cat([torch.arange(prompt.length, device=dev)[None], tail], dim=1)
    else:  # M-RoPE: text positions are equal on every row
        pos = torch.cat([prompt.position_ids, tail.expand(prompt.position_ids.shape[0], 1, -1)], dim=-1)
    if not extra:
        return replace(prompt, position_ids=None), pos
    ids = torch.cat([prompt.input_ids, torch.tensor([tree.tokens[1:]], dtype=prompt.input_ids.dtype, device=dev)],
                    dim=1)
    inputs = {k: torch.cat([v, v.new_zeros(v.shape[0], extra)], dim=1) if k in token_inputs else v
              for k, v in prompt.model_inputs.items()}
    return replace(prompt, input_ids=ids, model_inputs=inputs, position_ids=None), pos


def chain_tree_seen(chains: list[int], parents: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """(B, width, width) booleans: which of row r's tokens each one sees, for ``chains[r]`` tokens in order (each
    sees those before it and itself), then a tree's nodes under the last of them (``parents[r]``; each sees the
    whole chain and its own ancestors), then padding up to ``width`` (each sees only itself, and nothing real sees
    it). The chains and padding are built for all rows at once; each tree then opens its block of ``ancestors``."""
    q = torch.arange(width, device=device)[:, None]
    k = torch.arange(width, device=device)[None, :]
    c = torch.tensor(chains, device=device)[:, None, None]
    end = c + torch.tensor([len(p) - 1 for p in parents], device=device)[:, None, None]
    seen = ((k <= q) & (q < c)) | ((q >= c) & (q < end) & (k < c)) | ((q >= end) & (k == q))
    for r, (chain, tree) in enumerate(zip(chains, parents)):
        if len(tree) > 1:  # node i sits at row and column chain - 1 + i: the root is the chain's last token
            block = slice(chain - 1, chain - 1 + len(tree))
            seen[r, block, block] |= ancestors(tree).to(device)
    return seen


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask of a boolean one: 0 where a query sees a key, the dtype's lowest elsewhere."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, torch.finfo(dtype).min)


# A byte's bits, lowest first: unpacks the rows of ``ancestors``.
_BITS = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)


def ancestors(parents: list[int], width: int = 0) -> torch.Tensor:
    """(w, w) booleans on the CPU, w the larger of ``width`` and the tree's size: row i holds what node i sees of
    the tree, itself and its ancestors. A node whose parent is -1 (a static step's padding), and each row past
    the tree, sees only itself. Rows are built as bitmasks (``ancestor_bits``) and unpacked together in a few
    tensor operations: writing the cells one by one cost 0.35 ms at 64 nodes on a CPU core, this 0.04 (1.4 ms
    and 0.07 at 128)."""
    w = max(width, len(parents))
    return unpack_bits(ancestor_bits(parents, w), w)


def ancestor_bits(parents: list[int], width: int) -> list[int]:
    """``ancestors``' rows as bitmasks (bit j: the node sees node j), ``width`` rows at least: each node's row is
    its parent's with its own bit set."""
    bits: list[int] = []
    for i, parent in enumerate(parents):
        bits.append(bits[parent] | 1 << i if parent >= 0 else 1 << i)
    bits.extend(1 << i for i in range(len(parents), width))
    return bits


def unpack_bits(bits: list[int], width: int) -> torch.Tensor:
    """(len(bits), width) booleans of bitmask rows, lowest bit first, unpacked together: a batch's trees in one
    call cost what one tree's did (16 rows' trees unpacked one by one took 0.2 ms a step on a CPU core)."""
    size = (width + 7) // 8
    packed = torch.frombuffer(bytearray(b"".join(row.to_bytes(size, "little") for row in bits)), dtype=torch.uint8)
    return (packed.view(len(bits), size, 1) & _BITS).view(len(bits), 8 * size)[:, :width] != 0


def greedy_and_rows(logits: torch.Tensor, k: int) -> tuple[list[int], Rows]:
    """Each position's argmax and top-k rows, brought to the host in one copy (the step's only sync).

    Softmax over the top-k logits is p_i / sum_k p_j: the full softmax renormalised over its top k. Token ids
    travel as float32, exact below 2**24 (vocabularies are ~1.5e5)."""
    top = logits.topk(k, dim=-1)
    packed = torch.cat([logits.argmax(-1, keepdim=True).float(), top.indices.float(),
                        torch.softmax(top.values.float(), -1)], dim=1).cpu()
    return packed[:, 0].long().tolist(), Rows(ids=packed[:, 1:k + 1].long(), probs=packed[:, k + 1:])


def accept(tree: Tree, argmax: list[int]) -> list[int]:
    """Longest root-to-node path on which every node's token is the model's argmax (or chosen token) at its
    parent."""
    child = {}
    for i in range(len(tree) - 1, 0, -1):  # reversed, so the first of duplicate siblings wins
        child[(tree.parents[i], tree.tokens[i])] = i
    path = [0]
    while (nxt := child.get((path[-1], argmax[path[-1]]))) is not None:
        path.append(nxt)
    return path


def join_rows(prefix: Rows | None, suffix: Rows, positions: list[int]) -> Rows:
    """A prefix's stored prefill rows followed by the rows of a suffix at ``positions``."""
    if prefix is None or not prefix.positions:
        return Rows(ids=suffix.ids, probs=suffix.probs, positions=positions)
    return Rows(ids=torch.cat([prefix.ids, suffix.ids]), probs=torch.cat([prefix.probs, suffix.probs]),
                positions=prefix.positions + positions)


def text_positions(ids: torch.Tensor, image_token: int | None) -> torch.Tensor:
    """Prompt positions that hold text: the rows at image placeholders are keys no drafter meets again."""
    if image_token is None:
        return torch.arange(ids.numel(), device=ids.device)
    return (ids != image_token).nonzero().flatten()


@dataclass
class Generation:
    """One request's output and what it cost."""

    tokens: list[int] = field(default_factory=list)
    steps: int = 0
    accepted_hist: Counter = field(default_factory=Counter)  # drafted tokens emitted per step -> steps
    by_source: Counter = field(default_factory=Counter)  # Source name -> emitted tokens
    tree_nodes: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prompt_tokens: int = 0
    prefix_hit: int = 0  # prompt tokens taken from the prefix cache instead of prefilled
    prefill_tokens: int = 1  # tokens the prefill emitted: the first, and any draft it verified (prefill_tree)
    prefill_nodes: int = 1  # the tree the prefill verified, root (the prompt's last token) included

    @property
    def decode_s(self) -> float:
        return self.draft_s + self.verify_s

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the bonus), the paper's acceptance length;
        the prefill's tokens come from no step."""
        return (len(self.tokens) - self.prefill_tokens) / self.steps if self.steps else 0.0


def generate(engine: Engine, prompt: Prompt, drafter, max_new_tokens: int, picker: Picker | None = None) -> Generation:
    """Greedy decoding with drafting; stops exactly where generate(do_sample=False) stops. With ``picker`` each
    token follows its rule instead (a penalty, seeded sampling), exactly as one token at a time would."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    eos = engine.adapter.eos_token_ids
    if drafter.wants_costs:  # the engine's cost model learns from the steps themselves: nothing is timed here
        drafter.cost = engine.cost
    gen = Generation()
    t0 = time.perf_counter()
    chosen = {} if picker is None else {"picker": picker}  # plain greedy calls stay as they always were
    if picker is not None:
        picker.start(prompt.input_ids[0])
    context = prompt.input_ids[0].tolist()
    early = drafter.drafts_at_prefill and engine.drafts_in_prefill
    if early:  # the answer's first tokens are drafted from what the drafter knows before this prompt's rows
        drafter.start(context, None)
        t1 = time.perf_counter()
        tree = drafter.propose(context, room=max_new_tokens - 1).without(engine.adapter.image_token_id)
        gen.draft_s = time.perf_counter() - t1
    else:
        tree = Tree.root(context[-1])
    try:
        verified, rows = engine.prefill_tree(prompt, tree, want_rows=drafter.wants_prefill_rows,
                                             reserve=max_new_tokens, **chosen)
    except Exception:
        if early:  # the request never ran: what ``start`` wrote to the shared memories goes
            drafter.withdraw()
        raise
    if early:
        drafter.prompt_rows(context, rows)
        drafter.observe(tree, verified)
    else:
        drafter.start(context, rows)
    # The drafter's start (memories seeded from the prompt) included; drafting the prefill's tree is drafting.
    gen.prefill_s = time.perf_counter() - t0 - gen.draft_s
    added, done = commit(gen, tree, verified, eos, max_new_tokens, step=False)
    gen.prefill_tokens, gen.prefill_nodes = len(added), len(tree)
    context.extend(added)
    if picker is not None:
        picker.extend(added)
    while not done:
        t1 = time.perf_counter()
        tree = drafter.propose(context, room=max_new_tokens - len(gen.tokens) - 1)
        t2 = time.perf_counter()
        verified = engine.verify(tree, **chosen)
        t3 = time.perf_counter()
        drafter.observe(tree, verified)
        draft_s = (t2 - t1) + (time.perf_counter() - t3)
        engine.cost.observe_host(len(tree), draft_s)
        gen.draft_s += draft_s
        gen.verify_s += t3 - t2
        added, done = commit(gen, tree, verified, eos, max_new_tokens)
        engine.cost.observe_yield(len(added), len(tree))
        context.extend(added)
        if picker is not None:
            picker.extend(added)
    drafter.end(context)
    return gen


def commit(gen: Generation, tree: Tree, verified: Verified, eos: set[int], max_new_tokens: int,
           step: bool = True) -> tuple[list[int], bool]:
    """Append the accepted tokens and the bonus, cut at EOS or the token budget; say if the request ended.
    ``step``: the tree was verified by a step (not by the prefill, which is no step)."""
    new = [(tree.tokens[i], Source(tree.sources[i]).name) for i in verified.path[1:]]
    new.append((verified.bonus, Source.BONUS.name))
    added, done = [], False
    for token, source in new:
        added.append(token)
        gen.tokens.append(token)
        gen.by_source[source] += 1
        if token in eos or len(gen.tokens) >= max_new_tokens:
            done = True
            break
    if step:
        gen.steps += 1
        gen.tree_nodes += len(tree)
        # Drafted tokens that were emitted: an EOS or the token limit inside the path cuts the rest (and the bonus).
        gen.accepted_hist[min(len(added), len(new) - 1)] += 1
    return added, done
