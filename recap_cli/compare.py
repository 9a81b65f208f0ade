"""Paired speed comparisons: every method on the same inputs, in one process, interleaved per input.

The method order rotates from one input to the next so machine drift hits all methods alike. Every method's
tokens are checked against the baseline's; a mismatch is reported, never hidden. Statistics follow the RECAP
paper: the mean over inputs of per-input throughput ratios, plus the ratio of total throughputs and percentiles.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from .adapters import Adapter
from .batch import answer_all, answer_with_tokens
from .decoding.sampling import GREEDY, Settings
from .options import EVERY_DATASET, HF_METHODS, check_batch, parse_method  # parse_method: benchmarks read it here
from .records import Request
from .session import GenerateSession, Session

@dataclass
class Measurement:
    """One method on one input."""

    id: str
    dataset: str
    method: str
    new_tokens: int = 0
    seconds: float = 0.0  # prefill + decoding
    steps: int = 0
    nodes: int = 0  # tokens verified over all steps (tree nodes, root included)
    emitted: int = 0  # tokens that came out of verification steps (not the prefills')
    draft_s: float = 0.0
    decode_s: float = 0.0
    wall_s: float = 0.0  # its share of the wall time its method took over the dataset (batched: wall / inputs)
    match: bool | None = None  # tokens equal the reference method's (the baseline's unless that is hf: reference)
    first_difference: dict | None = None  # where a mismatch starts: first_difference's turn, position and tokens
    error: str | None = None
    prompt_tokens: int = 0
    prefix_hit: int = 0  # prompt tokens taken from the prefix cache
    input: int | None = None  # its position among all inputs: what pairs it with the baseline's (ids repeat)
    line: int | None = None  # its line in its file
    sampled: bool = False  # its tokens were drawn (the run's or its record's settings sample)

    @property
    def key(self) -> int | str:
        """What pairs a measurement with the baseline's of the same input: the input's position (rows built by
        hand without one fall back to the id)."""
        return self.input if self.input is not None else self.id

    @property
    def throughput(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def make_session(adapter: Adapter, spec: str, batch: int = 1,
                 sampling: Settings = GREEDY, prefix_cache: float | str = 0) -> Session | GenerateSession:
    """One method's session. Every method takes the same ``sampling`` settings (and seed): recap's methods then
    give the baseline's tokens; hf's sampled tokens come from torch's generator, so its match rate is low.
    ``prefix_cache``: MB of prefix reuse (or ``auto``) for every method that does not set its own (``:prefix=``)."""
    name, knobs = parse_method(spec)
    check_batch(name, batch)
    if name in HF_METHODS:
        return GenerateSession(adapter, name, sampling=sampling)
    return Session(adapter, name, batch=batch, sampling=sampling, **{"prefix_cache": prefix_cache} | knobs)


def group(requests: Iterable[Request]) -> dict[str, list[Request]]:
    """Datasets in first-seen order: a record's ``dataset`` field, else what the caller set (its file)."""
    groups: dict[str, list[Request]] = {}
    for req in requests:
        groups.setdefault(req.dataset or "default", []).append(req)
    return groups


def run(sessions: dict, requests: list[Request], baseline: str, model: str, max_new_tokens: int,
        warmup: int = 1, keep_memory: bool = False,
        on_input: Callable[[list[Measurement]], None] | None = None, repeats: int = 1,
        checked: str | None = None) -> list[Measurement]:
    """Measure every session on every request; memories are cleared before each dataset unless kept.
    ``repeats``: at batch 1, each input's runs per method, of which the fastest is kept (``_fastest``).
    ``checked``: the method every method's tokens are checked against, where the caller has it already (its
    reports name it); else ``reference``'s."""
    labels = list(sessions)
    if baseline not in sessions:
        raise ValueError(f"the baseline '{baseline}' must be among the methods")
    if checked is None:
        checked = reference(labels, baseline)
    if repeats < 1:
        raise ValueError("repeats is at least 1")
    if repeats > 1 and getattr(sessions[baseline], "batch", 1) > 1:
        raise ValueError("--repeats times one request at a time: a batch is timed by its wall time over the "
                         "whole dataset (use --batch 1, or repeat the whole comparison)")
    warm = [r for r in requests if r.error is None][:warmup]
    for label in labels:  # through the path the timed runs take (a batched session measures its step costs here)
        for _ in answer_all(sessions[label], warm, model, max_new_tokens):
            pass
    position = {id(req): i for i, req in enumerate(requests)}  # an input is its place in the list, never its id
    rows: list[Measurement] = []
    for d, (dataset, reqs) in enumerate(group(requests).items()):
        if d == 0 or not keep_memory:  # the warm-up's memories go too: every dataset starts alike
            for s in sessions.values():
                s.reset_memory()
        if getattr(sessions[baseline], "batch", 1) > 1:
            rows.extend(_run_batched(sessions, reqs, d, dataset, checked, model, max_new_tokens, on_input, position))
            continue
        for i, req in enumerate(reqs):
            order = labels[i % len(labels):] + labels[: i % len(labels)]
            answered = _fastest(sessions, order, req, model, max_new_tokens, repeats)
            measured = {label: _measured(*answered[label], req, dataset, label, input=position[id(req)])
                        for label in order}
            rows.extend(_matched(measured, checked, on_input))
    return rows


