"""Drafters: who proposes the draft tree each step. All sit behind ``Drafter`` and share the engine's verifier."""

from __future__ import annotations

from .base import Drafter
from .pld import PromptLookupDrafter
from .recap import RecapDrafter
from .tr import TokenRecyclingDrafter

METHODS = ("ar", "recap", "tr", "pld")


def make_drafter(method: str, vocab_size: int, banned=(), **knobs) -> Drafter:
    """A drafter by method name; ``knobs`` are RecapDrafter's ablation parameters (recap only)."""
    if method == "recap":
        return RecapDrafter(vocab_size, banned=banned, **knobs)
    if knobs:
        raise ValueError(f"options {sorted(knobs)} apply to recap only")
    if method == "ar":
        return Drafter()
    if method == "tr":
        return TokenRecyclingDrafter(vocab_size, banned=banned)
    if method == "pld":
        return PromptLookupDrafter(banned=banned)
    raise ValueError(f"unknown method '{method}': use one of {', '.join(METHODS)}")


__all__ = ["Drafter", "RecapDrafter", "TokenRecyclingDrafter", "PromptLookupDrafter", "make_drafter", "METHODS"]
