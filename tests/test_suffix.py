"""The suffix tree behind SuffixDecoding and RECAP's stream memory: counts, the reference's drafts worked by hand,
eviction, and both drafters decoding exactly."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from recap_cli.drafters import SuffixDecodingDrafter, make_drafter
from recap_cli.drafters.stream import StreamMemory
from recap_cli.drafters.suffix_tree import SuffixTree, f32
from recap_cli.decoding.tree import Source
from recap_cli.session import Session

from .conftest import request
from .test_drafters_exact import QUESTIONS, flat_costs


def substring_counts(seqs: list[list[int]], depth: int) -> Counter:
    counts = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                counts[tuple(s[i:j])] += 1
    return counts


@pytest.mark.parametrize("ordered", [True, False])
def test_counts_and_continuations_equal_brute_force_through_growth_and_eviction(ordered):
    rng = random.Random(1)
    for _ in range(150):
        depth, vocab = rng.randint(1, 6), rng.randint(1, 4)
        tree, seqs = SuffixTree(depth, ordered=ordered), {}
        for _ in range(rng.randint(1, 25)):
            if not seqs or rng.random() < 0.2:
                seqs[tree.new_seq()] = []
            elif rng.random() < 0.15:
                sid = rng.choice(list(seqs))
                tree.remove(sid)
                del seqs[sid]
                continue
            sid = rng.choice(list(seqs))
            for _ in range(rng.randint(1, 5)):
                t = rng.randrange(vocab)
                tree.append(sid, t)  # sequences grow interleaved, as rows of a batch do
                seqs[sid].append(t)
        counts = substring_counts(list(seqs.values()), depth)
        for sub, n in counts.items():
            pos = tree.match(sub)
            assert pos is not None and tree.occurrences(pos) == n
            kids = tree.children(pos)
            want = {s[-1]: c for s, c in counts.items() if len(s) == len(sub) + 1 and s[:-1] == sub}
            assert dict(kids) == want and [c for _, c in kids] == sorted(want.values(), reverse=True)
        for sid, s in seqs.items():  # a sequence's active suffixes are the matches of its own tail
            for length in range(1, min(len(s), depth) + 1):
                assert tree.occurrences(tree.active[sid][length - 1]) == counts[tuple(s[-length:])]


def test_equal_counts_keep_the_reference_sibling_order():
    """Children of equal count stay in the order the reference's sibling lists give them: a child that catches
    up with the run above it goes to that run's head if it was first of its own run, else to the run's tail."""
    tree = SuffixTree(4)
    sid = tree.new_seq([7, 1, 7, 2, 7, 3])  # under 7: 1, 2, 3, once each, in that order
    seven = tree.match([7])
    assert [t for t, _ in tree.children(seven)] == [1, 2, 3]
    tree.extend(sid, [7, 3])  # 3 (last of the count-1 run) catches up: head of the new count-2 run
    assert tree.children(seven) == [(3, 2), (1, 1), (2, 1)]
    tree.extend(sid, [7, 2])  # 2 (not first of its run): tail of the count-2 run
    assert tree.children(seven) == [(3, 2), (2, 2), (1, 1)]
    tree.extend(sid, [7, 1])  # 1 (first of its run, right after the count-2 run): its head
    assert tree.children(seven) == [(1, 2), (3, 2), (2, 2)]


def suffix(prompt: list[int], **kw) -> SuffixDecodingDrafter:
    d = SuffixDecodingDrafter(**kw)
    d.start(prompt, None)
    return d


def test_the_draft_is_the_best_scoring_match_worked_by_hand():
    ctx = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    d = suffix(ctx)
    draft = d.speculate(ctx, room=100)
    # "2" (3 times, once at the end) -> 3 at 2/3, but a 1-token match drafts 1 token: score 0.67. "1 2" -> 3 at
    # 2/3, then "1 2 3" -> 4 or 5 at 1/2 each: 4 came first; 2 tokens, score 1.0. "5 1 2" and longer occur once
    # (here): nothing follows them.
    assert draft.tokens == [3, 4] and draft.parents == [-1, 0] and draft.match_len == 2
    assert draft.probs == [f32(2 / 3), f32(f32(2 / 3) * 0.5)] and draft.score == f32(draft.probs[0] + draft.probs[1])


def test_chances_below_min_token_prob_are_not_drafted():
    prompt = [x for t in range(10, 21) for x in (9, t)] + [9]  # 9 is followed by eleven different tokens
    assert suffix(prompt).speculate(prompt, room=100).tokens == []
    assert suffix(prompt, min_token_prob=0.05).speculate(prompt, room=100).tokens != []


def test_long_matches_draft_long_and_depth_bounds_match_plus_draft():
    phrase = [5, 6, 7, 8, 9, 10, 11, 12]
    ctx = phrase + [1] + phrase[:4]
    assert suffix(ctx).speculate(ctx, room=100).tokens == [9, 10, 11, 12]  # a 4-token match drafts 4
    assert suffix(ctx).speculate(ctx, room=2).tokens == [9, 10]  # at most the room left
    # Depth 6: a 4-token match leaves room for 2 more; a 3-token match drafts 3 at the same chance, and wins.
    draft = suffix(ctx, depth=6).speculate(ctx, room=100)
    assert draft.tokens == [9, 10, 11] and draft.match_len == 3


def test_answers_of_earlier_requests_are_drafted_from_the_global_tree():
    d = SuffixDecodingDrafter()
    d.start([1, 2], None)
    answer = [40, 41, 42, 43, 44, 45]
    d.propose([1, 2] + answer, room=10)  # the answer is committed: it enters the global tree
    d.start([3, 4], None)
    tree = d.propose([3, 4, 40, 41, 42], room=10)
    assert tree.tokens[1:] == [43, 44, 45] and set(tree.sources[1:]) == {Source.STREAM}
    # FIFO eviction past max_cached_requests: with room for one answer, the new request's evicts the old one.
    e = SuffixDecodingDrafter(max_cached_requests=1)
    e.start([1, 2], None)
    e.propose([1, 2] + answer, room=10)
    e.start([3, 4], None)
    assert e.propose([3, 4, 40, 41, 42], room=10).tokens == [42]


def test_forks_share_the_answers_and_own_their_prompts():
    d = SuffixDecodingDrafter()
    a, b = d.fork(), d.fork()
    a.start([1, 2, 3], None)
    b.start([7, 8, 9], None)
    assert a.prompt_tree is not b.prompt_tree and a.responses is b.responses is d.responses
    a.propose([1, 2, 3, 50, 51, 52, 53], room=10)
    assert b.propose([7, 8, 9, 50, 51], room=10).tokens[1:] == [52, 53]


def test_suffix_takes_no_options():
    with pytest.raises(ValueError, match="suffix takes none"):
        make_drafter("suffix", 100, budget=3)


def test_the_most_frequent_continuations_of_a_node_with_many_come_first():
    """Unordered trees sort a node's children when read; asked for the first few of many, they pick them without
    sorting the rest, in the same order (count, then token)."""
    rng = random.Random(3)
    tree = SuffixTree(4, ordered=False)
    sid = tree.new_seq()
    for _ in range(400):
        tree.extend(sid, [0, rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] + [1, 2, 3] * 5)])
    pos = tree.match([0])
    toks, negc = tree.ranked(pos)
    assert len(toks) == 15 and list(negc) == sorted(negc)
    assert [(t, c) for t, c in zip(*tree.ranked(pos, 3))] == list(zip(toks, negc))[:3]


# --- RECAP's stream memory -----------------------------------------------------------------------------------

def test_stream_memory_splits_at_images_evicts_the_oldest_and_rebuilds_the_same_tree():
    memory = StreamMemory(banned=[99], depth=8, max_requests=2)
    first = memory.begin()
    memory.write(first, [1, 2, 3, 99, 99, 4, 5])
    assert memory.tree.match([3, 4]) is None and memory.tree.match([4, 5]) is not None  # no match runs past 99
    second = memory.begin()
    memory.write(second, [1, 2, 3, 6])
    assert memory.tree.occurrences(memory.tree.match([1, 2, 3])) == 2
    saved = memory.state()
    copy = StreamMemory(banned=[99], depth=8, max_requests=2)
    copy.load_state(saved)
    assert list(copy.tree.seqs.values()) == [[1, 2, 3], [4, 5], [1, 2, 3, 6]]
    assert copy.tree.children(copy.tree.match([1, 2, 3])) == memory.tree.children(memory.tree.match([1, 2, 3]))
    memory.write(memory.begin(), [7])  # a third request: the first is evicted, its counts with it
    assert memory.tree.occurrences(memory.tree.match([1, 2, 3])) == 1 and memory.tree.match([4, 5]) is None
    with pytest.raises(ValueError, match="add up"):
        copy.check_state({**saved, "lengths": saved["lengths"][:1]}, vocab_size=100)


def test_the_streams_most_frequent_tokens_are_kept_exact_through_writes_and_evictions():
    """Kept as text is written, recounted after an eviction or a withdrawn request, rebuilt on load: always the
    four most frequent tokens of the text the stream holds, ties by token."""
    rng = random.Random(0)
    memory = StreamMemory(banned=[99], depth=4, max_requests=3)

    def expected() -> list[tuple[int, int]]:
        counts = Counter(t for seq in memory.tree.seqs.values() for t in seq)
        return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:4]

    for n in range(12):
        segs = memory.begin()
        memory.write(segs, [rng.choice([1, 2, 3, 4, 5, 6, 7, 99]) for _ in range(rng.randint(1, 30))])
        if n == 7:
            memory.withdraw(segs)
        assert memory.frequent() == expected() and len(expected()) == 4
    copy = StreamMemory(banned=[99], depth=4, max_requests=3)
    copy.load_state(memory.state())
    assert copy.frequent() == memory.frequent()


def test_a_prompt_writes_only_what_the_previous_prompt_did_not():
    """Prompts in a stream share their start (template, image, earlier turns): the shared part is written once,
    except its last ``depth`` tokens after the last image, so every suffix of the new text still matches, and the
    place where the next prompt's new text starts is saved with the memory."""
    memory = StreamMemory(banned=[99], depth=4)
    template = [1, 2, 3, 99, 99, 5, 6, 7, 8, 9, 10, 11]
    assert memory.unseen(template + [20, 21]) == 0  # the first prompt: all of it
    assert memory.unseen(template + [30, 31]) == len(template) - 4  # the shared start, less its last 4 tokens
    assert memory.unseen([1, 2, 3, 99, 99, 5, 40]) == 5  # within depth of the end: from after the last image
    assert memory.unseen([50, 51]) == 0
    d = make_drafter("recap", 100, banned=[99], budget=8, stream_depth=4)
    d.start(template + [20, 21, 22], None)
    d.start(template + [20, 21, 23], None)
    tree = d.stream.tree
    assert tree.occurrences(tree.match([10, 11, 20, 21])) == 2  # written by both, so its continuations count
    assert tree.occurrences(tree.match([1, 2, 3])) == 1  # the shared start was written once
    copy = StreamMemory(banned=[99], depth=4)
    copy.load_state(d.stream.state())
    assert copy.last_prompt == template + [20, 21, 23]


