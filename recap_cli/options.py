"""What the command line names before anything heavy loads: method names, default batch sizes and the values
each decoding setting may take.

``recap --help``, ``recap models`` and a usage error must start in a fraction of a second, so the names their
help texts and checks need live here, in a module that imports neither torch nor transformers; the drafters and
the batched engine re-export them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

METHODS = ("ar", "recap", "tr", "pld", "suffix")
HF_METHODS = ("hf", "hf-pld")  # transformers' own generate(), a reference for `recap compare`
EVERY_DATASET = "all"  # `recap compare`'s table of every dataset together (a name no dataset may take beside it)
MAX_BUDGET = 512  # draft nodes a step: 4x the cost model's largest size (a bigger tree never pays), far below
# what would exhaust memory (a 100,000-node budget asked a batch for 80 GB of tree masks)

# Requests in flight when --batch is not given, by device type. CPU: on 2 cores 16 rows gave 3.2-3.8x the
# requests/hour of one at a time (demo model, SmolLM2) and 32 a further 12-21% on the 5M demo model only (a
# compute-bound model gains less as rows grow); CUDA: projected (docs/benchmarks.md), eager steps cost the same
# up to ~1,000 tokens, so more rows are nearly free.
DEFAULT_BATCH = {"cpu": 16, "cuda": 32}


def default_batch(device_type: str) -> int:
    return DEFAULT_BATCH.get(device_type, 1)


DTYPE_NAMES = ("auto", "fp32", "bf16", "fp16", "fp64")  # models.DTYPES' names, which need torch to hold
ATTENTION = ("sdpa", "eager")  # tree masks cannot go through flash-attention kernels


def check_loading(device: str, dtype: str, attn: str) -> None:
    """Refuse a --device, --dtype or --attn no model can load with before a download or a load is started."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise ValueError(f"--device takes auto, cpu, cuda or cuda:N, not '{device}'")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"--dtype takes {', '.join(DTYPE_NAMES)}, not '{dtype}'")
    if attn not in ATTENTION:
        raise ValueError(f"--attn takes sdpa or eager, not '{attn}': tree masks cannot go through flash-attention "
                         "kernels")


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
             "top_k": (lambda x: integer(x) and 0 <= x < 1 << 31, "an integer from 0 (off) to 2**31 - 1"),
             "repetition_penalty": (lambda x: number(x) and x > 0, "a number > 0 (1 is off)"),
             "seed": (lambda x: integer(x) and 0 <= x < 1 << 64, "an integer from 0 to 2**64 - 1")}
    for key, value in given.items():
        ok, what = rules[key]
        if value is not None and not ok(value):
            label = name.format(key.replace("_", "-") if name.startswith("--") else key)
            raise ValueError(f"{label} must be {what}")


def _on_off(value: str) -> bool:
    return {"on": True, "off": False}[value]


# A variant's keys (``recap:key=value`` in `recap compare`, the same values as `recap run`'s options): how the
# value is read from text, which values it may take, and those values in words for the error.
KNOBS: dict[str, tuple[Callable[[str], Any], Callable[[Any], bool], str]] = {
    "mixing": (str, lambda v: v in ("confidence", "fixed"), "confidence or fixed"),
    "budget": (str, lambda v: True, f"auto or a number of draft nodes from 0 to {MAX_BUDGET}"),  # parse_budget
    "depth": (int, lambda v: v >= 1, "an integer >= 1"),
    "width": (int, lambda v: v >= 1, "an integer >= 1"),
    "top_k": (int, lambda v: v >= 1, "an integer >= 1"),
    "stream_depth": (int, lambda v: 1 <= v <= 63, "an integer from 1 to 63"),  # the suffix tree's SPAN - 1
    **{key: (_on_off, lambda v: True, "on or off")
       for key in ("suffix", "calibrate", "paced", "early", "prompt_rows", "skip", "guesses")},
    "trust_decay": (float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "orders": (lambda v: tuple(int(c) for c in v.replace(",", "")), lambda v: bool(v) and set(v) <= {1, 2, 3},
               "a subset of 1, 2, 3 (e.g. 12 or 1,2)"),
    "prefix": (float, lambda v: math.isfinite(v) and v >= 0, "MB of prefix cache >= 0 (0: off)"),
}


def parse_knob(key: str, value: str) -> Any:
    """One variant value read and checked (a ValueError naming the key and what it takes)."""
    read, ok, what = KNOBS[key]
    try:
        parsed = read(value)
    except (KeyError, ValueError):
        parsed = None
    if parsed is None or not ok(parsed):
        raise ValueError(f"{key} takes {what}, not '{value}'")
    return parsed


def parse_method(spec: str) -> tuple[str, dict]:
    """``recap:mixing=fixed:orders=1:suffix=off:budget=16`` -> ("recap", knobs); plain names have no knobs. A
    ValueError names the spec it came from (``tr:budget=x: ...``): `recap compare --methods` takes several."""
    try:
        return _parse_method(spec)
    except ValueError as exc:
        raise ValueError(f"{spec}: {exc}") from None


def _parse_method(spec: str) -> tuple[str, dict]:
    name, *parts = spec.split(":")
    if name not in METHODS + HF_METHODS:
        named = f" '{name}'" if parts else ""  # a plain name is the spec the message starts with
        raise ValueError(f"unknown method{named}: use {', '.join(METHODS + HF_METHODS)}")
    knobs = {}
    for part in parts:
        key, _, value = part.partition("=")
        if key not in KNOBS:
            raise ValueError(f"'{part}': variants take {', '.join(KNOBS)} as key=value")
        if key in knobs:
            raise ValueError(f"sets {key} twice")
        knobs[key] = parse_knob(key, value)
    reuse = {"prefix_cache": knobs.pop("prefix")} if "prefix" in knobs else {}  # the session's, not a drafter's
    if reuse and name in HF_METHODS:
        raise ValueError("generate() keeps no prefix cache")
    if knobs and name != "recap" and (set(knobs) != {"budget"} or name not in ("tr", "pld")):
        raise ValueError("only recap has variants (tr and pld take budget; suffix runs as vLLM does)")
    if "budget" in knobs:
        knobs["budget"] = parse_budget(name, knobs["budget"])
    return name, knobs | reuse


def check_batch(method: str, batch: int) -> None:
    """Refuse a generate() method at ``batch`` > 1 (it answers one request at a time), before the model loads:
    found when its session is made, the refusal came after a load of minutes for a large model."""
    if method in HF_METHODS and batch > 1:
        raise ValueError(f"{method} runs transformers' generate() one request at a time: compare it at --batch 1")


def parse_budget(method: str, value: str) -> int | str:
    """``auto`` (trees sized by measured step cost) or a number of draft nodes; Token Recycling keeps its
    80-node template unless cut by cost (``auto``)."""
    if method == "suffix":
        raise ValueError("suffix sizes its drafts by SuffixDecoding's own rules: budget applies to recap, tr and pld")
    if method not in ("recap", "tr", "pld"):
        raise ValueError(f"{method} drafts nothing: budget applies to recap, tr and pld")
    if value == "auto":
        return value
    if method == "tr":
        raise ValueError("tr drafts its fixed 80-node template; its only budget is auto (cut by cost)")
    if not value.isdigit() or int(value) > MAX_BUDGET:
        raise ValueError(f"budget takes {KNOBS['budget'][2]}, not '{value}'")
    return int(value)
