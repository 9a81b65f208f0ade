"""Prompt lookup decoding: find the last n-gram (n = 3 down to 1) earlier in prompt + output and draft the
tokens that followed its first occurrence as one chain, as transformers' prompt_lookup_num_tokens does.

With ``budget="auto"`` (the default) the chain is cut to the length worth the step's cost
(recap_cli/decoding/cost.py): each token's chance is learned from the verifier's verdicts per (match length, step
along the chain), as RECAP's suffix lane does.
``budget=N`` drafts the whole chain of up to N tokens (transformers' behaviour with N = 10).
"""

from __future__ import annotations

from ..decoding.tree import Rows, Source, Tree, Verified
from .base import Drafter
from .calibration import ChainCalibration
from .memory import NgramIndex


class PromptLookupDrafter(Drafter):
    name = "pld"

    def __init__(self, banned=(), max_ngram: int = 3, num_tokens: int = 10, budget: int | str = "auto"):
        if budget != "auto" and not (isinstance(budget, int) and budget >= 0):
            raise ValueError("pld's budget is 'auto' or a chain length >= 0")
        self.num_tokens = num_tokens if budget == "auto" else budget
        self.budget = budget
        self.max_ngram, self.banned = max_ngram, banned
        self.calibration = ChainCalibration()
        self.own_request_state()

    def own_request_state(self) -> None:
        self.index = NgramIndex(self.max_ngram, keep="earliest", skip=self.banned)
        self._follow: tuple[int, list[int]] = (0, [])

    @property
    def wants_costs(self) -> bool:
        return self.budget == "auto"

    def start(self, prompt: list[int], rows: Rows | None) -> None:
        self.index.reset()

    def propose(self, context: list[int], room: int) -> Tree:
        tree = Tree.root(context[-1])
        n, follow = self.index.continuation(context, min(self.num_tokens, room))
        self._follow = (n, follow)
        if self.wants_costs and follow:
            keep = self.cost.best_size(self.calibration.path_chances(n, len(follow)))
            follow = follow[: keep - 1]
        for i, token in enumerate(follow):
            tree.tokens.append(token)
            tree.parents.append(i)
            tree.sources.append(Source.LOOKUP)
        return tree

    def rest(self, context: list[int]) -> Tree:
        self._follow = (0, [])
        return Tree.root(context[-1])

    def observe(self, tree: Tree, verified: Verified) -> None:
        """Chain token j was tested iff node j (its parent) was accepted; the first token past a cut is tested
        at the last node too, so a cut chain still learns whether it should have gone further."""
        n, follow = self._follow
        for j in range(min(len(verified.path), len(follow))):
            self.calibration.record(n, j, follow[j] == verified.argmax[j])

    def reset(self) -> None:
        self.calibration.clear()

    def state(self) -> dict:
        """The learned chances of continuations: what makes a later run cut its chains well from the start."""
        return {"calibration": self.calibration.state()}

    def load_state(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"calibration"}:
            raise ValueError("a prompt-lookup memory holds exactly one 'calibration'")
        self.calibration.load_state(state["calibration"])
