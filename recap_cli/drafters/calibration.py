"""How likely a drafted token is to be accepted, learned from the verifier's verdicts as a run goes.

Every node the verifier accepted was a fair test of all the candidates a drafter considered under it, placed in
the tree or not: the one that equals the model's argmax there would have been accepted, the others not. So each
step tests every candidate of every accepted node, and the estimates never starve, even when the cost cut leaves
a tree at its root. Estimates start at a guess worth ``prior`` observations.
"""

from __future__ import annotations

from bisect import bisect_right

import torch

# Length of an exact match in the stream -> bucket 0..7. The last two split long matches: 13-19 tokens is a
# phrase that recurs, 20 and more a passage being copied, which goes on far more surely (a list of a prompt's
# steps, accepted whole chain after chain). Runs sized and priced by frozen step costs (ms a token, mean of
# per-input speedups), SmolLM2 / its second text set / the demo's sets / held-out scenes, 13 the last edge:
# 52.97, 2.571 / 55.36, 1.635 / 2.133, 2.426 / 2.102, 2.416; a last edge at 20: 52.66, 2.573 / 54.63, 1.654 /
# 2.114, 2.433 / 2.062, 2.496, the one tried that gains on all four (at 17: 52.82, 2.550 / 54.63, 1.667 / 2.091,
# 2.498 / 2.096, 2.446; at 24: 52.96, 2.405 / 54.83, 1.641 / 2.122, 2.431 / 2.120, 2.421).
MATCHES = (1, 2, 3, 4, 6, 9, 13, 20)


def match_bucket(m: int) -> int:
    return max(0, bisect_right(MATCHES, m) - 1)


class Counts:
    """Hits and tries per evidence class, in a grid of ``shape`` (cells, or rows x cols); saved and loaded with a
    run's memory."""

    what = "the calibration counts"  # what a damaged memory's error names

    def __init__(self, *shape: int):
        self.shape = shape
        self.clear()

    def clear(self) -> None:
        self.hits = torch.zeros(self.shape, dtype=torch.float64).tolist()
        self.tries = torch.zeros(self.shape, dtype=torch.float64).tolist()
        self._coefficients = None

    def state(self) -> dict[str, torch.Tensor]:
        return {"hits": torch.tensor(self.hits, dtype=torch.float64),
                "tries": torch.tensor(self.tries, dtype=torch.float64)}

    def check_state(self, state) -> None:
        """A ValueError unless ``state`` is what ``state()`` gives: same shape, finite, 0 <= hits <= tries."""
        if not isinstance(state, dict) or set(state) != {"hits", "tries"}:
            raise ValueError(f"{self.what} must hold exactly 'hits' and 'tries'")
        hits, tries = state["hits"], state["tries"]
        if not all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point and tuple(t.shape) == self.shape
                   for t in (hits, tries)):
            raise ValueError(f"{self.what} must be two float tensors of shape {self.shape}")
        finite = torch.isfinite(hits).all() and torch.isfinite(tries).all()
        if not finite or (hits < 0).any() or (hits > tries).any():
            raise ValueError(f"{self.what} must be finite with 0 <= hits <= tries")

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.check_state(state)
        self.hits, self.tries = state["hits"].tolist(), state["tries"].tolist()
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


PLACED_EDGES = tuple(i / 10 for i in range(1, 10))  # a lane's chance -> bucket 0..9


class PlacedCalibration(Counts):
    """The second look: P(a node placed in the tree is accepted | its parent was) per (lane: where its chance
    came from; bucket of that chance). The lanes' estimates are learned over every candidate of an accepted
    node, many classes with few tests each, and a tree keeps the candidates whose estimates came out highest:
    those are the overrated ones (a winner's curse: benchmarks/calibration.py showed recycled nodes at a predicted
    0.1-0.2 accepted half as often). This maps each lane's chance to what placed nodes with that chance turned
    out to be worth, bucket by bucket, starting at the lane's own figure (``prior`` observations)."""

    def __init__(self, lanes: int = 2, prior: float = 8.0, refresh: int = 32):
        self.prior, self.refresh = prior, refresh
        self._since = 0
        super().__init__(lanes, len(PLACED_EDGES) + 1)

    @staticmethod
    def bucket(p: float) -> int:
        return min(int(p * 10), 9) if p > 0 else 0

    def renew(self) -> None:
        """Rebuild at the next read if anything was recorded since the last build (see ``CellChances.renew``)."""
        if self._since:
            self._coefficients = None

    def coefficients(self) -> list[list[tuple[float, float]]]:
        """a + b * p per (lane, bucket): the mapped chance is a + b * (the lane's chance); rebuilt every
        ``refresh`` records."""
        if self._coefficients is None or self._since >= self.refresh:
            self._since = 0
            prior = self.prior
            self._coefficients = [[(h / (t + prior), prior / (t + prior)) for h, t in zip(hs, ts)]
                                  for hs, ts in zip(self.hits, self.tries)]
        return self._coefficients

    def record(self, lane: int, p: float, hit: bool) -> None:
        b = self.bucket(p)
        self.tries[lane][b] += 1
        self.hits[lane][b] += hit
        self._since += 1