def test_a_conversations_next_turn_goes_on_in_its_request_instead_of_writing_the_answer_again():
    """A next turn's prompt is the earlier turns, their answers and a new question: it continues the ended turn's
    text (one request, each token counted once), writes only the new question, and sees the earlier answer as its
    own text. The answer's last step's tokens, never proposed from, are written when the turn ends."""
    d = make_drafter("recap", 100, banned=[99], budget=8, stream_depth=8)
    first = [1, 2, 99, 99, 3, 4]
    d.start(first, None)
    d.propose(first + [30, 31, 32], room=20)
    d.end(first + [30, 31, 32, 33, 34])  # the last step emitted 33 34: written now
    tree = d.stream.tree
    assert tree.occurrences(tree.match([32, 33, 34])) == 1
    nxt = first + [30, 31, 32, 33, 34, 5, 6, 7]
    d.start(nxt, None)
    assert len(d.stream.requests) == 1 and d.index.seen == len(nxt)
    assert list(tree.seqs.values()) == [[1, 2], [3, 4, 30, 31, 32, 33, 34, 5, 6, 7]]
    assert tree.occurrences(tree.match([30, 31, 32])) == 1  # the answer was not written again as prompt text
    d.propose(nxt + [30, 31], room=20)
    assert tree.source(tree.match([32, 33, 34])) in d._here  # the earlier answer is this conversation's own text
    other = [1, 2, 99, 99, 3, 9]  # a prompt that does not go on from an ended request's text: a request of its own
    d.end(nxt + [30, 31])
    d.start(other, None)
    assert len(d.stream.requests) == 2