def reference(labels: list[str], baseline: str) -> str:
    """The method whose tokens every method's are checked against: the baseline, unless it is a generate() method
    and a recap method is compared too. hf's sampled tokens are torch's draws, which no recap method reproduces:
    checked against them, every recap method would be reported as differing (and a real difference hidden among
    them), so recap's methods are checked against the first of them, and hf against it as usual."""
    if not _generate(baseline):
        return baseline
    return next((label for label in labels if not _generate(label)), baseline)


def unexpected(rows: list[Measurement]) -> list[Measurement]:
    """The mismatches that are faults: all but a generate() method's on a sampled input (its tokens come from
    torch's generator, not recap's draws: the same distribution, other tokens, as docs/sampling.md says). Decided
    per input, since a record's own settings may sample in a greedy run."""
    return [r for r in rows if r.match is False and not (r.sampled and _generate(r.method))]


def _generate(label: str) -> bool:
    """Whether a method label (``hf``, ``recap:budget=16``) names transformers' generate()."""
    return label.partition(":")[0] in HF_METHODS


def _fastest(sessions: dict, order: list[str], req: Request, model: str, max_new_tokens: int,
             repeats: int) -> dict[str, tuple[dict, list[list[int]]]]:
    """Each method's answer to ``req``: with ``repeats`` > 1, its fastest of that many runs, methods taking
    turns, each run starting from the memories the first started from (``Session.mark``), so it drafts exactly
    what the first did. A short request is timed in tens of milliseconds, where one hiccup of a shared machine
    is as large as a method's gain; the fastest run is the one the hiccups spared. A repeat that fails or gives
    other tokens (a bug) is the one kept, so it is reported."""
    if repeats == 1:
        return {label: answer_with_tokens(sessions[label], req, model, max_new_tokens) for label in order}
    marks = {label: sessions[label].mark() for label in order}
    first: dict[str, tuple[dict, list[list[int]]]] = {}
    best: dict[str, tuple[dict, list[list[int]]]] = {}
    for r in range(repeats):
        for label in order:
            if r and first[label][0]["error"] is not None:  # a failed input is not run again
                continue
            if r:
                sessions[label].rewind(marks[label])
            got = answer_with_tokens(sessions[label], req, model, max_new_tokens)
            if not r:
                first[label] = best[label] = got
                continue
            kept = best[label]
            if got[0]["error"] is not None or got[1] != first[label][1]:
                best[label] = got  # a repeat that failed or differed is what gets reported
            elif kept[0]["error"] is None and kept[1] == first[label][1] and _seconds(got[0]) < _seconds(kept[0]):
                best[label] = got
    return best


def _seconds(record: dict) -> float:
    return record["prefill_ms"] + record["decode_ms"]


def _run_batched(sessions: dict, reqs: list[Request], d: int, dataset: str, checked: str, model: str,
                 max_new_tokens: int, on_input: Callable[[list[Measurement]], None] | None,
                 position: dict[int, int]) -> list[Measurement]:
    """Every method over the whole dataset with its requests in flight together (the method order rotates
    from one dataset to the next); each input's wall share is its method's wall time over the inputs."""
    labels = list(sessions)
    results = {}
    for label in labels[d % len(labels):] + labels[: d % len(labels)]:
        t0 = time.perf_counter()
        answered = list(answer_all(sessions[label], reqs, model, max_new_tokens))
        share = (time.perf_counter() - t0) / len(reqs)
        results[label] = [_measured(record, tokens, req, dataset, label, share, position[id(req)])
                          for (record, tokens), req in zip(answered, reqs)]
    rows = []
    for i in range(len(reqs)):
        rows.extend(_matched({label: results[label][i] for label in labels}, checked, on_input))
    return rows


def _matched(measured: dict[str, tuple[Measurement, list[list[int]]]], checked: str,
             on_input: Callable[[list[Measurement]], None] | None) -> list[Measurement]:
    """One input's measurements, each checked against the tokens of the reference method ``checked``."""
    base, base_tokens = measured[checked]
    batch = []
    for m, tokens in measured.values():
        if m.error is None and base.error is None:
            m.match = tokens == base_tokens
            m.first_difference = None if m.match else first_difference(tokens, base_tokens)
        batch.append(m)
    if on_input:
        on_input(batch)
    return batch


def first_difference(tokens: list[list[int]], expected: list[list[int]]) -> dict | None:
    """Where ``tokens`` (an input's answers, a list of token ids per turn) first differ from ``expected``: the
    turn (an index into the record's answers), the position in it (from 0) and the token each has there (None
    where one has ended); None where they are equal. Where an exact-decoding bug starts."""
    for turn in range(max(len(tokens), len(expected))):
        got = tokens[turn] if turn < len(tokens) else []
        want = expected[turn] if turn < len(expected) else []
        if got != want:
            position = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            return {"turn": turn, "position": position, "token": got[position] if position < len(got) else None,
                    "expected": want[position] if position < len(want) else None}
    return None


