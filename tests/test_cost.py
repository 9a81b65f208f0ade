"""The step-cost model learns from the run's own steps and cannot lock itself out of drafting.

Timings here are never this machine's: every test gives the cost model a known "true" step cost (what the step
would have taken) in place of the measured seconds, so what is asserted is what the model learned and which
sizes the run stepped at, never how fast anything ran.
"""

from __future__ import annotations

import pytest

from recap_cli.batch import answer_all
from recap_cli.decoding.batched import BatchEngine
from recap_cli.decoding.cost import (PROBE_FIRST, PROBE_MOST, UNKNOWN, BatchCost, HostCost, OpeningCost, Probes,
                                     StepCost, batch_width, best_size)
from recap_cli.decoding.engine import Engine, generate
from recap_cli.decoding.tree import Source, Tree
from recap_cli.drafters import Drafter
from recap_cli.records import Request
from recap_cli.session import Session

from .conftest import request

SIZES = (1, 2, 4, 8, 16, 32, 64)


def cpu_like(n: int) -> float:
    """A one-row step of n tokens: 10 ms, plus a mask, plus 0.1 ms a token (seconds)."""
    return 0.010 + (0.002 if n > 1 else 0.0) + 0.0001 * n


def rows_like(rows: int, width: int) -> float:
    """A batched step: a fixed 5 ms, plus 1 ms a row, plus 0.05 ms a token (seconds)."""
    return 0.005 + 0.001 * rows + 0.00005 * rows * width


def grow(cost, chances) -> int:
    """What a best-first drafter does with ``cost``: places nodes of these path chances while bigger could pay."""
    sizer = cost.chooser()
    for chance in chances:
        if not sizer.worth_growing(chance):
            break
        sizer.place(chance)
    return sizer.size


GOOD = [0.95 ** (i + 1) for i in range(63)]  # a long chain the model would mostly accept


# --- the model alone ----------------------------------------------------------------------------------------


def test_a_pessimistic_start_is_corrected_by_probes():
    """Wide steps timed 20x too dear (a start-up taken while the machine was busy): without probes only
    one-token steps ever run and the estimates are never corrected; with them drafting comes back within a few
    probe intervals, and the estimate of the size in use ends close to the truth."""
    sizes_seen = {}
    for probes in (False, True):
        cost = StepCost(SIZES, probes=probes)
        cost.set([cpu_like(n) * (20 if n > 1 else 1) for n in SIZES])
        sizes = []
        for _ in range(300):
            size = grow(cost, GOOD)
            sizes.append(size)
            cost.observe(size, cpu_like(size))
        sizes_seen[probes] = sizes
    assert set(sizes_seen[False]) == {1}
    recovered = sizes_seen[True]
    first = next(i for i, s in enumerate(recovered) if s > 1)
    assert first <= PROBE_FIRST + 1  # the first probe
    assert min(recovered[60:]) >= 8  # normal steps draft again, and wide: the probes climbed
    in_use = recovered[-1]
    assert cost(in_use) == pytest.approx(cpu_like(in_use), rel=0.1)


def test_a_first_timing_that_bears_out_its_estimate_brings_no_probe_sooner():
    """A batched run meets untimed (rows, width) cells all along; a probe that times one at about what its
    neighbours' shape inferred found nothing wrong, so the probes keep spacing out (each wide probe of 16 rows
    costs 2-3 steps); one far under the inference, or where nothing was inferred, brings them back at once."""
    cost = StepCost((1, 2, 4, 8, 16))
    cost.observe(1, 0.010)
    cost.observe(2, 0.012)
    assert cost.forward_table()[4] == pytest.approx(0.012)  # inferred: one doubling from the widest timed
    interval = cost.probes.interval
    cost.probing = True
    cost.observe(4, 0.0125)  # borne out
    assert cost.probes.interval == 2 * interval
    cost.forward_table()
    cost.probing = True
    cost.observe(16, 0.02)  # nothing was inferred that far: a first timing corrects
    assert cost.probes.interval == PROBE_FIRST


