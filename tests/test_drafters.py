"""Semantics of RECAP's memories, mixing, suffix lookup and trees; the baselines' shapes."""

from __future__ import annotations

import pytest
import torch

from recap_cli.decoding.cost import StepCost
from recap_cli.drafters import PromptLookupDrafter, RecapDrafter, TokenRecyclingDrafter, make_drafter
from recap_cli.drafters.memory import KeyedMemory, NgramIndex, TokenTable
from recap_cli.drafters.calibration import match_bucket
from recap_cli.drafters.recap import BUCKETS, OPENING_LANE, SKIP_CONTEXT, Trust
from recap_cli.drafters.tr import LEVEL_SIZES, build_template
from recap_cli.decoding.tree import Rows, Source, Tree, Verified

V = 100
IMAGE = 99


def rows_of(*dists: dict[int, float]) -> Rows:
    """Rows from {token: prob} dicts (padded to k = 8 with tiny probabilities on unused tokens)."""
    ids, probs = [], []
    for d in dists:
        items = sorted(d.items(), key=lambda kv: -kv[1])
        pad = [t for t in range(80, 99) if t not in d][: 8 - len(items)]
        items += [(t, 1e-6) for t in pad]
        total = sum(p for _, p in items)
        ids.append([t for t, _ in items])
        probs.append([p / total for _, p in items])
    return Rows(ids=torch.tensor(ids), probs=torch.tensor(probs))


def verified(tree: Tree, rows: Rows, path=(0,)) -> Verified:
    return Verified(path=list(path), bonus=0, argmax=[0] * len(tree), rows=rows)


def costs(seconds_at: dict[int, float] | None = None, sizes=(1, 2, 4, 8, 16, 32, 64)) -> StepCost:
    """A cost model with given step costs (default: flat, every size costs what one token costs)."""
    cost = StepCost(sizes)
    cost.set([(seconds_at or {}).get(n, 1.0) for n in sizes])
    return cost


def drafter(**kw) -> RecapDrafter:
    """These tests drive a request's steps by hand, often with the prompt itself as the context: a drafter that
    drafts at prefill would take each of those trees for the request's opening (``early``), so it does not."""
    d = RecapDrafter(V, banned=[IMAGE], **{"early": False} | kw)
    d.cost = costs()
    return d


def test_order2_and_3_reset_per_request_order1_persists():
    d = drafter()
    prompt = [1, 2, 3, 4]
    d.start(prompt, Rows(ids=rows_of({5: 1}).ids.repeat(4, 1), probs=rows_of({5: 1}).probs.repeat(4, 1),
                         positions=[0, 1, 2, 3]))
    assert d.keyed[3].get((2, 3, 4)) is not None and d.keyed[2].get((3, 4)) is not None
    assert d.order1.get(4) is not None
    d.start([7, 8], None)
    assert len(d.keyed[2]) == 0 and len(d.keyed[3]) == 0
    assert d.order1.get(4) is not None  # the session memory survives the new request
    d.reset()
    assert d.order1.get(4) is None


def test_prefill_rows_skip_image_positions():
    d = drafter()
    prompt = [1, IMAGE, IMAGE, 2]
    d.start(prompt, Rows(ids=rows_of({5: 1}, {6: 1}).ids, probs=rows_of({5: 1}, {6: 1}).probs, positions=[0, 3]))
    assert d.order1.get(1)[0][0] == 5 and d.order1.get(2)[0][0] == 6
    assert d.order1.get(IMAGE) is None
    assert d.keyed[3].get((IMAGE, IMAGE, 2))[0][0] == 6  # the key is the real path, image tokens included


def test_keys_follow_each_node_path_and_newer_rows_overwrite():
    d = drafter(suffix=False)
    d.start([1, 2, 3], None)
    context = [1, 2, 3]
    d.propose(context, room=10)  # sets the committed tail (1, 2, 3)
    # root 3 -> 10 -> 11, and root -> 20 : node keys (1,2,3), (2,3,10), (3,10,11), (2,3,20)
    tree = Tree(tokens=[3, 10, 11, 20], parents=[-1, 0, 1, 0], sources=[0, 1, 1, 1])
    d.observe(tree, verified(tree, rows_of({40: 1}, {41: 1}, {42: 1}, {43: 1})))
    assert d.keyed[3].get((1, 2, 3))[0][0] == 40
    assert d.keyed[3].get((2, 3, 10))[0][0] == 41
    assert d.keyed[3].get((3, 10, 11))[0][0] == 42
    assert d.keyed[3].get((2, 3, 20))[0][0] == 43
    assert d.keyed[2].get((10, 11))[0][0] == 42
    # A newer row for the same key replaces the older one.
    d.observe(tree, verified(tree, rows_of({50: 1}, {41: 1}, {42: 1}, {43: 1})))
    assert d.keyed[3].get((1, 2, 3))[0][0] == 50 and d.order1.get(3)[0][0] == 50


