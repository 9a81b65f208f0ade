"""RECAP's stream memory: every token of text the stream has seen (earlier requests' prompts and answers, and
this request's so far) in one suffix tree, so a draft can continue the longest exact match of the current
context wherever in the stream it occurred, with how often each continuation followed it.

The longest context with the longest lifetime: orders 1-3 key rows by at most three tokens, this matches up to
``depth`` tokens (RECAP uses 32), across requests. Bounded like SuffixDecoding's global tree: past
``max_requests`` requests the oldest is evicted (its occurrences leave the counts). Image placeholders split the
text into segments (a match never runs through an image). Shared by every row of a batch; each request writes its
own segments. A conversation's next turn (a prompt that goes on from an ended request's whole text: the earlier
turns and their answers) continues that request's segments: its answers are not written again as prompt text,
and the stream counts each token of a conversation once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

from .suffix_tree import ROOT, SuffixTree

OPEN = -1  # a request's segment list ends with OPEN while no segment is being written (after an image)
GONE = -2  # an evicted request's segment list: it writes no more (not even a new segment after an image)
CONTINUABLE = 64  # ended requests whose text a new prompt may go on from (a conversation's next turn)
FREQUENT = 4  # the stream's most frequent tokens kept (``StreamMemory.frequent``)


class Cursor:
    """One request's place in the stream memory: its segments there, how much of its context they hold, where
    their text starts in it, and (a request that continues an ended one's text) that one's, to put back if this
    request never runs."""

    def __init__(self) -> None:
        self.segs: list[int] | None = None
        self.seen = self.start = 0
        self.resumed: Ended | None = None


class Ended:
    """A request that ended: its whole context (prompt and answer), its segments, where their text starts."""

    def __init__(self, context: list[int], segs: list[int], start: int):
        self.context, self.segs, self.start = context, segs, start


class StreamMemory:
    def __init__(self, banned: Iterable[int] = (), depth: int = 32, max_requests: int = 1000):
        self.banned, self.depth, self.max_requests = frozenset(banned), depth, max_requests
        self.clear()

    def clear(self) -> None:
        self.tree = SuffixTree(self.depth, ordered=False)  # equal counts in any order: cheaper to append
        self.requests: deque[list[int]] = deque()  # each request's segment ids, oldest request first
        self.last_prompt: list[int] = []
        self.ended: deque[Ended] = deque()  # the latest ended requests, oldest first: a next turn continues one
        self._top: list[tuple[int, int]] = []  # (-occurrences, token) of the most frequent tokens, most first

    def frequent(self) -> list[tuple[int, int]]:
        """The stream's FREQUENT most frequent tokens as (token, occurrences), most first, ties by token (as the
        tree's root ranks its children, from which it is recounted after an eviction). Kept as text is written:
        between evictions counts only grow, so a token enters the list only when its own count does."""
        return [(t, -c) for c, t in self._top]

    def _counted(self, token: int) -> None:
        """``token`` was written once more: its place among the most frequent."""
        tree = self.tree
        entry = (-tree.occurrences(tree.step(ROOT, token)), token)
        top = self._top
        for i, (_, t) in enumerate(top):
            if t == token:
                top[i] = entry
                top.sort()
                return
        if len(top) < FREQUENT or entry < top[-1]:
            top.append(entry)
            top.sort()
            del top[FREQUENT:]

    def _recount(self) -> None:
        toks, negc = self.tree.ranked(ROOT, FREQUENT)
        self._top = list(zip(negc, toks))[:FREQUENT]

    def unseen(self, prompt: list[int]) -> int:
        """Where a new prompt's text must start being written: prompts in a stream share their start (the chat
        template, the image, a conversation's earlier turns), which the previous prompt already wrote; writing it
        again would cost O(depth) per token and only add counts where every request agrees anyway. Its last
        ``depth`` shared tokens are written again (those after the last image placeholder among them), so every
        suffix of the new text is a match this request holds."""
        shared = 0
        for a, b in zip(prompt, self.last_prompt):
            if a != b:
                break
            shared += 1
        self.last_prompt = list(prompt)
        start = max(0, shared - self.depth)
        # No match runs through an image placeholder: text before the last shared one is another segment.
        last_image = next((i for i in range(shared - 1, start - 1, -1) if prompt[i] in self.banned), None)
        return start if last_image is None else last_image + 1

    def begin(self) -> list[int]:
        """A new request: its (growing) list of segments; the oldest requests past the bound are evicted."""
        segs = [OPEN]
        self.requests.append(segs)
        while len(self.requests) > self.max_requests:
            gone = self.requests.popleft()
            if self._began_last_prompt(gone):  # the start every prompt shares goes with it: the next writes it
                self.last_prompt = []
            self._forget(gone)
            gone[:] = [GONE]  # a request in flight (a row of a batch) writes no more: ``write``
            self.ended = deque(e for e in self.ended if e.segs is not gone)
        return segs

    def _began_last_prompt(self, segs: list[int]) -> bool:
        """Whether this request's text begins as the last prompt does (it wrote the start later prompts share and
        so skipped, ``unseen``): compared over up to ``depth`` tokens, from the prompt's first token that is text."""
        first = next((sid for sid in segs if sid >= 0 and sid in self.tree.seqs), None)
        at = next((i for i, t in enumerate(self.last_prompt) if t not in self.banned), None)
        if first is None or at is None:
            return False
        text = self.tree.seqs[first]
        n = min(len(text), len(self.last_prompt) - at, self.depth)
        return list(text[:n]) == self.last_prompt[at:at + n]

    def resume(self, prompt: list[int]) -> Ended | None:
        """The latest ended request whose whole text this prompt goes on from (a conversation's next turn: the
        earlier turns, their answers, then the new question), taken off the list: the new turn writes only what
        is new, continuing that request's segments, instead of writing its answer again as prompt text. None
        where no ended request's text starts this prompt."""
        for i in range(len(self.ended) - 1, -1, -1):
            ended = self.ended[i]
            n = len(ended.context)
            if n <= len(prompt) and prompt[n - 1] == ended.context[-1] and prompt[:n] == ended.context:
                del self.ended[i]
                self.last_prompt = list(prompt)
                return ended
        return None

    def end(self, segs: list[int], context: list[int], start: int) -> None:
        """A request has ended with ``context`` (all of it written): a next turn may continue its text. Past the
        latest CONTINUABLE, the oldest will write no more (``finish``). One evicted while in flight is not
        continued: its next turn is a request of its own."""
        if segs[-1] == GONE:
            return
        self.ended.append(Ended(list(context), segs, start))
        if len(self.ended) > CONTINUABLE:
            self.finish(self.ended.popleft().segs)

    def _forget(self, segs: list[int]) -> None:
        """A request's occurrences leave the counts (what only it held leaves the tree)."""
        for sid in segs:
            if sid >= 0 and sid in self.tree.seqs:
                self.tree.remove(sid)
        self._recount()

    def write(self, segs: list[int], tokens: Iterable[int]) -> None:
        """Append a request's next tokens (an image placeholder ends its segment)."""
        tree, banned = self.tree, self.banned
        sid = segs[-1]
        if sid == GONE:  # evicted while in flight: this request writes no more
            return
        for t in tokens:
            if t in banned:
                if sid != OPEN:
                    tree.close(sid)
                    segs.append(OPEN)
                    sid = OPEN
                continue
            if sid == OPEN:
                sid = segs[-1] = tree.new_seq()
            if sid not in tree.active:  # its sequence was taken out of the tree (``withdraw``)
                return
            tree.append(sid, t)
            self._counted(t)

    def withdraw(self, segs: list[int], resumed: Ended | None = None) -> None:
        """A request that never ran: its text leaves the counts and the request leaves the stream. The next prompt
        is written in full: the start it shares with the last one may be text only the withdrawn request held.
        One that continued an ended request (``resumed``) took that one's segments with it: that text is written
        again, as it was, and may be continued again (the same turn retried)."""
        self._forget(segs)
        self.requests = deque(r for r in self.requests if r is not segs)
        self.last_prompt = []
        if resumed is not None:
            again = self.begin()
            self.write(again, resumed.context[resumed.start:])
            self.ended.append(Ended(resumed.context, again, resumed.start))

    def finish(self, segs: list[int]) -> None:
        """The request will write no more (its segments' suffixes are let go; the text stays, counted)."""
        if segs and segs[-1] != OPEN and segs[-1] in self.tree.active:
            self.tree.close(segs[-1])

    def state(self) -> dict[str, torch.Tensor]:
        """The text, request by request and segment by segment: the tree is rebuilt from it on load, in the
        same order, so it is the same tree."""
        lengths, per_request, tokens = [], [], []
        for segs in self.requests:
            mine = [s for s in segs if s != OPEN and s in self.tree.seqs]
            per_request.append(len(mine))
            for sid in mine:
                lengths.append(len(self.tree.seqs[sid]))
                tokens.extend(self.tree.seqs[sid])
        return {"tokens": torch.tensor(tokens, dtype=torch.int32),
                "lengths": torch.tensor(lengths, dtype=torch.int64),
                "segments": torch.tensor(per_request, dtype=torch.int64),
                "last_prompt": torch.tensor(self.last_prompt, dtype=torch.int32)}

    def check_state(self, state, vocab_size: int) -> None:
        """``last_prompt`` (where the next prompt's shared start ends) is optional: a merged memory has none."""
        if not isinstance(state, dict) or not {"tokens", "lengths", "segments"} <= set(state) \
                or not set(state) <= {"tokens", "lengths", "segments", "last_prompt"}:
            raise ValueError("the stream memory must hold exactly 'tokens', 'lengths', 'segments' and optionally "
                             "'last_prompt'")
        last = state.get("last_prompt", torch.zeros(0, dtype=torch.int32))
        if not isinstance(last, torch.Tensor) or last.dim() != 1 or last.dtype.is_floating_point \
                or (last.numel() and (last.min() < 0 or last.max() >= vocab_size)):
            raise ValueError("the stream memory's last prompt must be a 1-D tensor of token ids")
        tokens, lengths, segments = state["tokens"], state["lengths"], state["segments"]
        if not all(isinstance(t, torch.Tensor) and t.dim() == 1 and not t.dtype.is_floating_point
                   for t in (tokens, lengths, segments)):
            raise ValueError("the stream memory's tokens, lengths and segments must be 1-D integer tensors")
        if (lengths < 1).any() or (segments < 0).any() or int(segments.sum()) != lengths.numel() \
                or int(lengths.sum()) != tokens.numel():
            raise ValueError("the stream memory's lengths and segments do not add up to its tokens")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab_size):
            raise ValueError(f"the stream memory holds token ids outside the vocabulary (0..{vocab_size - 1})")

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.clear()
        tokens, lengths = state["tokens"].tolist(), state["lengths"].tolist()
        at = seg = 0
        for n in state["segments"].tolist():
            segs = self.begin()
            for length in lengths[seg: seg + n]:
                self.write(segs, tokens[at: at + length])
                self.finish(segs)
                segs.append(OPEN)
                at += length
            seg += n
        self.last_prompt = state["last_prompt"].tolist() if "last_prompt" in state else []


