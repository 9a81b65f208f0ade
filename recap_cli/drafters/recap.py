"""RECAP: recycle the verifier's own earlier predictions as a draft tree.

Memories keyed by the last 1, 2 and 3 tokens of a node's path hold the top-k rows the verifier produced there.
Order 1 lives for the whole session (reusable transitions); orders 2 and 3 are reset per request (they carry
this image's context). A node's candidates mix the rows its keys find:

    score(c) = sum_o  w_o * conf_o * p_o(c)  /  sum_o w_o * conf_o

with w_o a weight by the order's rank among the orders present (most specific first; 0.80/0.15/0.05 by
default) and conf_o the row's top-1 probability (``mixing="confidence"``), or the public implementation's fixed
weights 0.70/0.20/0.10 by rank and no confidence term (``mixing="fixed"``, the ablation). The tree grows
best-first: a child's score is its parent's times its estimated chance of acceptance, so a node's score is the
chance that its whole path is accepted. A remembered probability is the model's confidence in an *earlier*
context, so it overrates recycled tokens where contexts alias ("the sign reads" continues differently per
image); with ``calibrate=True`` (the default) the chance is learned online from the verifier's verdicts per
(candidate rank, probability bucket), starting from the probability itself. A suffix continuation (the tokens
that followed the longest earlier match of the current suffix in prompt + output) competes in the same growth,
at its own learned chance, so a continuation that keeps being right earns the depth it pays for.

The tree's size comes from what a step costs (``budget="auto"``, the default): growth stops where expected tokens
per second (recap_cli/decoding/cost.py) can no longer rise, down to the root alone.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from operator import itemgetter

from ..decoding.tree import Rows, Source, Tree, Verified
from .base import Drafter
from .calibration import Calibration, ChainCalibration
from .memory import KeyedMemory, NgramIndex, Row, TokenTable, check_table, row_tuples

FIXED_WEIGHTS = (0.70, 0.20, 0.10)
# Rank weights for confidence mixing: chosen on SmolLM2-135M over the text prompts of sample_inputs/bench among
# (0.7,0.2,0.1) .. (0.97,0.02,0.01), 16 prompts x 64 new tokens: 0.8/0.15/0.05 gave 2.79 tokens/step, fixed 2.61.
CONFIDENCE_WEIGHTS = (0.80, 0.15, 0.05)
ORDER_SOURCE = {1: Source.ORDER1, 2: Source.ORDER2, 3: Source.ORDER3}
# A node's candidates: tokens and mixed probabilities best first, and the (order, row) pairs they came from.
Candidates = tuple[Sequence[int], Sequence[float], list[tuple[int, Row]]]
NO_CANDIDATES: Candidates = ((), (), [])
FOLLOW, MIX = -1, -2  # heap entries that are not a ranked candidate: the continuation's token, a pending mix


def _origin(found: list[tuple[int, Row]], token: int) -> Source:
    """The most specific memory whose row proposed ``token`` (rows are found most specific first)."""
    return ORDER_SOURCE[next(o for o, (ids, _) in found if token in ids)]


class RecapDrafter(Drafter):
    name = "recap"
    wants_prefill_rows = True

    def __init__(self, vocab_size: int, banned: Iterable[int] = (), orders: Iterable[int] = (1, 2, 3),
                 mixing: str = "confidence", weights: tuple[float, ...] = CONFIDENCE_WEIGHTS, suffix: bool = True,
                 suffix_len: int = 10, suffix_max_n: int = 8, budget: int | str = "auto", depth: int = 8,
                 width: int = 8, top_k: int = 8, cap: int = 1 << 16, calibrate: bool = True, depths: int = 3):
        if mixing not in ("confidence", "fixed"):
            raise ValueError("mixing is 'confidence' or 'fixed'")
        if budget != "auto" and not (isinstance(budget, int) and budget >= 0):
            raise ValueError("budget is 'auto' or a number of draft nodes >= 0")
        self.orders = tuple(sorted(set(orders), reverse=True))  # most specific first
        if not self.orders or not set(self.orders) <= {1, 2, 3}:
            raise ValueError("orders is a non-empty subset of 1, 2, 3")
        self.mixing, self.suffix, self.suffix_len = mixing, suffix, suffix_len
        self.weights = FIXED_WEIGHTS if mixing == "fixed" else tuple(weights)
        self.budget, self.depth, self.width, self.top_k = budget, depth, min(width, top_k), top_k
        self.banned = frozenset(banned)
        self.cap, self.suffix_max_n = cap, suffix_max_n
        self.order1 = TokenTable(vocab_size)
        self.calibration = Calibration(self.width, depths=depths) if calibrate else None
        self.continuation = ChainCalibration()  # the suffix lane's chances, learned with or without calibrate
        self.own_request_state()

    def own_request_state(self) -> None:
        """Orders 2 and 3 and the suffix index: this request's context, never shared between rows."""
        self.keyed = {2: KeyedMemory(self.cap), 3: KeyedMemory(self.cap)}
        self.index = NgramIndex(self.suffix_max_n, keep="latest", skip=self.banned)
        self._tail: tuple[int, ...] = ()
        # Nodes whose candidates the last tree drafted from: (tree index, mixed candidates, continuation token
        # or None, its step along the continuation, the candidates' depth); observe() grades them where the node
        # was accepted.
        self._tested: list[tuple[int, Candidates, int | None, int, int]] = []
        self._n_match = 0

    @property
    def wants_costs(self) -> bool:
        return self.budget == "auto"

    # --- memories -------------------------------------------------------------------------------------------

    def start(self, prompt: list[int], rows: Rows | None) -> None:
        for memory in self.keyed.values():
            memory.clear()
        self.index.reset()
        if rows is not None:
            self._store_rows(rows, [tuple(prompt[max(0, i - 2): i + 1]) for i in rows.positions])

    def observe(self, tree: Tree, verified: Verified) -> None:
        self._store_rows(verified.rows, self._node_keys(tree), verified.accepted_last(len(tree)))
        self._grade(verified)

    def _grade(self, verified: Verified) -> None:
        """Every candidate of an accepted node was put to the test: it passed iff it is the argmax there."""
        accepted = set(verified.path)
        for i, cands, follow_token, j, depth in self._tested:
            if i not in accepted:
                continue
            best = verified.argmax[i]
            if self.calibration is not None:
                for rank, (token, prob) in enumerate(zip(cands[0], cands[1])):
                    self.calibration.record(rank, prob, depth, token == best)
            if follow_token is not None:
                self.continuation.record(self._n_match, j, follow_token == best)

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
        self.continuation.clear()
        if self.calibration is not None:
            self.calibration.clear()

    def state(self) -> dict:
        """The order-1 table and the learned chances (recycled rows, suffix continuations): orders 2/3 and the
        suffix index reset per request."""
        calibration = self.calibration.state() if self.calibration is not None else None
        return {"order1": self.order1.state(), "calibration": calibration, "continuation": self.continuation.state()}

    def load_state(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"order1", "calibration", "continuation"}:
            raise ValueError("a RECAP memory holds exactly 'order1', 'calibration' and 'continuation'")
        check_table(state["order1"], self.order1.vocab_size)  # all checks first: a failure changes nothing
        self.continuation.check_state(state["continuation"])
        use_calibration = state["calibration"] is not None and self.calibration is not None
        if use_calibration:
            self.calibration.check_state(state["calibration"])
            self.calibration.load_state(state["calibration"])
        self.continuation.load_state(state["continuation"])
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

    def mix(self, key: tuple[int, ...]) -> Candidates:
        """(tokens, probabilities, rows found) of the candidates for the node whose path ends in ``key``, best
        first. One row (the common case) is its own mixture and is returned as stored, without a copy."""
        found = self.rows_for(key)
        if len(found) == 1:
            ids, probs = found[0][1]
            if self.banned.isdisjoint(ids):
                return ids[: self.width], probs[: self.width], found
        elif not found:
            return NO_CANDIDATES
        if self.mixing == "fixed":
            ws = self.weights[: len(found)]
        else:  # conf = the row's top-1 probability
            ws = [w * row[1][0] for w, (_, row) in zip(self.weights, found)]
        total = sum(ws)
        score: dict[int, float] = {}
        get = score.get
        for (_, (ids, probs)), w in zip(found, ws):
            f = w / total
            for t, p in zip(ids, probs):
                score[t] = get(t, 0.0) + f * p
        best = [tp for tp in sorted(score.items(), key=itemgetter(1), reverse=True) if tp[0] not in self.banned]
        best = best[: self.width]
        return [t for t, _ in best], [p for _, p in best], found

    def candidates(self, key: tuple[int, ...]) -> list[tuple[int, float, Source]]:
        """The mixture as (token, probability, source) triples: for reading, not for the hot path."""
        tokens, probs, found = self.mix(key)
        return [(t, p, _origin(found, t)) for t, p in zip(tokens, probs)]

    # --- the tree -------------------------------------------------------------------------------------------

    def rest(self, context: list[int]) -> Tree:
        self._tail, self._tested = tuple(context[-3:]), []  # observe() keys the root's row by the tail
        return Tree.root(context[-1])

    def propose(self, context: list[int], room: int) -> Tree:
        """Best-first growth over two lanes of candidates per node: its mixed recycled rows (in rank order;
        only a node's best unplaced one waits in the heap, its next sibling takes its place when it is placed)
        and, on the path of the suffix continuation, that continuation's next token. A token both lanes
        propose is placed once, at the better chance. With ``budget="auto"`` the tree stops growing when no
        bigger tree can beat the best expected tokens per second so far, and is cut to that best size.

        A node's rows are mixed only when it is its turn to grow children: until then it waits in the heap at
        its path chance times an upper bound on any first child's chance, so the order is exactly best-first
        and the leaves a tree ends with cost no mixing."""
        self._tail = tuple(context[-3:])
        max_depth = min(self.depth, room)
        n_match, follow = (self.index.continuation(context, min(self.suffix_len, room))
                           if self.suffix and room > 0 else (0, []))
        chance = self.calibration.chance if self.calibration is not None else _raw_chance
        bound = self.calibration.first_child_bound() if self.calibration is not None else 1.0
        follow_chance = self.continuation.chance
        nodes = [(context[-1], -1, Source.ROOT, 1.0)]  # token, parent, source, path chance
        # The root's rows are always mixed: its candidates are graded every step, even when the tree stays a root.
        keys, depths, cands = [self._tail], [0], [self.mix(self._tail) if max_depth > 0 else NO_CANDIDATES]
        on_path = [0 if follow else -1]  # node i's path = follow[:on_path[i]]; -1: off the continuation
        children: dict[tuple[int, int], int] = {}
        # (-chance, node, what): what >= 0 places the rank-`what` candidate of cands[node]; FOLLOW places the
        # continuation's next token under node; MIX mixes node's rows (its chance there is an upper bound).
        frontier: list[tuple[float, int, int]] = [(-chance(0, cands[0][1][0], 1), 0, 0)] if cands[0][0] else []
        if follow:
            heapq.heappush(frontier, (-follow_chance(n_match, 0), 0, FOLLOW))
        sizer = self.cost.chooser() if self.wants_costs else None
        while frontier:
            if sizer is not None and not sizer.worth_growing(-frontier[0][0]):
                break
            if sizer is None and len(nodes) > self.budget:
                break
            neg, parent, rank = heapq.heappop(frontier)
            if rank == MIX:
                cands[parent] = found = self.mix(keys[parent])
                if found[0]:
                    heapq.heappush(frontier, (-nodes[parent][3] * chance(0, found[1][0], depths[parent] + 1),
                                              parent, 0))
                continue
            if rank >= 0:
                tokens, probs, found = cands[parent]
                token = tokens[rank]
                source = ORDER_SOURCE[found[0][0]] if len(found) == 1 else _origin(found, token)
                if rank + 1 < len(tokens):
                    nxt = -nodes[parent][3] * chance(rank + 1, probs[rank + 1], depths[parent] + 1)
                    heapq.heappush(frontier, (nxt, parent, rank + 1))
            else:
                token, source = follow[on_path[parent]], Source.SUFFIX
            if (parent, token) in children:
                continue
            i = len(nodes)
            children[(parent, token)] = i
            nodes.append((token, parent, source, -neg))
            keys.append((keys[parent] + (token,))[-3:])
            depths.append(depths[parent] + 1)
            cands.append(NO_CANDIDATES)
            j = on_path[parent]
            on_path.append(j + 1 if 0 <= j and follow[j] == token and j + 1 < len(follow) else -1)
            if depths[i] < max_depth:
                heapq.heappush(frontier, (neg * bound, i, MIX))
            if on_path[i] > 0:
                heapq.heappush(frontier, (neg * follow_chance(n_match, on_path[i]), i, FOLLOW))
            if sizer is not None:
                sizer.place(-neg)
        if sizer is not None:
            del nodes[sizer.size:]
        tree, where = _layout(nodes)
        self._tested = [(where[i], cands[i], follow[on_path[i]] if on_path[i] >= 0 else None, on_path[i],
                         depths[i] + 1) for i in range(len(nodes)) if cands[i][0] or on_path[i] >= 0]
        self._n_match = n_match
        self.grown = len(children) + 1
        return tree


def _layout(nodes: list[tuple[int, int, int, float]]) -> tuple[Tree, dict[int, int]]:
    """Depth-first with the best child first, so the top-1 chain sits at indices 0..d: when it is the accepted
    path the KV compaction is only a cut. Best-first growth places siblings best first, so a node's children
    are already in order."""
    kids: list[list[int]] = [[] for _ in nodes]
    for i in range(1, len(nodes)):
        kids[nodes[i][1]].append(i)
    tree = Tree.root(nodes[0][0])
    new_index = {0: 0}
    stack = kids[0][::-1]  # the best is popped first
    while stack:
        i = stack.pop()
        token, parent, source, _ = nodes[i]
        new_index[i] = len(tree.tokens)
        tree.tokens.append(token)
        tree.parents.append(new_index[parent])
        tree.sources.append(source)
        stack.extend(kids[i][::-1])
    return tree, new_index


def _raw_chance(rank: int, p: float, depth: int) -> float:
    return p
