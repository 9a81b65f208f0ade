"""What a decoding step costs on this machine, measured, and the tree size that it makes worth drafting.

A step that verifies n tokens emits, in expectation, E(n) = 1 + sum of its draft nodes' path chances (the bonus
token is always emitted; a node adds a token exactly when its whole path is accepted). It takes T(n) = the
forward pass for n tokens + the host's drafting work for n nodes. Drafters grow trees best-first and keep the
size that maximises E(n) - rate * T(n), ``rate`` being the tokens per second the run achieves (``Pace``: what
maximises the run's throughput, not the step's own), or E(n) / T(n) until that rate is known; n = 1 (the root
alone: a plain greedy step) is always a candidate, so where nothing is predictable a step costs what an ``ar``
step costs.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from itertools import accumulate

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
# A batch-1 step's grid: every size up to 16, where most trees land and where a CPU's matrix kernels make some
# sizes dearer than the next (SmolLM2-135M, 2 AMD EPYC cores, fp32, ms: 3 tokens 87.3, 4 tokens 82.6; 7 99.8, 8
# 94.4; benchmarks/step_costs.py), then SIZES. A size between two grid sizes would be priced between them, and its
# steps would move both.
STEP_SIZES = tuple(range(1, 17)) + tuple(s for s in SIZES if s > 16)
REFRESH = 16
UNKNOWN = math.inf  # the cost of a size nothing has timed yet, nor can be inferred: no normal step goes there
PROBE_FIRST, PROBE_MOST = 4, 256  # steps between probes: soon at first, then doubling while probes confirm
CORRECTED = 0.75  # a probe that took less than this share of the estimate shows the estimate was wrong
DIP_STEPS = 8  # steps at each of two sizes before the smaller is believed the dearer (``StepCost.dips``)


class Probes:
    """When a step is a probe, and of which size: the cost model's guard against locking itself out.

    A size's estimate is corrected only by steps of about that size, and a size believed unprofitable is never
    chosen: one pessimistic estimate (a start-up timing or a first step taken while the machine was busy, a
    spike) would stand for the rest of the run, and with it the trees it rules out. So every ``interval`` steps
    one step is a probe: its tree may grow, as if nodes cost nothing, up to a ``rung``: one of the next two
    power-of-two sizes (or buckets) above the widest step since the last probe, alternately. What it took is
    believed at once where it is cheaper than the estimate (timing noise on a shared machine only ever adds
    time). The interval doubles while probes confirm the estimates, up to PROBE_MOST steps, and falls back to
    PROBE_FIRST when one corrects them. The first probe comes at the second step: the run's own steps are the
    only timing the model starts from (nothing is timed on copies of a prompt that may be an outlier).

    A confirmed interval is counted in the probe's own price (``price``: what a step of the rung costs in
    one-token steps, from the estimates the probes confirmed): a rung of 64 tokens costs SmolLM2 3-4 one-token
    steps on a CPU (60 ms a token, 180-260 ms at 64; the demo model 2.7), so one every 256 steps cost a steady
    run about 1% of its time; spaced by its price, a probe of any rung costs under one step in PROBE_MOST.
    While probes correct the estimates (the interval at PROBE_FIRST) the price is not trusted and adds no wait.
    """

    def __init__(self, sizes: Sequence[int], buckets: bool, price: Callable[[int], float] | None = None):
        self.rungs = tuple(s for s in sizes if s >= 2 and (buckets or s & (s - 1) == 0))
        self.price = price
        self.interval, self.countdown = PROBE_FIRST, 1
        self.widest = 1  # the widest normal step since the last probe
        self.last = 0  # the rung of the last probe
        self.rung: int | None = None  # the size of the probe that is due, None while none is
        self.priced = False  # the interval ran out and the wait for the rung's price was added

    def reset(self) -> None:
        """Every size was just timed (a warm-up): the first probe waits a whole interval."""
        self.interval = self.countdown = PROBE_FIRST
        self.widest, self.last, self.rung, self.priced = 1, 0, None, False

    def step(self, tokens: int) -> None:
        """A normal (not probing) step of ``tokens`` tokens was observed."""
        self.widest = max(self.widest, tokens)
        if self.rung is None:
            self.countdown -= 1
            if self.countdown <= 0:
                self._fall_due()

    def done(self, corrected: bool) -> None:
        """A probe step was observed; ``corrected``: it changed an estimate (a first timing, or a much lower one)."""
        self.interval = PROBE_FIRST if corrected else min(2 * self.interval, PROBE_MOST)
        self.countdown, self.rung, self.widest, self.priced = self.interval, None, 1, False

    def _fall_due(self) -> None:
        """The interval ran out: the probe is due, or first waits (price - 1) intervals more (see the class)."""
        above = [r for r in self.rungs if r > self.widest][:2]
        if not above:  # the widest size is in use: nothing above it to re-test
            self.done(False)
            return
        rung = next((r for r in above if r > self.last), above[0])
        if not self.priced and self.price is not None and self.interval > PROBE_FIRST:
            self.priced = True
            self.countdown = round((self.price(rung) - 1.0) * self.interval)
            if self.countdown > 0:
                return
        self.last = self.rung = rung


def probe_price(one: float, wide: float, tokens: int) -> float:
    """A step of ``tokens`` (costing ``wide``) in steps of one token (``one``), for spacing probes: 1 where either
    is unknown (a first timing is worth its step), at most ``tokens`` (n tokens in one pass never cost n passes:
    a pessimistic estimate cannot put its own correction off further than that)."""
    return 1.0 if UNKNOWN in (one, wide) or one <= 0 else min(max(wide / one, 1.0), float(tokens))


class HostCost:
    """The host's drafting seconds a step as ``fixed + per_node * nodes``, fitted by least squares over the
    run's recent steps (exponential forgetting, DECAY a step). Only the slope sizes trees: the fixed part
    (writing the step's tokens into the memories, reading the learned chances, the root's candidates, laying
    the tree out) is paid by every size, the root alone included. Seconds over nodes would charge it to every
    node: on the demo model at batch 1, 50 us a node where each node cost 20 us (and 0.2-0.3 ms a step was
    fixed), so trees were sized as if drafting cost two and a half times what it did.

    Trees of a single size say nothing about the slope: until the sizes vary (MIN_SPREAD), the estimate stays
    where it was (0 at first, as a forward size nothing has timed is met by growing into it). It never exceeds
    seconds over nodes, the charge a fixed part of 0 would give."""

    DECAY, MIN_SPREAD = 0.05, 0.5  # MIN_SPREAD: the variance of the steps' node counts (nodes squared)

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.per_node = 0.0

    def observe(self, nodes: int, seconds: float) -> float:
        """One step's drafting: ``nodes`` tree nodes kept, ``seconds`` of propose + observe; the new slope."""
        d, keep = self.DECAY, 1.0 - self.DECAY
        self.w = keep * self.w + d
        self.x = keep * self.x + d * nodes
        self.y = keep * self.y + d * seconds
        self.xx = keep * self.xx + d * nodes * nodes
        self.xy = keep * self.xy + d * nodes * seconds
        mx, my = self.x / self.w, self.y / self.w
        spread = self.xx / self.w - mx * mx
        if spread >= self.MIN_SPREAD:
            slope = (self.xy / self.w - mx * my) / spread
            self.per_node = min(my / mx, max(0.0, slope))
        return self.per_node