def test_an_optimistic_start_is_corrected_by_the_steps_it_causes():
    """Wide steps believed as cheap as one token while they cost 10x: the trees they invite are timed, and the
    model learns enough of their price to stop drafting them (one slow step moves an estimate by at most a
    tenth at batch 1: a spike cannot make a size look unaffordable for good)."""
    dear = lambda n: 0.010 * (1 + 9 * (n > 1)) + 0.001 * n  # noqa: E731 - any step above one token is dear
    cost = StepCost(SIZES)
    cost.set([0.010] * len(SIZES))
    chances = [0.6 ** (i + 1) for i in range(63)]  # a few nodes' worth at best, not 10x
    sizes = []
    for _ in range(200):
        size = grow(cost, chances)
        sizes.append(size)
        cost.observe(size, dear(size))
    assert sizes[0] == 64 and sizes[60:].count(1) > 0.9 * len(sizes[60:])  # from the largest tree to the root
    assert all(cost(n) > 1.5 * 0.010 for n in SIZES[1:])


def test_a_size_dearer_than_the_next_keeps_its_price_and_is_passed_over():
    """A CPU's matrix kernels run some sizes slower than the next one up (SmolLM2 on 2 cores: 3 tokens 87 ms, 4
    tokens 83): the learned costs keep the dip, a tree with a good 4th node takes it, and one without stops at 2
    nodes rather than pay for a 3rd that does not earn its price. Where a step capped the sizes below it at what
    it took (``dips=False``, a batch's widths), 3 nodes were priced as cheap as 4 and chosen."""
    chosen = {}
    for dips in (True, False):
        cost = StepCost((1, 2, 3, 4, 8), dips=dips)
        cost.set([1.0, 1.1, 1.5, 1.3, 3.0])
        for _ in range(3):
            cost.observe(4, 1.3)
        cost.forward_table()
        assert cost(3) == (1.5 if dips else 1.3)
        assert cost.floor()[3] == 1.3 and cost.floor()[5] == pytest.approx(1.725)  # 5: between 4 and 8
        chosen[dips] = grow(cost, [0.6, 0.4, 0.1]), grow(cost, [0.6, 0.4])
    assert chosen[True] == (4, 2)  # E/T: 2.1 / 1.3 beats 1.6 / 1.1; 2.0 / 1.5 does not
    assert chosen[False] == (4, 3)


def test_one_slow_step_cannot_price_a_size_out_and_a_dip_its_steps_bear_out_is_believed():
    """A size first stepped at while the machine was busy (2 tokens: 2.0 against a truth of 1.1) costs what a
    bigger, well-stepped size costs until its own steps say otherwise, so trees of that size still run and
    correct it (the mean of its steps); a size whose steps keep costing more than a bigger one's is believed."""
    for truth, believed in ((1.1, pytest.approx((2.0 + 7 * 1.1) / 8)), (2.0, 2.0)):
        cost = StepCost((1, 2, 3, 4, 8), probes=False)  # a probe would believe a cheaper step at once
        for _ in range(10):
            cost.observe(1, 1.0)
            cost.observe(4, 1.3)
        cost.observe(2, 2.0)
        cost._changed()  # the tables are rebuilt every REFRESH steps: now
        assert cost.table()[2] == pytest.approx(1.3) and grow(cost, [0.6]) == 2  # 1.6 / 1.3 beats 1 / 1.0
        for _ in range(7):
            cost.observe(2, truth)
        cost._changed()
        assert cost.table()[2] == believed
        assert grow(cost, [0.6]) == (2 if truth < 1.6 else 1)


def test_costs_are_learned_from_the_steps_nothing_is_timed_up_front():
    """A fresh model knows nothing: the first step is the root alone, the second probes two tokens, and what
    was not stepped at is inferred one doubling beyond the widest size stepped at, and not farther."""
    cost = StepCost(SIZES)
    assert not cost.measured and grow(cost, GOOD) == 1
    cost.observe(1, cpu_like(1))
    assert cost.probe() == 2
    assert grow(cost, GOOD) == 2  # a probe: free up to its size
    cost.observe(2, cpu_like(2))
    assert cost.known == [True, True, False, False, False, False, False]
    cost.forward_table()
    assert cost(4) == pytest.approx(cpu_like(2))  # one timing above one token: flat to the next doubling
    assert cost(8) == UNKNOWN
    cost.observe(4, cpu_like(4))
    cost.forward_table()
    assert cost(8) == pytest.approx(cpu_like(8))  # linear from the two widest timed sizes (one is exact here)
    assert cost(16) == UNKNOWN


