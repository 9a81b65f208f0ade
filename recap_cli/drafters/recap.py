"""RECAP: recycle the verifier's own earlier predictions as a draft tree.

Memories keyed by the last 1, 2 and 3 tokens of a node's path hold the top-k rows the verifier produced there.
Order 1 lives for the whole session (reusable transitions); orders 2 and 3 are reset per request (they carry
this image's context). A node's candidates mix the rows its keys find:

    score(c) = sum_o  w_o * conf_o * p_o(c)  /  sum_o w_o * conf_o

with w_o a weight by the order's rank among the orders present (most specific first; 0.80/0.15/0.05 by
default) and conf_o the row's top-1 probability (``mixing="confidence"``), or the public implementation's fixed
weights 0.70/0.20/0.10 by rank and no confidence term (``mixing="fixed"``, the ablation). The tree grows
best-first: a child's score is its parent's times its estimated chance of acceptance. A remembered probability
is the model's confidence in an *earlier* context, so it overrates recycled tokens where contexts alias ("the
sign reads" continues differently per image); with ``calibrate=True`` (the default) the chance is learned online
from the verifier's verdicts per (candidate rank, probability bucket), starting from the probability itself.
A suffix continuation (the tokens that followed the longest earlier match of the current suffix in prompt +
output) is merged in as one extra path.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import torch

from ..tree import Rows, Source, Tree, Verified
from .base import Drafter
from .memory import KeyedMemory, NgramIndex, Row, TokenTable, check_table, row_tuples

FIXED_WEIGHTS = (0.70, 0.20, 0.10)
# Rank weights for confidence mixing: chosen on SmolLM2-135M over the text prompts of sample_inputs/bench among
# (0.7,0.2,0.1) .. (0.97,0.02,0.01), 16 prompts x 64 new tokens: 0.8/0.15/0.05 gave 2.79 tokens/step, fixed 2.61.
CONFIDENCE_WEIGHTS = (0.80, 0.15, 0.05)
ORDER_SOURCE = {1: Source.ORDER1, 2: Source.ORDER2, 3: Source.ORDER3}


class RecapDrafter(Drafter):
    name = "recap"
    wants_prefill_rows = True

    def __init__(self, vocab_size: int, banned: Iterable[int] = (), orders: Iterable[int] = (1, 2, 3),
                 mixing: str = "confidence", weights: tuple[float, ...] = CONFIDENCE_WEIGHTS, suffix: bool = True,
                 suffix_len: int = 4, suffix_max_n: int = 8, budget: int = 64, depth: int = 8, width: int = 8,
                 top_k: int = 8, cap: int = 1 << 16, calibrate: bool = True):
        if mixing not in ("confidence", "fixed"):
            raise ValueError("mixing is 'confidence' or 'fixed'")
        self.orders = tuple(sorted(set(orders), reverse=True))  # most specific first
        if not self.orders or not set(self.orders) <= {1, 2, 3}:
            raise ValueError("orders is a non-empty subset of 1, 2, 3")
        self.mixing, self.suffix, self.suffix_len = mixing, suffix, suffix_len
        self.weights = FIXED_WEIGHTS if mixing == "fixed" else tuple(weights)
        self.budget, self.depth, self.width, self.top_k = budget, depth, min(width, top_k), top_k
        self.banned = frozenset(banned)
        self.order1 = TokenTable(vocab_size)
        self.keyed = {2: KeyedMemory(cap), 3: KeyedMemory(cap)}
        self.index = NgramIndex(suffix_max_n, keep="latest", skip=self.banned)
        self._tail: tuple[int, ...] = ()
        self.calibration = Calibration(self.width) if calibrate else None
        self._placed: list[tuple[int, int, int]] = []  # (tree index, rank, probability bucket) of drafted nodes

    # --- memories -------------------------------------------------------------------------------------------

    def start(self, prompt: list[int], rows: Rows | None) -> None:
        for memory in self.keyed.values():
            memory.clear()
        self.index.reset()
        if rows is not None:
            self._store_rows(rows, [tuple(prompt[max(0, i - 2): i + 1]) for i in rows.positions])

    def observe(self, tree: Tree, verified: Verified) -> None:
        self._store_rows(verified.rows, self._node_keys(tree), verified.accepted_last(len(tree)))
        if self.calibration is not None:
            self.calibration.update(self._placed, tree, verified)

    def _node_keys(self, tree: Tree) -> list[tuple[int, ...]]:
        """Each node's last three path tokens: its tree ancestors, then committed text (the context tail)."""
        keys = [self._tail]
        for i in range(1, len(tree)):
            keys.append((keys[tree.parents[i]] + (tree.tokens[i],))[-3:])
        return keys

    def _store_rows(self, rows: Rows, keys: list[tuple[int, ...]], order: Iterable[int] | None = None) -> None:
        row_of = row_tuples(rows)
        use = set(self.orders)
        for i in (range(len(keys)) if order is None else order):
            key, row = keys[i], row_of[i]
            if 1 in use:
                self.order1.put(key[-1], row)
            if 2 in use and len(key) >= 2:
                self.keyed[2].put(key[-2:], row)
            if 3 in use and len(key) == 3:
                self.keyed[3].put(key, row)

    def reset(self) -> None:
        self.order1.clear()
        for memory in self.keyed.values():
            memory.clear()
        self.index.reset()
        if self.calibration is not None:
            self.calibration.clear()

    def state(self) -> dict:
        """The order-1 table and the calibration counts: orders 2/3 and the suffix index reset per request."""
        calibration = self.calibration.state() if self.calibration is not None else None
        return {"order1": self.order1.state(), "calibration": calibration}

    def load_state(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"order1", "calibration"}:
            raise ValueError("a RECAP memory holds exactly 'order1' and 'calibration'")
        check_table(state["order1"], self.order1.vocab_size)  # all checks first: a failure changes nothing
        if state["calibration"] is not None and self.calibration is not None:
            self.calibration.load_state(state["calibration"])
        self.order1.load_state(state["order1"])

    # --- mixing ---------------------------------------------------------------------------------------------

    def rows_for(self, key: tuple[int, ...]) -> list[tuple[int, Row]]:
        """The rows this path's order-3, order-2 and order-1 keys find, most specific first."""
        found = []
        n = len(key)
        for o in self.orders:  # plain dict/list reads: this runs once per drafted node
            if o == 1:
                row = self.order1.rows[key[-1]]
            elif n >= o:
                row = self.keyed[o].rows.get(key if o == n else key[-o:])
            else:
                continue
            if row is not None:
                found.append((o, row))
        return found

    def mix(self, key: tuple[int, ...]) -> list[tuple[int, float, int]]:
        """(token, probability, order) candidates for the node whose path ends in ``key``, best first."""
        found = self.rows_for(key)
        if len(found) == 1:  # one row: the mixture is the row itself
            o, (ids, probs) = found[0]
            return [(t, p, o) for t, p in zip(ids, probs) if t not in self.banned][: self.width]
        if not found:
            return []
        if self.mixing == "fixed":
            ws = self.weights[: len(found)]
        else:  # conf = the row's top-1 probability
            ws = [w * row[1][0] for w, (_, row) in zip(self.weights, found)]
        total = sum(ws)
        score: dict[int, float] = {}
        origin: dict[int, int] = {}
        for (o, (ids, probs)), w in zip(found, ws):
            f = w / total
            for t, p in zip(ids, probs):
                score[t] = score.get(t, 0.0) + f * p
                origin.setdefault(t, o)  # rows come most specific first
        best = sorted(score.items(), key=lambda kv: -kv[1])
        return [(t, p, origin[t]) for t, p in best if t not in self.banned][: self.width]

    # --- the tree -------------------------------------------------------------------------------------------

    def propose(self, context: list[int], room: int) -> Tree:
        """Best-first growth. Only a node's best unplaced child waits in the heap; when it is placed, its next
        sibling takes its place, so each placed node costs one mix and two heap pushes."""
        self._tail = tuple(context[-3:])
        max_depth = min(self.depth, room)
        nodes = [(context[-1], -1, Source.ROOT, 1.0)]  # token, parent, source, score
        keys, depths, cands = [self._tail], [0], [self.mix(self._tail) if max_depth > 0 else []]
        chance = self.calibration.chance if self.calibration is not None else _raw_chance
        frontier: list[tuple[float, int, int]] = []  # (-score, parent, rank of the child in cands[parent])
        if cands[0]:
            frontier.append((-chance(0, cands[0][0][1]), 0, 0))
        ranks = [(-1, -1)]
        while frontier and len(nodes) <= self.budget:
            neg, parent, rank = heapq.heappop(frontier)
            token, prob, order = cands[parent][rank]
            if rank + 1 < len(cands[parent]):
                nxt = -nodes[parent][3] * chance(rank + 1, cands[parent][rank + 1][1])
                heapq.heappush(frontier, (nxt, parent, rank + 1))
            i = len(nodes)
            nodes.append((token, parent, ORDER_SOURCE[order], -neg))
            ranks.append((rank, _bucket(prob)))
            keys.append((keys[parent] + (token,))[-3:])
            depths.append(depths[parent] + 1)
            cands.append(self.mix(keys[i]) if depths[i] < max_depth else [])
            if cands[i]:
                heapq.heappush(frontier, (neg * chance(0, cands[i][0][1]), i, 0))
        if self.suffix and max_depth > 0:
            self._merge_suffix(context, nodes, depths, max_depth)
        tree, where = _layout(nodes)
        self._placed = [(where[i], r, b) for i, (r, b) in enumerate(ranks) if r >= 0]
        return tree

    def _merge_suffix(self, context: list[int], nodes: list, depths: list[int], max_depth: int) -> None:
        """Walk the continuation down from the root, reusing nodes that already hold its tokens."""
        _, follow = self.index.continuation(context, min(self.suffix_len, max_depth))
        children: dict[tuple[int, int], int] = {(parent, tok): i for i, (tok, parent, _, _) in enumerate(nodes)}
        at = 0
        for token in follow:
            nxt = children.get((at, token))
            if nxt is None:
                nodes.append((token, at, Source.SUFFIX, 0.0))
                depths.append(depths[at] + 1)
                nxt = len(nodes) - 1
                children[(at, token)] = nxt
            at = nxt


