"""The interface the engine's decoding loop calls each step."""

from __future__ import annotations

import copy

from ..decoding.cost import StepCost
from ..decoding.tree import Rows, Tree, Verified


class Drafter:
    """Proposes a draft tree under the root and learns from what the verifier saw.

    The base class drafts nothing, which makes every step a plain one-token greedy step: the ``ar`` baseline.
    A drafter that sizes its trees by what a step costs says so with ``wants_costs``; the decoding loop then
    hands it the engine's measured ``cost`` before the first step.
    """

    name = "ar"
    wants_prefill_rows = False
    # Draft the answer's first tokens before the prompt runs, to be verified in its forward pass (the engine's
    # ``prefill_tree``): ``start`` comes without rows, then ``propose``, then ``prompt_rows`` and ``observe``.
    drafts_at_prefill = False
    wants_costs = False
    cost: StepCost | None = None

    def start(self, prompt: list[int], rows: Rows | None) -> None:
        """A new request begins (per-request memories reset here); ``rows`` are the prefill predictions."""

    def prompt_rows(self, prompt: list[int], rows: Rows | None) -> None:
        """The prefill's predictions, when they come after ``start`` (a drafter that drafts at prefill); the
        ``observe`` that follows is of the tree the prefill verified."""

    def end(self, context: list[int]) -> None:
        """This request's turn has ended with ``context`` (its prompt and every token it emitted)."""

    def withdraw(self) -> None:
        """This request's prefill failed after ``start`` (a joint prefill out of memory): take back what ``start``
        wrote to the memories shared with other requests, so a turn that never ran leaves nothing there, and one
        retried alone (``Batch.add``, with a drafter of its own) does not find its prompt there twice."""

    def propose(self, context: list[int], room: int) -> Tree:
        """A tree whose root is ``context[-1]``; ``room`` bounds useful depth (tokens left after the bonus)."""
        return Tree.root(context[-1])

    def rest(self, context: list[int]) -> Tree:
        """A step without drafting (the root alone), when drafting is not expected to pay for its own host
        time; ``observe`` follows as after ``propose``."""
        return Tree.root(context[-1])

    def observe(self, tree: Tree, verified: Verified) -> None:
        """The verifier's rows for every node of ``tree`` (accepted or not)."""

    def fork(self) -> "Drafter":
        """A drafter for one more request in flight (batched decoding): it shares everything that persists
        across requests with this one (tables, learned chances: what every row reads and writes) and owns what
        a request resets."""
        row = copy.copy(self)
        row.own_request_state()
        return row

    def own_request_state(self) -> None:
        """Give this drafter fresh per-request memories of its own (none in the base class)."""

    def reset(self) -> None:
        """Forget everything, including what persists across requests (between datasets in a comparison)."""

    def state(self) -> dict | None:
        """Everything that carries over from one request to the next (what makes a later run warm), as tensors
        and plain values for ``torch.save``; None when nothing does."""
        return None

    def load_state(self, state: dict) -> None:
        """Take back what ``state`` gave, validated: a ValueError with one sentence when it does not fit."""