def test_a_next_turn_that_never_ran_gives_its_conversation_back():
    """A turn's prefill that fails takes back what it wrote; one that continued an ended turn puts that turn's
    text back as it was, to be continued again when the turn is retried (alone, with a drafter of its own)."""
    d = make_drafter("recap", 100, banned=[99], budget=8, stream_depth=8)
    first = [1, 2, 99, 3, 4]
    d.start(first, None)
    d.end(first + [30, 31, 32])
    before = [list(s) for s in d.stream.tree.seqs.values()], d.stream.tree.occurrences(d.stream.tree.match([30, 31, 32]))
    retry = first + [30, 31, 32, 5, 6]
    d.start(retry, None)
    d.withdraw()
    tree = d.stream.tree
    assert sorted(tree.seqs.values()) == sorted(before[0]) and len(d.stream.requests) == 1
    assert tree.occurrences(tree.match([30, 31, 32])) == before[1] and tree.match([32, 5]) is None
    again = d.fork()
    again.start(retry, None)
    assert len(d.stream.requests) == 1 and tree.occurrences(tree.match([32, 5, 6])) == 1


def test_ended_requests_evicted_from_the_stream_are_not_continued():
    memory = StreamMemory(banned=[99], depth=4, max_requests=1)
    segs = memory.begin()
    memory.write(segs, [1, 2, 3])
    memory.end(segs, [1, 2, 3], 0)
    memory.write(memory.begin(), [7, 8])  # a second request evicts the first
    assert memory.resume([1, 2, 3, 4]) is None


