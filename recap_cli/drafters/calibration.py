"""How likely a drafted token is to be accepted, learned from the verifier's verdicts as a run goes.

Every node the verifier accepted was a fair test of all the candidates a drafter considered under it, placed in
the tree or not: the one that equals the model's argmax there would have been accepted, the others not. So each
step tests every candidate of every accepted node, and the estimates never starve, even when the cost cut leaves
a tree at its root. Estimates start at a guess worth ``prior`` observations.
"""

from __future__ import annotations

import torch

BUCKETS = (0.5, 0.8, 0.95)  # remembered probability -> bucket 0..3


def bucket(p: float) -> int:
    return 3 if p >= 0.95 else 2 if p >= 0.8 else 1 if p >= 0.5 else 0


class Counts:
    """Hits and tries in a (rows, cols) grid of evidence classes; saved and loaded with a run's memory."""

    def __init__(self, rows: int, cols: int):
        self.shape = (rows, cols)
        self.clear()

    def clear(self) -> None:
        self.hits = [[0.0] * self.shape[1] for _ in range(self.shape[0])]
        self.tries = [[0.0] * self.shape[1] for _ in range(self.shape[0])]
        self._coefficients = None

    def state(self) -> dict[str, torch.Tensor]:
        return {"hits": torch.tensor(self.hits, dtype=torch.float64),
                "tries": torch.tensor(self.tries, dtype=torch.float64)}

    def check_state(self, state) -> None:
        """A ValueError unless ``state`` is what ``state()`` gives: same shape, finite, 0 <= hits <= tries."""
        if not isinstance(state, dict) or set(state) != {"hits", "tries"}:
            raise ValueError("the calibration must hold exactly 'hits' and 'tries'")
        hits, tries = state["hits"], state["tries"]
        if not all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point and tuple(t.shape) == self.shape
                   for t in (hits, tries)):
            raise ValueError(f"the calibration counts must be two float tensors of shape {self.shape}")
        finite = torch.isfinite(hits).all() and torch.isfinite(tries).all()
        if not finite or (hits < 0).any() or (hits > tries).any():
            raise ValueError("the calibration counts must be finite with 0 <= hits <= tries")

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.check_state(state)
        self.hits, self.tries = state["hits"].tolist(), state["tries"].tolist()
        self._coefficients = None


class Calibration(Counts):
    """P(a recycled candidate is accepted | its node was) per (rank among the node's candidates, bucket of the
    remembered probability, depth 1 / 2 / 3+), starting at the remembered probability itself. A remembered
    probability is the model's confidence in an *earlier* context, so it overrates recycled tokens where
    contexts alias. Depth matters because acceptances are not independent: a node deep in the tree is only
    tested when its whole path was right, on a stretch of text that is predictable, where the next token is
    more often right too; one figure for all depths would make long paths look less likely than they are."""

    def __init__(self, width: int, prior: float = 4.0, depths: int = 3):
        self.width, self.prior, self.depths = width, prior, depths  # depths=1: one figure for all depths
        super().__init__(width * depths, len(BUCKETS) + 1)

    def chance(self, rank: int, p: float, depth: int) -> float:
        """For a candidate at tree depth ``depth`` (1: a child of the root)."""
        row, b = rank * self.depths + min(depth, self.depths) - 1, bucket(p)
        return (self.hits[row][b] + self.prior * p) / (self.tries[row][b] + self.prior)

    def coefficients(self) -> list[list[tuple[float, float]]]:
        """``chance`` as a + b * p per (rank x depth row, bucket): what drafting reads, rebuilt after records."""
        if self._coefficients is None:
            prior = self.prior
            self._coefficients = [[(h / (t + prior), prior / (t + prior)) for h, t in zip(hs, ts)]
                                  for hs, ts in zip(self.hits, self.tries)]
        return self._coefficients

    def first_child_bound(self) -> float:
        """An upper bound on ``chance(0, p, depth)`` for any p (p <= 1) and depth: what a node's best child can
        be worth before its rows are mixed."""
        return max((h + self.prior) / (t + self.prior)
                   for d in range(self.depths) for h, t in zip(self.hits[d], self.tries[d]))

    def record(self, rank: int, p: float, depth: int, hit: bool) -> None:
        row, b = rank * self.depths + min(depth, self.depths) - 1, bucket(p)
        self.tries[row][b] += 1
        self.hits[row][b] += hit
        self._coefficients = None