def test_the_probe_schedule_backs_off_while_probes_confirm_and_climbs():
    probes = Probes(SIZES, buckets=False)
    probes.step(1)
    assert probes.rung == 2  # right after the first step
    probes.done(True)
    assert probes.countdown == PROBE_FIRST
    intervals = []
    for _ in range(8):
        for _ in range(probes.countdown):
            probes.step(8)  # the run uses 8-node trees
        assert probes.rung in (16, 32)  # the next two sizes above the widest in use, alternately
        intervals.append(probes.interval)
        probes.done(False)
    assert intervals == [min(PROBE_FIRST * 2 ** i, PROBE_MOST) for i in range(8)]  # at most one in PROBE_MOST
    buckets = Probes((1, 16, 32, 64, 128), buckets=True)
    buckets.step(1)
    assert buckets.rung == 16


def smollm2_like(n: int) -> float:
    """SmolLM2-135M on 2 CPU cores: 60 ms a one-token step, 3 ms a token more (64 tokens: 250 ms, 4 steps)."""
    return 0.060 + 0.003 * (n - 1)


def test_a_dear_probe_is_spaced_by_its_price():
    """A steady run of 16-node trees on a model whose wide steps are dear: the confirmed probes (of 32 and 64
    tokens, alternately) come their prices in one-token steps apart, so their extra time stays well under
    one step in PROBE_MOST; spaced by steps alone, they cost nearly three times as much of the run."""
    shares = {}
    for priced in (False, True):
        cost = StepCost(SIZES, probes=True)
        if not priced:
            cost.probes.price = None
        cost.set([smollm2_like(n) for n in SIZES])
        spent = extra = 0.0
        rungs = []
        for _ in range(20000):
            size = 16
            rung = cost.probe()
            if rung is not None:
                cost.chooser()  # hands the probe out (``probing``)
                rungs.append(rung)
                extra += smollm2_like(rung) - smollm2_like(size)
                size = rung
            spent += smollm2_like(size)
            cost.observe(size, smollm2_like(size))
        assert set(rungs) == {32, 64}
        shares[priced] = extra / spent
    assert shares[True] < 0.4 * shares[False]
    assert shares[True] < 0.5 / PROBE_MOST


def test_a_row_count_borrows_the_shape_of_its_nearest_timed_neighbour():
    cost = BatchCost(max_batch=16, per_row=16)
    for width in (1, 2, 4, 8):
        cost.observe(16, width, rows_like(16, width))
    cost.observe(4, 1, rows_like(4, 1))
    table = cost.forward_table(4)
    assert table[1] == pytest.approx(rows_like(4, 1))
    # No 4-row step was wider than one token: its curve takes the 16-row curve's multiples of a one-token step.
    assert table[8] == pytest.approx(rows_like(4, 1) * rows_like(16, 8) / rows_like(16, 1))
    assert cost.forward_table(16)[16] == pytest.approx(rows_like(16, 8) + 8 * (rows_like(16, 8) - rows_like(16, 4))
                                                       / 4)
    assert batch_width(cost, [GOOD] * 4) > 1


