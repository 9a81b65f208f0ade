"""Every drafter, and RECAP's ablations, reproduce the one-token greedy tokens on both architectures."""

from __future__ import annotations

import pytest

from recap_cli.session import Session

from .conftest import request

QUESTIONS = ["What colour is the square?", "Describe the picture in one sentence, please.",
             "Summarise the passage: the quick brown fox jumps over the lazy dog."]
# Sized by cost, recap/pld/tr:auto would draft little on a tiny model whose drafts are rarely right: "flat"
# step costs (up to 16 tokens cost one token's, as on a GPU, and drafting is negligible beside a step; more
# tokens cost far more) keep their trees at about 16
# nodes, so exactness is tested on real trees in every budget mode; "measured" is the default path (this
# machine's timings).
VARIANTS = [("recap", {}, "flat"), ("recap", {}, "measured"), ("recap", {"mixing": "fixed"}, "flat"),
            ("recap", {"orders": (1,)}, "flat"), ("recap", {"suffix": False, "budget": 16, "depth": 4}, None),
            ("recap", {"top_k": 4, "budget": 64}, None), ("recap", {"calibrate": False}, "flat"),
            ("tr", {}, None), ("tr", {"budget": "auto"}, "flat"), ("pld", {}, "flat"), ("pld", {"budget": 10}, None),
            ("recap", {"suffix": False}, "flat"), ("recap", {"prompt_rows": True}, "flat"),
            ("recap", {"prompt_rows": True, "early": False}, "flat"),
            ("suffix", {}, None)]


def flat_costs(session: Session) -> Session:
    cost = session.engine.cost
    cost.set([1.0 if size <= 16 else 1e3 for size in cost.sizes])  # seconds: drafting time is negligible beside
    cost.alpha = 0.0  # frozen: this machine's real step times must not move it
    return session


@pytest.mark.parametrize("arch", ["qwen", "llava", "text"])
def test_all_methods_match_ar_over_a_stream(get_adapter, arch):
    """One session per method over a stream of requests, so the persistent memory carries over between them."""
    adapter = get_adapter(arch)
    ar = Session(adapter, "ar")
    stream = [request(arch, q, seed) for seed, q in enumerate(QUESTIONS)] * 2  # repeats exercise warm memory
    expected = [ar.answer(m, imgs, 40).tokens for m, imgs in stream]
    for method, knobs, costs in VARIANTS:
        session = Session(adapter, method, **knobs)
        if costs == "flat":
            flat_costs(session)
        nodes = steps = 0
        for (m, imgs), want in zip(stream, expected):
            gen = session.answer(m, imgs, 40)
            assert gen.tokens == want, (method, knobs, costs)
            assert sum(gen.by_source.values()) == len(gen.tokens)
            nodes, steps = nodes + gen.tree_nodes, steps + gen.steps
        if costs == "flat" or method == "tr":  # real trees were verified, not root-only steps
            assert nodes / steps > (1.3 if method == "pld" else 4), (method, knobs, costs)


def test_recap_drafts_and_is_accepted_on_repeated_requests(get_adapter):
    """The second pass over the same request finds its own earlier predictions: more tokens per step."""
    adapter = get_adapter("qwen")
    session = flat_costs(Session(adapter, "recap"))
    msgs, imgs = request("qwen", QUESTIONS[1], 3)
    cold = session.answer(msgs, imgs, 40)
    warm = session.answer(msgs, imgs, 40)
    assert warm.tokens == cold.tokens
    assert warm.mean_accepted > cold.mean_accepted
    assert sum(warm.by_source[s] for s in ("ORDER1", "ORDER2", "ORDER3", "SUFFIX", "STREAM")) > 0


def test_image_token_is_never_drafted(get_adapter):
    adapter = get_adapter("llava")
    session = Session(adapter, "recap")
    seen = []
    real = session.engine.verify

    def spy(tree):
        seen.extend(tree.tokens[1:])
        return real(tree)

    session.engine.verify = spy
    for seed in range(2):
        session.answer(*request("llava", QUESTIONS[0], seed), 30)
    assert seen and adapter.image_token_id not in seen


def test_engine_top_k_follows_the_drafter(get_adapter):
    session = Session(get_adapter("text"), "recap", top_k=4)
    assert session.engine.top_k == 4
    gen = session.answer(*request("text", "hi", 0), 5)
    assert len(gen.tokens) == 5 and session.drafter.order1.get(gen.tokens[0]) is not None
    assert all(len(session.drafter.order1.get(t)[0]) == 4 for t in gen.tokens[:-1])


@pytest.mark.parametrize("arch", ["qwen", "llava"])
def test_static_cache_path_matches_for_every_drafter(get_adapter, arch):
    adapter = get_adapter(arch)
    stream = [request(arch, q, seed) for seed, q in enumerate(QUESTIONS[:2])]
    expected = [Session(adapter, "ar").answer(m, imgs, 30).tokens for m, imgs in stream]
    for method in ("ar", "recap", "tr", "pld", "suffix"):
        session = Session(adapter, method, static=True)
        assert session.engine.static and session.engine.cost.buckets == session.engine.buckets
        assert [session.answer(m, imgs, 30).tokens for m, imgs in stream] == expected, method


@pytest.mark.parametrize("early", [True, False])
def test_static_cache_takes_trees_wider_than_its_largest_bucket(get_adapter, early):
    """A fixed budget above the largest bucket (128): the static cache makes room for the prefill's tree and grows
    for a wide step (it crashed: "static KV cache full", a mask wider than the cache)."""
    adapter = get_adapter("text")
    msgs, imgs = request("text", QUESTIONS[2], 0)
    want = Session(adapter, "ar").answer(msgs, imgs, 40).tokens
    session = Session(adapter, "recap", static=True, budget=512, early=early)
    widest, real = [0], session.engine.verify

    def spy(tree, *args, **kwargs):
        widest[0] = max(widest[0], len(tree))
        return real(tree, *args, **kwargs)

    session.engine.verify = spy
    for _ in range(3):  # the memory warms up: trees grow past 128 nodes
        gen = session.answer(msgs, imgs, 40)
        assert gen.tokens == want
        widest[0] = max(widest[0], gen.prefill_nodes)
    assert widest[0] > 128
