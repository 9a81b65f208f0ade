"""Prompt lookup decoding: find the last n-gram (n = 3 down to 1) earlier in prompt + output and draft the
tokens that followed its first occurrence as one chain, as transformers' prompt_lookup_num_tokens does."""

from __future__ import annotations

from ..tree import Rows, Source, Tree
from .base import Drafter
from .memory import NgramIndex


class PromptLookupDrafter(Drafter):
    name = "pld"

    def __init__(self, banned=(), max_ngram: int = 3, num_tokens: int = 10):
        self.num_tokens = num_tokens
        self.index = NgramIndex(max_ngram, keep="earliest", skip=banned)

    def start(self, prompt: list[int], rows: Rows | None) -> None:
        self.index.reset()

    def propose(self, context: list[int], room: int) -> Tree:
        tree = Tree.root(context[-1])
        _, follow = self.index.continuation(context, min(self.num_tokens, room))
        for i, token in enumerate(follow):
            tree.tokens.append(token)
            tree.parents.append(i)
            tree.sources.append(Source.LOOKUP)
        return tree