def test_accepted_path_rows_win_within_a_step():
    d = drafter(suffix=False)
    d.start([1, 2, 3], None)
    d.propose([1, 2, 3], room=10)
    # Two nodes with token 10 at different places; the accepted one (node 2) must own order-1 key 10.
    tree = Tree(tokens=[3, 10, 7, 10], parents=[-1, 0, 0, 2], sources=[0, 1, 1, 1])
    d.observe(tree, verified(tree, rows_of({1: 1}, {60: 1}, {2: 1}, {61: 1}), path=[0, 2, 3]))
    assert d.order1.get(10)[0][0] == 61


def test_keyed_memory_cap_drops_the_oldest_key():
    m = KeyedMemory(cap=3)
    for i in range(5):
        m.put((i,), ((i,), (1.0,)))
    assert len(m) == 3 and m.get((0,)) is None and m.get((1,)) is None and m.get((4,)) is not None


def test_token_table_state_round_trip():
    t = TokenTable(10)
    t.put(3, ((4, 5), (0.75, 0.25)))
    u = TokenTable(10)
    u.load_state(t.state())
    assert u.get(3) == ((4, 5), (0.75, 0.25)) and u.filled() == 1


def _seed(d: RecapDrafter, key: tuple[int, int, int], order: int, dist: dict[int, float]) -> None:
    r = rows_of(dist)
    row = (tuple(r.ids[0].tolist()), tuple(r.probs[0].tolist()))
    if order == 1:
        d.order1.put(key[-1], row)
    else:
        d.keyed[order].put(key[-order:], row)


def test_mixing_prefers_the_more_specific_key():
    d = drafter()
    key = (1, 2, 3)
    _seed(d, key, 1, {10: 0.7, 11: 0.3})
    _seed(d, key, 3, {11: 0.7, 10: 0.3})
    assert d.candidates(key)[0][0] == 11 and d.candidates(key)[0][2] == Source.ORDER3


def test_mixing_prefers_the_more_confident_row():
    d = drafter(weights=(0.4, 0.3, 0.3))
    key = (1, 2, 3)
    _seed(d, key, 3, {20: 0.6, 21: 0.2, 22: 0.2})  # specific but less concentrated
    _seed(d, key, 2, {21: 0.97, 20: 0.03})  # concentrated
    assert d.candidates(key)[0][0] == 21
    # With fixed weights (0.7 for the most specific present) the order-3 row wins instead.
    f = drafter(mixing="fixed")
    _seed(f, key, 3, {20: 0.6, 21: 0.2, 22: 0.2})
    _seed(f, key, 2, {21: 0.97, 20: 0.03})
    assert f.candidates(key)[0][0] == 20


def test_mixture_is_a_distribution_and_orders_can_be_switched_off():
    d = drafter()
    key = (1, 2, 3)
    _seed(d, key, 1, {10: 0.5, 11: 0.5})
    _seed(d, key, 3, {12: 1.0})
    total = sum(p for _, p, _ in drafter_mix_all(d, key))
    assert abs(total - 1) < 1e-4
    only1 = drafter(orders=(1,))
    _seed(only1, key, 1, {10: 0.5, 11: 0.5})
    _seed(only1, key, 3, {12: 1.0})
    assert {t for t, _, _ in only1.candidates(key)} >= {10, 11} and 12 not in {t for t, _, _ in only1.candidates(key)}


def drafter_mix_all(d: RecapDrafter, key):
    d.width = 64
    return d.candidates(key)


def test_suffix_lookup_finds_the_longest_earlier_match():
    idx = NgramIndex(max_n=8)
    seq = [5, 1, 2, 3, 9, 7, 2, 3, 8, 1, 2, 3]
    # "2 3" occurs at 2..3 and 6..7, but "1 2 3" only at 1..3: the longer match wins, followed by 9, 7.
    n, follow = idx.continuation(seq, 2)
    assert n == 3 and follow == [9, 7]
    assert idx.continuation([1, 2, 3, 4], 3) == (0, [])


def test_suffix_lookup_never_continues_into_image_tokens():
    idx = NgramIndex(max_n=4, skip=[IMAGE])
    assert idx.continuation([1, 2, 4, IMAGE, IMAGE, 1, 2], 4) == (2, [4])


