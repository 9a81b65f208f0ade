"""Drafters: who proposes the draft tree each step. All sit behind ``Drafter`` and share the engine's verifier."""

from __future__ import annotations

from ..options import METHODS
from .base import Drafter
from .pld import PromptLookupDrafter
from .recap import RecapDrafter
from .suffix import SuffixDecodingDrafter
from .tr import TokenRecyclingDrafter


def make_drafter(method: str, vocab_size: int, banned=(), stops=(), **knobs) -> Drafter:
    """A drafter by method name. ``knobs`` are RecapDrafter's ablation parameters; ``tr`` and ``pld`` take
    ``budget`` only (tr: "auto" cuts its template by cost; pld: a fixed chain length, else cut by cost);
    ``suffix`` (SuffixDecoding) runs with the reference's defaults and takes none. ``stops``: the tokens that end
    a generation (RECAP drafts nothing after one; the baselines draft as their references do)."""
    if method == "recap":
        return RecapDrafter(vocab_size, banned=banned, stops=stops, **knobs)
    if method == "suffix":
        if knobs:
            raise ValueError(f"options {sorted(knobs)} apply to recap, tr and pld only (suffix takes none)")
        return SuffixDecodingDrafter(banned=banned)
    if set(knobs) - {"budget"} or (knobs and method == "ar"):
        raise ValueError(f"options {sorted(knobs)} apply to recap only" + ("" if method == "ar" else
                         f" ({method} takes budget)"))
    if method == "ar":
        return Drafter()
    if method == "tr":
        return TokenRecyclingDrafter(vocab_size, banned=banned, **knobs)
    if method == "pld":
        return PromptLookupDrafter(banned=banned, **knobs)
    raise ValueError(f"unknown method '{method}': use one of {', '.join(METHODS)}")


__all__ = ["Drafter", "RecapDrafter", "TokenRecyclingDrafter", "PromptLookupDrafter", "SuffixDecodingDrafter",
           "make_drafter", "METHODS"]