def test_a_row_evicted_while_in_flight_writes_no_more_even_after_an_image():
    """A batch row whose request the stream evicts (other rows began past ``max_requests``) writes no more: not
    even a new segment after an image placeholder, which no request would own (never evicted, never saved), and
    its next turn does not continue it."""
    memory = StreamMemory(banned=[99], depth=4, max_requests=1)
    a = memory.begin()
    memory.write(a, [1, 2, 99])  # row a's text so far ends at an image: no segment open
    memory.write(memory.begin(), [5, 6])  # row b begins: a is evicted
    memory.write(a, [3, 4, 3, 4])  # row a decodes on
    assert list(memory.tree.seqs.values()) == [[5, 6]] and memory.state()["tokens"].tolist() == [5, 6]
    memory.end(a, [1, 2, 99, 3, 4, 3, 4], 0)
    assert memory.resume([1, 2, 99, 3, 4, 3, 4, 7]) is None
    for _ in range(3):
        memory.write(memory.begin(), [7])
    assert list(memory.tree.seqs.values()) == [[7]]


def test_the_start_every_prompt_shares_outlives_the_request_that_wrote_it():
    """Prompts write only what the last one did not share (``unseen``): when the request that wrote the shared
    start (a system prompt, a document) is evicted, the next prompt writes it again instead of the stream losing
    it for good."""
    doc = list(range(10, 60))
    d = make_drafter("recap", 200, budget=8, stream_requests=2)
    for i in range(6):
        prompt = doc + [100 + i]
        d.start(prompt, None)
        d.end(prompt + [150 + i])
        tree = d.stream.tree
        assert tree.match(doc[:8]) is not None, i


