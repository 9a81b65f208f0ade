"""What a decoding step costs on this machine, measured, and the tree size that it makes worth drafting.

A step that verifies n tokens emits, in expectation, E(n) = 1 + sum of its draft nodes' path chances (the bonus
token is always emitted; a node adds a token exactly when its whole path is accepted). It takes T(n) = the
forward pass for n tokens + the host's drafting work for n nodes. Drafters grow trees best-first and keep the
size that maximises E(n) / T(n); n = 1 (the root alone: a plain greedy step) is always a candidate, so where
nothing is predictable a step costs what an ``ar`` step costs.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from functools import lru_cache

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
REFRESH = 16


class StepCost:
    """Seconds per verification step as a function of the tokens in the forward pass.

    Starts from a timing of every size in ``sizes`` (``Engine.measure_costs``) and follows the run: each
    observed step moves the two grid sizes around it towards what it took (weighted by distance), so the model
    tracks a machine that gets busier or a prefix that grows. Between grid sizes cost is linear; with
    ``buckets`` (a static-shape engine pads every step to a bucket) a step costs what its bucket costs. A later
    batched engine asks ``cost(total tokens in the step)``.
    """

    def __init__(self, sizes: Sequence[int] = SIZES, buckets: Sequence[int] | None = None, alpha: float = 0.05):
        self.sizes = tuple(buckets or sizes)
        self.buckets = tuple(buckets) if buckets else None
        self.alpha = alpha
        self.seconds: list[float] | None = None  # per grid size, None until measured
        self.host_per_node = 0.0  # drafting work (propose + observe) per tree node, seconds
        self._table: list[float] | None = None  # forward(n) for n = 0..max, rebuilt lazily after updates
        self._with_host: tuple | None = None  # (the forward table it was built from, T(n))
        self._stale = 0  # observations since the table was built: estimates move slowly, so it is rebuilt
        # every REFRESH observations, not every step (a rebuild is 64 interpolations: more than a step's drafting)

    @property
    def measured(self) -> bool:
        return self.seconds is not None

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def chooser(self) -> "SizeChooser":
        """A fresh stop rule for one tree's best-first growth (one request per step: batch 1)."""
        return SizeChooser(self.table(), self.max_tokens)

    def best_size(self, chances: Sequence[float]) -> int:
        return best_size(chances, self.chooser())

    def set(self, seconds: Sequence[float]) -> None:
        """The warm-up timing, one figure per grid size."""
        if len(seconds) != len(self.sizes):
            raise ValueError("one timing per grid size")
        self.seconds = list(seconds)
        self._table = self._with_host = None
        self._stale = 0

    def observe(self, tokens: int, seconds: float, weight: float = 1.0) -> None:
        """A verification step of ``tokens`` took ``seconds`` (``weight``: how much this curve owns the step,
        when a batched step falls between two curves). One slow outlier (another process, a page fault) counts
        at most three times the current estimate, so it cannot make a size look unaffordable for good."""
        if self.seconds is None:
            return
        lo, hi, w = self._bracket(tokens)
        for j, share in ((lo, 1.0 - w), (hi, w)):
            if share > 0:
                s = min(seconds, 3 * self.seconds[j])
                self.seconds[j] += self.alpha * weight * share * (s - self.seconds[j])
        self._stale += 1

    def observe_host(self, nodes: int, seconds: float) -> None:
        """Drafting time of one step (propose + observe) for a tree of ``nodes`` nodes."""
        if nodes > 0:
            self.host_per_node += 0.1 * (seconds / nodes - self.host_per_node)

    def __call__(self, tokens: int) -> float:
        """Forward-pass seconds for a step of ``tokens`` tokens (the root included; at most ``max_tokens``)."""
        assert self.seconds is not None, "measure the step costs first"
        if self.buckets:
            return self.seconds[min(bisect.bisect_left(self.buckets, tokens), len(self.buckets) - 1)]
        lo, hi, w = self._bracket(tokens)
        return self.seconds[lo] + w * (self.seconds[hi] - self.seconds[lo])

    def table(self) -> list[float]:
        """T(n) for n = 0..max_tokens: forward pass + drafting, made non-decreasing (a measured dip at some
        size is noise; a bigger tree is never cheaper), so that bounds on future rates hold."""
        forward = self.forward_table()
        if self._with_host is None or self._with_host[0] is not forward:  # drafting time as of this rebuild
            t = [0.0]
            for n in range(1, self.max_tokens + 1):
                t.append(max(t[-1], forward[n] + self.host_per_node * n))
            self._with_host = (forward, t)
        return self._with_host[1]

    def forward_table(self) -> list[float]:
        """The forward pass alone for n = 0..max_tokens tokens, non-decreasing, rebuilt every REFRESH
        observations."""
        if self._table is None or self._stale >= REFRESH:
            self._stale = 0
            t = [0.0]
            for n in range(1, self.max_tokens + 1):
                t.append(max(t[-1], self(n)))
            self._table = t
        return self._table

    def _bracket(self, tokens: int) -> tuple[int, int, float]:
        """Grid indices around ``tokens`` and the interpolation weight of the upper one."""
        sizes = self.sizes
        hi = bisect.bisect_left(sizes, tokens)
        if hi == 0:
            return 0, 0, 0.0
        if hi >= len(sizes):
            return len(sizes) - 1, len(sizes) - 1, 0.0
        lo = hi - 1
        if sizes[hi] == tokens:
            return hi, hi, 0.0
        return lo, hi, (tokens - sizes[lo]) / (sizes[hi] - sizes[lo])


ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)


