"""Where recycled predictions live: a dense per-token table, capped keyed maps, and an n-gram index.

A row is (ids, probs): the verifier's top-k successors of some context, renormalised over k, stored as Python
tuples because drafting reads a few dozen of them per step and tuple indexing is the cheapest read there is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..decoding.tree import Rows

Row = tuple[tuple[int, ...], tuple[float, ...]]


def row_tuples(rows: Rows) -> list[Row]:
    """The verifier's rows in the form the memories store."""
    return [(tuple(i), tuple(p)) for i, p in zip(rows.ids.tolist(), rows.probs.tolist())]


class TokenTable:
    """Rows keyed by one token, one slot per vocabulary id: bounded by the vocabulary, O(1) reads and writes."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.rows: list[Row | None] = [None] * vocab_size

    def get(self, token: int) -> Row | None:
        return self.rows[token] if 0 <= token < self.vocab_size else None

    def put(self, token: int, row: Row) -> None:
        if 0 <= token < self.vocab_size:
            self.rows[token] = row

    def filled(self) -> int:
        return sum(r is not None for r in self.rows)

    def clear(self) -> None:
        self.rows = [None] * self.vocab_size

    def state(self) -> dict[str, torch.Tensor]:
        """Dense (vocab, k) tensors, -1 where a token has no row: the on-disk form of the memory."""
        k = max((len(r[0]) for r in self.rows if r is not None), default=1)
        ids = torch.full((self.vocab_size, k), -1, dtype=torch.int32)
        probs = torch.zeros(self.vocab_size, k)
        for t, r in enumerate(self.rows):
            if r is not None:
                ids[t, : len(r[0])] = torch.tensor(r[0], dtype=torch.int32)
                probs[t, : len(r[1])] = torch.tensor(r[1])
        return {"ids": ids, "probs": probs}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take back ``state()``'s tensors after checking every property drafting relies on."""
        check_table(state, self.vocab_size)
        ids, probs = state["ids"], state["probs"]
        self.clear()
        counts = (ids >= 0).sum(1).tolist()
        for t, (row_ids, row_probs) in enumerate(zip(ids.tolist(), probs.tolist())):
            if counts[t]:
                self.rows[t] = (tuple(row_ids[: counts[t]]), tuple(row_probs[: counts[t]]))


def check_table(state, vocab_size: int) -> None:
    """A ValueError naming the first thing wrong with a saved table (ids padded with -1 at the end of each row,
    probabilities in [0, 1] beside them), so a damaged file fails at load, not at the first request."""
    if not isinstance(state, dict) or set(state) != {"ids", "probs"}:
        raise ValueError("the token table must hold exactly 'ids' and 'probs'")
    ids, probs = state["ids"], state["probs"]
    if not isinstance(ids, torch.Tensor) or not isinstance(probs, torch.Tensor):
        raise ValueError("the token table's 'ids' and 'probs' must be tensors")
    if ids.dtype not in (torch.int32, torch.int64) or not probs.dtype.is_floating_point:
        raise ValueError(f"the token table has ids of {ids.dtype} and probabilities of {probs.dtype}")
    if ids.dim() != 2 or ids.shape != probs.shape or ids.shape[1] < 1:
        raise ValueError(f"the token table's ids {tuple(ids.shape)} and probabilities {tuple(probs.shape)} "
                         "must be two equal (vocabulary, k) shapes")
    if ids.shape[0] != vocab_size:
        raise ValueError(f"memory is for a vocabulary of {ids.shape[0]} tokens, the model has {vocab_size}")
    if ids.numel() and (ids.min() < -1 or ids.max() >= vocab_size):
        raise ValueError(f"the token table holds token ids outside the vocabulary (0..{vocab_size - 1})")
    present = ids >= 0
    if (present[:, 1:] & ~present[:, :-1]).any():
        raise ValueError("the token table has a gap (-1) inside a row")
    if not torch.isfinite(probs).all() or (probs < 0).any() or (probs > 1).any():
        raise ValueError("the token table holds probabilities outside [0, 1]")


class KeyedMemory:
    """Rows keyed by a tuple of tokens, capped: past ``cap`` keys the least recently written one goes."""

    def __init__(self, cap: int = 1 << 16):
        self.cap = cap
        self.rows: dict[tuple[int, ...], Row] = {}

    def get(self, key: tuple[int, ...]) -> Row | None:
        return self.rows.get(key)

    def put(self, key: tuple[int, ...], row: Row) -> None:
        rows = self.rows
        rows.pop(key, None)  # re-inserting moves the key to the young end of the dict's order
        rows[key] = row
        if len(rows) > self.cap:
            del rows[next(iter(rows))]

    def __len__(self) -> int:
        return len(self.rows)

    def clear(self) -> None:
        self.rows.clear()


class NgramIndex:
    """Where each n-gram (n <= max_n) of a growing token sequence ended, for suffix and prompt lookup.

    Positions are indexed lazily up to (not including) the current last token, so a lookup of the current suffix
    finds only earlier occurrences.
    """

    def __init__(self, max_n: int, keep: str = "latest", skip: Iterable[int] = ()):
        if keep not in ("latest", "earliest"):
            raise ValueError("keep is 'latest' or 'earliest'")
        self.max_n, self.latest = max_n, keep == "latest"
        self.skip = frozenset(skip)
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0

    def reset(self) -> None:
        self.ends.clear()
        self.indexed = 0

    def _index(self, seq: Sequence[int], upto: int) -> None:
        ends, latest = self.ends, self.latest
        for j in range(self.indexed, upto):
            if seq[j] in self.skip:
                continue
            for n in range(1, min(self.max_n, j + 1) + 1):
                key = tuple(seq[j - n + 1: j + 1])
                if latest or key not in ends:
                    ends[key] = j
        self.indexed = max(self.indexed, upto)

    def continuation(self, seq: Sequence[int], length: int, min_n: int = 1) -> tuple[int, list[int]]:
        """(n, tokens): the longest suffix of ``seq`` (n >= min_n) seen earlier, and up to ``length`` tokens that
        followed it there; (0, []) when no suffix recurs."""
        last = len(seq) - 1
        self._index(seq, last)
        for n in range(min(self.max_n, len(seq)), min_n - 1, -1):
            end = self.ends.get(tuple(seq[last - n + 1:]))
            if end is not None:
                follow = list(seq[end + 1: end + 1 + length])
                cut = next((i for i, t in enumerate(follow) if t in self.skip), len(follow))
                if cut:
                    return n, follow[:cut]
        return 0, []