def _requests(state: dict[str, torch.Tensor] | None) -> list[list[list[int]]]:
    """A saved stream memory as requests of segments of tokens."""
    if state is None:
        return []
    tokens, lengths = state["tokens"].tolist(), state["lengths"].tolist()
    out, at, seg = [], 0, 0
    for n in state["segments"].tolist():
        segs = []
        for length in lengths[seg: seg + n]:
            segs.append(tokens[at: at + length])
            at += length
        out.append(segs)
        seg += n
    return out


def merge_states(seed: dict[str, torch.Tensor] | None, states: list[dict[str, torch.Tensor]]) -> dict:
    """Several workers' stream memories, each grown from ``seed``, as one: the seed's requests, then each worker's
    own, worker by worker (a worker that evicted some of the seed's oldest requests still starts with the rest).
    Loading bounds the result to the memory's request limit, oldest out first."""
    base = _requests(seed)
    merged = list(base)
    for state in states:
        mine = _requests(state)
        drop = next(len(base) - e for e in range(len(base) + 1) if mine[: len(base) - e] == base[e:])
        merged.extend(mine[drop:])
    return {"tokens": torch.tensor([t for r in merged for s in r for t in s], dtype=torch.int32),
            "lengths": torch.tensor([len(s) for r in merged for s in r], dtype=torch.int64),
            "segments": torch.tensor([len(r) for r in merged], dtype=torch.int64)}
