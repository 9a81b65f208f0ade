"""Draft trees and verification results: the data the engine and drafters pass each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch


class Source(IntEnum):
    """Who proposed a node; accepted tokens are counted by source in the statistics."""

    ROOT = 0
    ORDER1 = 1
    ORDER2 = 2
    ORDER3 = 3
    SUFFIX = 4  # a continuation found earlier in the same request's text
    MATRIX = 5  # Token Recycling's successor matrix
    LOOKUP = 6  # prompt lookup
    OTHER = 7  # test drafters
    BONUS = 8  # the verifier's own token after the accepted path (never a draft node)
    STREAM = 9  # a continuation found in earlier requests' text (the stream-wide suffix memory)


@dataclass
class Tree:
    """Node 0 is the root: the last committed token, not yet in the KV cache. ``parents[i] < i`` for i > 0, so
    the order is topological and a node's KV row can be written at position P + i during verification."""

    tokens: list[int]
    parents: list[int]
    sources: list[int] = field(default_factory=list)

    @classmethod
    def root(cls, token: int) -> "Tree":
        return cls([token], [-1], [Source.ROOT])

    @classmethod
    def balanced(cls, size: int) -> "Tree":
        """A balanced binary tree of ``size`` nodes (depth log2 size), shaped like real drafts for the mask: what
        the engines time a step of each size with."""
        return cls(tokens=[0] * size, parents=[-1] + [(i - 1) // 2 for i in range(1, size)])

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return d

    def padded(self, width: int) -> tuple[list[int], list[int]]:
        """Tokens and depths padded to ``width`` nodes, as a fixed-shape step lays them out: a padding node repeats
        the root's token at depth 0 (it hangs off nothing, and its mask row lets it see only itself)."""
        pad = width - len(self.tokens)
        return self.tokens + [self.tokens[0]] * pad, self.depths() + [0] * pad

    def without(self, token: int | None) -> "Tree":
        """This tree less the nodes holding ``token`` and those under them (itself when none does)."""
        if token is None or token not in self.tokens[1:]:
            return self
        keep, where = [0], {0: 0}
        for i in range(1, len(self.tokens)):
            if self.parents[i] in where and self.tokens[i] != token:
                where[i] = len(keep)
                keep.append(i)
        sources = [self.sources[i] for i in keep] if self.sources else []
        return Tree([self.tokens[i] for i in keep], [-1] + [where[self.parents[i]] for i in keep[1:]], sources)

    def validate(self) -> None:
        if not self.tokens or self.parents[0] != -1:
            raise ValueError("a tree starts with its root (parent -1)")
        if len(self.parents) != len(self.tokens):
            raise ValueError("tokens and parents differ in length")
        for i in range(1, len(self.parents)):
            if not 0 <= self.parents[i] < i:
                raise ValueError(f"node {i}: parent {self.parents[i]} must come before it")


@dataclass
class Rows:
    """The verifier's top-k next-token predictions at each evaluated position, renormalised over those k.

    Row i belongs to node i (or prompt position i at prefill): it predicts the token that follows it.
    """

    ids: torch.Tensor  # (N, k) int64, on the CPU
    probs: torch.Tensor  # (N, k) float32, on the CPU, each row sums to 1
    positions: list[int] | None = None  # at prefill: the prompt position of each row (image tokens have none)


@dataclass
class Verified:
    path: list[int]  # accepted node indices, starting with the root (0)
    bonus: int  # the model's greedy token after the last accepted node
    argmax: list[int]  # the model's token at every node: its argmax, or its rule's choice (decoding/sampling.py)
    rows: Rows

    def accepted_last(self, n: int) -> list[int]:
        """All n node indices, the accepted path last: memories written in this order keep, among rows for the
        same key, the row of the path that was committed."""
        accepted = set(self.path)
        return [i for i in range(n) if i not in accepted] + self.path