class StepCost:
    """Seconds per verification step as a function of the tokens in the forward pass.

    Starts knowing nothing (or a warm-up timing, ``set``) and learns from the run's own steps: each observed
    step moves the two grid sizes around it towards what it took (weighted by distance), so the model tracks a
    machine that gets busier or a prefix that grows; the first step at a size sets it. A size never stepped at is
    inferred from those that were (``_fill``): linear in between, linear one doubling beyond the largest (a
    bigger guess would be a leap: farther sizes are reached by growing into them or by a probe, see ``Probes``),
    UNKNOWN past that. With ``buckets`` (a static-shape engine pads every step to a bucket) a step costs what
    its bucket costs. ``alpha = 0`` freezes the model (given costs, e.g. projected ones): no learning, no probes.

    ``dips``: a size may cost more than a bigger one (a CPU's matrix kernels run 4 tokens faster than 3 on
    SmolLM2, reproducibly): a tree of 3 nodes is then priced dearer than one of 4, and sizing, which ranks sizes
    by these costs, takes the 4th node where it has one. A dip is believed once both sizes were stepped at
    DIP_STEPS times, and each size's estimate is the mean of its steps until there are 1 / alpha of them: one
    slow first step at a size, never chosen again, cannot price it out for good; until then the smaller size
    costs what the bigger one does. Bounds on bigger trees read ``floor`` (what any size from n up costs at
    least). Without ``dips`` (a batch's widths, padded to powers of two) the costs never decrease and a step
    caps the sizes below it at what it took, which drags them towards the fastest step above: on SmolLM2's
    second text set, 3 tokens so learned cost 67.6 ms where its steps took 83.3 (median; docs/benchmarks.md).
    """

    def __init__(self, sizes: Sequence[int] = STEP_SIZES, buckets: Sequence[int] | None = None, alpha: float = 0.05,
                 probes: bool = True, dips: bool = True):
        self.sizes = tuple(buckets or sizes)
        self.buckets = tuple(buckets) if buckets else None
        self.alpha = alpha
        self.dips = dips
        self.seconds: list[float] | None = None  # per grid size (timed, observed or inferred); None until any is
        self.known = [False] * len(self.sizes)  # timed or observed, not inferred
        self.steps = [0.0] * len(self.sizes)  # the steps each size learned from (weighted), for ``dips``
        self.host_per_node = 0.0  # drafting work (propose + observe) per tree node, seconds (``HostCost``)
        self.host = HostCost()
        self.pace = Pace()  # tokens per second the run achieves: what a step's marginal node must beat
        self.probes = Probes(self.sizes, self.buckets is not None, self._price) if probes else None
        self.probing = False  # the step being drafted is a probe (set by ``chooser``)
        self.templates: Callable[[], list[list[float]]] | None = None  # neighbours' shapes (``BatchCost``)
        self._table: list[float] | None = None  # forward(n) for n = 0..max, rebuilt lazily after updates
        self._with_host: tuple | None = None  # (the forward table it was built from, T(n), its floor)
        self._stale = 0  # observations since the table was built: estimates move slowly, so it is rebuilt
        # every REFRESH observations, not every step (a rebuild is 64 interpolations: more than a step's drafting)

    @property
    def measured(self) -> bool:
        return self.seconds is not None

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    @property
    def frozen(self) -> bool:
        return self.alpha == 0

    def chooser(self, paced: bool = True, probe: bool = True) -> "SizeChooser":
        """A fresh stop rule for one tree's best-first growth (one request per step: batch 1). When a probe is
        due, the tree may grow up to the probe's size as if its nodes cost nothing. ``paced``: sized against
        the run's own rate (``Pace``) once it is known, else by the step's own tokens per second. ``probe``
        False: a tree no step will time (an answer's opening, verified by its prompt's prefill) never takes
        the probe: it would grow as if its nodes were free and leave the probe to the next step anyway."""
        rung = self.probe() if probe else None
        if rung is not None:
            self.probing = True
            first = self.table()[1]
            return SizeChooser([0.0] + [first if first < UNKNOWN else 1.0] * rung, rung)
        _, table, floor = self._tables()  # both in one read (``table()`` and ``floor()`` would each check them)
        return SizeChooser(table, self.max_tokens, rate=self.pace.rate if paced else None, floor=floor)

    def best_size(self, chances: Sequence[float]) -> int:
        return best_size(chances, self.chooser())

    def probe(self) -> int | None:
        """The size the next step probes, or None (no probe due, or frozen costs)."""
        if self.probes is None or self.frozen or self.seconds is None:
            return None
        return self.probes.rung

    def _price(self, tokens: int) -> float:
        """A probe of ``tokens`` in one-token steps, as estimated (``probe_price``)."""
        return probe_price(self(1), self(tokens), tokens)

    def set(self, seconds: Sequence[float]) -> None:
        """A timing of every grid size (a warm-up, or given costs)."""
        if len(seconds) != len(self.sizes):
            raise ValueError("one timing per grid size")
        self.seconds = list(seconds)
        self.known = [True] * len(self.sizes)
        # A timing of every size is believed as it is (its dips too) and moves as a moving average from here.
        self.steps = [max(float(DIP_STEPS), 1.0 / self.alpha if self.alpha else 0.0)] * len(self.sizes)
        if self.probes is not None:
            self.probes.reset()
        self._changed()

    def observe(self, tokens: int, seconds: float, weight: float = 1.0, bound: bool = True,
                contended: bool = False) -> bool:
        """A verification step of ``tokens`` took ``seconds`` (``weight``: how much this curve owns the step,
        when a batched step falls between two curves). One slow outlier (another process, a page fault) counts
        at most three times the current estimate, so it cannot make a size look unaffordable for good. Timing
        noise on a shared machine only ever adds time, so a step under half its estimate moves it halfway (the
        machine or the prefix changed), and a probe (``chooser`` handed one out) is believed at once where it
        is cheaper than the estimate. ``bound`` (without ``dips``): no smaller step costs more than this one took.
        A ``contended`` step (other work shared the cores) says only that its size costs at most what it took:
        it lowers an estimate, timed or inferred, and never raises one. Believed, its contention would price the
        size out, and a size priced out is not stepped at again to be corrected.
        Returns whether an estimate was corrected: a size timed for the first time well under what was inferred
        for it (or with nothing inferred), or one a probe found much cheaper."""
        probing, self.probing = self.probing, False
        if self.frozen:
            return False
        if self.seconds is None:
            self.seconds = [UNKNOWN] * len(self.sizes)
        lo, hi, w = self._bracket(tokens)
        corrected = first = surprised = False  # surprised: a step far from its estimate (rebuild the tables now)
        for j, share in ((lo, 1.0 - w), (hi, w)):
            if share <= 0:
                continue
            if contended and seconds >= self.seconds[j]:
                continue
            if not self.known[j]:
                if weight * share >= 0.5:  # the nearer grid size takes the first timing whole
                    # A correction (probes come sooner again) where it is much cheaper than what was inferred
                    # for it, or nothing was: a batched run meets untimed (rows, width) cells all along, and a
                    # first timing that bears out its neighbours' shape finds nothing wrong.
                    corrected |= seconds < CORRECTED * self.seconds[j]
                    self.seconds[j], self.known[j] = seconds, True
                    self.steps[j] = weight * share
                    first = True
                continue
            estimate = self.seconds[j]
            self.steps[j] += weight * share
            if probing and seconds < estimate:
                corrected |= seconds < CORRECTED * estimate
                self.seconds[j] += weight * share * (seconds - estimate)
            else:
                rate = self.alpha if seconds > estimate / 2 else max(self.alpha, 0.5)
                if self.dips:  # the mean of the steps so far, until the moving average weighs more
                    rate = max(rate, 1.0 / self.steps[j])
                self.seconds[j] += rate * weight * share * (min(seconds, 3 * estimate) - estimate)
                surprised |= not estimate / 2 < seconds < 2 * estimate
        if bound and not self.dips:
            for j in range(bisect.bisect_left(self.sizes, tokens)):
                if self.known[j] and self.seconds[j] > seconds:
                    self.seconds[j] = seconds
        if self.probes is not None:
            if probing and tokens >= 2:
                self.probes.done(corrected)
            elif not probing:
                self.probes.step(tokens)
        if first or surprised or (probing and corrected):
            self._changed()
        else:
            self._stale += 1
        return corrected

    def observe_host(self, nodes: int, seconds: float) -> None:
        """Drafting time of one step (propose + observe) for a tree of ``nodes`` nodes."""
        if nodes > 0:
            self.host_per_node = self.host.observe(nodes, seconds)

    def observe_yield(self, tokens: int, nodes: int) -> None:
        """A step of ``nodes`` nodes emitted ``tokens``: the run's rate, priced at what the model says such a step
        costs (its own units: a cost model uniformly off by a factor still sizes trees as a right one would)."""
        seconds = self.table()[min(nodes, self.max_tokens)]
        if 0 < seconds < UNKNOWN:
            self.pace.observe(tokens, seconds)

    def __call__(self, tokens: int) -> float:
        """Forward-pass seconds for a step of ``tokens`` tokens (the root included; at most ``max_tokens``);
        UNKNOWN where nothing timed it."""
        if self.seconds is None:
            return UNKNOWN
        if self.buckets:
            return self.seconds[min(bisect.bisect_left(self.buckets, tokens), len(self.buckets) - 1)]
        lo, hi, w = self._bracket(tokens)
        a, b = self.seconds[lo], self.seconds[hi]
        if w == 0.0 or a == b:
            return a
        return UNKNOWN if UNKNOWN in (a, b) else a + w * (b - a)

    def table(self) -> list[float]:
        """T(n) for n = 0..max_tokens: forward pass + drafting (non-decreasing without ``dips``)."""
        return self._tables()[1]

    def floor(self) -> list[float]:
        """The least T(k) for k >= n, n = 0..max_tokens: what a tree of n nodes or more costs at least, for
        bounds on what bigger trees can earn (``table`` itself where it never decreases)."""
        return self._tables()[2]

    def _tables(self) -> tuple[list[float], list[float], list[float]]:
        forward = self.forward_table()
        if self._with_host is None or self._with_host[0] is not forward:  # drafting time as of this rebuild
            t = [forward[n] + self.host_per_node * n for n in range(self.max_tokens + 1)]
            if not self.dips:
                t = list(accumulate(t, max))
            floor = list(accumulate(reversed(t), min))[::-1] if self.dips else t
            self._with_host = (forward, t, floor)
        return self._with_host

    def forward_table(self) -> list[float]:
        """The forward pass alone for n = 0..max_tokens tokens (non-decreasing without ``dips``), rebuilt every
        REFRESH observations."""
        if self._table is None or self._stale >= REFRESH:
            self._stale = 0
            self._fill(self.templates() if self.templates is not None else ())
            t = [0.0] + [self(n) for n in range(1, self.max_tokens + 1)]
            self._table = self._believed_dips(t) if self.dips else list(accumulate(t, max))
        return self._table

    def _believed_dips(self, t: list[float]) -> list[float]:
        """``t`` where each size costs at most what a bigger one does, but where both were stepped at often
        enough (``dips``)."""
        floor, at = UNKNOWN, 0  # the least cost above n, and the size that costs it
        for n in range(len(t) - 1, 0, -1):
            if t[n] <= floor:
                floor, at = t[n], n
            elif not (self._stepped(n) and self._stepped(at)):
                t[n] = floor
        return t

    def _stepped(self, tokens: int) -> bool:
        lo, hi, _ = self._bracket(tokens)
        return min(self.steps[lo], self.steps[hi]) >= DIP_STEPS

    def _changed(self) -> None:
        """An estimate moved a lot (a first timing, a probe's correction): rebuild the tables at the next read."""
        self._stale = REFRESH

    def _fill(self, templates: Sequence[Sequence[float]] = ()) -> None:
        """Infer the sizes nothing has timed from those something has: linear between two timed sizes; above the
        largest, the shape of the first of ``templates`` (other curves' own values: a batched step's neighbours,
        nearest first) that has one, else linear from the two largest timed sizes above 1 (a one-token step
        carries no mask: no slope from it), one doubling at most; below the smallest, as ``_below``; UNKNOWN
        where nothing says anything. A curve nothing has timed is the first template, its gaps filled alike."""
        known = [j for j, k in enumerate(self.known) if k]
        if not known:
            if templates:
                self.seconds = list(templates[0])
                low = next((j for j, v in enumerate(self.seconds) if v < UNKNOWN), None)
                if low is not None:
                    _below(self.seconds, low, templates[1:])
            return
        s, sizes = self.seconds, self.sizes
        top = known[-1]
        wide = [j for j in known if sizes[j] >= 2][-2:]
        slope = 0.0
        if len(wide) == 2:
            slope = max(0.0, (s[wide[1]] - s[wide[0]]) / (sizes[wide[1]] - sizes[wide[0]]))
        _below(s, known[0], templates)
        before = known[0]
        for j in range(known[0], len(sizes)):
            if self.known[j]:
                before = j
            elif j < top:
                after = next(k for k in known if k > j)
                f = (sizes[j] - sizes[before]) / (sizes[after] - sizes[before])
                s[j] = s[before] + f * (s[after] - s[before])
            elif (shape := _lender(templates, j, top)) is not None:
                s[j] = s[top] * shape[j] / shape[top]
            elif sizes[j] <= 2 * sizes[top]:
                s[j] = s[top] + slope * (sizes[j] - sizes[top])
            else:
                s[j] = UNKNOWN

    def own_values(self) -> list[float]:
        """The grid's values inferred from this curve's own timings alone (for a neighbour's ``_fill``): UNKNOWN
        below the smallest size timed, where its flat guess would be no shape to lend."""
        if True not in self.known:
            return [UNKNOWN] * len(self.sizes)
        mine = StepCost(self.sizes, self.buckets, probes=False, dips=self.dips)
        mine.seconds, mine.known = list(self.seconds), list(self.known)
        mine._fill()
        low = self.known.index(True)
        return [UNKNOWN] * low + mine.seconds[low:]

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