def test_a_row_count_timed_only_wide_borrows_its_neighbours_shape_below():
    # A batch's drain: its few rows step wide, so their curve is timed at the widest width alone. Flat beneath
    # that timing, a one-token step would cost what a sixteen-token one does and the widest tree look free.
    cost = BatchCost(max_batch=16, per_row=16)
    for width in (1, 2, 4, 8, 16):
        cost.observe(16, width, rows_like(16, width))
    cost.observe(4, 16, rows_like(4, 16))
    table = cost.forward_table(4)
    assert table[16] == pytest.approx(rows_like(4, 16))
    assert table[1] == pytest.approx(rows_like(4, 16) * rows_like(16, 1) / rows_like(16, 16))
    assert table[1] < table[2] < table[8] < table[16]
    # Two rows, never stepped: the nearest timed curve's values (four rows'), its gaps filled alike.
    assert cost.forward_table(2)[1] == pytest.approx(table[1])
    weak = [[0.02] * 15] * 4  # too little to pay for a wider step, were it not free
    assert batch_width(cost, weak) == 1
    flat = BatchCost(max_batch=16, per_row=16)
    flat.observe(4, 16, rows_like(4, 16))  # no neighbour timed narrower: flat beneath, as before
    assert flat.forward_table(4)[1] == pytest.approx(rows_like(4, 16))
    assert batch_width(flat, weak) == 16


def test_a_busy_step_lowers_a_cost_never_raises_it():
    # Steps that shared the cores with the next turns' preparation took 3-8 times a quiet one. Believed, one
    # would price its width out, and a width priced out is not stepped at again to be corrected.
    cost = BatchCost(max_batch=16, per_row=16)
    cost.busy = True
    cost.observe(16, 1, 0.010)  # below nothing known: taken
    assert cost.forward_table(16)[1] == pytest.approx(0.010)
    for busy, seconds, width_2 in ((True, 0.050, 0.010),  # untimed: keeps what width 1 infers for it
                                   (False, 0.011, 0.011),  # quiet (the flag lasts one step): its first timing
                                   (True, 0.040, 0.011),  # timed: not raised
                                   (True, 0.009, 0.0106)):  # lowered, as by any step (alpha 0.2)
        cost.busy = busy
        cost.observe(16, 2, seconds)
        assert cost.by_rows[16](2) == pytest.approx(width_2)  # the estimate (the tables are rebuilt lazily)
    assert batch_width(cost, [[0.5] * 15] * 16) >= 2  # still worth drafting at


def test_a_frozen_model_never_probes():
    cost = StepCost(SIZES, alpha=0.0)
    cost.set([1.0 if n <= 16 else 1e3 for n in SIZES])
    for _ in range(100):
        size = grow(cost, GOOD)
        assert size == 16
        cost.observe(size, 0.001)
    assert cost(16) == 1.0 and cost.probe() is None


def paced(rate: float) -> StepCost:
    """CPU-like costs and a run known to emit ``rate`` tokens per second (of those costs)."""
    cost = StepCost(SIZES)
    cost.set([cpu_like(n) for n in SIZES])
    for _ in range(cost.pace.warm):
        cost.pace.observe(1, 1 / rate)  # two averages of constants from zero: their ratio is exactly the rate
    assert cost.pace.rate == pytest.approx(rate)
    return cost


def best_by(chances: list[float], value) -> int:
    """The size (root included) that ``value(expected tokens, seconds)`` ranks first, by brute force."""
    sizes = range(1, len(chances) + 2)
    return max(sizes, key=lambda n: (value(1 + sum(chances[:n - 1]), cpu_like(n)), -n))


@pytest.mark.parametrize("rate, chances, more", [
    (150.0, [0.25], False),  # a poor step in a good run: the node the step's own ratio buys is not worth it
    (80.0, [0.9, 0.8, 0.7, 0.6, 0.5] + [0.03] * 8, True),  # a rich step in a poor run: cheap nodes are
])
def test_paced_sizes_maximise_the_runs_throughput(rate, chances, more):
    """With the run's rate known, a tree is cut where a node adds fewer tokens than the run earns in the time it
    costs (E(n) - rate * T(n)), not where it stops raising the step's own tokens per second."""
    by_rate = best_by(chances, lambda e, t: e - rate * t)
    by_ratio = best_by(chances, lambda e, t: e / t)
    assert (by_rate > by_ratio) if more else (by_rate < by_ratio)
    assert grow(paced(rate), chances) == by_rate
    assert grow(StepCost(SIZES), chances) == 1  # nothing timed, no rate: the root alone
    unpaced = paced(rate)
    sizer = unpaced.chooser(paced=False)
    for c in chances:
        if not sizer.worth_growing(c):
            break
        sizer.place(c)
    assert sizer.size == by_ratio


