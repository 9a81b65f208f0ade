"""What the command line names before anything heavy loads: method names and default batch sizes.

``recap --help``, ``recap models`` and a usage error must start in a fraction of a second, so the names their
help texts and checks need live here, in a module that imports neither torch nor transformers; the drafters and
the batched engine re-export them.
"""

from __future__ import annotations

METHODS = ("ar", "recap", "tr", "pld", "suffix")

# Requests in flight when --batch is not given, by device type. CPU: on 2 cores 16 rows gave 3.2-3.8x the
# requests/hour of one at a time (demo model, SmolLM2) and 32 a further 12-21% on the 5M demo model only (a
# compute-bound model gains less as rows grow); CUDA: projected (docs/benchmarks.md), eager steps cost the same
# up to ~1,000 tokens, so more rows are nearly free.
DEFAULT_BATCH = {"cpu": 16, "cuda": 32}


def default_batch(device_type: str) -> int:
    return DEFAULT_BATCH.get(device_type, 1)