class BatchCost:
    """Seconds per batched step as a function of its rows B and width T (every row's tree padded to T nodes):
    one ``StepCost`` over widths per row count of a grid, linear in between.

    Not a function of B * T alone: each row attends over its own cache, which grows with B (2 CPU cores, demo
    model, 300 cached positions: sixteen rows of one token cost 7.1 ms, one row of sixteen tokens 5.0 ms).
    """

    def __init__(self, max_batch: int, per_row: int, buckets: Sequence[int] | None = None):
        self.rows = tuple(sorted({r for r in ROWS if r < max_batch} | {max_batch}))
        widths = tuple(sorted({w for w in WIDTHS if w < per_row} | {per_row}))
        # Faster to follow than batch 1's: start-up timings are taken on one prompt's short prefix, while a
        # run's rows are ragged and their caches grow (a wide step at 16 rows then costs 15-30% more than
        # measured); wide steps are rare, so each must count. ``buckets``: a static-shape engine pads every
        # step to a width bucket (and runs every slot), so a step costs its bucket's.
        self.by_rows = {r: StepCost(widths, buckets=buckets, alpha=0.2) for r in self.rows}
        self.max_width = per_row
        self.host_per_node = 0.0
        self._tables: dict[int, tuple[list[float], list[float], list[float]]] = {}

    @property
    def measured(self) -> bool:
        return all(c.measured for c in self.by_rows.values())

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A step of ``rows`` rows at width ``width`` took ``seconds``: the cells around it move towards it."""
        lo, hi, w = self._bracket(rows)
        self.by_rows[lo].observe(width, seconds, 1.0 - w)
        if hi != lo:
            self.by_rows[hi].observe(width, seconds, w)

    def observe_host(self, nodes: int, seconds: float) -> None:
        """Drafting time of one row's step (propose + observe) for a tree of ``nodes`` nodes."""
        if nodes > 0:
            self.host_per_node += 0.1 * (seconds / nodes - self.host_per_node)

    def forward_table(self, rows: int) -> list[float]:
        """Forward seconds of a step of ``rows`` rows at width n, for n = 0..max_width (non-decreasing)."""
        lo, hi, w = self._bracket(rows)
        low, high = self.by_rows[lo].forward_table(), self.by_rows[hi].forward_table()
        cached = self._tables.get(rows)
        if cached is None or cached[0] is not low or cached[1] is not high:
            cached = (low, high, [a + w * (b - a) for a, b in zip(low, high)])
            self._tables[rows] = cached
        return cached[2]

    def _bracket(self, rows: int) -> tuple[int, int, float]:
        grid = self.rows
        hi = bisect.bisect_left(grid, rows)
        if hi >= len(grid):
            return grid[-1], grid[-1], 0.0
        if grid[hi] == rows or hi == 0:
            return grid[hi], grid[hi], 0.0
        lo = hi - 1
        return grid[lo], grid[hi], (rows - grid[lo]) / (grid[hi] - grid[lo])


class RowShare:
    """A step's cost as one row of a batch sees it, for sizing that row's tree (recap_cli/decoding/batched.py).

    Every row's tree is padded to the widest, so a step of B rows at width w costs forward(B, w) plus the
    host's drafting of all rows. Rows draft one after another: the row drafting now sees the step's width so far
    (``width``: chosen for all rows by ``batch_width``, widened by rows before it; nodes up to it cost only
    drafting) and the tokens the other rows are expected to emit (``base``), and keeps the size that maximises
    the whole step's expected tokens per second. So a tree widens the batch only while its extra nodes pay for a
    wider forward pass of every row.
    """

    def __init__(self, cost: BatchCost, rows: int, width: int, base: float, other_nodes: int):
        self.cost, self.rows, self.width = cost, rows, width
        self.base, self.other_nodes = base, other_nodes
        self.max_tokens = cost.max_width
        self._chooser: SizeChooser | None = None

    def table(self) -> ShareTable:
        forward = self.cost.forward_table(self.rows)
        return ShareTable(forward, forward[min(self.width, self.max_tokens)], self.cost.host_per_node,
                          self.other_nodes)

    def chooser(self) -> SizeChooser:
        self._chooser = SizeChooser(self.table(), self.max_tokens, base=self.base)
        return self._chooser

    def best_size(self, chances: Sequence[float]) -> int:
        return best_size(chances, self.chooser())

    def chosen_expected(self) -> float:
        """Tokens the sized tree is expected to emit (1, its bonus token, when nothing sized it)."""
        return self._chooser.best_expected - self.base if self._chooser is not None else 1.0

    def cut_to_root(self) -> bool:
        """The tree had candidates, and none was worth its cost at this batch."""
        return self._chooser is not None and self._chooser.stopped and self._chooser.size == 1

    def grown_chances(self) -> list[float]:
        """The path chances of every node the growth placed, cut or not, in placement order: what this row
        would emit from a tree of each size, next step's guess when the batch picks its width."""
        return self._chooser.chances if self._chooser is not None else []


