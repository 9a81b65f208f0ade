"""Token Recycling (Luo et al., ACL 2025), the training-free baseline RECAP extends.

One table of top-k successors per token, overwritten from every node the verifier evaluates and kept across
requests (hot start), read through a static tree template: each template node is "the r-th successor of my
parent's token". The template has 80 nodes + root over 6 levels of 8/21/25/15/8/3 nodes, as in the paper; which
(parent, rank) slots fill each level is our reconstruction: the slots with the highest prior acceptance, taking
rank r's prior as decaying with r (``RANK_PRIOR``).

``budget="auto"`` (the ``tr:budget=auto`` variant, not the paper's) keeps the template but cuts it to the size
worth the step's cost (recap_cli/decoding/cost.py), taking each node's path chance as the product of the table's
probabilities along it: Token Recycling at equal cost, for a fair comparison with RECAP.
"""

from __future__ import annotations

from ..decoding.tree import Rows, Source, Tree, Verified
from .base import Drafter
from .memory import TokenTable, row_tuples

LEVEL_SIZES = (8, 21, 25, 15, 8, 3)
RANK_PRIOR = (0.55, 0.15, 0.08, 0.05, 0.04, 0.03, 0.025, 0.02)


def build_template(level_sizes=LEVEL_SIZES, prior=RANK_PRIOR) -> list[tuple[int, int]]:
    """(parent index, rank) for each template node after the root; levels in order, best slots first."""
    template: list[tuple[int, int]] = []
    level = [(0, 1.0)]  # (node index, prior of its path)
    for size in level_sizes:
        slots = sorted(((score * p, parent, r) for parent, score in level for r, p in enumerate(prior)),
                       key=lambda s: -s[0])[:size]
        level = []
        for score, parent, r in slots:
            template.append((parent, r))
            level.append((len(template), score))
    return template


class TokenRecyclingDrafter(Drafter):
    name = "tr"
    wants_prefill_rows = True

    def __init__(self, vocab_size: int, banned=(), top_k: int = 8, prefill_rows: bool = True,
                 budget: str | None = None):
        if budget not in (None, "auto"):
            raise ValueError("Token Recycling's budget is its 80-node template, or 'auto' (cut by cost)")
        self.table = TokenTable(vocab_size)
        self.template = build_template()
        self.banned = frozenset(banned)
        self.top_k = top_k
        self.wants_prefill_rows = prefill_rows
        self.wants_costs = budget == "auto"

    def start(self, prompt: list[int], rows: Rows | None) -> None:
        if rows is not None:
            self._store(rows, [prompt[i] for i in rows.positions])

    def observe(self, tree: Tree, verified: Verified) -> None:
        self._store(verified.rows, tree.tokens, verified.accepted_last(len(tree)))

    def _store(self, rows: Rows, tokens: list[int], order=None) -> None:
        row_of = row_tuples(rows)
        for i in (range(len(tokens)) if order is None else order):
            self.table.put(tokens[i], row_of[i])

    def propose(self, context: list[int], room: int) -> Tree:
        """Fill the template breadth-first; a slot whose parent is missing or has no r-th successor is dropped."""
        tree = Tree.root(context[-1])
        placed = {0: 0}  # template index -> tree index
        depth, chance = [0], [1.0]
        for j, (parent, rank) in enumerate(self.template, start=1):
            at = placed.get(parent)
            if at is None or depth[at] >= room:
                continue
            row = self.table.get(tree.tokens[at])
            if row is None or rank >= len(row[0]) or row[0][rank] in self.banned:
                continue
            placed[j] = len(tree.tokens)
            tree.tokens.append(row[0][rank])
            tree.parents.append(at)
            tree.sources.append(Source.MATRIX)
            depth.append(depth[at] + 1)
            chance.append(chance[at] * row[1][rank])
        return self._cut(tree, chance) if self.wants_costs and len(tree) > 1 else tree

    def _cut(self, tree: Tree, chance: list[float]) -> Tree:
        """The nodes in order of decreasing path chance (a parent never follows its child: its chance is at
        least as high, ties keep template order), cut to the best size."""
        order = sorted(range(1, len(tree)), key=lambda i: -chance[i])
        keep = self.cost.best_size([chance[i] for i in order])
        kept = sorted(order[: keep - 1])  # template order again: parents before children
        index = {0: 0} | {old: new for new, old in enumerate(kept, start=1)}
        return Tree(tokens=[tree.tokens[0]] + [tree.tokens[i] for i in kept],
                    parents=[-1] + [index[tree.parents[i]] for i in kept],
                    sources=[tree.sources[0]] + [tree.sources[i] for i in kept])

    def reset(self) -> None:
        self.table.clear()

    def state(self) -> dict:
        return {"table": self.table.state()}

    def load_state(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"table"}:
            raise ValueError("a Token Recycling memory holds exactly one 'table'")
        self.table.load_state(state["table"])