def _seeded_chain_drafter(p: float = 0.6, **kw) -> RecapDrafter:
    d = drafter(**kw)
    d.start([1, 2, 3], None)
    for t in range(1, 60):  # token t is followed by t+1 with prob p (0.6), then by others
        rest = 1 - p
        dist = {t + 1: p, t + 20: rest / 2, t + 21: rest / 4, t + 22: rest / 4}
        dist = {k % 98: v for k, v in dist.items()}
        _seed(d, (0, 0, t), 1, dist)
    return d


def test_tree_respects_budget_depth_and_lays_the_top1_chain_first():
    d = _seeded_chain_drafter(budget=20, depth=4, suffix=False)
    tree = d.propose([1, 2, 3], room=100)
    tree.validate()
    assert len(tree) == 21
    assert max(tree.depths()) <= 4
    # The top-1 chain 3 -> 4 -> 5 -> 6 -> 7 sits at indices 0..4.
    assert tree.tokens[:5] == [3, 4, 5, 6, 7] and tree.parents[:5] == [-1, 0, 1, 2, 3]
    assert d.propose([1, 2, 3], room=2).depths() and max(d.propose([1, 2, 3], room=2).depths()) <= 2


def test_growth_keeps_the_paths_of_highest_chance():
    """Best-first growth: a tree of N drafted nodes holds the N paths of highest path chance (the product of
    its nodes' chances) among every path the memories propose, enumerated here."""
    d = _seeded_chain_drafter(budget=12, depth=4, suffix=False, calibrate=False)
    tree = d.propose([1, 2, 3], room=100)
    chances = []

    def walk(key: tuple[int, ...], chance: float, depth: int) -> None:
        for c, token, *_ in d._candidates(key, None, 0, 1 if depth else 0) if depth < 4 else ():
            chances.append(chance * c)
            walk((key + (token,))[-3:], chance * c, depth + 1)

    walk((1, 2, 3), 1.0, 0)
    assert len(tree) == 13 and len(chances) > 20  # up to two candidates a node (``width``)
    assert sorted(d.chances[1:], reverse=True) == pytest.approx(sorted(chances, reverse=True)[:12])


def test_tree_never_drafts_the_image_token():
    d = drafter(suffix=False)
    d.start([1, 2, 3], None)
    _seed(d, (0, 0, 3), 1, {IMAGE: 0.9, 4: 0.1})
    tree = d.propose([1, 2, 3], room=10)
    assert IMAGE not in tree.tokens[1:] and 4 in tree.tokens


def test_siblings_share_at_most_one_and_a_sure_own_continuation_keeps_its_chance():
    """A node's children are exclusive (the model has one argmax there): where the stream's and the rows' guesses
    add up to more than 1 they are scaled to add up to 1, unless the best is a continuation of this request's own
    text at ``SURE`` or more: it keeps its chance and each next gets at most what the better ones left (scaled
    alike, a copied passage's next token, 0.94-0.99 alone, fell to 0.6-0.8 wherever the rows guessed two others).
    The same continuation from another request's text is scaled alike."""

    def root_chances(earlier: list[int], prompt: list[int], row: dict[int, float]) -> dict[int, float]:
        d = drafter(calibrate=False, orders=(1,))  # raw guesses: a continuation's share, a row's probability
        if earlier:  # another request's text in the stream memory
            d.start(earlier, None)
            d.propose(earlier, room=10)
        d.start(prompt, None)
        _seed(d, (0, 0, 12), 1, row)
        d.propose(prompt + [12], room=10)
        return {token: chance for chance, token, *_ in d._nodes[0][4]}  # the root's candidates

    copied = [10, 11, 12, 13, 5, 10, 11, 12, 13, 6, 10, 11]  # 13 followed "10 11 12" every time, in this text
    assert root_chances([], copied, {40: 0.6, 41: 0.4}) == pytest.approx({13: 1.0, 40: 0.0, 41: 0.0}, abs=1e-4)
    # The same text, another request's: scaled alike, 1 + 0.6 + 0.4 to 1.
    assert root_chances(copied, [7, 10, 11], {40: 0.6, 41: 0.4}) == pytest.approx(
        {13: 0.5, 40: 0.3, 41: 0.2}, abs=1e-4)
    # This request's own, 13 in 2 of 3 occurrences and 14 in 1 (not sure): scaled alike, as is a row's best.
    branched = [10, 11, 12, 13, 5, 10, 11, 12, 13, 6, 10, 11, 12, 14, 7, 10, 11]
    assert root_chances([], branched, {40: 0.6, 41: 0.4}) == pytest.approx(
        {13: 1 / 3, 40: 0.3, 41: 0.2, 14: 1 / 6}, abs=1e-4)
    assert root_chances([], branched, {40: 0.95, 41: 0.05}) == pytest.approx(
        {40: 0.475, 13: 1 / 3, 14: 1 / 6, 41: 0.025}, abs=1e-4)


