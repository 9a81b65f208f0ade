"""What the command line names before anything heavy loads: method names, default batch sizes and the values
each decoding setting may take.

``recap --help``, ``recap models`` and a usage error must start in a fraction of a second, so the names their
help texts and checks need live here, in a module that imports neither torch nor transformers; the drafters and
the batched engine re-export them.
"""

from __future__ import annotations

import math
from typing import Any

METHODS = ("ar", "recap", "tr", "pld", "suffix")

# Requests in flight when --batch is not given, by device type. CPU: on 2 cores 16 rows gave 3.2-3.8x the
# requests/hour of one at a time (demo model, SmolLM2) and 32 a further 12-21% on the 5M demo model only (a
# compute-bound model gains less as rows grow); CUDA: projected (docs/benchmarks.md), eager steps cost the same
# up to ~1,000 tokens, so more rows are nearly free.
DEFAULT_BATCH = {"cpu": 16, "cuda": 32}


def default_batch(device_type: str) -> int:
    return DEFAULT_BATCH.get(device_type, 1)


GENERATION_CONFIGS = ("model", "greedy")  # --generation-config: the checkpoint's settings, or plain greedy


def check_settings(given: dict[str, Any], name: str = "{}") -> None:
    """Refuse values no setting can take (a ValueError, one sentence naming the setting as ``name`` formats it:
    a record's 'top_p', the command line's --top-p)."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    def integer(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    rules = {"temperature": (lambda x: number(x) and x >= 0, "a number >= 0 (0 is greedy decoding)"),
             "top_p": (lambda x: number(x) and 0 <= x <= 1, "a number from 0 to 1"),
             "top_k": (lambda x: integer(x) and x >= 0, "an integer >= 0 (0 is off)"),
             "repetition_penalty": (lambda x: number(x) and x > 0, "a number > 0 (1 is off)"),
             "seed": (lambda x: integer(x) and 0 <= x < 1 << 64, "an integer from 0 to 2**64 - 1")}
    for key, value in given.items():
        ok, what = rules[key]
        if value is not None and not ok(value):
            label = name.format(key.replace("_", "-") if name.startswith("--") else key)
            raise ValueError(f"{label} must be {what}")
