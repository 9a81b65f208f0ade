"""RECAP: recycle the verifier's own earlier predictions as a draft tree.

Two kinds of memory propose a node's children:

- **Recycled rows.** Every position the verifier evaluates (each tree node, accepted or not, and the prompt at
  prefill) yields a row: its top-k next tokens, renormalised over k. Rows are keyed by the last 1, 2 and 3 tokens
  of the node's own path. Order 1 lives for the whole session (reusable transitions); orders 2 and 3 are reset
  per request (they carry this image's context). A node's rows are mixed

      score(c) = sum_o  w_o * conf_o * p_o(c)  /  sum_o w_o * conf_o

  with w_o a weight by the order's rank among the orders present (most specific first; 0.80/0.15/0.05) and
  conf_o the row's top-1 probability (``mixing="confidence"``), or fixed weights 0.70/0.20/0.10 by rank and no
  confidence term (``mixing="fixed"``, the ablation); the mixture's best ``width`` (2) tokens are candidates.
- **The stream memory** (recap_cli/drafters/stream.py): exact matches of the context, up to 32 tokens long,
  anywhere in the text the stream has seen (this request's and earlier requests' prompts and answers), with how
  often each continuation followed. The longest match wins; a continuation drafted past the memory's depth
  re-anchors on its own last 16 tokens, so a long copied span keeps its draft going (its nodes are classed as a
  passage being copied, the longest match: the path has matched the memory's whole depth). Where the model has just
  filled a slot as no earlier text did ("Bar C" where earlier answers said "Bar A", "Bar D"), the context's own
  match is that new token alone; what followed the slot's earlier fillings ("is the shortest") is drafted at the
  step's root as *skip* candidates, in a class of their own (``skip=False`` turns them off). A root whose token
  the stream never saw (no match of any length, no row) drafts the stream's most frequent tokens at their shares of
  its text, each on as a match of itself (``_guesses``; ``guesses=False`` turns them off).

A candidate's chance of acceptance is learned from the verifier's verdicts (every candidate of an accepted node
was put to the test: the one equal to the model's argmax there would have been accepted) per evidence class:
for the stream, whose text the continuation last occurred in (this request's or another's), the match length,
rank and share of occurrences, and whether the recycled rows agree; for rows,
the most specific order present, rank, probability, depth and whether the stream proposed something else
(recap_cli/drafters/calibration.py ``CellChances``); then once more per placed node (``PlacedCalibration``),
against the winner's curse of keeping only the best-looking candidates. A node's children are exclusive (the
model has one argmax there), so their chances are scaled to add up to at most 1, unless the best is a continuation of
the request's own text at ``SURE`` or more: that one keeps its chance, the rest share what it leaves.

The tree grows best-first: a child's path chance is its parent's times its own, so the expected tokens a step
emits are 1 + the sum of its nodes' path chances. A node's candidates are worked out as it is placed, so its
best one waits at its true path chance and the stop below reads the best chance still to come. (Worked out only
when the node's turn to grow children came, it waited in the heap behind a bound on its best child's chance: that
second entry a node cost more host time than the leaves' candidates it spared.) With ``budget="auto"`` (the
default) the tree stops growing where no bigger tree can add more expected tokens than the run earns in the time
it costs, and is cut to the best size (recap_cli/decoding/cost.py), down to the root alone: a plain greedy step
where nothing is predictable enough. A request whose recent trees fell short of their chances scales them down for
its own sizing (``Trust``); a drafted end-of-answer token is a leaf.

An answer's first tree, its *opening*, is drafted before its prompt runs (``early``), from what the memories
already hold (how earlier answers went on from the same prompt ending), and verified in the prompt's own forward
pass (decoding/engine.py ``prefill_tree``): the first tokens it gets right cost no step. Openings continue
differently from a passage inside an answer, so their nodes are mapped in a placed-calibration lane of their own
and graded in no evidence class, and they say nothing about the request's own text: not the request's ``Trust``
but the stream's openings' own (``opening_trust``). Where prompts share little but their chat template, a match
of the prompt's end is the template and the answers it continues are other questions': openings that keep failing
shrink to what still pays. An opening is never a probe of the step costs (no step times it).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from operator import itemgetter

import torch

from ..decoding.tree import Rows, Source, Tree, Verified
from .base import Drafter
from .calibration import MATCHES, CellChances, PlacedCalibration, match_bucket
from .memory import KeyedMemory, Row, TokenTable, check_table
from .stream import Cursor, StreamMemory
from .suffix_tree import ROOT

FIXED_WEIGHTS = (0.70, 0.20, 0.10)
# Rank weights for confidence mixing: chosen on SmolLM2-135M over the text prompts of sample_inputs/bench among
# (0.7,0.2,0.1) .. (0.97,0.02,0.01), 16 prompts x 64 new tokens: 0.8/0.15/0.05 gave 2.79 tokens/step, fixed 2.61.
CONFIDENCE_WEIGHTS = (0.80, 0.15, 0.05)
ORDER_SOURCE = {1: Source.ORDER1, 2: Source.ORDER2, 3: Source.ORDER3}
# A node's mixed rows: tokens and probabilities best first, and the (order, row) pairs they came from.
Mixed = tuple[Sequence[int], Sequence[float], list[tuple[int, Row]]]
NO_ROWS: Mixed = ((), (), [])
STREAM_RANKS = 4  # continuations the stream proposes per node, most frequent first
ANCHOR = 16  # tokens a continuation re-anchors on when it runs past the stream memory's depth

# Evidence classes (cells) and their parents, as flat indices.
# Stream: where the continuation last occurred, this request's own text or another request's, or a skip (a
# continuation past a token the model put where earlier text had another: ``_skipped``) (3) x match-length bucket
# (``BUCKETS``: 8) x rank 0 / 1 / 2+ (3) x share bucket (5; edges 0.2, 0.5, 0.8, 0.95, inlined in ``_candidates``)
# x rows agree (2); parent: kind x match bucket x rank > 0 x agree. A long match can be the chat template every
# request shares; own text (a copied passage, a repeated phrase) continues differently from what other requests'
# answers did.
BUCKETS = len(MATCHES)
STREAM_CELLS = [(((kind * BUCKETS + m) * 2 + (r > 0)) * 2 + agree) for kind in range(3) for m in range(BUCKETS)
                for r in range(3) for s in range(5) for agree in range(2)]
OWN, SKIP = BUCKETS, 2 * BUCKETS  # a stream cell's kind, as its offset in match buckets (other requests' text: 0)
# Where the text branches, a continuation seen once is classed as another request's text whoever wrote
# it (inside its chain, past the branch, its own sequence decides). Classed by its writer instead, ms a token and
# mean of per-input speedups on the proxy (calibration.py --inner --costs fixed; SmolLM2 / second set / demo /
# held-out): 57.402, 2.428 / 58.344, 1.627 / 3.173, 2.006 / 3.048, 2.043, against 56.782, 2.350 / 57.328, 1.668 /
# 3.109, 2.062 / 3.030, 2.088 this way (why, a guess: own cells at branches get few tests and stay untaught).
OWNED, SKIPPED = OWN * 15 * 2, SKIP * 15 * 2  # stream cells from OWNED are this request's own text, from SKIPPED skips
# A skip needs the text before the new token to match this much: a frame (the prompt's end and an answer's first
# words, a repeated sentence) whose slot earlier text filled otherwise. After a short match a new token is just
# text going its own way (calibration.py --costs fixed, tokens a step with no minimum / 4 / 8: SmolLM2 1.646 /
# 1.669 / 1.676; held-out demo VQA 2.422 / 2.583 / 2.583, captions 3.556 / 3.485 / 3.593; without skips 1.646,
# 2.183, 3.593).
SKIP_CONTEXT = 8
# Siblings whose chances add up to more than 1 are scaled to add up to 1, except below a continuation of the
# request's own text at SURE or more (a passage being copied): it keeps its chance, and each next sibling gets at
# most what the better ones left. Scaled alike, the copy's next token (0.94-0.99 alone) fell to 0.6-0.8 wherever
# the rows guessed two other tokens beside it, and side branches outranked the copy's deeper nodes. Timed, the
# README's SmolLM2 sets, mean speedup over ar with and without this, two runs each: first set 2.252 / 2.183 and
# 2.200 / 2.092, second 1.827 / 1.772 and 1.851 / 1.798; the demo's scenes within noise (1.704 / 1.705 and 1.816 /
# 1.835; held-out 1.867 / 1.916 and 1.976 / 1.946). Kept for every best from 0.9, not only own text, the demo's
# captions lost 7% (timed); kept for every best, the demo's and held-out scenes lost 1.1% and 2.5% on the proxy
# (docs/benchmarks.md, forty-second and forty-third sections).
SURE = 0.9
# Rows: order 1/2/3 (3) x rank 0..3+ (4) x probability bucket (5, the same edges) x below the root (2) x the
# stream proposed something else (2); parent: order x rank x stream.
ROW_CELLS = [((o * 4 + r) * 2 + other) for o in range(3) for r in range(4) for p in range(5) for deep in range(2)
             for other in range(2)]
ROW_ORDER_CELLS = len(ROW_CELLS) // 3  # cells per order: a row cell's order is cell // ROW_ORDER_CELLS + 1
STREAM_LANE, ROW_LANE = 0, 1
# A guess (``_guesses``): its row cell, and its lane, which no calibration reads or records.
GUESS, GUESS_LANE = -2, -1
# The placed-node calibration's own lane for an opening's nodes (the tree drafted before its prompt runs),
# whichever memory proposed them: how earlier answers began continues differently from a passage inside one.
OPENING_LANE = 2
UNMAPPED = [(0.0, 1.0)] * 11  # an uncalibrated drafter's placed-node map: a + b * c is c
# A candidate: (its lane's chance, token, stream cell or -1, row cell or -1: the class that gave the chance, its
# placed chance). A node's candidates are in decreasing lane chance; the heap orders by placed chances.
Candidate = tuple[float, int, int, int, float]
# Match length -> bucket (calibration.match_bucket), read once per expanded node.
MATCH_BUCKETS = tuple(match_bucket(m) for m in range(64))
# The match length a re-anchored path's nodes are classed at (the longest bucket). Classed at their re-anchored
# match (16 tokens: the 13-19 bucket, where a rewrite's recurring phrases sit), a copy's chains past the memory's
# depth were drafted at the chances of phrases that stop, 0.6-0.8; this way, on the proxy at two step-cost curves
# (benchmarks/calibration.py --costs fixed --orders 3), ms a token fell on all six sets (docs/benchmarks.md,
# twenty-first session).
FAR = len(MATCH_BUCKETS) - 1
# The floor of the openings' trust, below a request's (Trust.LOW): a stream whose openings keep failing drafts
# almost none (an opening is one bet a request on how other answers began).
OPENING_LOW = 0.05
# A request's trust weighs its steps by recency, each step's sums decaying by this much (``Trust``): an answer
# turns from free text to a repeated list and back within a few steps. Chosen on runs sized by host_time.py's
# frozen step costs (as benchmarks/calibration.py --costs fixed runs them), by the ms a token those costs put on
# their trees, decay 1 / 0.95 / 0.9 / 0.8 / 0.7 / 0.5: SmolLM2 3.971 / 4.001 / 3.940 / 3.900 / 3.841 / 3.881,
# the demo's sets 2.934 / 2.942 / 2.947 / 2.890 / 2.904 / 2.900, held-out scenes 2.863 / 2.820 / 2.801 / 2.837 /
# 2.802 / 2.831.
TRUST_DECAY = 0.7
# The deepest a tree grows: the stream memory's depth, so a copied passage (a prompt's steps as a list) can be
# drafted a whole memory's length at a step; the cost model decides how deep it pays. Runs sized and priced by
# frozen step costs (SmolLM2's by tree size for its prompts, host_time.py's for the demo's), the mean of per-input
# speedups at depth 24 / 28 / 32 / 48 / 64: SmolLM2 2.465 / 2.539 / 2.571 / 2.558 / 2.556, the second text set
# 1.649 / 1.635 / 1.635 / 1.634 / 1.634, the demo's sets 2.427 / 2.426 / 2.426 / 2.426 / 2.490, held-out scenes
# 2.384 / 2.416 / 2.416 / 2.438 / 2.375: a copy (text-02) takes 2 steps instead of 3.
DEPTH = 32


def _origin(found: list[tuple[int, Row]], token: int) -> Source:
    """The most specific memory whose row proposed ``token`` (rows are found most specific first)."""
    return ORDER_SOURCE[next(o for o, (ids, _) in found if token in ids)]


class RecapDrafter(Drafter):
    name = "recap"

    def __init__(self, vocab_size: int, banned: Iterable[int] = (), stops: Iterable[int] = (),
                 orders: Iterable[int] = (1, 2, 3),
                 mixing: str = "confidence", weights: tuple[float, ...] = CONFIDENCE_WEIGHTS, suffix: bool = True,
                 stream_depth: int = 32, stream_requests: int = 1000, budget: int | str = "auto", depth: int = DEPTH,
                 width: int = 2, top_k: int = 8, cap: int = 1 << 16, calibrate: bool = True, paced: bool = True,
                 early: bool = True, prompt_rows: bool = False, skip: bool = True, guesses: bool = True,
                 trust_decay: float = TRUST_DECAY):
        if mixing not in ("confidence", "fixed"):
            raise ValueError("mixing is 'confidence' or 'fixed'")
        if budget != "auto" and not (isinstance(budget, int) and budget >= 0):
            raise ValueError("budget is 'auto' or a number of draft nodes >= 0")
        if not 0.0 < trust_decay <= 1.0:
            raise ValueError("trust_decay is a number in (0, 1]: 1 weighs every step of a request alike")
        self.trust_decay = trust_decay
        self.orders = tuple(sorted(set(orders), reverse=True))  # most specific first
        if not self.orders or not set(self.orders) <= {1, 2, 3}:
            raise ValueError("orders is a non-empty subset of 1, 2, 3")
        self._uses = (3 in self.orders, 2 in self.orders, 1 in self.orders)
        self.mixing, self.suffix = mixing, suffix
        self.weights = FIXED_WEIGHTS if mixing == "fixed" else tuple(weights)
        self.budget, self.depth, self.width, self.top_k = budget, depth, min(width, top_k), top_k
        self.banned = frozenset(banned)
        self.stops = frozenset(stops)  # a drafted stop token is a leaf: the generation ends there
        self.cap, self.paced, self.calibrate = cap, paced, calibrate
        self.skips = skip  # skip candidates at a step's root (``_skipped``)
        self.guesses = guesses  # the stream's most frequent tokens at a root with nothing else (``_guesses``)
        self.drafts_at_prefill = early  # the first tree rides on the prompt's forward pass (where the engine can)
        # ``prompt_rows``: the prefill's predictions at every prompt text position seed the rows too. Off by
        # default: they cost the output layer at every such position (on a CPU with text-heavy prompts, most of
        # recap's extra prefill time) and bought no acceptance (benchmarks/acceptance.py, fixed sizes: demo
        # 3.27 vs 3.33 tokens/step without them at 16 nodes, SmolLM2 2.03 vs 2.00): a prompt's text is in the
        # stream memory, which continues it anyway, and its rows overwrote order-1 rows the answers had taught.
        self.wants_prefill_rows = prompt_rows
        self.vocab_size = vocab_size
        self.order1 = TokenTable(vocab_size)
        self.stream = StreamMemory(self.banned, stream_depth, stream_requests)  # shared by every row of a batch
        # Untaught guesses: a stream continuation's chance is 3/4 of its share of occurrences; a remembered
        # probability p (the model's confidence in an earlier context) is worth p^2: confident rows were right as
        # often as they said, unsure ones far less (benchmarks/calibration.py, SmolLM2 and the demo model).
        self.stream_chances = CellChances(STREAM_CELLS, weight=0.75)
        self.row_chances = CellChances(ROW_CELLS, weight=1.0)  # of the guess p * p
        self.placed = PlacedCalibration(lanes=3)  # the stream, the rows, openings
        self.opening_trust = Trust(low=OPENING_LOW)  # how the stream's openings have kept their promises
        # The coefficients a tree reads, fetched by ``propose`` (None: the raw guesses, as uncalibrated).
        self._row_ab = self._stream_ab = (None, None)
        self._lanes = (UNMAPPED, UNMAPPED)  # the placed-node maps of a stream and a row candidate (``_placed_lanes``)
        self._padded: tuple = (None, [])  # the placed coefficients, each lane's list with its top bucket repeated
        self._memories: tuple = (None, None, None)  # order-3 and order-2 rows, the order-1 table (``propose``)
        self.own_request_state()

    def own_request_state(self) -> None:
        """Orders 2 and 3 and this request's place in the stream: never shared between rows."""
        self.keyed = {2: KeyedMemory(self.cap), 3: KeyedMemory(self.cap)}
        self._mixed: dict[tuple[int, ...], tuple[list[Row], Mixed]] = {}  # mixtures of several rows
        self.index = Cursor()  # where this request's text goes in the stream memory
        self.chances = [1.0]  # the last tree's path chances, node by node (what calibration checks read)
        self.trust = Trust(decay=self.trust_decay)  # how this request's recent drafts fared against their chances
        # The last tree's nodes, in tree order: [key, stream position, match length, depth, candidates, placed, row
        # cell, past the memory's depth], ``placed`` being (lane, lane chance) for the placed-node calibration (None
        # at the root).
        self._nodes: list[list] = []
        self._here: set[int] | tuple = ()  # this request's segments in the stream memory (set by ``propose``)
        self._prompt_length = 0  # where this request's answer starts: a tree rooted there is its opening
        self._skip: tuple[int, int] | None = None  # the step's skip point (``_advance``)
        self._skip_at: dict[int, tuple[int, int]] = {}  # a skip candidate -> (stream position, path length)
        self._opening = False  # the last tree was an opening (drafted before the prompt ran, verified by it)

    @property
    def wants_costs(self) -> bool:
        return self.budget == "auto"

    # --- memories -------------------------------------------------------------------------------------------

    def start(self, prompt: list[int], rows: Rows | None) -> None:
        for memory in self.keyed.values():
            memory.clear()
        self._mixed.clear()
        self.trust = Trust(decay=self.trust_decay)
        self._prompt_length = len(prompt)
        self.stream_chances.renew()
        self.row_chances.renew()
        self.placed.renew()
        if self.index.segs is not None:  # one request at a time: the last one stopped without ``end``
            self.stream.finish(self.index.segs)
        self.index = cursor = Cursor()
        if self.suffix:
            cursor.resumed = self.stream.resume(prompt)  # a conversation's next turn goes on from the last one
            if cursor.resumed is not None:
                cursor.segs, cursor.start = cursor.resumed.segs, cursor.resumed.start
                cursor.seen = len(cursor.resumed.context)
            else:
                cursor.segs = self.stream.begin()
                cursor.seen = cursor.start = self.stream.unseen(prompt)
            self._write(prompt)
        self.prompt_rows(prompt, rows)

    def end(self, context: list[int]) -> None:
        """The answer's last tokens (those of its last step) go into the stream memory, and a next turn of the
        conversation may go on from its text."""
        if self.index.segs is not None:
            self._write(context)
            self.stream.end(self.index.segs, context, self.index.start)
        self.index = Cursor()

    def withdraw(self) -> None:
        if self.index.segs is not None:
            self.stream.withdraw(self.index.segs, self.index.resumed)
        self.index = Cursor()

    def prompt_rows(self, prompt: list[int], rows: Rows | None) -> None:
        if rows is not None:
            self._store_rows(rows.ids.tolist(), rows.probs.tolist(),
                             [tuple(prompt[max(0, i - 2): i + 1]) for i in rows.positions])

    def _write(self, context: list[int], end: int | None = None) -> None:
        """The stream memory learns this request's text as it is committed (up to ``end``)."""
        cursor = self.index
        end = len(context) if end is None else end
        if cursor.segs is not None and end > cursor.seen:
            self.stream.write(cursor.segs, context[cursor.seen:end])
            cursor.seen = end

    def _advance(self, context: list[int]) -> tuple[int, int] | None:
        """``_write``, and the step's skip point: where the context's last token never followed the longest match
        of the text before it, at least SKIP_CONTEXT tokens long (the model filled a slot of a frame earlier text
        had filled otherwise), that match as (stream node, length), for the root's skip candidates
        (``_skipped``); else None."""
        cursor = self.index
        if not self.skips or cursor.segs is None or len(context) <= cursor.seen or context[-1] in self.banned:
            self._write(context)
            return None
        self._write(context, len(context) - 1)
        pos, m = self._match()
        new = pos is not None and context[-1] not in self.stream.tree.kids[pos]  # before this text adds it there
        self._write(context)
        return (pos, m) if new and m >= SKIP_CONTEXT else None

    def _skipped(self, streamed: dict[int, tuple[int, float]]) -> None:
        """The root's skip candidates, into ``streamed`` (a token the exact match proposes keeps its own). The
        model put a token where the earlier text had others ("Bar C" where answers said "Bar A", "Bar D"): what
        followed those others ("Bar A is", "Bar D is") likely follows this one too. Their continuations, counted
        over them, with their shares, in a class of their own; the node of one drafts on along the stream path
        it came from (``_skip_at``)."""
        (pos, m), tree, banned = self._skip, self.stream.tree, self.banned
        counts: dict[int, int] = {}
        best: dict[int, int] = {}
        self._skip_at = at = {}
        total = 0
        for t, nc in zip(*tree.ranked(pos, STREAM_RANKS)):
            mid = tree.step(pos, t)
            total -= nc
            for x, c in tree.children(mid, STREAM_RANKS):
                if x in banned:
                    continue
                counts[x] = counts.get(x, 0) + c
                if c > best.get(x, 0):
                    best[x] = c
                    at[x] = (tree.step(mid, x), m + 2)
        mb = MATCH_BUCKETS[m]
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:STREAM_RANKS]
        for rank, (x, c) in enumerate(ranked):
            if x in streamed:
                continue
            p = c / total
            b = 4 if p >= 0.95 else 3 if p >= 0.8 else 2 if p >= 0.5 else 1 if p >= 0.2 else 0
            streamed[x] = (((SKIP + mb) * 15 + (rank if rank < 2 else 2) * 5 + b) * 2, p)

    def observe(self, tree: Tree, verified: Verified) -> None:
        nodes = self._nodes
        if len(nodes) != len(tree):  # not this drafter's last tree (a test's hand-made one): keys from its paths
            nodes = [[key, None, 0, 0, (), None, -1] for key in self._node_keys(tree)]
        path = verified.path
        # A request's trust is how its own text keeps its trees' promises. Its opening was drafted before any of
        # that text existed (from how other answers went on from the same prompt ending): a failed one says
        # nothing about it, and would sink the trust to its floor before the request could say anything. It
        # counts in the stream's openings' trust instead.
        if len(self.chances) == len(tree):
            (self.opening_trust if self._opening else self.trust).observe(sum(self.chances) - 1.0, len(path) - 1)
        self._store_rows(verified.rows.ids.tolist(), verified.rows.probs.tolist(), [node[0] for node in nodes],
                         verified.accepted_last(len(tree)))
        if self.calibrate:
            if not self._opening:  # the classes learn from answers' own text; openings have their lane below
                self._grade(nodes, path, verified.argmax)
            accepted, parents, placed = set(path), tree.parents, self.placed
            for i in range(1, len(tree)):
                lane = nodes[i][5]
                if lane is not None and lane[0] >= 0 and parents[i] in accepted:  # a fair test of its chance
                    placed.record(OPENING_LANE if self._opening else lane[0], lane[1], i in accepted)

    def _grade(self, nodes: list[list], path: list[int], argmax: list[int]) -> None:
        """Every candidate of an accepted node was put to the test: it passed iff it is the argmax there. Each
        is graded in the class that gave its chance."""
        stream, rows = self.stream_chances, self.row_chances
        for i in path:
            best = argmax[i]
            for _, token, s_cell, r_cell, _ in nodes[i][4]:
                if s_cell >= 0:
                    stream.record(s_cell, token == best)
                elif r_cell >= 0:  # not a guess
                    rows.record(r_cell, token == best)

    def _node_keys(self, tree: Tree) -> list[tuple[int, ...]]:
        """Each node's last three path tokens: its tree ancestors, then committed text (the context tail)."""
        keys = [self._nodes[0][0] if self._nodes else ()]  # the last proposal's context tail
        for i in range(1, len(tree)):
            keys.append((keys[tree.parents[i]] + (tree.tokens[i],))[-3:])
        return keys

    def _store_rows(self, ids: list, probs: list, keys: list[tuple[int, ...]],
                    order: Iterable[int] | None = None) -> None:
        """Rows (lists, read-only from here on) under their keys; later rows overwrite earlier ones."""
        use3, use2, use1 = self._uses
        table, vocab = self.order1.rows, self.order1.vocab_size
        m2, m3 = self.keyed[2].rows, self.keyed[3].rows
        for i in (range(len(keys)) if order is None else order):
            key, row = keys[i], (ids[i], probs[i])
            if not key:
                continue
            if use1 and 0 <= key[-1] < vocab:
                table[key[-1]] = row
            if len(key) == 3:
                if use2:  # re-inserting moves the key to the young end (KeyedMemory.put, inlined)
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
        self.stream.clear()
        self.stream_chances.clear()
        self.row_chances.clear()
        self.placed.clear()
        self.opening_trust = Trust(low=OPENING_LOW)
        self.own_request_state()

    def state(self) -> dict:
        """The order-1 table, the stream memory, the learned chances and how openings fared: orders 2/3 and a
        request's own trust reset per request."""
        return {"order1": self.order1.state(), "stream": self.stream.state(),
                "stream_chances": self.stream_chances.state(), "row_chances": self.row_chances.state(),
                "placed": self.placed.state(), "opening_trust": self.opening_trust.state()}

    def load_state(self, state: dict) -> None:
        keys = {"order1", "stream", "stream_chances", "row_chances", "placed", "opening_trust"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError("a RECAP memory holds exactly " + ", ".join(f"'{k}'" for k in sorted(keys)) +
                             " (a memory file from an older recap: start without it)")
        check_table(state["order1"], self.order1.vocab_size)  # all checks first: a failure changes nothing
        self.stream.check_state(state["stream"], self.vocab_size)
        self.stream_chances.check_state(state["stream_chances"])
        self.row_chances.check_state(state["row_chances"])
        self.placed.check_state(state["placed"])
        Trust.check_state(state["opening_trust"])
        self.order1.load_state(state["order1"])
        self.stream.load_state(state["stream"])
        self.stream_chances.load_state(state["stream_chances"])
        self.row_chances.load_state(state["row_chances"])
        self.placed.load_state(state["placed"])
        self.opening_trust.load_state(state["opening_trust"])

    # --- mixing ---------------------------------------------------------------------------------------------

    def rows_for(self, key: tuple[int, ...]) -> list[tuple[int, Row]]:
        """The rows this path's order-3, order-2 and order-1 keys find, most specific first (keys are a path's
        last three tokens at most)."""
        found = []
        n = len(key)
        use3, use2, use1 = self._uses
        if n == 3 and use3 and (row := self.keyed[3].rows.get(key)) is not None:
            found.append((3, row))
        if n >= 2 and use2 and (row := self.keyed[2].rows.get(key[1:] if n == 3 else key)) is not None:
            found.append((2, row))
        if n and use1 and 0 <= key[-1] < self.vocab_size and (row := self.order1.rows[key[-1]]) is not None:
            found.append((1, row))
        return found

    def mix(self, key: tuple[int, ...]) -> Mixed:
        """(tokens, probabilities, rows found) of the recycled candidates for the node whose path ends in
        ``key``, best first. One row (the common case) is its own mixture and is returned as stored."""
        found = self.rows_for(key)
        if len(found) == 1:
            ids, probs = found[0][1]
            return ids[: self.width], probs[: self.width], found
        return self._mixture(key, found) if found else NO_ROWS

    def _mixture(self, key: tuple[int, ...], found: list[tuple[int, Row]]) -> Mixed:
        """Several rows' mixture, cached until one of the rows it mixed is overwritten (rows are never changed in
        place)."""
        cached = self._mixed.get(key)
        if cached is not None and len(cached[0]) == len(found) and all(a is b[1] for a, b in zip(cached[0], found)):
            return cached[1]
        out = self._mix(found)
        if len(self._mixed) >= self.cap:
            self._mixed.clear()
        self._mixed[key] = ([row for _, row in found], out)
        return out

    def _mix(self, found: list[tuple[int, Row]]) -> Mixed:
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
        best = sorted(score.items(), key=itemgetter(1), reverse=True)[: self.width]
        return [t for t, _ in best], [p for _, p in best], found

    def candidates(self, key: tuple[int, ...]) -> list[tuple[int, float, Source]]:
        """The recycled mixture as (token, probability, source) triples: for reading, not for the hot path."""
        tokens, probs, found = self.mix(key)
        return [(t, p, _origin(found, t)) for t, p in zip(tokens, probs) if t not in self.banned]

    # --- a node's candidates --------------------------------------------------------------------------------

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
        count, kids = tree.count, tree.kids
        for m in range(min(len(active), tree.depth - 1), 0, -1):
            pos = active[m - 1]
            if pos > 0 and count[pos] > 1 and kids[pos]:
                return pos, m
        return None, 0

    def _candidates(self, key: tuple[int, ...], spos: int | None, m: int, deep: int) -> list[Candidate]:
        """A node's candidates, best first: the stream's continuations of its match (``spos``, of length ``m``)
        and its recycled rows, each token once, each with its learned chance; the chances add up to <= 1, and
        each is then mapped as placed nodes of its lane turned out (``PlacedCalibration``). ``deep``: 0 at the
        root (whose own occurrence in the stream has no continuation yet), else 1. Runs once per placed node:
        buckets are inlined, chances read as a + b * guess from the coefficients ``propose`` fetched."""
        banned = self.banned
        streamed: dict[int, tuple[int, float]] = {}  # token -> (cell without the agree bit, share)
        if spos is not None:
            tree, here = self.stream.tree, self._here
            mb = MATCH_BUCKETS[m]
            if spos >= 0:
                toks, negc = tree.ranked(spos, STREAM_RANKS)
                total = tree.count[spos] - (not deep)
                if total > 0:
                    kids, last = tree.kids[spos], tree.last
                    for rank in range(min(STREAM_RANKS, len(toks))):
                        t = toks[rank]
                        if t in banned:
                            continue
                        p = -negc[rank] / total
                        b = 4 if p >= 0.95 else 3 if p >= 0.8 else 2 if p >= 0.5 else 1 if p >= 0.2 else 0
                        # Own text where the sequence that last passed there is this request's; a continuation
                        # seen once (a leaf, ~leaf in ``kids``) counts as another request's (see ``OWN``).
                        ref = kids[t]
                        own = OWN if ref >= 0 and last[ref] in here else 0
                        streamed[t] = (((own + mb) * 15 + (rank if rank < 2 else 2) * 5 + b) * 2, p)
            else:  # inside a chain only one sequence holds: one continuation, every time
                follows = tree.chain_next(spos)
                if follows is not None and follows[0] not in banned:
                    own = OWN if follows[1] in here else 0
                    streamed[follows[0]] = (((own + mb) * 15 + 4) * 2, 1.0)
        if not deep and self._skip is not None:
            self._skipped(streamed)
        # Each candidate is mapped as placed nodes of its lane turned out (a + b * c in the chance's tenth, 0 <= c
        # <= 1) as it comes; where the chances add up to more than 1 they are shared out (``SURE``) and mapped again.
        stream_lane, row_lane = self._lanes
        out: list[Candidate] = []
        total = 0.0
        found = []  # ``rows_for``, inlined: the memories ``propose`` fetched, most specific first
        m3, m2, table = self._memories
        n = len(key)
        if n == 3 and m3 is not None and (row := m3.get(key)) is not None:
            found.append((3, row))
        if n >= 2 and m2 is not None and (row := m2.get(key[1:] if n == 3 else key)) is not None:
            found.append((2, row))
        if n and table is not None and 0 <= key[-1] < self.vocab_size and (row := table[key[-1]]) is not None:
            found.append((1, row))
        if len(found) == 1:  # one row is its own mixture (``mix``, inlined)
            ids, probs = found[0][1]
        else:
            ids, probs, found = self._mixture(key, found) if found else NO_ROWS
        agree = ()
        if ids:
            a, b = self._row_ab
            base = (found[0][0] - 1) * 4
            tail = deep * 2 + (1 if streamed else 0)
            for rank in range(min(len(ids), self.width)):
                t = ids[rank]
                if t in streamed:
                    agree = agree or set()
                    agree.add(t)
                    continue
                if t in banned:
                    continue
                p = probs[rank]
                cell = ((base + (rank if rank < 3 else 3)) * 5 +
                        (4 if p >= 0.95 else 3 if p >= 0.8 else 2 if p >= 0.5 else 1 if p >= 0.2 else 0)) * 4 + tail
                c = a[cell] + b[cell] * p * p if a is not None else p
                total += c
                la, lb = row_lane[int(c * 10)]
                out.append((c, t, -1, cell, la + lb * c))
        if streamed:
            a, b = self._stream_ab
            for t, (cell, share) in streamed.items():
                if t in agree:
                    cell += 1
                c = a[cell] + b[cell] * share if a is not None else share
                total += c
                la, lb = stream_lane[int(c * 10)]
                out.append((c, t, cell, -1, la + lb * c))
        if total > 1.0:  # exclusive siblings
            best, _, best_cell, _, _ = max(out)
            sure = best >= SURE and OWNED <= best_cell < SKIPPED
            if sure:  # what is left is handed out best first
                out.sort(reverse=True)
            scaled, left = [], 1.0
            for x, t, s_cell, r_cell, _ in out:
                if sure:
                    c = x if x <= left else left
                    left -= c
                else:
                    c = x / total
                la, lb = (stream_lane if s_cell >= 0 else row_lane)[int(c * 10)]
                scaled.append((c, t, s_cell, r_cell, la + lb * c))
            out = scaled
        out.sort(reverse=True)
        return out

    def _guesses(self) -> list[Candidate]:
        """A root with nothing to continue (its token new to the stream, no row for it): the stream's most
        frequent tokens, each at its share of the stream's text as its chance, drafting on as a match of itself.
        Over SmolLM2's text sets the four most frequent came next there about as often as their shares say
        (0.14-0.19 against 0.15-0.18; docs/benchmarks.md, forty-fifth session), so those chances are drafted as
        they are, in no evidence class and no placed lane: learning them would shift when every stream class's
        coefficients are rebuilt (``CellChances``), and that moved the proxy by itself."""
        total = self.stream.tree.count[ROOT]
        if not total:
            return []
        return [(c / total, t, -1, GUESS, c / total) for t, c in self.stream.frequent() if t not in self.banned]

    def _placed_lanes(self) -> tuple[list, list]:
        """The placed-node maps (a, b) by tenth of a chance, for a stream candidate and a row candidate (an
        opening's both in its own lane), each with its top tenth repeated so that a chance of exactly 1 reads it
        as ``int(c * 10)``; uncalibrated, a map that keeps every chance as it is."""
        if not self.calibrate:
            return UNMAPPED, UNMAPPED
        mapped = self.placed.coefficients()
        if self._padded[0] is not mapped:  # rebuilt since the last read
            self._padded = (mapped, [lane + lane[-1:] for lane in mapped])
        padded = self._padded[1]
        if self._opening:
            return padded[OPENING_LANE], padded[OPENING_LANE]
        return padded[STREAM_LANE], padded[ROW_LANE]

    # --- the tree -------------------------------------------------------------------------------------------

    def rest(self, context: list[int]) -> Tree:
        self._write(context)
        self._nodes = [[tuple(context[-3:]), None, 0, 0, (), None, -1]]
        self.chances = [1.0]
        self._opening = False
        return Tree.root(context[-1])

    def propose(self, context: list[int], room: int) -> Tree:
        """Best-first growth: a node's best unplaced candidate waits in the heap at its path chance (its next
        sibling takes its place when it is placed). With ``budget="auto"`` the tree stops growing when no bigger
        tree can beat the best size so far (``SizeChooser``), and is cut to that best size."""
        self._skip = self._advance(context)
        self._here = set(self.index.segs) if self.index.segs is not None else ()  # this request's own text
        tail = tuple(context[-3:])
        max_depth = min(self.depth, room)
        spos, m = self._match() if self.suffix and max_depth > 0 else (None, 0)
        if m > 1:  # the context's own match says more than its last token: no skip
            self._skip = None
        # The learned coefficients, fetched once: nothing is recorded until the step is verified.
        calibrated = self.calibrate
        self._row_ab = self.row_chances.coefficients() if calibrated else (None, None)
        self._stream_ab = self.stream_chances.coefficients() if calibrated else (None, None)
        self._opening = self.drafts_at_prefill and len(context) == self._prompt_length  # before the prompt runs
        self._lanes = self._placed_lanes()
        use3, use2, use1 = self._uses
        self._memories = (self.keyed[3].rows if use3 else None, self.keyed[2].rows if use2 else None,
                          self.order1.rows if use1 else None)
        first = self._candidates(tail, spos, m, 0) if max_depth > 0 else []
        if not first and self.guesses and not self._opening and max_depth > 0:
            first = self._guesses()
        # Per node: [key, stream position, match length, depth, candidates, (lane, lane chance) if placed, its row
        # cell (-1: not from the rows; GUESS: a guess), whether its path outran the stream memory's depth
        # (``_reanchor``)]
        nodes: list[list] = [[tail, spos, m, 0, first, None, -1, False]]
        tokens, parents, chances = [context[-1]], [-1], [1.0]
        tree_s = self.stream.tree
        anchor = min(ANCHOR, tree_s.depth - 1)
        sizer = self.cost.chooser(self.paced, probe=not self._opening) if self.wants_costs else None
        budget, stops = self.budget, self.stops
        push, pop = heapq.heappush, heapq.heappop
        # (-path chance, node, rank of the candidate it places)
        frontier: list[tuple[float, int, int]] = [(-first[0][4], 0, 0)] if first else []
        trust = (self.opening_trust if self._opening else self.trust).factor if sizer is not None else 1.0
        # Growth surely goes on while the best waiting chance beats the sizer's threshold (it moves only when a
        # node is placed); below it the sizer decides. Without a sizer, up to the budget.
        limit = sizer.threshold() / trust if sizer is not None else 0.0
        while frontier:
            if sizer is None:
                if len(tokens) > budget:
                    break
            elif -frontier[0][0] <= limit and not sizer.worth_growing(-frontier[0][0] * trust):
                break
            neg, parent, rank = pop(frontier)
            node = nodes[parent]
            cands = node[4]
            chance, token, s_cell, r_cell, _ = cands[rank]
            lane = STREAM_LANE if s_cell >= 0 else ROW_LANE if r_cell >= 0 else GUESS_LANE
            if rank + 1 < len(cands):
                push(frontier, (-chances[parent] * cands[rank + 1][4], parent, rank + 1))
            i = len(tokens)
            tokens.append(token)
            parents.append(parent)
            chances.append(-neg)
            d = node[3] + 1
            spos = node[1]
            if s_cell >= SKIPPED:  # a skip (at the root): on along the stream path it came from
                child, cm = self._skip_at[token]
            elif r_cell == GUESS:  # on as a match of itself
                child, cm = tree_s.step(ROOT, token), 1
            else:
                child = tree_s.step(spos, token) if spos is not None else None
                cm = node[2] + 1 if child is not None else 0
            far = node[7] and child is not None
            if child is None and spos is not None and node[2] + 1 >= tree_s.depth or cm >= tree_s.depth:
                # At the memory's depth nothing continues: match the path's own last tokens afresh.
                child, cm = self._reanchor(context, tokens, parents, i, anchor)
                far = child is not None
            key = (node[0] + (token,))[-3:]
            kids = ()
            if d < max_depth and token not in stops:
                # A path that outran the memory's depth has matched at least that long, whatever its re-anchored
                # match says: it is classed with the longest matches (a passage being copied).
                kids = self._candidates(key, child, FAR if far else cm, 1)
                if kids:
                    push(frontier, (neg * kids[0][4], i, 0))
            nodes.append([key, child, cm, d, kids, (lane, chance), r_cell, far])
            if sizer is not None:
                limit = sizer.place(-neg * trust) / trust
        n = sizer.size if sizer is not None else len(tokens)
        return self._tree(tokens[:n], parents[:n], chances[:n], nodes[:n])

    def _reanchor(self, context: list[int], tokens: list[int], parents: list[int], i: int,
                  anchor: int) -> tuple[int | None, int]:
        """Node ``i``'s path has outrun the stream memory's depth: match its last ``anchor`` tokens afresh."""
        path = []
        j = i
        while j > 0 and len(path) < anchor:
            path.append(tokens[j])
            j = parents[j]
        path.reverse()
        if len(path) < anchor:
            path = context[len(path) - anchor:] + path
        pos = self.stream.tree.match(path)
        return (pos, anchor) if pos is not None else (None, 0)

    def _tree(self, tokens: list[int], parents: list[int], chances: list[float], nodes: list[list]) -> Tree:
        """Lay the kept nodes out depth-first, best child first (best-first growth placed siblings best first),
        so the top-1 chain sits at indices 0..d: when it is the accepted path the KV compaction is only a cut."""
        n = len(tokens)
        size = [1] * n  # of each node's subtree
        for i in range(n - 1, 0, -1):
            size[parents[i]] += size[i]
        # Siblings come in index order (best first): a node's place is its parent's, past the subtrees of the
        # siblings before it.
        where, free = [0] * n, [1] * n  # a node's place; the next free place under it, counted from its own
        for i in range(1, n):
            p = parents[i]
            where[i] = where[p] + free[p]
            free[p] += size[i]
        order = [0] * n
        for old, new in enumerate(where):
            order[new] = old
        self._nodes = laid = [nodes[i] for i in order]
        self.chances = [chances[i] for i in order]
        return Tree([tokens[i] for i in order], [-1] + [where[parents[i]] for i in order[1:]], self._sources(laid))

    def _sources(self, nodes: list[list]) -> list[Source]:
        """Who proposed each node, for the statistics: the stream (this request's own text: SUFFIX) or the
        recycled rows, by the most specific order that had a row there (what its chance was learned for)."""
        here, source = self._here, self.stream.tree.source
        suffix, stream = Source.SUFFIX, Source.STREAM
        out = [Source.ROOT]
        for node in nodes[1:]:
            if node[5][0] == STREAM_LANE:
                pos = node[1]
                out.append(suffix if pos is not None and source(pos) in here else stream)
            elif node[5][0] == GUESS_LANE:  # the stream's counts
                out.append(stream)
            else:
                out.append(ORDER_SOURCE[node[6] // ROW_ORDER_CELLS + 1])
        return out


class Trust:
    """How far this request's trees have kept their promises: (drafted tokens emitted + k) / (expected + k) over
    its steps so far, within [LOW, HIGH]. The learned chances are the run's averages; one request (a rewrite of a
    passage whose phrases keep matching and never continue as they did, an answer that copies its prompt) can sit
    far from them, and a tree sized on the averages would keep paying for nodes that do not come. Sizing scales
    a tree's chances by it; the tree's shape and order do not change. A request's own weighs its steps by
    recency (``decay``: each step, the sums so far count that much): an answer that turns from free text to a
    repeated list (SmolLM2's prompts) is trusted again within a few steps, not after as many as it failed, and
    steps that draft nothing let it forget too: a request cannot lock itself out of drafting.

    The stream's openings keep one of their own, across requests and in the memory file, with a lower floor: an
    opening is one tree a request, and a stream whose openings keep failing (prompts that share only their chat
    template: after SmolLM2's third prompt most openings accepted nothing) should draft almost none, while one
    whose questions repeat (the demo's VQA) keeps them whole."""

    LOW, HIGH, K = 0.25, 1.5, 4.0

    def __init__(self, low: float = LOW, decay: float = 1.0) -> None:
        self.low, self.decay = low, decay
        self.expected = self.emitted = 0.0

    def observe(self, expected: float, emitted: int) -> None:
        self.expected = self.decay * self.expected + expected
        self.emitted = self.decay * self.emitted + emitted

    def state(self) -> dict[str, torch.Tensor]:
        return {"expected": torch.tensor(self.expected, dtype=torch.float64),
                "emitted": torch.tensor(self.emitted, dtype=torch.float64)}

    @staticmethod
    def check_state(state) -> None:
        if not isinstance(state, dict) or set(state) != {"expected", "emitted"} or not all(
                isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype.is_floating_point and torch.isfinite(t)
                and t >= 0 for t in state.values()):
            raise ValueError("the openings' trust must hold 'expected' and 'emitted', two finite numbers >= 0")

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.check_state(state)
        self.expected, self.emitted = float(state["expected"]), float(state["emitted"])

    @property
    def factor(self) -> float:
        return min(self.HIGH, max(self.low, (self.emitted + self.K) / (self.expected + self.K)))