class ChainCalibration(Counts):
    """P(the j-th token of a continuation found earlier in the text is accepted | the tokens before it were),
    per (length of the match that found it, j), both capped. A long match continues reliably, a one-token
    match rarely; the first token of a continuation is the riskiest, later ones ride on its success."""

    def __init__(self, guess: float = 0.5, prior: float = 4.0, max_n: int = 4, max_j: int = 8):
        self.guess, self.prior, self.max_n, self.max_j = guess, prior, max_n, max_j
        super().__init__(max_n + 1, max_j + 1)

    def chance(self, n: int, j: int) -> float:
        n, j = min(n, self.max_n), min(j, self.max_j)
        return (self.hits[n][j] + self.prior * self.guess) / (self.tries[n][j] + self.prior)

    def path_chances(self, n: int, length: int) -> list[float]:
        """Chance that the first 1, 2, ... ``length`` tokens of a continuation are all accepted."""
        out, c = [], 1.0
        for j in range(length):
            c *= self.chance(n, j)
            out.append(c)
        return out

    def record(self, n: int, j: int, hit: bool) -> None:
        n, j = min(n, self.max_n), min(j, self.max_j)
        self.tries[n][j] += 1
        self.hits[n][j] += hit


MATCH_BUCKETS = (1, 2, 3, 4, 6, 9, 13)  # match length -> bucket 0..6 (13 and longer: the last)


def match_bucket(m: int) -> int:
    return 6 if m >= 13 else 5 if m >= 9 else 4 if m >= 6 else min(m, 4) - 1 if m >= 1 else 0


class StreamCalibration(Counts):
    """P(a continuation from the stream memory is accepted | its node was), per (length of the exact match
    behind it: the context's match plus the path below the root, bucketed; its rank among the match's
    continuations, 0 or later; the share of the match's occurrences it followed, bucketed). A token that
    followed a 12-token match every time is another thing than one that followed a single token once in ten.
    Starts at a guess of half the count-based share, worth ``prior`` observations."""

    def __init__(self, prior: float = 4.0):
        self.prior = prior
        super().__init__(len(MATCH_BUCKETS) * 2, len(BUCKETS) + 1)

    def chance(self, m: int, share: float, rank: int) -> float:
        row, b = 2 * match_bucket(m) + (rank > 0), bucket(share)
        return (self.hits[row][b] + self.prior * 0.5 * share) / (self.tries[row][b] + self.prior)

    def record(self, m: int, share: float, rank: int, hit: bool) -> None:
        row, b = 2 * match_bucket(m) + (rank > 0), bucket(share)
        self.tries[row][b] += 1
        self.hits[row][b] += hit


PLACED_EDGES = tuple(i / 10 for i in range(1, 10))  # a lane's chance -> bucket 0..9


class PlacedCalibration(Counts):
    """The second look: P(a node placed in the tree is accepted | its parent was) per (lane: the most specific
    recycled order behind it, or the stream; bucket of the chance its lane gave it). The lanes' estimates are
    learned over every candidate of an accepted node, but a tree keeps only the candidates that looked best, and
    those are the overrated ones (a winner's curse: the benchmarks/calibration.py table showed recycled nodes at
    a predicted 0.9-1.0 accepted 42% of the time). This maps each lane's chance to what placed nodes with that
    chance turned out to be worth, bucket by bucket, starting at the lane's own figure (``prior``
    observations)."""

    LANES = 4  # recycled with order 1 / 2 / 3 rows present, stream

    def __init__(self, prior: float = 8.0):
        self.prior = prior
        super().__init__(self.LANES, len(PLACED_EDGES) + 1)

    @staticmethod
    def bucket(p: float) -> int:
        return min(int(p * 10), 9) if p > 0 else 0

    def coefficients(self) -> list[list[tuple[float, float]]]:
        """a + b * p per (lane, bucket): the mapped chance is a + b * (the lane's chance)."""
        if self._coefficients is None:
            prior = self.prior
            self._coefficients = [[(h / (t + prior), prior / (t + prior)) for h, t in zip(hs, ts)]
                                  for hs, ts in zip(self.hits, self.tries)]
        return self._coefficients

    def bound(self, most: float = 1.0) -> float:
        """An upper bound on the mapped chance of any lane chance <= ``most`` (for nodes not yet mixed)."""
        return min(1.0, max(a + b * min(most, (j + 1) / 10) for row in self.coefficients()
                            for j, (a, b) in enumerate(row) if j / 10 <= most))

    def record(self, lane: int, p: float, hit: bool) -> None:
        b = self.bucket(p)
        self.tries[lane][b] += 1
        self.hits[lane][b] += hit
        self._coefficients = None