def batch_width(cost: BatchCost, chances: list[list[float]], trust: float = 1.0) -> int:
    """The width (nodes per row, root included) maximising the step's expected tokens per second when every row
    may fill its tree up to it: row r emits 1 + its first w - 1 chances (``chances[r]``, best first; from its
    last tree, so scaled by ``trust``, what such guesses turned out to be worth). Rows size their trees one by
    one, and each alone seldom pays for widening every row's forward pass; together they may, so the width is
    chosen for all of them first."""
    rows, forward, h = len(chances), cost.forward_table(len(chances)), cost.host_per_node
    best_w, best_rate = 1, rows / (forward[1] + h * rows)
    expected, nodes = float(rows), rows
    longest = min(max((len(c) for c in chances), default=0) + 1, cost.max_width)
    for w in range(2, longest + 1):
        for c in chances:
            if len(c) >= w - 1:
                expected += trust * c[w - 2]
                nodes += 1
        rate = expected / (forward[w] + h * nodes)
        if rate > best_rate:
            best_w, best_rate = w, rate
    return best_w


class ShareTable:
    """T(n) of a row's share, n = 0..max_width, read lazily: growth stops after a few sizes, and building the
    whole table for every row of every step would cost more host time than the reads."""

    def __init__(self, forward: list[float], floor: float, host_per_node: float, other_nodes: int):
        self.forward, self.floor, self.h, self.others = forward, floor, host_per_node, other_nodes

    def __len__(self) -> int:
        return len(self.forward)

    def __getitem__(self, n: int) -> float:
        if n == 0:
            return 0.0
        return max(self.floor, self.forward[n]) + self.h * (self.others + n)


class SizeChooser:
    """Best-first growth with a stop: feed the path chance of each node as it is placed (non-increasing, as
    best-first growth on chances <= 1 places them); ``size`` is the tree size (root included) with the best
    expected tokens per second so far, ``worth_growing`` says whether a bigger tree could still beat it.

    The bound: every node still to come has a chance <= ``next_chance`` (the best unplaced one), so a tree of
    k nodes emits at most E(n) + (k - n) * next_chance. Between two grid sizes a < k <= b that is at most
    E(n) + (b - n) * next_chance, over at least T(a + 1) seconds (T never decreases): one check per grid
    segment. Where steps are cheap that bound stays loose (it assumes every later node as likely as the next),
    and growth goes on long after the best size, paying drafting for nodes that are cut. So growth also stops
    at twice the best size so far plus 4: a step-cost curve whose sizes double (the static buckets 16, 32, 64)
    is still searched one bucket beyond the best.
    """

    def __init__(self, table: Sequence[float], limit: int, grid: Sequence[int] = SIZES, base: float = 0.0):
        self.t = table
        self.limit = min(limit, len(table) - 1)
        self.n, self.expected = 1, 1.0 + base  # ``base``: tokens the step's other rows are expected to emit
        self.size, self.best = 1, self.expected / table[1]
        self.best_expected = self.expected
        self.grid = _checkpoints(self.limit, tuple(grid))
        self.chances: list[float] = []  # of the nodes placed, in order
        self.stopped = False  # growth ended because no bigger tree could pay (not for want of candidates)

    def place(self, chance: float) -> None:
        self.n += 1
        self.expected += chance
        self.chances.append(chance)
        rate = self.expected / self.t[self.n]
        if rate > self.best:
            self.size, self.best, self.best_expected = self.n, rate, self.expected

    def worth_growing(self, next_chance: float) -> bool:
        n, t, e = self.n, self.t, self.expected
        self.stopped = True
        if n >= self.limit or n >= 2 * self.size + 4:
            return False
        a = n
        for b in self.grid[bisect.bisect_right(self.grid, n):]:
            if (e + (b - n) * next_chance) / t[a + 1] > self.best:
                self.stopped = False
                return True
            a = b
        return False


@lru_cache(maxsize=64)
def _checkpoints(limit: int, grid: tuple[int, ...]) -> tuple[int, ...]:
    """The grid sizes below ``limit``, then ``limit``: where growth checks its bound (once per limit, not per step)."""
    return tuple(sorted({g for g in grid if g < limit} | {limit}))


def best_size(chances: Sequence[float], chooser: SizeChooser) -> int:
    """The tree size (root included) maximising expected tokens per second, for nodes whose path chances come
    in placement order (a chain, or a template in order of decreasing chance)."""
    for c in chances[: chooser.limit - 1]:
        chooser.place(c)
    return chooser.size