def _below(seconds: list[float], low: int, templates: Sequence[Sequence[float]]) -> None:
    """Sizes under ``low`` (the smallest with a value) take ``low``'s cost times the first template's multiple
    of it there (at most 1), where a template has both; else ``low``'s cost. A batch's drain steps its fewer
    rows wide, so their curves are timed at wide widths alone: flat beneath, a one-token step of 9 rows was
    priced at 23.6 ms (a 16-row one took 6-7), every width alike, and the widest trees looked free
    (docs/benchmarks.md, thirty-first session)."""
    for j in range(low):
        shape = _lender(templates, j, low)
        seconds[j] = seconds[low] * min(1.0, shape[j] / shape[low]) if shape is not None else seconds[low]


def _lender(templates: Sequence[Sequence[float]], j: int, at: int) -> Sequence[float] | None:
    """The first template with values at both ``j`` and ``at``: its shape between them is the one lent."""
    return next((t for t in templates if t[j] < UNKNOWN and t[at] < UNKNOWN), None)


ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)


class BatchCost:
    """Seconds per batched step as a function of its rows B and width T (every row's tree padded to T nodes):
    one ``StepCost`` over widths per row count of a grid, linear in between.

    Not a function of B * T alone: each row attends over its own cache, which grows with B (2 CPU cores, demo
    model, 300 cached positions: sixteen rows of one token cost 7.1 ms, one row of sixteen tokens 5.0 ms).
    Learned from the run's own steps, like ``StepCost``, with one probe schedule for the whole batch (a probe
    step lets every row's tree grow, at no believed cost, up to the probe's width). A row count whose curve has
    not been timed at some width borrows the shape of the nearest row count's curve that has (a width costs
    about the same multiple of a one-node step at 12 rows as at 16), scaled to its own timings.
    """

    def __init__(self, max_batch: int, per_row: int, buckets: Sequence[int] | None = None):
        self.rows = tuple(sorted({r for r in ROWS if r < max_batch} | {max_batch}))
        widths = tuple(sorted({w for w in WIDTHS if w < per_row} | {per_row}))
        # Faster to follow than batch 1's: a run's rows are ragged and their caches grow (a wide step at 16 rows
        # costs 15-30% more late in a run than early); wide steps are rare, so each must count. ``buckets``: a
        # static-shape engine pads every step to a width bucket (and runs every slot), so a step costs its bucket's.
        self.by_rows = {r: StepCost(widths, buckets=buckets, alpha=0.2, probes=False, dips=False) for r in self.rows}
        for r, curve in self.by_rows.items():
            curve.templates = self._templates_for(r)
        self.max_width = per_row
        self.host_per_node = 0.0  # as StepCost's, over every row's steps
        self.host = HostCost()
        self.probes = Probes(buckets or widths, buckets is not None, self._price)
        self.last_rows = 1  # the rows of the last step: the probe's price is read at them
        self.probing = False  # the step being drafted is a probe (set by the batch, see ``probe``)
        self.busy = False  # the step being drafted shares the cores with other work (set by the batch)
        self._stale = 0
        self._tables: dict[int, tuple[list[float], list[float], list[float]]] = {}

    @property
    def measured(self) -> bool:
        return all(c.measured for c in self.by_rows.values())

    @property
    def frozen(self) -> bool:
        return all(c.frozen for c in self.by_rows.values())

    def probe(self) -> int | None:
        """The width the next step probes (every row's tree may grow to it), or None."""
        if self.frozen or not any(any(c.known) for c in self.by_rows.values()):
            return None
        return self.probes.rung

    def set_all(self, seconds: Sequence[float]) -> None:
        """Every row count costs these (a static-shape engine runs every slot every step)."""
        for curve in self.by_rows.values():
            curve.set(seconds)
        self.probes.reset()

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A step of ``rows`` rows at width ``width`` took ``seconds``: the cells around it move towards it (only
        the curve of fewer rows learns that its narrower steps cost no more). A ``busy`` step (the batch's next
        turns were being prepared on the same cores) can lower a cell's cost, never raise it: such steps took up
        to 78 ms where quiet ones took 6-11, and one width-2 step of 39 ms priced width 2 out for the rest of a
        run (docs/benchmarks.md, thirty-second session)."""
        probing, self.probing = self.probing, False
        busy, self.busy = self.busy, False
        self.last_rows = rows
        lo, hi, w = self._bracket(rows)
        self.by_rows[lo].probing = probing
        corrected = self.by_rows[lo].observe(width, seconds, 1.0 - w, contended=busy)
        if hi != lo:
            self.by_rows[hi].probing = probing
            corrected |= self.by_rows[hi].observe(width, seconds, w, bound=False, contended=busy)
        if not self.frozen:
            if probing and width >= 2:
                self.probes.done(corrected)
            elif not probing:
                self.probes.step(width)
        self._stale += 1
        if corrected or self._stale >= REFRESH:  # neighbours' shapes changed too: every curve rebuilds
            self._stale = 0
            for curve in self.by_rows.values():
                curve._changed()

    def _price(self, width: int) -> float:
        """A probe's price at the last step's rows: its width's step in one-node steps (``StepCost._price``)."""
        table = self.forward_table(self.last_rows)
        return probe_price(table[1], table[min(width, self.max_width)], width)

    def observe_host(self, nodes: int, seconds: float) -> None:
        """Drafting time of one row's step (propose + observe) for a tree of ``nodes`` nodes."""
        if nodes > 0:
            self.host_per_node = self.host.observe(nodes, seconds)

    def forward_table(self, rows: int) -> list[float]:
        """Forward seconds of a step of ``rows`` rows at width n, for n = 0..max_width (non-decreasing)."""
        lo, hi, w = self._bracket(rows)
        low, high = self.by_rows[lo].forward_table(), self.by_rows[hi].forward_table()
        cached = self._tables.get(rows)
        if cached is None or cached[0] is not low or cached[1] is not high:
            mixed = low if w == 0.0 else [UNKNOWN if UNKNOWN in (a, b) else a + w * (b - a)
                                         for a, b in zip(low, high)]
            cached = (low, high, mixed)
            self._tables[rows] = cached
        return cached[2]

    def _templates_for(self, rows: int):
        """The other row counts' own values, nearest first (ties: more rows, the dearer guess)."""
        others = sorted((r for r in self.rows if r != rows), key=lambda r: (abs(r - rows), -r))

        def templates() -> list[list[float]]:
            return [self.by_rows[r].own_values() for r in others if any(self.by_rows[r].known)]
        return templates

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
        width = min(self.width, self.max_tokens)
        floor = forward[width] if forward[width] < UNKNOWN else forward[1]  # a probe's width may be untimed
        return ShareTable(forward, width, floor, self.cost.host_per_node, self.other_nodes)

    def chooser(self, paced: bool = True, probe: bool = True) -> SizeChooser:
        """Sized by the step's own rate: with every other row's tokens in ``base`` that is already about the
        run's rate (``Pace``), so ``paced`` changes nothing here; nor does ``probe`` (the batch sets a probe's
        width for every row)."""
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
        """The path chances of every node the growth placed, cut or not, in placement order, then that of the
        node it stopped before (``SizeChooser.beyond``): what this row would emit from a tree of each size, next
        step's guess when the batch picks its width. Growth stops where one more node does not pay for widening
        every row's step alone; without that node the guess would mostly end at this step's width, and the batch
        would widen mostly at probes (docs/benchmarks.md, thirty-fifth section)."""
        chooser = self._chooser
        if chooser is None:
            return []
        return chooser.chances if chooser.beyond is None else chooser.chances + [chooser.beyond]