def _layout(nodes: list[tuple[int, int, int, float]]) -> tuple[Tree, dict[int, int]]:
    """Depth-first with the best child first, so the top-1 chain sits at indices 0..d: when it is the accepted
    path the KV compaction is only a cut."""
    kids: list[list[int]] = [[] for _ in nodes]
    for i in range(1, len(nodes)):
        kids[nodes[i][1]].append(i)
    tree = Tree.root(nodes[0][0])
    new_index = {0: 0}
    stack = sorted(kids[0], key=lambda c: nodes[c][3])  # worst first: the best is popped first
    while stack:
        i = stack.pop()
        token, parent, source, _ = nodes[i]
        new_index[i] = len(tree.tokens)
        tree.tokens.append(token)
        tree.parents.append(new_index[parent])
        tree.sources.append(source)
        stack.extend(sorted(kids[i], key=lambda c: nodes[c][3]))
    return tree, new_index


BUCKETS = (0.5, 0.8, 0.95)  # remembered probability -> bucket 0..3


def _bucket(p: float) -> int:
    return sum(p >= b for b in BUCKETS)


def _raw_chance(rank: int, p: float) -> float:
    return p


class Calibration:
    """P(a drafted child is accepted | its parent was) per (rank among its siblings, probability bucket),
    counted from the verifier's verdicts, with ``prior`` pseudo-observations at the remembered probability."""

    def __init__(self, width: int, prior: float = 4.0):
        self.width, self.prior = width, prior
        self.clear()

    def clear(self) -> None:
        self.hits = [[0.0] * (len(BUCKETS) + 1) for _ in range(self.width)]
        self.tries = [[0.0] * (len(BUCKETS) + 1) for _ in range(self.width)]

    def state(self) -> dict[str, torch.Tensor]:
        return {"hits": torch.tensor(self.hits, dtype=torch.float64),
                "tries": torch.tensor(self.tries, dtype=torch.float64)}

    def load_state(self, state: dict) -> None:
        """Counts saved by ``state()``: same (rank, bucket) shape, finite, 0 <= hits <= tries."""
        if not isinstance(state, dict) or set(state) != {"hits", "tries"}:
            raise ValueError("the calibration must hold exactly 'hits' and 'tries'")
        hits, tries = state["hits"], state["tries"]
        shape = (self.width, len(BUCKETS) + 1)
        if not all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point and tuple(t.shape) == shape
                   for t in (hits, tries)):
            raise ValueError(f"the calibration counts must be two float tensors of shape {shape}")
        finite = torch.isfinite(hits).all() and torch.isfinite(tries).all()
        if not finite or (hits < 0).any() or (hits > tries).any():
            raise ValueError("the calibration counts must be finite with 0 <= hits <= tries")
        self.hits, self.tries = hits.tolist(), tries.tolist()

    def chance(self, rank: int, p: float) -> float:
        b = _bucket(p)
        return (self.hits[rank][b] + self.prior * p) / (self.tries[rank][b] + self.prior)

    def update(self, placed: list[tuple[int, int, int]], tree: Tree, verified: Verified) -> None:
        """Only children of accepted nodes were put to the test: each passed iff it is its parent's argmax."""
        accepted = set(verified.path)
        for i, rank, b in placed:
            parent = tree.parents[i]
            if parent in accepted:
                self.tries[rank][b] += 1
                self.hits[rank][b] += verified.argmax[parent] == tree.tokens[i]