def test_the_stream_classes_a_continuation_seen_once_at_a_branch_as_another_requests_text():
    """A continuation seen once sits in a leaf: at the branch, its chance's class is another request's text
    whoever wrote it (recap.py, at ``OWN``), never a class read off the leaf's number (which a reload or an
    eviction changes: it read leaf ``leaf // SPAN``'s writer)."""
    from recap_cli.drafters.recap import OWN
    d = make_drafter("recap", 100, budget=8, calibrate=False)
    d.start([1, 2, 3], None)
    d.end([1, 2, 3, 4])
    d.start([50, 51], None)
    d.propose([50, 51, 7, 8, 7, 9, 7], room=8)  # 7 was followed by 8, then 9: both leaves of this request
    cells = {token: s_cell for _, token, s_cell, _, _ in d._nodes[0][4]}
    assert set(cells) == {8, 9} and all(cell // 30 < OWN for cell in cells.values())


def test_a_loaded_memory_drafts_as_the_run_that_saved_it_went_on_past_evictions(get_adapter, tmp_path):
    """Half a stream, saved and loaded into a new session, then the other half: the same trees as one session
    over the whole stream, though the stream evicted many requests (its nodes and leaves are numbered otherwise
    after a reload)."""
    rng = random.Random(1)
    asks = ["What colour is the square?", "Describe the picture.", "Count the dots.", "Say hello.",
            "What colour is the circle?"]
    reqs = [([{"role": "user", "content": rng.choice(asks)}], rng.choice([1, 2, 8, 24])) for _ in range(30)]

    def trees(session: Session, part) -> list:
        log, propose = [], session.drafter.propose
        session.drafter.propose = lambda context, room: log.append(propose(context, room)) or log[-1]
        for messages, n in part:
            session.answer(messages, [], n)
        return [(t.tokens, t.parents) for t in log]

    knobs = dict(stream_requests=3, budget=16)
    one = Session(get_adapter("text"), "recap", **knobs)
    trees(one, reqs[:15])
    one.save_memory(tmp_path / "m.pt")
    two = Session(get_adapter("text"), "recap", **knobs)
    two.load_memory(tmp_path / "m.pt")
    assert trees(two, reqs[15:]) == trees(one, reqs[15:])


def test_recap_drafts_a_phrase_of_an_earlier_request_from_the_stream():
    d = make_drafter("recap", 100, budget=8)
    d.start([1, 2], None)
    d.propose([1, 2, 30, 31, 32, 33, 34, 35, 36], room=20)  # the answer enters the stream memory
    d.start([3, 4], None)
    tree = d.propose([3, 4, 30, 31, 32], room=20)
    assert tree.tokens[1:5] == [33, 34, 35, 36] and tree.parents[1:5] == [0, 1, 2, 3]
    assert set(tree.sources[1:5]) == {Source.STREAM}


@pytest.mark.parametrize("arch", ["qwen", "llava", "text"])
def test_repeated_requests_are_drafted_from_the_stream_and_stay_exact(get_adapter, arch):
    """A request seen before is continued from the stream memory (the whole answer is an exact match), and the
    tokens are still greedy decoding's."""
    adapter = get_adapter(arch)
    stream = [request(arch, q, seed) for seed, q in enumerate(QUESTIONS)]
    want = [Session(adapter, "ar").answer(m, imgs, 40).tokens for m, imgs in stream]
    recap, suffix_ = flat_costs(Session(adapter, "recap")), Session(adapter, "suffix")
    first = [recap.answer(m, imgs, 40) for m, imgs in stream]
    assert [g.tokens for g in first] == want
    assert [suffix_.answer(m, imgs, 40).tokens for m, imgs in stream] == want
    again = [recap.answer(m, imgs, 40) for m, imgs in stream]
    assert [g.tokens for g in again] == want
    per_step = [sum(len(g.tokens) - 1 for g in gens) / sum(g.steps for g in gens) for gens in (first, again)]
    assert per_step[1] > per_step[0] + 0.5 and sum(g.by_source["STREAM"] for g in again) > 20
    twice = [suffix_.answer(m, imgs, 40) for m, imgs in stream]
    assert [g.tokens for g in twice] == want and sum(g.by_source["STREAM"] for g in twice) > 0


def test_batch_rows_share_the_stream_memory_and_own_their_place_in_it():
    d = make_drafter("recap", 100, budget=8)
    a, b = d.fork(), d.fork()
    assert a.stream is b.stream is d.stream and a.index is not b.index
    a.start([1, 2], None)
    b.start([3, 4], None)
    a.propose([1, 2, 30, 31, 32, 33, 34], room=20)  # row a's answer so far, while b decodes beside it
    tree = b.propose([3, 4, 30, 31], room=20)
    assert tree.tokens[1:4] == [32, 33, 34] and set(tree.sources[1:4]) == {Source.STREAM}


def test_workers_stream_memories_merge_into_the_seed_then_each_workers_requests():
    from recap_cli.drafters.stream import merge_states

    def memory(*requests):
        m = StreamMemory(max_requests=3)
        for text in requests:
            m.write(m.begin(), text)
        return m

    seed = memory([1, 2], [3, 4])
    a = memory([1, 2], [3, 4], [5, 6])  # grew from the seed
    b = memory([3, 4], [7, 8], [9])  # grew from the seed and evicted its oldest request
    merged = merge_states(seed.state(), [a.state(), b.state()])
    back = StreamMemory(max_requests=10)
    back.load_state(merged)
    assert list(back.tree.seqs.values()) == [[1, 2], [3, 4], [5, 6], [7, 8], [9]]
    small = StreamMemory(max_requests=2)  # loading bounds it: the oldest requests go first
    small.load_state(merged)
    assert list(small.tree.seqs.values()) == [[7, 8], [9]]