def batch_width(cost: BatchCost, chances: list[list[float]], trust: float = 1.0) -> int:
    """The width (nodes per row, root included) maximising the step's expected tokens per second when every row
    may fill its tree up to it: row r emits 1 + its first w - 1 chances (``chances[r]``, best first; from its
    last growth and the node it stopped before, ``RowShare.grown_chances``, so scaled by ``trust``, what such
    guesses turned out to be worth). Rows size their trees one by one, and each alone seldom pays for widening
    every row's forward pass; together they may, so the width is chosen for all of them first. Each row's chances
    come best first, so the tokens one more node a row adds never grow with the width: the search stops where even
    that many more, at the next width's cost, cannot win."""
    rows, forward, h = len(chances), cost.forward_table(len(chances)), cost.host_per_node
    best_w, best_rate = 1, rows / (forward[1] + h * rows)
    expected, nodes = float(rows), rows
    longest = min(max((len(c) for c in chances), default=0) + 1, cost.max_width)
    for w in range(2, longest + 1):
        gain = 0.0
        for c in chances:
            if len(c) >= w - 1:
                gain += trust * c[w - 2]
                nodes += 1
        expected += gain
        rate = expected / (forward[w] + h * nodes)
        if rate > best_rate:
            best_w, best_rate = w, rate
        if w == longest or (expected + (longest - w) * gain) / (forward[w + 1] + h * nodes) <= best_rate:
            break
    return best_w


