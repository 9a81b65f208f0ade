"""Drafters: who proposes the draft tree each step. All sit behind ``Drafter`` and share the engine's verifier."""

from .base import Drafter

__all__ = ["Drafter"]