def test_drafting_is_charged_per_node_its_slope_not_its_fixed_part():
    """A step's drafting = a fixed part (writes, the root, the layout) + a cost per node: only the per-node part
    prices a bigger tree. Seconds over nodes would charge the fixed part to every node."""
    for cost in (StepCost(SIZES), BatchCost(16, 8)):
        for i in range(200):
            n = 1 + (7 * i) % 20
            cost.observe_host(n, 200e-6 + 20e-6 * n)
        assert cost.host_per_node == pytest.approx(20e-6, rel=1e-3)  # seconds over nodes: 38 us
    host = HostCost()
    for _ in range(50):  # one size says nothing about the slope: nothing is charged yet
        host.observe(1, 220e-6)
    assert host.per_node == 0.0
    for i in range(100):
        host.observe(1 + (3 * i) % 12, 200e-6 + 20e-6 * (1 + (3 * i) % 12))
    for _ in range(200):  # the root alone again (nothing predictable): the slope learned stays
        host.observe(1, 220e-6)
    assert host.per_node == pytest.approx(20e-6, rel=1e-3)
    for i in range(300):  # never more than seconds over nodes (a fixed part below 0 is noise): 34 us, not 50
        host.observe(1 + i % 4, 10e-6 + 50e-6 * (i % 4))
    assert host.per_node == pytest.approx(host.y / host.x) and host.per_node < 40e-6


def test_the_pace_is_in_the_cost_models_own_units():
    """A cost model uniformly off by a factor (a start-up taken on a busy machine) prices the run's steps off by
    the same factor, so it sizes trees as a right one would."""
    right, slow = StepCost(SIZES), StepCost(SIZES)
    right.set([cpu_like(n) for n in SIZES])
    slow.set([20 * cpu_like(n) for n in SIZES])
    assert right.pace.rate is None
    for tokens, nodes in [(3, 8), (1, 1), (2, 4), (4, 16)] * 3:
        right.observe_yield(tokens, nodes)
        slow.observe_yield(tokens, nodes)
    assert slow.pace.rate == pytest.approx(right.pace.rate / 20)
    for chances in ([0.3, 0.1], [0.9, 0.8, 0.7, 0.6, 0.5] + [0.03] * 8, GOOD):
        assert grow(slow, chances) == grow(right, chances)


# --- on a model: every engine ---------------------------------------------------------------------------------

QUESTIONS = ["What colour is the square?", "Describe the picture in one sentence, please.", "hi",
             "Summarise: the quick brown fox jumps over the lazy dog and runs into the forest."]
NEW = 40


class ChainOracle(Drafter):
    """Good candidates: the true greedy continuation (from a reference run) as a chain, each node given chance
    0.95 of its parent's, sized by the cost model like any ``auto`` drafter."""

    name = "oracle"
    wants_costs = True

    def __init__(self, references: dict[tuple[int, ...], list[int]], most: int = 63):
        self.references, self.most = references, most
        self.prompt: tuple[int, ...] = ()

    def start(self, prompt, rows):
        self.prompt = tuple(prompt)

    def propose(self, context, room):
        done = len(context) - len(self.prompt)
        follow = self.references[self.prompt][done:done + min(room, self.most)]
        sizer = self.cost.chooser()
        for i in range(len(follow)):
            if not sizer.worth_growing(0.95 ** (i + 1)):
                break
            sizer.place(0.95 ** (i + 1))
        tree = Tree.root(context[-1])
        for i, token in enumerate(follow[:sizer.size - 1]):
            tree.tokens.append(token)
            tree.parents.append(i)
            tree.sources.append(Source.OTHER)
        return tree


_REFERENCES: dict[tuple[int, str], list[int]] = {}


