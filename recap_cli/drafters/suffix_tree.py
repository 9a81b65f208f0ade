"""A suffix tree of bounded depth over many growing token sequences, with occurrence counts.

What SuffixDecoding (Oliaro et al., 2025) drafts from, and RECAP's stream memory: every substring of up to
``depth`` tokens of every sequence is a path from the root, and a node's count is how many times its substring
occurs. So count(s + t) / count(s) estimates how often ``t`` followed ``s``, for every ``s`` at once.

Semantics are those of an uncompressed trie of depth ``depth`` (the reference implementation's, which compresses
paths in C++); children are kept in decreasing count, ties in the order the reference keeps them, so its drafts
come out the same token for token. Memory stays linear in the text: a substring seen once is not spelled out
node by node but kept as a *leaf*, a reference into the sequence that holds it, and turned into nodes only when
a second occurrence walks into it.

Appending a token costs O(depth) dictionary operations: each suffix of the sequence (up to ``depth`` long) moves
one step down. Those suffixes, kept per sequence (``active``), are also the matches of the sequence's own tail,
so a drafter reads its longest matches without walking from the root.

Positions: an int >= 0 is a node; a negative int ``~(leaf * SPAN + k)`` is the point ``k`` tokens into a leaf's
chain (``k = 0`` in a sequence's own active list: its own leaf, at the end of the text).
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

SPAN = 64  # positions per leaf in the encoding: depth < SPAN
ROOT = 0


class SuffixTree:
    """``ordered``: keep every node's children in the reference's order as counts change (what SuffixDecoding's
    drafts depend on); otherwise children are sorted by count (ties by token) only when read (``ranked``), which
    makes appending cheaper, and the order a function of the counts alone: a tree rebuilt from the same text
    reads the same."""

    def __init__(self, depth: int = 24, ordered: bool = True):
        if not 1 <= depth < SPAN:
            raise ValueError(f"depth is 1..{SPAN - 1}")
        self.depth, self.ordered = depth, ordered
        self.count: list[int] = [0]
        self.kids: list[dict[int, int]] = [{}]  # token -> node (>= 0) or ~leaf
        # Ordered trees only: children's tokens, decreasing count (the root's are not kept), and minus their counts
        # beside them (increasing, for bisect).
        self.toks: list[list[int]] = [[]]
        self.negc: list[list[int]] = [[]]
        self.last: list[int] = [-1]  # the sequence that most recently passed through each node
        self.free: list[int] = []  # node ids to reuse
        self.leaf_seq: list[int] = []
        self.leaf_pos: list[int] = []  # where the chain's first token sits in its sequence
        self.leaf_depth: list[int] = []  # the depth of that first token
        self.leaf_free: list[int] = []
        self.seqs: dict[int, list[int]] = {}
        self.active: dict[int, list[int]] = {}  # sid -> positions of its suffixes, index l-1 for length l
        self._next = 0

    # --- building ------------------------------------------------------------------------------------------

    def new_seq(self, tokens: Iterable[int] = ()) -> int:
        sid = self._next
        self._next += 1
        self.seqs[sid] = []
        self.active[sid] = []
        self.extend(sid, tokens)
        return sid

    def extend(self, sid: int, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(sid, t)

    def append(self, sid: int, token: int) -> None:
        """One more token at the end of sequence ``sid``: each of its suffixes (the empty one included) moves one
        step down, the longest falling off past ``depth``."""
        seq = self.seqs[sid]
        seq.append(token)
        old = self.active[sid]
        new = [0] * min(len(old) + 1, self.depth)
        if not self.ordered:
            self._descend(sid, token, old, new, len(seq) - 1)
            self.active[sid] = new
            return
        count, kids, last = self.count, self.kids, self.last
        for length in range(len(new) - 1, -1, -1):  # longest first, as the reference walks its suffixes
            pos = old[length - 1] if length else ROOT
            if pos < 0:  # its own leaf: the chain is the sequence itself, so it grows by itself
                new[length] = pos
                continue
            child = kids[pos].get(token)
            if child is None:
                new[length] = ~(self._new_leaf(pos, token, sid, len(seq) - 1, length + 1) * SPAN)
                continue
            if child < 0:
                child = self._materialize(pos, token, ~child)
            self._increment(pos, token, child)
            last[child] = sid
            new[length] = child
        count[ROOT] += 1
        self.active[sid] = new

    def _descend(self, sid: int, token: int, old: list[int], new: list[int], at: int) -> None:
        """``append``'s walk where children are ordered only when read: the counts alone (the loop every token
        of the stream memory pays, ``depth`` times)."""
        count, kids, last, materialize = self.count, self.kids, self.last, self._materialize
        # The longest suffixes are usually new text, each in its own leaf, which grows by itself: copied at once.
        top = len(new) - 1
        while top and old[top - 1] < 0:
            top -= 1
        new[top + 1:] = old[top:len(new) - 1]
        for length in range(top, 0, -1):  # longest first; a suffix of length >= 1 is never the root
            pos = old[length - 1]
            if pos < 0:  # its own leaf grows by itself
                new[length] = pos
                continue
            child = kids[pos].get(token)
            if child is None:
                new[length] = ~(self._new_leaf(pos, token, sid, at, length + 1) * SPAN)
                continue
            if child < 0:
                child = materialize(pos, token, ~child)
            count[child] += 1
            last[child] = sid
            new[length] = child
        child = kids[ROOT].get(token)  # the empty suffix: the root's children are never read in order
        if child is None:
            new[0] = ~(self._new_leaf(ROOT, token, sid, at, 1) * SPAN)
        else:
            if child < 0:
                child = self._materialize(ROOT, token, ~child)
            count[child] += 1
            last[child] = sid
            new[0] = child
        count[ROOT] += 1

    def close(self, sid: int) -> None:
        """The sequence will not grow: forget its suffixes (its text stays, for the chains that read it)."""
        self.active[sid] = []

    def remove(self, sid: int) -> None:
        """Take every occurrence in sequence ``sid`` out of the counts (eviction), dropping what only it held."""
        seq = self.seqs[sid]
        self.active.pop(sid, None)
        for start in range(len(seq)):
            self.count[ROOT] -= 1
            pos = ROOT
            for i in range(start, min(start + self.depth, len(seq))):
                token = seq[i]
                child = self.kids[pos].get(token)
                if child is None:
                    break
                if child < 0 or self.count[child] == 1:
                    self._drop(pos, token, child)
                    break
                self._decrement(pos, token, child)
                pos = child
        del self.seqs[sid]

    def _new_leaf(self, parent: int, token: int, sid: int, at: int, depth: int) -> int:
        if self.leaf_free:
            leaf = self.leaf_free.pop()
            self.leaf_seq[leaf], self.leaf_pos[leaf], self.leaf_depth[leaf] = sid, at, depth
        else:
            leaf = len(self.leaf_seq)
            self.leaf_seq.append(sid)
            self.leaf_pos.append(at)
            self.leaf_depth.append(depth)
        self.kids[parent][token] = ~leaf
        if parent != ROOT and self.ordered:  # a new child has count 1: last in its parent's order
            self.toks[parent].append(token)
            self.negc[parent].append(-1)
        return leaf

    def _materialize(self, parent: int, token: int, leaf: int) -> int:
        """A second occurrence walks into a leaf: its first token becomes a node of count 1 (incremented by the
        caller), and the chain, one token shorter, hangs under it. Every token written into text seen before pays
        this, up to ``depth`` times: it allocates only what the tree reads (an unordered tree keeps no sibling
        order; it sorts a node's children when a drafter reads them, ``ranked``)."""
        sid, at, depth = self.leaf_seq[leaf], self.leaf_pos[leaf], self.leaf_depth[leaf]
        seq = self.seqs[sid]
        follows = at + 1 < len(seq) and depth < self.depth
        below = {seq[at + 1]: ~leaf} if follows else {}
        if self.free:
            node = self.free.pop()
            self.count[node], self.kids[node], self.last[node] = 1, below, sid
        else:
            node = len(self.count)
            self.count.append(1)
            self.kids.append(below)
            self.last.append(sid)
        if self.ordered:  # the children in the reference's order (unordered trees sort them when read)
            toks, negc = ([seq[at + 1]], [-1]) if follows else ([], [])
            if node < len(self.toks):
                self.toks[node], self.negc[node] = toks, negc
            else:
                self.toks.append(toks)
                self.negc.append(negc)
        self.kids[parent][token] = node
        if follows:
            self.leaf_pos[leaf], self.leaf_depth[leaf] = at + 1, depth + 1
        else:  # the chain was one token long: the leaf is gone; its owner, if still growing, now sits here
            self.leaf_free.append(leaf)
            active = self.active.get(sid)
            own = len(seq) - (at - depth + 1)  # the owner's suffix length
            if active and own == depth and own <= len(active) and active[own - 1] == ~(leaf * SPAN):
                active[own - 1] = node
        return node

    def _increment(self, parent: int, token: int, child: int) -> None:
        """count += 1, moving the child in its parent's order as the reference's sibling lists do: the first of a
        run of equal counts that passes the run above joins it at its head; any later one moves to the head of
        its own run's position, i.e. the tail of the run above."""
        c = self.count[child]
        self.count[child] = c + 1
        if parent == ROOT or not self.ordered:
            return
        toks, negc = self.toks[parent], self.negc[parent]
        i = bisect_left(negc, -c)
        while toks[i] != token:
            i += 1
        if i == 0 or -negc[i - 1] > c + 1:
            negc[i] = -c - 1
            return
        j = bisect_left(negc, negc[i - 1])  # the head of the previous sibling's run
        del toks[i], negc[i]
        toks.insert(j, token)
        negc.insert(j, -c - 1)

    def _decrement(self, parent: int, token: int, child: int) -> None:
        """count -= 1; a child with equal-count siblings after it moves behind them (the reference's order)."""
        c = self.count[child]
        self.count[child] = c - 1
        if parent == ROOT or not self.ordered:
            return
        toks, negc = self.toks[parent], self.negc[parent]
        i = bisect_left(negc, -c)
        while toks[i] != token:
            i += 1
        del toks[i], negc[i]
        j = bisect_right(negc, -c)
        toks.insert(j, token)
        negc.insert(j, -c + 1)

    def _drop(self, parent: int, token: int, child: int) -> None:
        """Remove a child of count 1 and everything under it."""
        del self.kids[parent][token]
        if parent != ROOT and self.ordered:
            toks, negc = self.toks[parent], self.negc[parent]
            i = len(toks) - 1 - toks[::-1].index(token)
            del toks[i], negc[i]
        stack = [child]
        while stack:
            ref = stack.pop()
            if ref < 0:
                self.leaf_free.append(~ref)
                continue
            stack.extend(self.kids[ref].values())
            self.free.append(ref)
            self.kids[ref] = {}

    # --- reading -------------------------------------------------------------------------------------------

    def step(self, pos: int, token: int) -> int | None:
        """The position one token further down (None: this continuation never occurred)."""
        if pos >= 0:
            child = self.kids[pos].get(token)
            if child is None or child >= 0:
                return child
            return ~(~child * SPAN + 1)
        leaf, k = divmod(~pos, SPAN)
        at = self.leaf_pos[leaf] + k
        seq = self.seqs[self.leaf_seq[leaf]]
        if k and at < len(seq) and self.leaf_depth[leaf] + k <= self.depth and seq[at] == token:
            return ~(leaf * SPAN + k + 1)
        return None

    def match(self, tokens: Sequence[int]) -> int | None:
        pos: int | None = ROOT
        for t in tokens:
            pos = self.step(pos, t)
            if pos is None:
                return None
        return pos

    def ranked(self, pos: int, top: int | None = None) -> tuple[Sequence[int], Sequence[int]]:
        """A node's children's tokens and minus their counts, most frequent first (unordered: sorted here, ties by
        token: a drafter reads a few nodes a step, while every token written would change some order). ``top``:
        the first ``top`` are enough (a short context in a long stream can have thousands of continuations)."""
        if self.ordered:
            return self.toks[pos], self.negc[pos]
        kids, count = self.kids[pos], self.count
        if len(kids) == 1:
            for t, r in kids.items():
                return (t,), (-(count[r] if r >= 0 else 1),)
        pairs = ((-(count[r] if r >= 0 else 1), t) for t, r in kids.items())
        order = heapq.nsmallest(top, pairs) if top is not None and len(kids) > 4 * top else sorted(pairs)
        return [t for _, t in order], [c for c, _ in order]

    def occurrences(self, pos: int) -> int:
        return self.count[pos] if pos >= 0 else 1

    def children(self, pos: int, top: int | None = None) -> list[tuple[int, int]]:
        """(token, count) of every continuation, most frequent first (ties in the reference's order); ``top``: only
        the first ``top`` are needed (``ranked``: more may come)."""
        if pos >= 0:
            return [(t, -c) for t, c in zip(*self.ranked(pos, top))]
        follows = self.chain_next(pos)
        return [(follows[0], 1)] if follows is not None else []

    def chain_next(self, pos: int) -> tuple[int, int] | None:
        """A point inside a chain (``pos`` < 0): its one continuation and the sequence that holds it (``children``
        and ``source`` in one read, for a drafter's hot path); None where the chain ends."""
        leaf, k = divmod(~pos, SPAN)
        sid = self.leaf_seq[leaf]
        at = self.leaf_pos[leaf] + k
        seq = self.seqs[sid]
        if k and at < len(seq) and self.leaf_depth[leaf] + k <= self.depth:
            return seq[at], sid
        return None

    def source(self, pos: int) -> int:
        """The sequence that most recently passed through ``pos``."""
        return self.last[pos] if pos >= 0 else self.leaf_seq[~pos // SPAN]

    def __len__(self) -> int:
        """Nodes and leaves in use (what the tree's memory grows with)."""
        return len(self.count) - len(self.free) + len(self.leaf_seq) - len(self.leaf_free)


# --- SuffixDecoding's drafts ---------------------------------------------------------------------------------

_F32 = array("f", [0.0])


def f32(x: float) -> float:
    """``x`` rounded to float32: the reference computes chances in float32, and a chance at the threshold or a
    tie between two drafts' scores must come out the same."""
    _F32[0] = x
    return _F32[0]


@dataclass
class Draft:
    """SuffixDecoding's speculation: tokens with their parents (-1: under the root), the count-based chance of
    each, their sum (the score two drafts are compared by) and the length of the match that found it."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


def speculate(tree: SuffixTree, matches: Iterable[int | None], max_tokens: int, factor: float = 1.0,
              offset: float = 0.0, min_prob: float = 0.1, as_tree: bool = False) -> Draft:
    """The best draft over the context's matches (``matches``: the tree positions of its last 1, 2, ... tokens,
    None where that suffix never occurred: the search stops there). A match of length m may draft
    ``factor * m + offset`` tokens; each draft follows the most frequent continuation (``as_tree``: the most
    likely continuations, best first) while the chance, a product of count ratios, stays >= ``min_prob``. The
    best draft has the highest score (sum of chances); a tie goes to the longer match."""
    best = Draft()
    grow = _tree if as_tree else _path
    min_prob = f32(min_prob)
    for m, pos in enumerate(matches, start=1):
        if pos is None:
            break
        limit = max(0, min(max_tokens, int(m * factor + offset + 1e-6)))
        draft = grow(tree, pos, limit, min_prob)
        if draft.score >= best.score:
            best = draft
            best.match_len = m
    return best


def _path(tree: SuffixTree, pos: int, limit: int, min_prob: float) -> Draft:
    draft, prob, score = Draft(), 1.0, 0.0
    tokens = draft.tokens
    while len(tokens) < limit:
        if pos >= 0:
            toks = tree.toks[pos]
            if not toks:
                break
            token, n = toks[0], tree.count[pos]
            child = tree.kids[pos][token]
            prob = f32(prob * f32((tree.count[child] if child >= 0 else 1) / n))
            if prob < min_prob:
                break
            pos = child if child >= 0 else ~(~child * SPAN + 1)
        else:
            nxt = tree.children(pos)
            if not nxt:
                break
            token = nxt[0][0]
            pos = tree.step(pos, token)
        draft.parents.append(len(tokens) - 1)
        tokens.append(token)
        draft.probs.append(prob)
        score = f32(score + prob)
    draft.score = score
    return draft


def _tree(tree: SuffixTree, pos: int, limit: int, min_prob: float) -> Draft:
    """Best-first over continuations: the most likely unplaced one next (ties: the first found)."""
    draft, score, order = Draft(), 0.0, 0
    heap: list[tuple[float, int, int, int, int]] = []  # (-chance, order, position, token, parent index)

    def push(at: int, prob: float, parent: int) -> None:
        nonlocal order
        total = tree.occurrences(at)
        for token, count in tree.children(at):
            p = f32(f32(prob * count) / total)
            if p < min_prob:
                break
            order += 1
            heapq.heappush(heap, (-p, order, at, token, parent))

    push(pos, 1.0, -1)
    while heap and len(draft.tokens) < limit:
        neg, _, at, token, parent = heapq.heappop(heap)
        draft.parents.append(parent)
        draft.tokens.append(token)
        draft.probs.append(-neg)
        score = f32(score - neg)
        push(tree.step(at, token), -neg, len(draft.tokens) - 1)
    draft.score = score
    return draft