def draining_width(cost: BatchCost, chances: list[list[float]], bounding: list[bool], trust: float = 1.0) -> int:
    """``batch_width`` for a batch whose run lasts as long as its slowest row (nothing will join it): the step's
    worth is how far it moves the run's end, the tokens of the bounding row that gains least (1 + its first
    w - 1 chances, scaled by ``trust``; rows that do not bound the run count for nothing), per second of the
    whole batch's step. Where many rows bound the run (prompts that all run to their limit) a node pays only if
    every one of them gains: a wider step seldom does."""
    rows, forward, h = len(chances), cost.forward_table(len(chances)), cost.host_per_node
    bound = [c for c, b in zip(chances, bounding) if b]
    best_w, best_rate = 1, 1.0 / (forward[1] + h * rows)
    longest = min(min((len(c) for c in bound), default=0) + 1, cost.max_width)
    for w in range(2, longest + 1):
        slowest = 1.0 + trust * min(sum(c[:w - 1]) for c in bound)
        rate = slowest / (forward[w] + h * (rows + len(bound) * (w - 1)))
        if rate > best_rate:
            best_w, best_rate = w, rate
    return best_w


class OpeningCost:
    """What a joining row's opening costs where it rides on a joint prefill (batched decoding), for sizing it.

    Each node is one more token of a pass that runs anyway, plus its drafting (``host_s``); each token it gets
    accepted is one the row need not emit in a step (``emit_s``: seconds a step spends per token it emits, over
    all its rows). So a node pays while its path chance beats their ratio: the chooser ranks sizes by
    E(n) - T(n) with T(n) = 1 + (n - 1) * ratio, in units of a step's token. A prefill token's cost is the
    slope of a join's seconds over its tokens (a least-squares line through the run's joins, moving averages
    of its moments): a small join's seconds per token is mostly the pass's fixed cost, which no node adds to.
    Nothing is guessed: until a step and two joins of different sizes were seen ``known`` is False and a joining
    row drafts nothing.
    """

    RATE = 0.2

    def __init__(self, max_nodes: int):
        self.max_nodes = max_nodes
        self.emit_s: float | None = None
        self.host_s = 0.0  # drafting seconds per node (BatchCost.host_per_node, set by the batch)
        self._moments: list[float] | None = None  # means of tokens, seconds, tokens^2, tokens * seconds

    @property
    def token_s(self) -> float | None:
        """Seconds one more token adds to a joint prefill, None while the joins' sizes have not varied."""
        if self._moments is None:
            return None
        x, y, xx, xy = self._moments
        var = xx - x * x
        if var <= 1e-9 * xx:
            return None
        return min(max(0.0, (xy - x * y) / var), y / x)  # at most the mean seconds per token

    @property
    def known(self) -> bool:
        return self.emit_s is not None and self.token_s is not None

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        new = [tokens, seconds, tokens * tokens, tokens * seconds]
        if self._moments is None:
            self._moments = new
        else:
            self._moments = [m + self.RATE * (v - m) for m, v in zip(self._moments, new)]

    def observe_step(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            rate = seconds / tokens
            self.emit_s = rate if self.emit_s is None else self.emit_s + self.RATE * (rate - self.emit_s)

    def ratio(self) -> float:
        """The path chance a node must beat to pay for itself."""
        return (self.token_s + self.host_s) / self.emit_s

    def chooser(self, paced: bool = True, probe: bool = True) -> SizeChooser:
        """Sizes ranked by E(n) - T(n), time counted in a step's tokens (so the rate is 1): ``paced`` and ``probe``
        change nothing here."""
        ratio = self.ratio()
        table = [0.0] + [1.0 + n * ratio for n in range(self.max_nodes)]
        return SizeChooser(table, self.max_nodes, rate=1.0)


class ShareTable:
    """T(n) of a row's share, n = 0..max_width, read lazily: growth stops after a few sizes, and building the
    whole table for every row of every step would cost more host time than the reads."""

    def __init__(self, forward: list[float], width: int, floor: float, host_per_node: float, other_nodes: int):
        self.forward, self.width, self.floor = forward, width, floor
        self.h, self.others = host_per_node, other_nodes

    def __len__(self) -> int:
        return len(self.forward)

    def __getitem__(self, n: int) -> float:
        if n == 0:
            return 0.0
        forward = self.floor if n <= self.width else max(self.floor, self.forward[n])  # up to the width: paid
        return forward + self.h * (self.others + n)


class Pace:
    """The run's decoding rate, tokens emitted per second of steps (drafting included) over its recent steps,
    each step priced by the cost model.

    The rate that sizes trees best: a run's throughput is (sum of tokens) / (sum of seconds) over its steps, and
    a step's choice maximises it when it maximises E(n) - rate * T(n) at the best achievable rate (the
    renewal-reward argument; iterating on the achieved rate converges to it, as in Dinkelbach's method). The
    step's own ratio E(n) / T(n) over-buys where the step is poor (its rate is below the run's: it grows nodes
    worth less than the run earns per second) and under-buys where it is rich.
    """

    def __init__(self, decay: float = 0.02, warm: int = 8):
        self.decay, self.warm = decay, warm
        self.tokens = self.seconds = 0.0
        self.steps = 0

    @property
    def rate(self) -> float | None:
        """Tokens per second, None until ``warm`` steps were seen."""
        return self.tokens / self.seconds if self.steps >= self.warm and self.seconds > 0 else None

    def observe(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens += self.decay * (tokens - self.tokens)
        self.seconds += self.decay * (seconds - self.seconds)


class SizeChooser:
    """Best-first growth with a stop: feed the path chance of each node as it is placed (non-increasing, as
    best-first growth on chances <= 1 places them); ``size`` is the tree size (root included) with the best
    value so far (E(n) - rate * T(n), or E(n) / T(n) without a rate), ``worth_growing`` says whether a bigger
    tree could still beat it.

    The bound: every node still to come has a chance <= ``next_chance`` (the best unplaced one), so a tree of
    k nodes emits at most E(n) + (k - n) * next_chance. Between two grid sizes a < k <= b that is at most
    E(n) + (b - n) * next_chance, over at least ``floor[a + 1]`` seconds (the least T from a + 1 up: ``table``
    where T never decreases), and both values grow with tokens and fall with seconds: one check per grid
    segment. Sizes are ranked by T itself, so where a size costs more than the next (``StepCost.dips``) the
    bigger tree wins. Where steps are cheap that bound stays loose (it assumes every later node as likely as
    the next), and growth goes on long after the best size, paying drafting for nodes that are cut. So growth
    also stops at twice the best size so far plus 4: a step-cost curve whose sizes double (the static buckets
    16, 32, 64) is still searched one bucket beyond the best.
    """

    def __init__(self, table: Sequence[float], limit: int, grid: Sequence[int] = SIZES, base: float = 0.0,
                 rate: float | None = None, floor: Sequence[float] | None = None):
        self.t = table
        self.floor = table if floor is None else floor
        self.limit = min(limit, len(table) - 1)
        self.rate = rate  # with a rate, sizes are ranked by E(n) - rate * T(n) (``Pace``), else by E(n) / T(n)
        self.n, self.expected = 1, 1.0 + base  # ``base``: tokens the step's other rows are expected to emit
        self.size, self.best = 1, self._value(self.expected, table[1])
        self.best_expected = self.expected
        self.grid = _checkpoints(self.limit, tuple(grid))
        self.after = _next_checkpoint(self.grid)  # n -> the first checkpoint above n (n < limit)
        self.chances: list[float] = []  # of the nodes placed, in order
        self.stopped = False  # growth ended because no bigger tree could pay (not for want of candidates)
        # The path chance of the node growth stopped before (``worth_growing`` said no to it): the best unplaced
        # one, so exactly the next node's chance in best-first order. None while growth goes on or ran out.
        self.beyond: float | None = None
        self._threshold: float | None = None

    def place(self, chance: float) -> float:
        """One more node, of path ``chance``; returns ``threshold()`` as it now stands (growth reads it at every
        node: computed here, where its parts are at hand)."""
        n = self.n = self.n + 1
        e = self.expected = self.expected + chance
        self.chances.append(chance)
        t = self.t
        seconds = t[n]
        rate = self.rate
        value = e / seconds if rate is None else e - rate * seconds  # ``_value``, inlined: every node
        if value > self.best:
            self.size, self.best, self.best_expected = n, value, e
        threshold = math.inf
        if n < self.limit and n < 2 * self.size + 4:  # ``threshold``, inlined
            seconds = self.floor[n + 1]
            need = self.best * seconds if rate is None else self.best + rate * seconds
            if need < math.inf:
                threshold = (need - e) / (self.after[n] - n)
        self._threshold = threshold
        return threshold

    def _value(self, expected: float, seconds: float) -> float:
        return expected / seconds if self.rate is None else expected - self.rate * seconds

    def worth_growing(self, next_chance: float) -> bool:
        n, e = self.n, self.expected
        self.stopped = True
        self.beyond = next_chance if n < self.limit else None  # no step is wider than the limit
        if n >= self.limit or n >= 2 * self.size + 4:
            return False
        a, rate, best, floor = n, self.rate, self.best, self.floor
        for b in self.grid[bisect.bisect_right(self.grid, n):]:
            most, seconds = e + (b - n) * next_chance, floor[a + 1]
            if (most / seconds if rate is None else most - rate * seconds) > best:  # ``_value``, inlined
                self.stopped, self.beyond = False, None
                return True
            a = b
        return False

    def threshold(self) -> float:
        """A chance above which growth surely goes on: the first grid segment's bound solved for the chance
        (it is linear in it). It moves only when a node is placed, so a drafter compares the chances it pops
        against it and asks ``worth_growing``, which checks every segment, only below it."""
        if self._threshold is None:
            n = self.n
            self._threshold = math.inf
            if n < self.limit and n < 2 * self.size + 4:
                b = self.after[n]
                seconds = self.floor[n + 1]
                need = self.best * seconds if self.rate is None else self.best + self.rate * seconds
                if need < math.inf:  # an untimed size (or an undefined bound): ask worth_growing
                    self._threshold = (need - self.expected) / (b - n)
        return self._threshold


@lru_cache(maxsize=64)
def _checkpoints(limit: int, grid: tuple[int, ...]) -> tuple[int, ...]:
    """The grid sizes below ``limit``, then ``limit``: where growth checks its bound (once per limit, not per step)."""
    return tuple(sorted({g for g in grid if g < limit} | {limit}))


@lru_cache(maxsize=64)
def _next_checkpoint(grid: tuple[int, ...]) -> tuple[int, ...]:
    """For each n below the last checkpoint, the first checkpoint above it: ``threshold``'s next segment."""
    return tuple(grid[bisect.bisect_right(grid, n)] for n in range(grid[-1]))


def best_size(chances: Sequence[float], chooser: SizeChooser) -> int:
    """The tree size (root included) maximising expected tokens per second, for nodes whose path chances come
    in placement order (a chain, or a template in order of decreasing chance)."""
    for c in chances[: chooser.limit - 1]:
        chooser.place(c)
    return chooser.size