def references(adapter, questions=QUESTIONS) -> dict[tuple[int, ...], list[int]]:
    """Each question's prompt ids -> its greedy continuation (one-token steps), computed once per question."""
    out = {}
    for q in questions:
        prompt = adapter.build(*request("text", q))
        if (id(adapter), q) not in _REFERENCES:
            _REFERENCES[id(adapter), q] = generate(Engine(adapter), prompt, Drafter(), NEW).tokens
        out[tuple(prompt.input_ids[0].tolist())] = _REFERENCES[id(adapter), q]
    return out


def text_requests(questions=QUESTIONS, repeat: int = 2) -> list[Request]:
    return [Request(line=i + 1, id=f"r{i}", turns=[q], max_new_tokens=NEW)
            for i, q in enumerate(list(questions) * repeat)]


def true_timing(session: Session, widths: list[int], pessimistic: bool) -> None:
    """The engine's cost model sees the true cost of each step (``cpu_like``/``rows_like``, by the padded width
    the step ran at), after a start-up that priced wide steps 20x too dear if ``pessimistic``."""
    engine = session.batch_engine or session.engine
    cost = engine.cost
    if isinstance(cost, BatchCost):
        if pessimistic:
            for rows, curve in cost.by_rows.items():
                curve.set([rows_like(rows, w) * (20 if w > 1 else 1) for w in curve.sizes])
            cost.probes.reset()
        real = cost.observe

        def observe(rows, width, seconds):
            widths.append(width)
            real(rows, width, rows_like(rows, width))
    else:
        if pessimistic:
            cost.set([cpu_like(n) * (20 if n > 1 else 1) for n in cost.sizes])
        real = cost.observe

        def observe(tokens, seconds, weight=1.0, bound=True):
            widths.append(tokens)
            return real(tokens, cpu_like(tokens), weight, bound)
    cost.observe = observe


