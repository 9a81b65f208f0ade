"""SuffixDecoding (Oliaro, Jia, Campos, Qiao; NeurIPS 2025, arXiv 2411.04975) as a baseline: ``--method suffix``.

As vLLM runs it (speculative method ``suffix``, defaults): two suffix trees of depth 24, one over this request's
prompt and answer so far, one over the answers of earlier requests (and this one's, as it grows), FIFO-evicted
past 10,000 requests. Each step matches the context's last 1..23 tokens in each tree, drafts from every match
the most frequent continuation while its count-based chance stays >= 0.1, at most ``max_spec_factor`` x the
match length tokens, and keeps the draft with the highest summed chance (the prompt tree's on a tie). One chain
per step, no cost model: what the reference does. Our own code (recap_cli/drafters/suffix_tree.py), checked
draft for draft against the reference implementation by benchmarks/suffix_reference.py.

Two deviations, both where the engine needs them: a draft stops before an image placeholder token (never
drafted, as for every method), and at most ``room`` tokens are drafted (the tokens left to generate).
"""

from __future__ import annotations

from collections import deque

from ..decoding.tree import Rows, Source, Tree
from .base import Drafter
from .suffix_tree import Draft, SuffixTree, speculate


class SuffixDecodingDrafter(Drafter):
    name = "suffix"

    def __init__(self, banned=(), depth: int = 24, max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, max_cached_requests: int = 10000, max_spec_tokens: int | None = None,
                 tree: bool = False):
        self.depth, self.factor, self.offset, self.min_prob = depth, max_spec_factor, max_spec_offset, min_token_prob
        self.max_cached, self.as_tree = max_cached_requests, tree
        self.max_tokens = depth if max_spec_tokens is None else max_spec_tokens
        self.banned = frozenset(banned)
        self.responses = SuffixTree(depth)  # the global tree: answers, shared by every row of a batch
        self.cached: deque[int] = deque()  # its sequences, oldest first
        self.own_request_state()

    def own_request_state(self) -> None:
        self.prompt_tree: SuffixTree | None = None  # this request's prompt + answer
        self.local = self.answer = -1  # their sequence ids in the two trees
        self.seen = self.prompt_len = 0  # context tokens added to the trees; where the answer starts
        self.last: Draft = Draft()

    def start(self, prompt: list[int], rows: Rows | None) -> None:
        if self.answer >= 0 and self.answer in self.responses.seqs:
            self.responses.close(self.answer)  # batch 1: the previous request of this drafter has ended
        self.prompt_tree = SuffixTree(self.depth)
        self.local = self.prompt_tree.new_seq(prompt)
        self.seen = self.prompt_len = len(prompt)
        self.answer = -1
        if self.max_cached != 0:
            self.answer = self.responses.new_seq()
            self.cached.append(self.answer)
            while self.max_cached > 0 and len(self.cached) > self.max_cached:  # FIFO, never the new one
                self.responses.remove(self.cached.popleft())

    def withdraw(self) -> None:
        if self.answer >= 0 and self.answer in self.responses.seqs:
            self.responses.remove(self.answer)
            self.cached.remove(self.answer)  # in place: every row shares the deque
        self.answer = -1

    def _sync(self, context: list[int]) -> None:
        """Add the tokens committed since the last step to both trees (the reference's add_active_response)."""
        new = context[self.seen:]
        self.seen = max(self.seen, len(context))
        self.prompt_tree.extend(self.local, new)
        if self.answer in self.responses.active:
            self.responses.extend(self.answer, new)

    def speculate(self, context: list[int], room: int) -> Draft:
        """The reference's draft for this context: the better of the prompt tree's and the answers' tree's."""
        self._sync(context)
        pattern = context[-self.depth:]
        limit = min(self.max_tokens, room)
        longest = len(pattern) - 1  # the reference matches suffixes shorter than the pattern
        # Both trees hold this request's own text, so their active suffixes are the context's matches.
        own = self.prompt_tree.active[self.local][:longest]
        draft = speculate(self.prompt_tree, own, limit, self.factor, self.offset, self.min_prob, self.as_tree)
        if self.answer in self.responses.active:
            found = self.responses.active[self.answer][:longest]
            more = (self.responses.match(pattern[-m:]) for m in range(len(found) + 1, longest + 1))
            other = speculate(self.responses, _chain(found, more), limit, self.factor, self.offset, self.min_prob,
                              self.as_tree)
            if other.score > draft.score:
                draft = other
                draft.match_len = -draft.match_len  # negative: from the answers' tree (for the node sources)
        return draft

    def propose(self, context: list[int], room: int) -> Tree:
        draft = self.speculate(context, room)
        self.last = draft
        source = Source.STREAM if draft.match_len < 0 else Source.SUFFIX
        tree = Tree.root(context[-1])
        for token, parent in zip(draft.tokens, draft.parents):
            if token in self.banned or (parent >= 0 and parent + 1 >= len(tree)):
                break
            tree.tokens.append(token)
            tree.parents.append(parent + 1)
            tree.sources.append(source)
        return tree

    def rest(self, context: list[int]) -> Tree:
        self._sync(context)
        return Tree.root(context[-1])

    def reset(self) -> None:
        self.responses = SuffixTree(self.depth)
        self.cached = deque()
        self.own_request_state()


def _chain(first, rest):
    yield from first
    yield from rest
