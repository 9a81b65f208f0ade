"""How likely a drafted token is to be accepted, learned from the verifier's verdicts as a run goes.

Every node the verifier accepted was a fair test of all the candidates a drafter considered under it, placed in
the tree or not: the one that equals the model's argmax there would have been accepted, the others not. So each
step tests every candidate of every accepted node, and the estimates never starve, even when the cost cut leaves
a tree at its root. Estimates start at a guess worth ``prior`` observations.
"""

from __future__ import annotations

BUCKETS = (0.5, 0.8, 0.95)  # remembered probability -> bucket 0..3


def bucket(p: float) -> int:
    return 3 if p >= 0.95 else 2 if p >= 0.8 else 1 if p >= 0.5 else 0


class Calibration:
    """P(a recycled candidate is accepted | its node was) per (rank among the node's candidates, bucket of the
    remembered probability), starting at the remembered probability itself. A remembered probability is the
    model's confidence in an *earlier* context, so it overrates recycled tokens where contexts alias."""

    def __init__(self, width: int, prior: float = 4.0):
        self.width, self.prior = width, prior
        self.clear()

    def clear(self) -> None:
        self.hits = [[0.0] * (len(BUCKETS) + 1) for _ in range(self.width)]
        self.tries = [[0.0] * (len(BUCKETS) + 1) for _ in range(self.width)]

    def chance(self, rank: int, p: float) -> float:
        b = bucket(p)
        return (self.hits[rank][b] + self.prior * p) / (self.tries[rank][b] + self.prior)

    def record(self, rank: int, p: float, hit: bool) -> None:
        b = bucket(p)
        self.tries[rank][b] += 1
        self.hits[rank][b] += hit


class ChainCalibration:
    """P(the j-th token of a continuation found earlier in the text is accepted | the tokens before it were),
    per (length of the match that found it, j), both capped. A long match continues reliably, a one-token
    match rarely; the first token of a continuation is the riskiest, later ones ride on its success."""

    def __init__(self, guess: float = 0.5, prior: float = 4.0, max_n: int = 4, max_j: int = 8):
        self.guess, self.prior, self.max_n, self.max_j = guess, prior, max_n, max_j
        self.clear()

    def clear(self) -> None:
        self.hits = [[0.0] * (self.max_j + 1) for _ in range(self.max_n + 1)]
        self.tries = [[0.0] * (self.max_j + 1) for _ in range(self.max_n + 1)]

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