def test_suffix_continuation_is_merged_as_a_path():
    d = drafter(budget=4, suffix=True)  # no memories: the continuation is the only candidate
    context = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    d.start(context[:-1], None)
    tree = d.propose(context, room=10)
    assert tree.tokens == [3, 4, 5, 6, 1] and tree.parents == [-1, 0, 1, 2, 3]
    assert all(s == Source.SUFFIX for s in tree.sources[1:])
    # A continuation that starts with an already drafted token reuses that node.
    m = _seeded_chain_drafter(budget=3, depth=3, suffix=True)
    m.start([1, 2, 3, 4, 9, 1, 2], None)
    t = m.propose([1, 2, 3, 4, 9, 1, 2, 3], room=10)
    assert t.tokens.count(4) == 1 and t.parents[t.tokens.index(9)] == t.tokens.index(4)


def test_token_recycling_template_has_the_papers_shape():
    template = build_template()
    assert len(template) == 80
    depth = [0]
    for parent, _ in template:
        depth.append(depth[parent] + 1)
    assert [depth.count(level) for level in range(1, 7)] == list(LEVEL_SIZES)
    assert len(set(template)) == 80


def test_token_recycling_fills_from_the_matrix_and_keeps_it_across_requests():
    d = TokenRecyclingDrafter(V)
    d.start([1, 2], Rows(ids=rows_of({5: 1}, {6: 1}).ids, probs=rows_of({5: 1}, {6: 1}).probs, positions=[0, 1]))
    tree = d.propose([1, 2], room=10)
    assert tree.tokens[1] == 6 and all(s == Source.MATRIX for s in tree.sources[1:])
    d.start([7], None)
    assert d.propose([1, 2], room=10).tokens[1] == 6  # hot start: the matrix outlives the request
    assert max(d.propose([1, 2], room=1).depths()) == 1


def test_prompt_lookup_drafts_a_chain_after_the_first_match():
    d = PromptLookupDrafter(budget=3)
    ctx = [7, 1, 2, 3, 4, 5, 1, 2, 3, 8, 9, 1, 2, 3]
    d.start(ctx, None)
    tree = d.propose(ctx, room=10)
    assert tree.tokens == [3, 4, 5, 1] and tree.parents == [-1, 0, 1, 2]


def test_make_drafter_rejects_unknown_methods_and_misplaced_knobs():
    import pytest

    with pytest.raises(ValueError, match="unknown method"):
        make_drafter("magic", V)
    with pytest.raises(ValueError, match="recap only"):
        make_drafter("tr", V, mixing="fixed")
    with pytest.raises(ValueError, match="template"):
        make_drafter("tr", V, budget=3)
    with pytest.raises(ValueError, match="recap only"):
        make_drafter("ar", V, budget=3)


def test_calibration_learns_that_overconfident_memories_fail():
    """Rank-0 candidates at p = 0.6 that the verifier keeps rejecting lose their estimate; the rank-1 ones it
    picks gain. Every candidate of an accepted node is graded, placed in the tree or not."""
    d = _seeded_chain_drafter(budget=0, depth=4, suffix=False)  # the root alone: nothing placed
    tree = d.propose([1, 2, 3], room=100)
    assert len(tree) == 1

    def chances():
        return {token: chance for chance, token, *_ in d._candidates((1, 2, 3), None, 0, 0)}

    before = chances()
    assert before[4] == pytest.approx(0.6 ** 2, rel=1e-4) and before[23] == pytest.approx(0.2 ** 2, rel=1e-4)
    for _ in range(50):  # the model's argmax at the root is always the rank-1 candidate, 3 + 20
        tree = d.propose([1, 2, 3], room=100)
        d.observe(tree, Verified(path=[0], bonus=23, argmax=[23], rows=rows_of({23: 1.0})))
        d.order1.rows[3] = _seeded_chain_drafter().order1.rows[3]  # the seeded row back (observe overwrote it)
    after = chances()
    assert after[4] < before[4] / 2 and after[23] > 2 * before[23]
    raw = _seeded_chain_drafter(budget=0, depth=4, suffix=False, calibrate=False)
    raw.propose([1, 2, 3], room=100)
    assert {t: c for c, t, *_ in raw._candidates((1, 2, 3), None, 0, 0)} == pytest.approx({4: 0.6, 23: 0.2}, rel=1e-4)