def _measured(record: dict, tokens: list[list[int]], req: Request, dataset: str, label: str,
              wall_s: float | None = None, input: int | None = None) -> tuple[Measurement, list[list[int]]]:
    m = Measurement(id=str(req.id), dataset=dataset, method=label, error=record["error"], input=input, line=req.line)
    if m.error is None:
        m.new_tokens = record["new_tokens"]
        m.seconds = (record["prefill_ms"] + record["decode_ms"]) / 1000
        m.steps = record["steps"]
        m.nodes = round(record["mean_nodes"] * record["steps"])
        m.emitted = record["new_tokens"] - record["prefill_tokens"]
        m.draft_s = record["draft_ms"] / 1000
        m.decode_s = record["decode_ms"] / 1000
        m.prompt_tokens, m.prefix_hit = record.get("prompt_tokens", 0), record.get("prefix_hit", 0)
        m.sampled = bool(record.get("decoding", {}).get("do_sample"))
    m.wall_s = m.seconds if wall_s is None else wall_s
    return m, tokens


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(rows: list[Measurement], baseline: str) -> dict:
    """Per dataset (and ``all``) and per method: the paper's statistics against the baseline."""
    out: dict[str, dict] = {}
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    for dataset in datasets + ([EVERY_DATASET] if len(datasets) > 1 else []):
        sub = [r for r in rows if dataset == EVERY_DATASET or r.dataset == dataset]
        base = {r.key: r for r in sub if r.method == baseline and r.error is None}
        out[dataset] = {method: _stats([r for r in sub if r.method == method], base)
                        for method in dict.fromkeys(r.method for r in sub)}
    return out


def _stats(rows: list[Measurement], base: dict[int | str, Measurement]) -> dict:
    ok = [r for r in rows if r.error is None and r.key in base and base[r.key].throughput > 0]
    speedups = [r.throughput / base[r.key].throughput for r in ok]
    checked = [r for r in rows if r.match is not None]
    tokens, seconds = sum(r.new_tokens for r in ok), sum(r.seconds for r in ok)
    base_tokens, base_seconds = sum(base[r.key].new_tokens for r in ok), sum(base[r.key].seconds for r in ok)
    steps = sum(r.steps for r in ok)
    decode = sum(r.decode_s for r in ok)
    wall, base_wall = sum(r.wall_s for r in ok), sum(base[r.key].wall_s for r in ok)
    return {
        "inputs": len(rows), "errors": sum(r.error is not None for r in rows),
        "mean_speedup": sum(speedups) / len(speedups) if speedups else math.nan,
        "total_speedup": (tokens / seconds) / (base_tokens / base_seconds) if seconds and base_seconds else math.nan,
        # Throughput over wall time: with requests in flight together, what a batch gains (latencies overlap).
        "wall_speedup": (tokens / wall) / (base_tokens / base_wall) if wall and base_wall else math.nan,
        "wall_tokens_per_s": tokens / wall if wall else math.nan,
        "p10": quantile(speedups, 0.1), "p50": quantile(speedups, 0.5), "p90": quantile(speedups, 0.9),
        "tokens_per_s": tokens / seconds if seconds else math.nan,
        "mean_accepted": sum(r.emitted for r in ok) / steps if steps else None,
        "nodes_per_step": sum(r.nodes for r in ok) / steps if steps else None,
        "draft_share": sum(r.draft_s for r in ok) / decode if decode else 0.0,
        "match_rate": sum(r.match for r in checked) / len(checked) if checked else math.nan,
        "mismatches": [r.id for r in checked if not r.match],
        # each mismatch's id and where it starts (first_difference), in the order of "mismatches"
        "first_differences": [{"id": r.id, **(r.first_difference or {})} for r in checked if not r.match],
        "prefix_reuse": sum(r.prefix_hit for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "speedups": speedups,
    }


def failures(rows: list[Measurement]) -> tuple[dict[str, list[Measurement]], dict[str, int]]:
    """Every method's failed measurements, and per method how many of them failed on an input another method
    answered (the baseline failing where others answered counts too): the statistics then leave out inputs that
    some methods were measured on. An input that fails for every method (a bad line) is left out of every method
    alike."""
    failed: dict[str, list[Measurement]] = {}
    answered: set[int | str] = set()
    for r in rows:
        if r.error is None:
            answered.add(r.key)
        else:
            failed.setdefault(r.method, []).append(r)
    uneven = {method: sum(r.key in answered for r in ms) for method, ms in failed.items()}
    return failed, {method: n for method, n in uneven.items() if n}


def rows_as_dicts(rows: list[Measurement]) -> list[dict]:
    return [asdict(r) | {"tokens_per_s": r.throughput} for r in rows]