class CellChances(Counts):
    """P(a candidate is accepted | its node was) per evidence class (a *cell*), learned from graded candidates,
    each cell shrunk towards its coarser *parent* class, and the parent towards a guess made from the candidate's
    own figure (a remembered probability, a share of occurrences):

        parent(g) = (hits_p + k_p * w * g) / (tries_p + k_p)
        chance    = (hits_c + k_c * parent(g)) / (tries_c + k_c)

    A fine cell separates what matters (a 12-token match from a 2-token one) but starts empty; its parent has
    data sooner. Both are linear in the guess g, so drafting reads ``a + b * guess`` per cell from
    ``coefficients``, rebuilt once ``refresh`` records came in (8: about every step that accepted a drafted node,
    so a request unlike the run's average, an answer that copies its prompt, moves its own cells within its
    answer; at 256 the cells moved every ~14 steps, after most answers had ended). A rebuild redoes only the
    parents that were recorded in since the last one: a cell's coefficients depend on its own counts and its
    parent's alone. The parents' counts are kept as sums of their cells' (integers: exact in any order)."""

    what = "learned chances"

    def __init__(self, parents: list[int], weight: float = 0.5, k_cell: float = 4.0, k_parent: float = 4.0,
                 refresh: int = 8):
        self.parents, self.weight, self.k_cell, self.k_parent = parents, weight, k_cell, k_parent
        self.refresh = refresh
        self._groups = max(parents) + 1
        self._members: list[list[int]] = [[] for _ in range(self._groups)]
        for cell, parent in enumerate(parents):
            self._members[parent].append(cell)
        super().__init__(len(parents))

    def clear(self) -> None:
        super().clear()
        self._restart()

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state(state)
        self._restart()

    def _restart(self) -> None:
        """The parents' sums from the counts, and every parent to rebuild at the next read."""
        ph, pt = [0.0] * self._groups, [0.0] * self._groups
        for p, h, t in zip(self.parents, self.hits, self.tries):
            ph[p] += h
            pt[p] += t
        self._parent_hits, self._parent_tries = ph, pt
        self._a, self._b = [0.0] * len(self.parents), [0.0] * len(self.parents)
        self._dirty = set(range(self._groups))
        self._since = self.refresh

    def record(self, cell: int, hit: bool) -> None:
        self.tries[cell] += 1
        self.hits[cell] += hit
        parent = self.parents[cell]
        self._parent_tries[parent] += 1
        self._parent_hits[parent] += hit
        self._dirty.add(parent)
        self._since += 1

    def renew(self) -> None:
        """Rebuild the coefficients at the next read if anything was recorded since the last build (a new
        request): where they are rebuilt depends on the requests alone, so a run that loads a saved memory drafts
        as the run that saved it would have gone on."""
        if self._since:
            self._since = self.refresh

    def coefficients(self) -> tuple[list[float], list[float]]:
        """(a, b) per cell: the chance is a + b * guess. Rebuilt once ``refresh`` records came in since the last
        build (or on the first read), in place: the same two lists, read by index."""
        if self._coefficients is None or self._since >= self.refresh:
            self._since = 0
            hits, tries, a, b = self.hits, self.tries, self._a, self._b
            kc, kp, w = self.k_cell, self.k_parent, self.weight
            for parent in self._dirty:
                t_p = self._parent_tries[parent]
                rate = kc * self._parent_hits[parent] / (t_p + kp)  # k_cell * the parent's a
                slope = kc * kp * w / (t_p + kp)  # k_cell * the parent's b
                for cell in self._members[parent]:
                    a[cell] = (hits[cell] + rate) / (tries[cell] + kc)
                    b[cell] = slope / (tries[cell] + kc)
            self._dirty.clear()
            self._coefficients = (a, b)
        return self._coefficients