@pytest.mark.parametrize("batch,static", [(1, False), (1, True), (4, False), (4, True)])
def test_drafting_recovers_from_a_pessimistic_start(get_adapter, batch, static, monkeypatch):
    adapter = get_adapter("text")
    refs = references(adapter)
    want = [refs[tuple(adapter.build(*request("text", r.turns[0])).input_ids[0].tolist())][:NEW]
            for r in text_requests()]
    runs = {}
    for probing in (False, True):
        if not probing:
            monkeypatch.setattr(Probes, "step", lambda self, tokens: None)  # no probe ever falls due
        session = Session(adapter, "ar", batch=batch, static=static)
        session.drafter = ChainOracle(refs)
        widths: list[int] = []
        true_timing(session, widths, pessimistic=True)
        out = list(answer_all(session, text_requests(), "tiny", NEW))
        assert [tokens[0] for _, tokens in out] == want  # exact either way
        runs[probing] = widths
        monkeypatch.undo()
    assert max(runs[False]) == 1  # locked out: root-only steps throughout
    recovered = runs[True]
    assert next(i for i, w in enumerate(recovered) if w > 1) <= PROBE_FIRST + 1
    later = recovered[len(recovered) // 2:]
    assert sum(w > 1 for w in later) > 0.8 * len(later)  # normal steps draft again
    assert len(recovered) < 0.5 * len(runs[False])  # and the good chains cut the steps by more than half


def test_a_run_times_nothing_but_its_own_steps(get_adapter, monkeypatch):
    """No start-up timing: every verification is a step of the run (one per step at batch > 1, one per
    emitted step at batch 1), every prompt is prefilled once, and nothing is timed on copies of a prompt."""
    adapter = get_adapter("text")
    monkeypatch.setattr(BatchEngine, "measure_costs", lambda *a, **k: pytest.fail("timed on copies of a prompt"))
    monkeypatch.setattr(Engine, "measure_costs", lambda *a, **k: pytest.fail("timed on copies of a prompt"))
    for batch in (1, 4):
        session = Session(adapter, "recap", batch=batch)
        engine = session.batch_engine or session.engine
        counts = {"verify": 0, "prompts": 0}
        real_verify = engine.verify

        def verify(trees, real_verify=real_verify):
            counts["verify"] += 1
            return real_verify(trees)

        engine.verify = verify
        if batch > 1:
            real_join = engine.join_trees

            def join(prompts, trees, want_rows=False, real_join=real_join):
                counts["prompts"] += len(prompts)
                return real_join(prompts, trees, want_rows)

            engine.join_trees = join
        else:
            real_prefill = engine.prefill_tree

            def prefill(prompt, tree, want_rows=False, reserve=256, real_prefill=real_prefill):
                counts["prompts"] += 1
                return real_prefill(prompt, tree, want_rows, reserve)

            engine.prefill_tree = prefill
        reqs = text_requests(repeat=1)
        out = list(answer_all(session, reqs, "tiny", NEW))
        assert counts["prompts"] == len(reqs)
        assert counts["verify"] == (session.steps if batch > 1 else sum(r["steps"] for r, _ in out))
        assert engine.cost.measured if batch == 1 else any(c.measured for c in engine.cost.by_rows.values())


def test_a_long_first_prompt_weighs_only_on_the_steps_it_takes_part_in(get_adapter):
    """One 600-token prompt first, short ones after (the start-up used to be timed on copies of the first):
    a step's true cost grows with the longest cached row (its steps cost 20x a short one), and from the second
    step after the long request has left the model's estimates of the short steps are within 1.5x of their
    truth, and good chains are drafted throughout."""
    adapter = get_adapter("text")
    long_q = "a very long question " * 150
    questions = [long_q] + QUESTIONS
    refs = references(adapter, questions)
    assert max(len(k) for k in refs) > 10 * min(len(k) for k in refs)
    session = Session(adapter, "ar", batch=4)
    session.drafter = ChainOracle(refs, most=4)  # short chains: many steps
    engine, cost = session.batch_engine, session.batch_engine.cost
    real = cost.observe
    steps = []  # (longest cached row, rows, width, the estimate before the step, its truth)

    def truth(rows, width):
        return rows_like(rows, width) * (1 + engine.width / 50)

    def observe(rows, width, seconds):
        steps.append((engine.width, rows, width, cost.forward_table(rows)[width], truth(rows, width)))
        real(rows, width, truth(rows, width))

    cost.observe = observe
    reqs = [Request(line=1, id="long", turns=[long_q], max_new_tokens=6)] + text_requests(repeat=3)[1:]
    list(answer_all(session, reqs, "tiny", NEW))
    short = [s for s in steps if s[0] < 200]
    assert steps[0][0] > 500 and len(short) > 20  # the long prompt took part in the first steps only
    settled = short[2:]  # a step or two after the long request left
    assert all(estimate <= 1.5 * true for _, _, _, estimate, true in settled if estimate < UNKNOWN)
    assert sum(w > 1 for _, _, w, _, _ in settled) > 0.8 * len(settled)


def test_unknown_costs_make_the_first_batched_step_a_plain_one():
    cost = BatchCost(max_batch=4, per_row=16)
    assert cost.probe() is None and cost.forward_table(4)[1] == UNKNOWN
    assert batch_width(cost, [GOOD] * 4) == 1
    cost.observe(4, 1, rows_like(4, 1))
    assert cost.probe() == 2


def test_an_opening_pays_while_its_chances_beat_a_prefill_tokens_share_of_a_step_token():
    """OpeningCost (batched openings ride on joint prefills): a prefill token costs the slope of the joins'
    seconds over their tokens, not their mean (a small join is mostly fixed cost), and a node is kept while its
    path chance beats (that slope + drafting) / a step's seconds per emitted token."""
    cost = OpeningCost(max_nodes=64)
    cost.observe_step(16, 0.016)  # 1 ms a token
    cost.observe_prefill(100, 0.01 + 100 * 2e-4)
    assert not cost.known  # one join size: no slope yet, and nothing guessed
    for tokens in (20, 300, 60, 180):
        cost.observe_prefill(tokens, 0.01 + tokens * 2e-4)
    assert cost.known and cost.token_s == pytest.approx(2e-4)
    cost.host_s = 5e-5
    assert cost.ratio() == pytest.approx(0.25)
    assert best_size([0.9, 0.6, 0.3, 0.2, 0.1], cost.chooser()) == 4  # root + the three nodes above 0.25
