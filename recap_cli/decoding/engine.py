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
from dataclasses import dataclass, field

import torch

from ..adapters import Adapter, Prompt
from ..prefix_cache import Layers, PrefixCache, common_prefix, rows_before
from . import compat
from .cost import SIZES, StepCost
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
        return StepCost([s for s in SIZES if s <= max_size])

    def _new_cache(self, need: int) -> None:
        if not self.static:
            self.cache = self.adapter.new_cache()
            return
        if self.cache is None or self.capacity < need:  # reused across requests while it is big enough
            self.capacity = -(-max(need, self.min_capacity) // 256) * 256
            self.cache = self.adapter.new_cache(self.capacity)
        compat.set_length(self.cache, 0)

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, want_rows: bool = False, reserve: int = 256,
                picker: Picker | None = None) -> tuple[int, Rows | None]:
        """Run the prompt; return the first token (greedy, or ``picker``'s choice) and, if asked, the raw top-k
        rows at every text position.

        ``reserve`` is the room a static cache keeps after the prompt (new tokens + the largest tree). With
        ``prefixes``, a prompt that starts like an earlier one prefills only its suffix (``prefill_from``)."""
        if self.prefixes is not None and (reuse := self._reusable(prompt, reserve)) is not None:
            return self.prefill_from(prompt, *reuse, want_rows=want_rows, reserve=reserve, picker=picker)
        self.hit, self.prompt_rows, self.held = 0, None, None
        self._new_cache(prompt.length + reserve + max(self.buckets))
        self.rope_delta = prompt.rope_delta
        keep: int | torch.Tensor = 1
        if want_rows:  # rows at image placeholders are never keys a drafter could meet again
            keep = text_positions(prompt.input_ids[0], self.adapter.image_token_id)
        mask = self.adapter.prefill_mask(self._causal_mask(prompt.length), prompt) if self.static else None
        out = self.model(input_ids=prompt.input_ids, position_ids=prompt.position_ids, attention_mask=mask,
                         use_cache=True, logits_to_keep=keep, **{self._cache_kw: self.cache}, **prompt.model_inputs)
        self.length = prompt.length
        logits = out.logits[0]
        first = int(logits[-1].argmax()) if picker is None else first_token(logits[-1:], prompt, picker, self.top_k)
        if not want_rows:
            return first, None
        rows = greedy_and_rows(logits, self.top_k)[1]
        rows.positions = keep.tolist()
        self.prompt_rows = rows
        return first, rows

    def _reusable(self, prompt: Prompt, reserve: int) -> tuple[int, Layers | None, Rows | None] | None:
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
                if not self.static or self.capacity >= self._room(prompt.length, reserve):
                    return n, None, rows
                return n, compat.row_layers(self.cache, 0, n), rows  # a static cache too small: copied over
        return (best, hit.entry.layers, hit.entry.rows_before(best)) if hit is not None else None

    @torch.inference_mode()
    def prefill_from(self, prompt: Prompt, n: int, prefix: Layers | None, rows: Rows | None, want_rows: bool = False,
                     reserve: int = 256, picker: Picker | None = None) -> tuple[int, Rows | None]:
        """``prefill`` over the keys and values of the prompt's first ``n`` tokens, already computed: ``prefix``
        (a copy, loaded into a new cache), or the first ``n`` positions of this cache (``prefix`` None). Only the
        suffix runs, as a chain of text tokens (no image token is left in it) at positions n.. (+ the rope
        delta), each seeing the prefix and the tokens before it; ``rows``, the prefix's stored prefill rows,
        and the suffix's make the rows a full prefill gives."""
        total = prompt.length
        if prefix is None:
            compat.keep_rows(self.cache, n, None, n)
        else:
            self._new_cache(self._room(total, reserve))
            compat.load_prefixes(self.cache, [prefix], [n])
        self.rope_delta, self.length = prompt.rope_delta, n
        ids = prompt.input_ids[:, n:]
        pos = torch.arange(n, total, device=self.device)[None] + self.rope_delta
        mask = self.adapter.layer_masks(self._chain_mask(total - n), pos, n)
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                         logits_to_keep=0 if want_rows else 1, **{self._cache_kw: self.cache})
        self.length, self.hit, self.prompt_rows = total, n, None
        logits = out.logits[0]
        first = int(logits[-1].argmax()) if picker is None else first_token(logits[-1:], prompt, picker, self.top_k)
        if not want_rows:
            return first, None
        self.prompt_rows = join_rows(rows, greedy_and_rows(logits, self.top_k)[1], list(range(n, total)))
        return first, self.prompt_rows

    def _room(self, length: int, reserve: int) -> int:
        return length + reserve + max(self.buckets)

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

    def _chain_mask(self, t: int) -> torch.Tensor:
        """Additive (1, 1, t, P+t) mask of t tokens appended in order: each sees the prefix, the tokens before
        it and itself (over a static cache the mask spans its capacity)."""
        p = self.length
        width = self.capacity if self.static else p + t
        mask = torch.full((t, width), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
        mask[:, :p] = 0.0
        mask[:, p:p + t] = torch.full((t, t), torch.finfo(self.dtype).min, dtype=self.dtype,
                                      device=self.device).triu(1)
        return mask[None, None]

    @torch.inference_mode()
    def verify(self, tree: Tree, picker: Picker | None = None) -> Verified:
        """Evaluate root + draft nodes in one forward pass, accept the longest path of chosen tokens (greedy, or
        ``picker``'s), compact the cache."""
        t0 = time.perf_counter()
        n = len(tree)
        ids, pos, mask = self.step_inputs(tree)
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
            raise RuntimeError(f"static KV cache full ({self.capacity} positions): reserve more at prefill")
        pad = size - n  # padding nodes hang off nothing: they see the prefix and themselves, no node sees them
        ids = torch.tensor([tree.tokens + [tree.tokens[0]] * pad], device=self.device)
        pos = torch.tensor([tree.depths() + [0] * pad], device=self.device) + (self.length + self.rope_delta)
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

    def _causal_mask(self, n: int) -> torch.Tensor:
        """Prefill mask over a static cache: causal within the prompt, nothing beyond it."""
        mask = torch.full((n, self.capacity), torch.finfo(self.dtype).min, dtype=self.dtype)
        mask[:, :n] = torch.full((n, n), torch.finfo(self.dtype).min, dtype=self.dtype).triu(1)
        return mask.to(self.device)[None, None]

    def _tree_mask(self, parents: list[int]) -> torch.Tensor:
        """Additive (1, 1, T, P+T) mask in the model dtype. Additive, not bool: eager attention adds the mask.
        Over a static cache the mask spans its whole capacity; positions past P+T stay masked."""
        n, p = len(parents), self.length
        ancestors: list[list[int]] = []
        rows, cols = [], []
        for i, parent in enumerate(parents):
            line = (ancestors[parent] if parent >= 0 else []) + [p + i]
            ancestors.append(line)
            rows.extend([i] * len(line))
            cols.extend(line)
        width = self.capacity if self.static else p + n
        mask = torch.full((n, width), torch.finfo(self.dtype).min, dtype=self.dtype)
        mask[:, :p] = 0.0
        mask[rows, cols] = 0.0
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


def greedy_and_rows(logits: torch.Tensor, k: int) -> tuple[list[int], Rows]:
    """Each position's argmax and top-k rows, brought to the host in one copy (the step's only sync).

    Softmax over the top-k logits is p_i / sum_k p_j: the full softmax renormalised over its top k. Token ids
    travel as float32, exact below 2**24 (vocabularies are ~1.5e5)."""
    top = logits.topk(k, dim=-1)
    packed = torch.cat([logits.argmax(-1, keepdim=True).float(), top.indices.float(),
                        torch.softmax(top.values.float(), -1)], dim=1).cpu()
    return packed[:, 0].long().tolist(), Rows(ids=packed[:, 1:k + 1].long(), probs=packed[:, k + 1:])


def first_token(logits: torch.Tensor, prompt: Prompt, picker: Picker, k: int) -> int:
    """The first new token under ``picker``'s rule: the prompt is its whole history (``logits`` at its last
    position, shape (1, V))."""
    return choose(logits, [Tree.root(int(prompt.input_ids[0, -1]))], [picker], k)[0][0]


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

    @property
    def decode_s(self) -> float:
        return self.draft_s + self.verify_s

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the bonus), the paper's acceptance length;
        the first token comes from prefill, not from a step."""
        return (len(self.tokens) - 1) / self.steps if self.steps else 0.0


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
    first, rows = engine.prefill(prompt, want_rows=drafter.wants_prefill_rows, reserve=max_new_tokens, **chosen)
    context = prompt.input_ids[0].tolist()
    drafter.start(context, rows)
    gen.prefill_s = time.perf_counter() - t0  # the drafter's start (memories seeded from the prompt) included
    context.append(first)
    gen.tokens.append(first)
    gen.by_source[Source.BONUS.name] += 1
    if picker is not None:
        picker.extend([first])
    while first not in eos and len(gen.tokens) < max_new_tokens:
        t1 = time.perf_counter()
        tree = drafter.propose(context, room=max_new_tokens - len(gen.tokens) - 1)
        t2 = time.perf_counter()
        verified = engine.verify(tree, **chosen)
        t3 = time.perf_counter()
        drafter.observe(tree, verified)
        draft_s = (t2 - t1) + (time.perf_counter() - t3)
        engine.cost.observe_host(max(len(tree), drafter.grown), draft_s)
        gen.draft_s += draft_s
        gen.verify_s += t3 - t2
        added, done = commit(gen, tree, verified, eos, max_new_tokens)
        engine.cost.observe_yield(len(added), len(tree))
        context.extend(added)
        if picker is not None:
            picker.extend(added)
        if done:
            break
    return gen


def commit(gen: Generation, tree: Tree, verified: Verified, eos: set[int],
            max_new_tokens: int) -> tuple[list[int], bool]:
    """Append the accepted tokens and the bonus, cut at EOS or the token budget; say if the request ended."""
    new = [(tree.tokens[i], Source(tree.sources[i]).name) for i in verified.path[1:]]
    new.append((verified.bonus, Source.BONUS.name))
    gen.steps += 1
    gen.tree_nodes += len(tree)
    added, done = [], False
    for token, source in new:
        added.append(token)
        gen.tokens.append(token)
        gen.by_source[source] += 1
        if token in eos or len(gen.tokens) >= max_new_tokens:
            done = True
            break
    # Drafted tokens that were emitted: an EOS or the token limit inside the path cuts the rest (and the bonus).
    gen.accepted_hist[min(len(added), len(new) - 1)] += 1
    return added, done
