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
at its own learned chance, so a continuation that keeps being right earns the depth it pays for. Continuations
come from the stream memory (recap_cli/drafters/stream.py): exact matches of up to 16 context tokens anywhere
in the stream's text (this request's and earlier requests' prompts and answers), each continuation with the
share of the match's occurrences it followed; its chance is learned per match length, rank and share.

The tree's size comes from what a step costs (``budget="auto"``, the default): growth stops where no bigger tree
can add more expected tokens than the run earns in the time it costs (recap_cli/decoding/cost.py; ``paced=False``:
where the step's own expected tokens per second can no longer rise, the ablation), down to the root alone.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from operator import itemgetter

from ..decoding.tree import Rows, Source, Tree, Verified
from .base import Drafter
from .calibration import Calibration, PlacedCalibration, StreamCalibration
from .memory import KeyedMemory, Row, TokenTable, check_table
from .stream import Cursor, StreamMemory

FIXED_WEIGHTS = (0.70, 0.20, 0.10)
# Rank weights for confidence mixing: chosen on SmolLM2-135M over the text prompts of sample_inputs/bench among
# (0.7,0.2,0.1) .. (0.97,0.02,0.01), 16 prompts x 64 new tokens: 0.8/0.15/0.05 gave 2.79 tokens/step, fixed 2.61.
CONFIDENCE_WEIGHTS = (0.80, 0.15, 0.05)
ORDER_SOURCE = {1: Source.ORDER1, 2: Source.ORDER2, 3: Source.ORDER3}
# A node's candidates: tokens and mixed probabilities best first, and the (order, row) pairs they came from.
Candidates = tuple[Sequence[int], Sequence[float], list[tuple[int, Row]]]
NO_CANDIDATES: Candidates = ((), (), [])
MIX = -1  # a heap entry that mixes a node's rows (its chance there is an upper bound on its best child's)
STREAM = -2  # heap entries <= STREAM place the stream candidate of rank STREAM - what
STREAM_RANKS = 4  # stream continuations considered per node, most frequent first


def _origin(found: list[tuple[int, Row]], token: int) -> Source:
    """The most specific memory whose row proposed ``token`` (rows are found most specific first)."""
    return ORDER_SOURCE[next(o for o, (ids, _) in found if token in ids)]


class RecapDrafter(Drafter):
    name = "recap"
    wants_prefill_rows = True

    def __init__(self, vocab_size: int, banned: Iterable[int] = (), orders: Iterable[int] = (1, 2, 3),
                 mixing: str = "confidence", weights: tuple[float, ...] = CONFIDENCE_WEIGHTS, suffix: bool = True,
                 suffix_len: int = 10, stream_depth: int = 16, stream_requests: int = 1000,
                 budget: int | str = "auto", depth: int = 8, width: int = 8, top_k: int = 8, cap: int = 1 << 16,
                 calibrate: bool = True, depths: int = 3, paced: bool = True):
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
        self.cap = cap
        self.paced = paced
        self.vocab_size = vocab_size
        self.order1 = TokenTable(vocab_size)
        self.calibration = Calibration(self.width, depths=depths) if calibrate else None
        self.stream = StreamMemory(self.banned, stream_depth, stream_requests)  # shared by every row of a batch
        self.continuation = StreamCalibration()  # the stream lane's chances, learned with or without calibrate
        self.placed = PlacedCalibration() if calibrate else None  # what placed nodes' chances turn out to be
        self.own_request_state()

    def own_request_state(self) -> None:
        """Orders 2 and 3 and this request's place in the stream: never shared between rows."""
        self.keyed = {2: KeyedMemory(self.cap), 3: KeyedMemory(self.cap)}
        self._mixed: dict[tuple[int, ...], tuple[list[Row], Candidates]] = {}  # mixtures of several rows
        self.index = Cursor()  # where this request's text goes in the stream memory
        self.chances = [1.0]  # the last tree's path chances, node by node (what calibration checks read)
        self._lanes: list[tuple[int, float]] = []  # the last tree's nodes' (lane, lane chance), in tree order
        self._tail: tuple[int, ...] = ()
        # Nodes whose candidates the last tree drafted from: (tree index, mixed candidates, stream candidates or
        # None, the stream match length there, the candidates' depth); observe() grades them where the node was
        # accepted.
        self._tested: list[tuple[int, Candidates, tuple | None, int, int]] = []

    @property
    def wants_costs(self) -> bool:
        return self.budget == "auto"

    # --- memories -------------------------------------------------------------------------------------------

    def start(self, prompt: list[int], rows: Rows | None) -> None:
        for memory in self.keyed.values():
            memory.clear()
        self._mixed.clear()
        if self.index.segs is not None:  # one request at a time: the last one has ended
            self.stream.finish(self.index.segs)
        self.index = Cursor()
        if self.suffix:
            self.index.segs = self.stream.begin()
            self._write(prompt)
        if rows is not None:
            self._store_rows(rows, [tuple(prompt[max(0, i - 2): i + 1]) for i in rows.positions])

    def _write(self, context: list[int]) -> None:
        """The stream memory learns this request's text as it is committed."""
        cursor = self.index
        if cursor.segs is not None and len(context) > cursor.seen:
            self.stream.write(cursor.segs, context[cursor.seen:])
            cursor.seen = len(context)

    def observe(self, tree: Tree, verified: Verified) -> None:
        self._store_rows(verified.rows, self._node_keys(tree), verified.accepted_last(len(tree)))
        self._grade(verified)
        if self.placed is not None and len(self._lanes) == len(tree):
            accepted = set(verified.path)
            parents = tree.parents
            for i in range(1, len(tree)):
                if parents[i] in accepted:  # a fair test of the node's own chance
                    lane, p = self._lanes[i]
                    self.placed.record(lane, p, i in accepted)

    def _grade(self, verified: Verified) -> None:
        """Every candidate of an accepted node was put to the test: it passed iff it is the argmax there."""
        accepted = set(verified.path)
        for i, cands, streamed, m, depth in self._tested:
            if i not in accepted:
                continue
            best = verified.argmax[i]
            if self.calibration is not None:
                for rank, (token, prob) in enumerate(zip(cands[0], cands[1])):
                    self.calibration.record(rank, prob, depth, token == best)
            if streamed is not None:
                tokens, negc, total = streamed
                for rank in range(min(STREAM_RANKS, len(tokens))):
                    self.continuation.record(m, -negc[rank] / total, rank, tokens[rank] == best)

    def _node_keys(self, tree: Tree) -> list[tuple[int, ...]]:
        """Each node's last three path tokens: its tree ancestors, then committed text (the context tail)."""
        keys = [self._tail]
        for i in range(1, len(tree)):
            keys.append((keys[tree.parents[i]] + (tree.tokens[i],))[-3:])
        return keys

    def _store_rows(self, rows: Rows, keys: list[tuple[int, ...]], order: Iterable[int] | None = None) -> None:
        ids, probs = rows.ids.tolist(), rows.probs.tolist()  # lists as stored: read-only from here on
        use1, use2, use3 = 1 in self.orders, 2 in self.orders, 3 in self.orders
        table, vocab = self.order1.rows, self.order1.vocab_size
        m2, m3 = self.keyed[2].rows, self.keyed[3].rows
        for i in (range(len(keys)) if order is None else order):
            key, row = keys[i], (ids[i], probs[i])
            if use1 and 0 <= key[-1] < vocab:
                table[key[-1]] = row
            if len(key) == 3:
                if use2:  # KeyedMemory.put inlined: re-inserting moves the key to the young end
                    k = key[1:]
                    m2.pop(k, None)
                    m2[k] = row
                if use3:
                    m3.pop(key, None)
                    m3[key] = row
            elif use2 and len(key) == 2:
                m2.pop(key, None)
                m2[key] = row
        for memory in self.keyed.values():  # the caps, once per step
            while len(memory.rows) > memory.cap:
                del memory.rows[next(iter(memory.rows))]

    def reset(self) -> None:
        self.order1.clear()
        for memory in self.keyed.values():
            memory.clear()
        self._mixed.clear()
        self.stream.clear()
        self.index = Cursor()
        self.continuation.clear()
        if self.calibration is not None:
            self.calibration.clear()
            self.placed.clear()

    def state(self) -> dict:
        """The order-1 table, the stream memory and the learned chances (recycled rows, stream continuations):
        orders 2/3 reset per request."""
        calibration = self.calibration.state() if self.calibration is not None else None
        placed = self.placed.state() if self.placed is not None else None
        return {"order1": self.order1.state(), "calibration": calibration, "continuation": self.continuation.state(),
                "placed": placed, "stream": self.stream.state()}

    def load_state(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"order1", "calibration", "continuation", "placed", "stream"}:
            raise ValueError("a RECAP memory holds exactly 'order1', 'calibration', 'continuation', 'placed' and "
                             "'stream'")
        check_table(state["order1"], self.order1.vocab_size)  # all checks first: a failure changes nothing
        self.continuation.check_state(state["continuation"])
        self.stream.check_state(state["stream"], self.vocab_size)
        use_calibration = state["calibration"] is not None and self.calibration is not None
        use_placed = state["placed"] is not None and self.placed is not None
        if use_placed:
            self.placed.check_state(state["placed"])
        if use_calibration:
            self.calibration.check_state(state["calibration"])
            self.calibration.load_state(state["calibration"])
        if use_placed:
            self.placed.load_state(state["placed"])
        self.continuation.load_state(state["continuation"])
        self.order1.load_state(state["order1"])
        self.stream.load_state(state["stream"])

    # --- mixing ---------------------------------------------------------------------------------------------

    def rows_for(self, key: tuple[int, ...]) -> list[tuple[int, Row]]:
        """The rows this path's order-3, order-2 and order-1 keys find, most specific first."""
        found = []
        n = len(key)
        for o in self.orders:  # plain dict/list reads: this runs once per drafted node
            if o == 1:
                row = self.order1.rows[key[-1]] if 0 <= key[-1] < self.order1.vocab_size else None
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
        # A mixture is cached until one of the rows it mixed is overwritten (rows are never changed in place).
        cached = self._mixed.get(key)
        if cached is not None and len(cached[0]) == len(found) and all(a is b[1] for a, b in zip(cached[0], found)):
            return cached[1]
        out = self._mix(found)
        if len(self._mixed) >= self.cap:
            self._mixed.clear()
        self._mixed[key] = ([row for _, row in found], out)
        return out

    def _mix(self, found: list[tuple[int, Row]]) -> Candidates:
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

    # --- the stream lane ------------------------------------------------------------------------------------

    def _match(self) -> tuple[int | None, int]:
        """The stream position of the longest suffix of the context that occurred before (somewhere other than
        right here) and was followed by something, and its length; (None, 0) when none was."""
        segs = self.index.segs
        if segs is None or segs[-1] < 0:
            return None, 0
        tree = self.stream.tree
        active = tree.active.get(segs[-1])
        if not active:
            return None, 0
        count, toks = tree.count, tree.toks
        for m in range(min(len(active), tree.depth - 1), 0, -1):
            pos = active[m - 1]
            if pos > 0 and count[pos] > 1 and toks[pos]:
                return pos, m
        return None, 0

    def _streamed(self, pos: int, here: bool) -> tuple[list[int], list[int], int] | None:
        """A stream position's continuations: tokens, minus their counts, and the occurrences they share
        (``here``: the match at the root, whose own occurrence has no continuation yet)."""
        tree = self.stream.tree
        if pos >= 0:
            toks, negc = tree.ranked(pos)
            if not toks:
                return None
            return toks, negc, tree.count[pos] - here
        kids = tree.children(pos)
        return ([kids[0][0]], [-1], 1) if kids else None

    # --- the tree -------------------------------------------------------------------------------------------

    def _chance(self):
        """The calibrated chance of a recycled candidate as a closure over this step's coefficients (the same
        figure as ``Calibration.chance``, without its bookkeeping: it runs for every candidate placed)."""
        if self.calibration is None:
            return _raw_chance
        co, nd = self.calibration.coefficients(), self.calibration.depths

        def chance(rank: int, p: float, depth: int) -> float:
            a, b = co[rank * nd + (depth if depth < nd else nd) - 1][
                3 if p >= 0.95 else 2 if p >= 0.8 else 1 if p >= 0.5 else 0]
            return a + b * p

        return chance

    def _mapped(self):
        """The placed-node calibration as a closure: a lane's chance -> what such nodes turned out to be worth."""
        if self.placed is None:
            return lambda lane, p: p
        co = self.placed.coefficients()

        def mapped(lane: int, p: float) -> float:
            a, b = co[lane][min(int(p * 10), 9) if p > 0 else 0]
            return a + b * p

        return mapped

    def rest(self, context: list[int]) -> Tree:
        self._write(context)
        self._lanes = []
        self._tail, self._tested = tuple(context[-3:]), []  # observe() keys the root's row by the tail
        return Tree.root(context[-1])

    def propose(self, context: list[int], room: int) -> Tree:
        """Best-first growth over two lanes of candidates per node: its mixed recycled rows (in rank order;
        only a node's best unplaced one waits in the heap, its next sibling takes its place when it is placed)
        and, where the node's path is still an exact match in the stream memory, the continuations that
        followed it there (most frequent first, likewise one at a time). A token both lanes propose is placed
        once, at the better chance. With ``budget="auto"`` the tree stops growing when no bigger tree can beat
        the best size so far (``SizeChooser``), and is cut to that best size.

        A node's rows are mixed only when it is its turn to grow children: until then it waits in the heap at
        its path chance times an upper bound on any first child's chance, so the order is exactly best-first
        and the leaves a tree ends with cost no mixing."""
        self._write(context)
        self._tail = tail = tuple(context[-3:])
        max_depth = min(self.depth, room)
        chance, mapped = self._chance(), self._mapped()
        bound = 1.0 if self.calibration is None else self.calibration.first_child_bound()
        bound = self.placed.bound(bound) if self.placed is not None else bound
        stream_chance = self.continuation.chance
        tree_s = self.stream.tree
        here = set(self.index.segs) if self.index.segs is not None else ()
        spos, m = self._match() if self.suffix and max_depth > 0 else (None, 0)
        tokens, parents, sources, chances, lanes = [context[-1]], [-1], [Source.ROOT], [1.0], [(0, 1.0)]
        used = [0.0]  # the path chance a node's placed children have taken of its own
        # The root's rows are always mixed: its candidates are graded every step, even when the tree stays a root.
        keys, depths, cands = [tail], [0], [self.mix(tail) if max_depth > 0 else NO_CANDIDATES]
        stream_pos = [spos]
        streamed = [self._streamed(spos, True) if spos is not None else None]
        children: dict[tuple[int, int], int] = {}
        # (-chance, node, what): what >= 0 places the rank-`what` candidate of cands[node]; what <= STREAM places
        # the stream candidate of rank STREAM - what; MIX mixes node's rows (its chance there is an upper bound).
        # Each entry also carries the lane (its most specific recycled order - 1, or 3: the stream) and the chance
        # the lane gave it, which the placed-node calibration maps and later grades.
        frontier: list[tuple[float, int, int, int, float]] = []
        if cands[0][0]:
            raw, lane = chance(0, cands[0][1][0], 1), cands[0][2][0][0] - 1
            frontier.append((-mapped(lane, raw), 0, 0, lane, raw))
        if streamed[0] is not None:
            toks0, negc0, total0 = streamed[0]
            raw = stream_chance(m, -negc0[0] / total0, 0)
            frontier.append((-mapped(3, raw), 0, STREAM, 3, raw))
            heapq.heapify(frontier)
        sizer = self.cost.chooser(self.paced) if self.wants_costs else None
        budget = self.budget
        push, pop = heapq.heappush, heapq.heappop
        while frontier:
            if sizer is not None:
                if not sizer.worth_growing(-frontier[0][0]):
                    break
            elif len(tokens) > budget:
                break
            neg, parent, what, lane, raw = pop(frontier)
            if what == MIX:
                cands[parent] = found = self.mix(keys[parent])
                if found[0]:
                    r, ln = chance(0, found[1][0], depths[parent] + 1), found[2][0][0] - 1
                    push(frontier, (-chances[parent] * mapped(ln, r), parent, 0, ln, r))
                continue
            # A node's children are exclusive (the model has one argmax there): their chances add up to at most
            # 1. Two lanes calibrated apart can overshoot that, so a child gets at most what its better-placed
            # siblings left, and waits its turn again at that figure.
            left = chances[parent] - used[parent]
            if -neg > left + 1e-12:
                if left > 1e-9 * chances[parent]:
                    push(frontier, (-left, parent, what, lane, raw))
                continue
            if what >= 0:
                ranked, probs, found = cands[parent]
                token = ranked[what]
                source = ORDER_SOURCE[found[0][0]] if len(found) == 1 else _origin(found, token)
                if what + 1 < len(ranked):
                    r = chance(what + 1, probs[what + 1], depths[parent] + 1)
                    push(frontier, (-chances[parent] * mapped(lane, r), parent, what + 1, lane, r))
            else:
                rank = STREAM - what
                toks_s, negc_s, total_s = streamed[parent]
                token = toks_s[rank]
                if rank + 1 < min(STREAM_RANKS, len(toks_s)):
                    r = stream_chance(m + depths[parent], -negc_s[rank + 1] / total_s, rank + 1)
                    push(frontier, (-chances[parent] * mapped(3, r), parent, what - 1, 3, r))
                if token in self.banned:
                    continue
                source = None
            if (parent, token) in children:
                continue
            i = len(tokens)
            children[(parent, token)] = i
            sp = stream_pos[parent]
            sp = tree_s.step(sp, token) if sp is not None else None
            if source is None:
                source = Source.SUFFIX if sp is not None and tree_s.source(sp) in here else Source.STREAM
            tokens.append(token)
            parents.append(parent)
            sources.append(source)
            chances.append(-neg)
            used[parent] += -neg
            used.append(0.0)
            lanes.append((lane, raw))
            keys.append((keys[parent] + (token,))[-3:])
            d = depths[parent] + 1
            depths.append(d)
            cands.append(NO_CANDIDATES)
            stream_pos.append(sp)
            s = self._streamed(sp, False) if sp is not None and d < max_depth and d < self.suffix_len else None
            streamed.append(s)
            if d < max_depth:
                push(frontier, (neg * bound, i, MIX, 0, 0.0))
                if s is not None:
                    r = stream_chance(m + d, -s[1][0] / s[2], 0)
                    push(frontier, (neg * mapped(3, r), i, STREAM, 3, r))
            if sizer is not None:
                sizer.place(-neg)
        n = sizer.size if sizer is not None else len(tokens)
        tree, where = _layout(tokens[:n], parents[:n], sources[:n])
        self._tested = [(where[i], cands[i], streamed[i], m + depths[i], depths[i] + 1) for i in range(n)
                        if cands[i][0] or streamed[i] is not None]
        self.grown = len(tokens)
        self.chances = [0.0] * n  # each tree node's estimated path chance, for calibration checks
        self._lanes = [(0, 1.0)] * n
        for i in range(n):
            self.chances[where[i]] = chances[i]
            self._lanes[where[i]] = lanes[i]
        return tree


def _layout(tokens: list[int], parents: list[int], sources: list[int]) -> tuple[Tree, list[int]]:
    """Depth-first with the best child first, so the top-1 chain sits at indices 0..d: when it is the accepted
    path the KV compaction is only a cut. Best-first growth places siblings best first, so a node's children
    are already in order."""
    n = len(tokens)
    if n == 1:
        return Tree([tokens[0]], [-1], [sources[0]]), [0]
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        kids[parents[i]].append(i)
    tree = Tree([tokens[0]], [-1], [sources[0]])
    new_index = [0] * n
    stack = kids[0][::-1]  # the best is popped first
    t_tokens, t_parents, t_sources = tree.tokens, tree.parents, tree.sources
    while stack:
        i = stack.pop()
        new_index[i] = len(t_tokens)
        t_tokens.append(tokens[i])
        t_parents.append(new_index[parents[i]])
        t_sources.append(sources[i])
        if kids[i]:
            stack.extend(kids[i][::-1])
    return tree, new_index


def _raw_chance(rank: int, p: float, depth: int) -> float:
    return p