def test_cost_cut_keeps_the_root_alone_when_chances_are_low_and_nodes_cost():
    d = _seeded_chain_drafter(suffix=False)  # budget auto
    for _ in range(30):  # teach it that its drafts are never accepted: the argmax is always unseen token 50
        tree = d.propose([1, 2, 3], room=100)
        d.observe(tree, Verified(path=[0], bonus=50, argmax=[50] * len(tree), rows=rows_of(*[{}] * len(tree))))
        d.start([1, 2, 3], None)
        d.order1.rows = list(_seeded_chain_drafter().order1.rows)  # memories back as seeded
    d.cost = costs({1: 1.0, 2: 1.5, 4: 1.6, 8: 1.8, 16: 2.2, 32: 3.0, 64: 5.0})  # CPU-like: a tree costs more
    assert len(d.propose([1, 2, 3], room=100)) == 1
    d.cost = costs()  # flat (a GPU): even unlikely nodes are free, so the tree grows until their chances vanish
    flat = d.propose([1, 2, 3], room=100)
    assert len(flat) >= 48 and min(d.chances) < 1e-12  # (adding ~1e-16 to E no longer changes it in floats)


def test_cost_cut_grows_where_chances_are_high():
    d = _seeded_chain_drafter(suffix=False, p=0.9)
    d.cost = costs({1: 1.0, 2: 1.5, 4: 1.6, 8: 1.8, 16: 2.2, 32: 3.0, 64: 5.0})
    tree = d.propose([1, 2, 3], room=100)
    # Untaught, the chain's chances are 0.9^2 each: it pays for a few nodes, not 64.
    assert 3 <= len(tree) <= 16 and tree.tokens[:3] == [3, 4, 5]
    assert len(d.propose([1, 2, 3], room=100)) == len(tree)  # deterministic for the same state
    weak = _seeded_chain_drafter(suffix=False)  # 0.6^2 = 0.36 a node: not worth a 1.5x step
    weak.cost = d.cost
    assert len(weak.propose([1, 2, 3], room=100)) == 1


@pytest.mark.parametrize("decay", [None, 1.0])
def test_a_request_whose_drafts_fail_sizes_smaller_trees(decay):
    """The learned chances are the run's; a request that keeps missing them (trust) grows less, and the next
    request starts afresh. Weighing every step alike (decay 1) the trust sinks with every failure; weighing recent
    steps most (the default) it stays where those steps put it: trees that promise little cost little."""
    flat = {1: 1.0, 2: 1.3, 4: 1.3, 8: 1.3, 16: 1.4, 32: 1.6, 64: 2.0}
    d = _seeded_chain_drafter(suffix=False, p=0.9, calibrate=False, **({} if decay is None else {"trust_decay": decay}))
    d.cost = costs(flat)
    fresh = len(d.propose([1, 2, 3], room=100))
    for _ in range(6):
        tree = d.propose([1, 2, 3], room=100)
        d.observe(tree, Verified(path=[0], bonus=50, argmax=[50] * len(tree), rows=rows_of(*[{}] * len(tree))))
        d.order1.rows = list(_seeded_chain_drafter(p=0.9).order1.rows)
    assert d.trust.factor < (0.5 if decay == 1.0 else 0.8) and len(d.propose([1, 2, 3], room=100)) < fresh
    d.start([1, 2, 3], None)
    d.order1.rows = list(_seeded_chain_drafter(p=0.9).order1.rows)
    assert d.trust.factor == 1.0 and len(d.propose([1, 2, 3], room=100)) == fresh


def test_a_requests_trust_follows_its_recent_steps():
    """An answer turns from free text (drafts that fail) to a repeated passage (drafts that hold): a request's trust
    weighs its recent steps most, so it trusts its drafts again within a few steps; weighing every step alike
    (``trust_decay=1``) it would stay low for as long as the failures had lasted."""
    recent, alike = Trust(decay=0.7), Trust(decay=1.0)
    for trust in (recent, alike):
        for _ in range(10):
            trust.observe(5.0, 0)
    assert recent.factor == alike.factor == Trust.LOW
    for trust in (recent, alike):
        for _ in range(4):
            trust.observe(5.0, 5)
    assert recent.factor > 0.8 and alike.factor < 0.5
    assert drafter().trust.decay == 0.7 and drafter(trust_decay=1.0).trust.decay == 1.0
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="trust_decay"):
            drafter(trust_decay=bad)


def test_a_stop_token_ends_its_branch():
    d = drafter(suffix=False, budget=10, stops=[7])
    d.start([1, 2, 3], None)
    for t in range(3, 12):
        _seed(d, (0, 0, t), 1, {t + 1: 0.9, 40 + t: 0.1})
    tree = d.propose([1, 2, 3], room=100)
    at = tree.tokens.index(7)
    assert all(parent != at for parent in tree.parents)  # nothing is drafted after the end of the answer
    assert 8 not in tree.tokens


def test_a_continuation_longer_than_the_stream_depth_re_anchors():
    """The stream memory holds matches up to its depth; a copied span longer than that keeps its draft going by
    matching its own last tokens afresh."""
    passage = list(range(10, 40))
    d = drafter(budget=40, stream_depth=6, orders=(1,), width=1)
    prompt = [1] + passage + [2]
    d.start(prompt, None)
    context = prompt + passage[:3]
    tree = d.propose(context, room=100)
    chain = [0]
    while (nxt := next((i for i in range(1, len(tree)) if tree.parents[i] == chain[-1]), None)) is not None:
        chain.append(nxt)
    assert [tree.tokens[i] for i in chain[1:]][:20] == passage[3:23]  # far deeper than 6
    # Past the depth a node's candidates are classed with the longest matches (a passage being copied), not by
    # the few tokens its path re-anchored on; before it, by the match as it grew. (A stream cell is ((kind's offset
    # + match bucket) * 15 + rank and share) * 2 + the rows' agreement: recap.py ``STREAM_CELLS``.)
    buckets = [[(cell // 30) % BUCKETS for _, _, cell, _, _ in d._nodes[i][4] if cell >= 0] for i in chain]
    deep = [b for i, b in zip(chain, buckets) if d._nodes[i][3] > 6 and b]
    assert deep and all(b == [BUCKETS - 1] for b in deep)
    assert buckets[0] == [match_bucket(3)] and buckets[1] == [match_bucket(4)]


def test_step_cost_interpolates_follows_observations_and_buckets():
    c = costs({1: 1.0, 2: 2.0, 4: 2.0, 8: 4.0})
    assert c(3) == 2.0 and c(6) == 3.0 and c(8) == 4.0
    c.observe(6, 100.0)  # an outlier counts at most 3x the estimate, shared between the sizes around 6
    assert 2.0 < c(4) < 2.2 and 4.0 < c(8) < 4.5
    t, floor = c.table(), c.floor()
    assert t[16] < t[8]  # sizes cost what they were given (16 tokens: 1.0), dips included
    assert all(a <= b for a, b in zip(floor[1:], floor[2:])) and all(f == min(t[n:]) for n, f in enumerate(floor))
    m = StepCost((1, 2, 4, 8, 16), dips=False)  # a batch's widths: never cheaper wider
    m.set([1.0, 2.0, 2.0, 4.0, 1.0])
    assert m.table()[16] == 4.0 and m.floor() == m.table()
    b = StepCost(buckets=(1, 16, 32))
    b.set([1.0, 2.0, 3.0])
    assert b(1) == 1.0 and b(2) == b(16) == 2.0 and b(17) == 3.0


def test_prompt_lookup_cut_follows_learned_chances():
    ctx = [7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 2, 3]
    d = PromptLookupDrafter()
    d.cost = costs({1: 1.0, 2: 1.5, 4: 1.6, 8: 1.8, 16: 2.2, 32: 3.0, 64: 5.0})
    d.start(ctx, None)
    assert len(d.propose(ctx, room=10)) == 5  # prior chances 0.5, 0.25, ...: four tokens pay for a 1.65x step
    for _ in range(10):  # the continuation's first token is never right
        tree = d.propose(ctx, room=10)
        d.observe(tree, Verified(path=[0], bonus=0, argmax=[0] * len(tree), rows=rows_of(*[{}] * len(tree))))
    assert len(d.propose(ctx, room=10)) == 1
    for _ in range(30):  # now it keeps being right: the root alone still tests the first token, and it grows
        tree = d.propose(ctx, room=10)
        truth = [4, 5, 6, 8, 9, 1, 2, 3, 0, 0]  # the model's argmax after each chain node
        d.observe(tree, Verified(path=list(range(len(tree))), bonus=truth[len(tree) - 1],
                                 argmax=truth[:len(tree)], rows=rows_of(*[{}] * len(tree))))
    assert d.propose(ctx, room=10).tokens == [3, 4, 5, 6, 8, 9, 1, 2, 3]


def test_token_recycling_auto_cuts_its_template_by_path_chance():
    d = TokenRecyclingDrafter(V, budget="auto")
    d.cost = costs({1: 1.0, 2: 1.5, 4: 1.6, 8: 1.8, 16: 2.2, 32: 3.0, 64: 5.0})
    d.start([1, 2], Rows(ids=rows_of({5: 1}, {6: 0.99}).ids, probs=rows_of({5: 1}, {6: 0.99}).probs,
                         positions=[0, 1]))
    for t in range(6, 20):
        d.table.put(t, (tuple(range(t + 1, t + 9)), (0.95,) + (0.05 / 7,) * 7))
    tree = d.propose([1, 2], room=10)
    tree.validate()
    full = TokenRecyclingDrafter(V)
    full.table = d.table
    assert 2 < len(tree) < len(full.propose([1, 2], room=10))
    assert tree.tokens[:4] == [2, 6, 7, 8]  # the likely chain survives the cut


def test_a_failed_opening_leaves_the_requests_trust_alone():
    """An opening (the tree at the prompt's end, drafted before the prompt runs) comes from how other answers
    went on: its failure says nothing of this request, which must keep its trust and go on drafting, and it is
    learned in a lane of its own, not in the classes answers' own text is drafted from; a failed tree of the
    request's own text lowers its trust."""
    d = RecapDrafter(V, budget="auto")
    d.cost = costs()  # flat: every size costs what one token costs, so anything likely is drafted
    d.start([1, 2, 3], None)
    d.propose([1, 2, 3, 4, 5, 6, 7], room=10)  # the first answer, 4 5 6 7, is in the stream memory
    d.start([1, 2, 3], None)
    opening = d.propose([1, 2, 3], room=10)
    assert opening.tokens[:2] == [3, 4] and sum(d.chances) > 1.5
    classes = sum(d.stream_chances.tries) + sum(d.row_chances.tries)
    d.observe(opening, verified(opening, rows_of(*[{}] * len(opening))))  # rejected at its first token
    assert d.trust.factor == 1.0
    assert sum(d.stream_chances.tries) + sum(d.row_chances.tries) == classes
    assert sum(d.placed.tries[OPENING_LANE]) > 0 and d.placed.hits[OPENING_LANE] == [0.0] * 10
    later = d.propose([1, 2, 3, 8, 4], room=10)
    assert later.tokens[:2] == [4, 5]
    d.observe(later, verified(later, rows_of(*[{}] * len(later))))
    assert d.trust.factor < 1.0


def _answered_once() -> RecapDrafter:
    """A drafter whose stream memory holds one answer, 4 5 6 7, to the prompt 1 2 3: the next request with that
    prompt drafts its opening from it."""
    d = RecapDrafter(V, budget="auto")
    d.cost = costs()
    d.start([1, 2, 3], None)
    d.propose([1, 2, 3, 4, 5, 6, 7], room=10)
    return d


def test_an_opening_never_takes_the_step_costs_probe():
    """A probe lets a step's tree grow as if nodes were free, to time a size the costs rule out. An opening is
    verified by its prompt's prefill, which no step cost times: taking the probe would grow a big opening for
    nothing and leave the probe to the next step anyway. So the opening is sized by the costs, and the probe
    waits for the first step."""
    d = _answered_once()
    steep = {1: 1.0, 2: 3.0, 4: 5.0, 8: 9.0, 16: 17.0, 32: 33.0, 64: 65.0}  # a node costs 2x a step's token
    d.cost = costs(steep)
    for _ in range(4):  # the probe countdown runs out: the next chooser hands out a probe of size 2
        d.cost.observe(1, 1.0)
    assert d.cost.probe() == 2
    d.start([1, 2, 3], None)
    opening = d.propose([1, 2, 3], room=10)
    assert len(opening) == 1 and not d.cost.probing and d.cost.probe() == 2
    d.observe(opening, verified(opening, rows_of({4: 1.0})))
    step = d.propose([1, 2, 3, 4], room=10)  # the answer's first step: the probe grows its tree to 2
    assert len(step) == 2 and step.tokens[1] == 5 and d.cost.probing


def test_openings_that_keep_failing_shrink_and_their_trust_is_kept():
    """The stream's openings keep a trust of their own: an opening that fails lowers it (the request's own trust
    stays), an opening under a low trust is sized smaller from the same memories, forks share it, and the memory
    file carries it over."""
    d = _answered_once()
    d.cost = costs({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7, 16: 2.5, 32: 4.1, 64: 7.3})  # a node costs a tenth of a step
    d.start([1, 2, 3], None)
    saved = d.state()
    opening = d.propose([1, 2, 3], room=10)
    promised = sum(d.chances) - 1.0
    assert len(opening) > 3 and promised > 2 and d.opening_trust.factor == 1.0
    d.observe(opening, verified(opening, rows_of(*[{}] * len(opening))))  # rejected at its first token
    assert (d.opening_trust.expected, d.opening_trust.emitted) == (promised, 0.0) and d.trust.factor == 1.0
    assert d.fork().opening_trust is d.opening_trust
    again = RecapDrafter(V, budget="auto")
    again.load_state(d.state())
    assert again.opening_trust.factor == d.opening_trust.factor < 1.0
    # The same memories as before that opening, under a trust that more such failures would leave (below the
    # floor a request's own trust stops at):
    d.load_state(saved)
    d.start([1, 2, 3], None)
    d.opening_trust.observe(8 * promised, 0)
    assert d.opening_trust.factor < 0.25
    assert len(d.propose([1, 2, 3], room=10)) < len(opening)
    with pytest.raises(ValueError, match="openings' trust"):
        again.load_state({**saved, "opening_trust": {"expected": torch.tensor(-1.0, dtype=torch.float64),
                                                     "emitted": torch.tensor(0.0, dtype=torch.float64)}})


def test_a_slot_filled_anew_drafts_what_followed_the_slot_before():
    """Earlier answers to the same prompt said 10 11 12 13 and 10 14 12 13; this one says 10 15, a token the
    stream never saw there. The context's own match is that new token alone, but what followed the slot before
    (12, then 13) is a skip candidate at the step's root, drafted on along the stream path it came from. Off,
    nothing is; nor after a frame shorter than SKIP_CONTEXT tokens (a new token after a short match is text
    going its own way)."""
    def tree_after_new_slot(prompt: list[int], **kw) -> Tree:
        d = drafter(**kw)
        for answer in ([10, 11, 12, 13], [10, 14, 12, 13]):
            d.start(prompt, None)
            d.propose(prompt + answer, room=10)
        d.start(prompt, None)
        return d.propose(prompt + [10, 15], room=10)

    frame = list(range(1, SKIP_CONTEXT))  # with the answer's first token: a frame of SKIP_CONTEXT tokens
    skipped = tree_after_new_slot(frame)
    assert skipped.tokens[1:3] == [12, 13] and skipped.parents[1:3] == [0, 1]
    assert skipped.sources[1] in (Source.STREAM, Source.SUFFIX)
    # (12 is among the stream's most frequent tokens, guessed where nothing else is drafted: ``guesses``)
    assert 12 not in tree_after_new_slot(frame, skip=False, guesses=False).tokens
    assert 12 not in tree_after_new_slot(frame[1:], guesses=False).tokens


def test_a_root_new_to_the_stream_guesses_the_streams_most_frequent_tokens():
    """Nothing continues a token the stream never saw before (no match, no row): the root drafts the stream's
    four most frequent tokens at their shares, each drafting on as a match of itself; the guesses are graded in no
    class (the learned chances stay as they were) but count in the request's trust; none at an opening or with
    ``guesses=False``."""
    context = [5, 6, 5, 7, 5, 6, 42]  # written as the step starts: 5 three times in 7 tokens, 6 twice, 7 and 42
    d = drafter()
    d.start(context[:-1], None)
    tree = d.propose(context, room=10)
    guesses = [i for i in range(1, len(tree)) if tree.parents[i] == 0]
    assert [tree.tokens[i] for i in guesses] == [5, 6, 7, 42]
    assert [d.chances[i] for i in guesses] == pytest.approx([3 / 7, 2 / 7, 1 / 7, 1 / 7])
    assert {tree.sources[i] for i in guesses} == {Source.STREAM}
    assert tree.tokens[2] == 6 and tree.parents[2] == 1  # on from 5 as the stream went on from it (5 6, twice)
    learned = {k: v for k, v in d.state().items() if k in ("stream_chances", "row_chances", "placed")}
    promised = sum(d.chances) - 1.0
    d.observe(tree, Verified(path=[0], bonus=0, argmax=[6] * len(tree), rows=rows_of(*[{}] * len(tree))))
    assert all(torch.equal(learned[k][part], d.state()[k][part]) for k in learned for part in learned[k])
    assert d.trust.expected == pytest.approx(promised) and d.trust.emitted == 0.0
    off = drafter(guesses=False)
    off.start(context[:-1], None)
    assert len(off.propose(context, room=10)) == 1
    opening = drafter(early=True)
    opening.start(context, None)
    assert len(opening.propose(context, room=10)) == 1
