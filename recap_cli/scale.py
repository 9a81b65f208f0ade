"""`recap run --ray`: the same job on a Ray cluster, one long-lived session per worker, the same records out.

Requests become a Ray dataset; an actor pool of ``Worker``s (Ray Data ``map_batches`` with a class UDF) answers
them, each worker one ``Session`` whose persistent memory carries over between its requests, exactly as a local
run's does. Decoding is lossless, so which worker answers a request, and what its memory holds, changes only the
speed, never the answer. The driver writes the records in input order (Ray Data's ``preserve_order``) as they
arrive, once per input line.

Faults: Ray Data restarts a dead actor and retries its unfinished batch (``max_restarts`` / ``max_task_retries``
default to unlimited for actor pools); a batch's records leave a worker only when the whole batch is done, so a
retry never duplicates, and the driver drops any line number it has already written all the same.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

import numpy as np
import orjson
import ray
import torch
from ray.data import DataContext
from ray.exceptions import RayError

from . import records
from .batch import Totals, answer, answer_all, error_record
from .decoding.batched import DEFAULT_BATCH, default_batch
from .decoding.sampling import GREEDY, resolve
from .drafters.stream import merge_states as merge_stream_states

if TYPE_CHECKING:  # the workers import the session (and the model code) when they start
    from .session import Session

FAULT_ENV = "RECAP_FAULT_KILL_AFTER"  # test knob: one worker exits hard once after this many records
PUSH_EVERY_S = 60.0  # how often a worker copies its memory to the driver's collector mid-run
FINAL_WAIT_S = 60.0  # how long the driver waits for the workers' last memories after the last record


class ScaleError(Exception):
    """The distributed run could not start; the message is one sentence meant for the user."""


@dataclass
class Job:
    """What every worker needs to answer requests the way a local ``recap run`` would."""

    model: str
    method: str
    knobs: dict
    compile: str
    device: str
    dtype: str
    attn: str
    max_new_tokens: int
    base: Path  # relative image paths resolve here: the same path on every node (a shared file system)
    batch: int | None = None  # requests in flight per worker; None: by the worker's device
    fault_after: int = 0
    decoding: dict | None = None  # the command line's decoding settings (mode, options, the run's seed)
    allow_longer: bool = False  # a record's own max_new_tokens may go past max_new_tokens (else it is capped)


@dataclass
class Cluster:
    address: str = "auto"
    workers: int = 1
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0


@dataclass
class Outcome:
    totals: Totals
    per_worker: dict[str, Totals] = field(default_factory=dict)
    wall_s: float = 0.0
    interrupted: bool = False
    memories_merged: int = 0
    memories_final: bool = True
    restarts: int = 0
    failed_before: list[int] = field(default_factory=list)  # lines --resume skipped: only errors of earlier runs
    failure: str | None = None  # what ended the run part way on Ray's side (the records written stand)


def run(source: IO[bytes], job: Job, cluster: Cluster, sink: IO[bytes], earlier: records.Earlier | None,
        memory: Path | None, progress=None, unknown: Callable[[int, list[str]], None] | None = None,
        capped: Callable[[int], None] | None = None, warm: bool = True) -> Outcome:
    """Answer every line of ``source`` on the cluster and write the records to ``sink`` in input order; with
    ``earlier`` (--resume: what the output holds, ``records.answered``) only the lines a local run would answer;
    ``unknown(line, keys)`` hears of each line's keys recap does not read (the workers parse the lines), and
    ``capped(line)`` of the first line whose own max_new_tokens the run's cap cut. Without ``warm`` the workers
    start cold and the merged memory owes nothing to ``memory``'s file (a damaged one the user chose to replace):
    seeded from it, every worker failed to load it, and the merge would read it again."""
    lines = list(records.numbered_lines(source))
    cap = capped is not None and not job.allow_longer  # said of the first capped line only
    for n, raw in lines if unknown is not None or cap else ():
        keys, asked = records.glance(raw)
        if keys and unknown is not None:
            unknown(n, keys)
        if cap and asked is not None and asked > job.max_new_tokens:
            capped(n)
            cap = False
    failed_before: list[int] = []
    if earlier is not None:
        todo, failed_before = pending(lines, earlier, job.base)
        for _ in range(len(lines) - len(todo)):
            progress and progress()  # skipped lines count as done, as in a local run
        lines = todo
    started = _connect(cluster.address)
    collector = None
    try:
        seed = memory.read_bytes() if warm and memory is not None and memory.is_file() else None
        collector = ray.remote(Memories).options(num_cpus=0).remote(seed, job.fault_after)
        outcome = _answer_all(lines, job, cluster, collector, sink, progress)
        outcome.failed_before = failed_before
        try:
            outcome.restarts = ray.get(collector.restarts.remote())
            if memory is not None:
                stopped = outcome.interrupted or outcome.failure is not None
                outcome.memories_merged, outcome.memories_final = _save_merged(collector, memory, wait=not stopped)
        except RayError as exc:  # the cluster went away after the records: they stand, the memory is not merged
            outcome.failure = outcome.failure or _ray_failed(exc, outcome.totals.items)
        return outcome
    finally:
        if collector is not None:
            ray.kill(collector)
        if started:
            ray.shutdown()


def fault_after() -> int:
    """The fault-injection knob, read on the driver and handed to the workers (they may run elsewhere)."""
    value = os.environ.get(FAULT_ENV, "0")
    if not value.isdigit():
        raise ScaleError(f"{FAULT_ENV} takes a number of records, not '{value}'")
    return int(value)


def extra_summary(outcome: Outcome) -> dict:
    """What a distributed run adds to the summary: wall-clock rates and each worker's own totals."""
    wall = outcome.wall_s
    return {"workers": len(outcome.per_worker), "restarts": outcome.restarts, "wall_s": round(wall, 3),
            "requests_per_hour": outcome.totals.answered * 3600 / wall if wall else 0.0,
            "wall_tokens_per_s": outcome.totals.new_tokens / wall if wall else 0.0,
            "per_worker": {w: t.summary() for w, t in sorted(outcome.per_worker.items())}}


def worker_lines(outcome: Outcome) -> list[tuple[str, str]]:
    return [(w, f"{s['items']} items, {s['errors']} errors, {s['tokens_per_s']:.1f} tokens/s, "
                f"mean accepted {s['mean_accepted']:.2f}" if s["answered"] else
                f"{s['items']} items, {s['errors']} errors: nothing answered")
            for w, s in extra_summary(outcome)["per_worker"].items()]


def parse_capped(raw: bytes, line: int, job: Job) -> records.Request:
    """A line's request as a local run answers it: a record's own max_new_tokens is at most the run's
    ``--max-new-tokens`` unless ``--allow-longer``."""
    req = records.parse_line(raw, line, job.base)
    records.cap_new_tokens(req, job.max_new_tokens, job.allow_longer)
    return req


def pending(lines: list[tuple[int, bytes]], earlier: records.Earlier,
            base: Path) -> tuple[list[tuple[int, bytes]], list[int]]:
    """The lines ``--resume`` still has to answer (those the output holds no record of, or only errors a rerun
    may fix, as a local run goes by), and the numbers of those it skips whose records are only errors, for the
    run's end to say."""
    todo, failed = [], []
    for n, raw in lines:
        skipped = earlier.skips(records.answer_key(records.parse_line(raw, n, base)))
        if skipped is None:
            todo.append((n, raw))
        elif skipped == records.FAILED:
            failed.append(n)
    return todo, failed


def _connect(address: str) -> bool:
    """Join Ray; True when this call started it (and so must stop it).

    ``auto``: the cluster RAY_ADDRESS names, else one already running on this machine, else a new local Ray.
    ``local``: always a new local Ray. Anything else is a cluster address for ``ray.init``.
    """
    if ray.is_initialized():
        return False
    kw = dict(include_dashboard=False, logging_level="WARNING")
    try:
        if address == "local":
            ray.init(address="local", **kw)
        elif address == "auto" and not os.environ.get("RAY_ADDRESS"):
            try:
                ray.init(address="auto", **kw)
            except ConnectionError:
                ray.init(**kw)
        else:
            ray.init(address=None if address == "auto" else address, **kw)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise ScaleError(f"cannot reach the Ray cluster at {address}: {records.first_line(exc)}") from exc
    return True


def _answer_all(lines, job: Job, cluster: Cluster, collector, sink: IO[bytes], progress) -> Outcome:
    ctx = DataContext.get_current()
    ctx.execution_options.preserve_order = True  # records leave in input order, whichever worker is faster
    ctx.enable_progress_bars = False  # the CLI draws its own on a terminal
    ctx.print_on_execution_start = False
    outcome = Outcome(Totals())
    t0 = time.perf_counter()
    if lines:
        # Small blocks spread the requests over the workers and let records stream out as they are done.
        # A block is what one worker decodes together: room for two batches keeps its rows full.
        per_block = max(8, 2 * (job.batch or max(DEFAULT_BATCH.values())))
        rows_per_block = max(1, min(per_block, len(lines) // (4 * cluster.workers)))
        ds = ray.data.from_items([{"line": n, "raw": raw} for n, raw in lines],
                                 override_num_blocks=math.ceil(len(lines) / rows_per_block))
        ds = ds.map_batches(Worker, fn_constructor_kwargs={"job": job, "collector": collector},
                            compute=ray.data.ActorPoolStrategy(size=cluster.workers), batch_size=None,
                            batch_format="numpy", num_gpus=cluster.gpus_per_worker or None,
                            num_cpus=cluster.cpus_per_worker)
        written: set[int] = set()
        try:
            for row in _rows(ds):
                line = int(row["line"])
                if line in written:
                    continue
                written.add(line)
                sink.write(row["record"])
                sink.flush()
                record = orjson.loads(row["record"])
                outcome.totals.add(record)
                outcome.per_worker.setdefault(str(row["worker"]), Totals()).add(record)
                if progress is not None:
                    progress()
        except KeyboardInterrupt:
            outcome.interrupted = True
        except RayError as exc:  # not a worker's setup (``_rows``): the cluster failed part way
            outcome.failure = _ray_failed(exc, len(written))
    outcome.wall_s = time.perf_counter() - t0
    return outcome


def _rows(ds):
    """The dataset's rows as they come; a worker that cannot start (bad model, bad memory file) is a usage error."""
    try:
        yield from ds.iter_rows()
    except RayError as exc:
        setup = _setup_error(exc)
        if setup is None:
            raise
        raise ScaleError(setup) from exc


def _ray_failed(exc: BaseException, written: int) -> str:
    """The one line for a Ray failure that ended a run part way (a node lost, the cluster shut down)."""
    return f"Ray failed after {written} records: {type(exc).__name__}: {records.first_line(exc)}"


def _setup_error(exc: BaseException) -> str | None:
    text = str(exc)
    marker = "WorkerSetupError: "
    at = text.rfind(marker)
    return text[at + len(marker):].splitlines()[0] if at >= 0 else None


def _say(message: str) -> None:
    """A worker's note for people (a compile that fell back to eager): its stderr, which Ray shows on the driver."""
    print(message, file=sys.stderr, flush=True)


class WorkerSetupError(Exception):
    """A worker could not load the model or its memory: the same on every worker, so the run stops."""


class Worker:
    """One recap session in one Ray actor: the model is loaded once, the session lives as long as the actor."""

    def __init__(self, job: Job, collector):
        from .models import ModelError, freeze_loaded, load
        from .session import start_session

        self.job, self.collector = job, collector
        self.id = ray.get_runtime_context().get_actor_id()[:8]  # the actor's own part; a restart keeps it
        self.done = 0
        try:
            adapter = load(job.model, device=job.device, dtype=job.dtype, attn=job.attn)
            freeze_loaded()
            batch = job.batch or default_batch(adapter.device.type)
            compiled = job.compile == "on" or (job.compile == "auto" and batch == 1 and adapter.device.type == "cuda")
            settings = resolve(adapter.model.generation_config, **job.decoding) if job.decoding else GREEDY
            self.session = start_session(adapter, job.method, job.knobs, compiled, batch, settings, warn=_say,
                                         info=_say)
        except (ModelError, ValueError) as exc:
            raise WorkerSetupError(str(exc)) from None
        # A restarted worker picks up the memory its last life sent; a new one starts from --memory's.
        blob = ray.get(collector.start.remote(self.id))
        if blob is not None:
            load_sent(self.session, blob)
        self.pushed = time.monotonic()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        lines = [(int(line), bytes(raw)) for line, raw in zip(batch["line"], batch["raw"])]
        out = self._answer_batched(lines) if self.session.batch > 1 else [self._answer(*lr) for lr in lines]
        if time.monotonic() - self.pushed > PUSH_EVERY_S:
            self._push(final=False)
        return {"line": batch["line"], "record": np.array(out, dtype=object),
                "worker": np.array([self.id] * len(out), dtype=object)}

    def _answer(self, line: int, raw: bytes) -> bytes:
        """One record, whatever goes wrong: a worker never raises for a request."""
        req = records.Request(line, line)
        try:
            req = parse_capped(raw, line, self.job)
            record = answer(self.session, req, self.job.model, self.job.max_new_tokens)
        except Exception as exc:  # noqa: BLE001 - an unexpected failure fails its record, not the worker
            # It is recap's own failure, not the line's (parse_line turns a bad line into a request): retried.
            record = error_record(req, self.job.method, self.job.model, f"{type(exc).__name__}: "
                                  f"{records.first_line(exc)}", retry=True)
        self.done += 1
        self._maybe_fault()
        return records.dumps(record)

    def _answer_batched(self, lines: list[tuple[int, bytes]]) -> list[bytes]:
        """The block's requests in flight together (continuous batching), records in line order."""
        reqs = []
        for line, raw in lines:
            try:
                reqs.append(parse_capped(raw, line, self.job))
            except Exception as exc:  # noqa: BLE001 - see _answer
                reqs.append(records.Request(line, line, error=f"{type(exc).__name__}: {records.first_line(exc)}",
                                            retry=True))
        out = []
        for record, _ in answer_all(self.session, reqs, self.job.model, self.job.max_new_tokens):
            out.append(records.dumps(record))
            self.done += 1
            self._maybe_fault()
        return out

    def _maybe_fault(self) -> None:
        if self.job.fault_after and self.done >= self.job.fault_after and \
                ray.get(self.collector.claim_fault.remote()):
            os._exit(1)  # as an out-of-memory kill would: no clean-up, the batch in flight is lost

    def _push(self, final: bool) -> None:
        with _scratch() as path:
            blob = path.read_bytes() if self.session.save_memory(path) else None
        ray.get(self.collector.put.remote(self.id, blob, final))
        self.pushed = time.monotonic()

    def __del__(self):
        """Ray Data deletes the UDF when the pool shuts down cleanly: hand the final memory to the driver."""
        if hasattr(self, "session"):
            try:
                self._push(final=True)
            except Exception:  # noqa: BLE001 - the cluster may already be going away; the last push stands
                pass


def load_sent(session: Session, blob: bytes) -> None:
    """A memory sent to a worker (--memory's file, or the worker's own last one), into its session; a
    WorkerSetupError if it cannot be used. The session reads files: the message names the worker's scratch copy,
    which no one has heard of, so it says what the copy is of."""
    with _scratch() as path:
        try:
            path.write_bytes(blob)
            session.load_memory(path)
        except (ValueError, RuntimeError, OSError) as exc:
            said = str(exc).replace(str(path), "the memory sent to this worker (--memory's file, or its own last)")
            raise WorkerSetupError(f"cannot load memory: {said}") from None


class _scratch:
    """A temporary file path for Session's save/load, which work on files (their format is theirs alone)."""

    def __enter__(self) -> Path:
        self.dir = tempfile.TemporaryDirectory(prefix="recap-memory-")
        return Path(self.dir.name) / "memory.pt"

    def __exit__(self, *exc) -> None:
        self.dir.cleanup()


class Memories:
    """The driver's end of the workers' memories (a Ray actor): the seed, each worker's latest, who finished."""

    def __init__(self, seed: bytes | None, fault_after: int):
        self.seed, self.latest, self.final, self.fault_left = seed, {}, set(), 1 if fault_after else 0
        self.starts: dict[str, int] = {}

    def start(self, worker: str) -> bytes | None:
        self.starts[worker] = self.starts.get(worker, 0) + 1
        return self.latest.get(worker, self.seed)

    def restarts(self) -> int:
        return sum(n - 1 for n in self.starts.values())

    def put(self, worker: str, blob: bytes | None, final: bool) -> None:
        if blob is not None:
            self.latest[worker] = blob
        if final:
            self.final.add(worker)

    def status(self) -> tuple[bytes | None, dict[str, bytes], bool]:
        """The seed, each worker's latest memory, and whether every worker that started has sent its last."""
        return self.seed, self.latest, set(self.starts) <= self.final

    def claim_fault(self) -> bool:
        """True once per run: the fault-injection knob kills one worker, one time."""
        claimed, self.fault_left = self.fault_left > 0, 0
        return claimed


def _save_merged(collector, path: Path, wait: bool) -> tuple[int, bool]:
    """Wait for the workers' final memories, merge them into one and write it: how many were merged, and whether
    every worker's last one was among them (else some worker's latest mid-run copy stood in for it)."""
    deadline = time.monotonic() + (FINAL_WAIT_S if wait else 0)
    while True:
        seed, latest, finished = ray.get(collector.status.remote())
        if finished or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if not latest:
        return 0, finished
    load = lambda blob: torch.load(_as_file(blob), map_location="cpu", weights_only=True)  # noqa: E731
    merged = merge_memories(load(seed) if seed else None, [load(latest[w]) for w in sorted(latest)])
    path = path.resolve()  # through a symlink: its target is replaced, the link stays
    fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.")
    os.close(fd)
    try:
        torch.save(merged, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return len(latest), finished


def _as_file(blob: bytes):
    import io

    return io.BytesIO(blob)


def merge_memories(seed: dict | None, states: list[dict]) -> dict:
    """One memory file's content from several workers' (what ``Session.save_memory`` writes), part by part.

    Token tables (RECAP's order-1 rows, Token Recycling's matrix), per token: a row some worker wrote beats the
    seed's (newer over older, as Token Recycling overwrites); among workers that wrote one, the most concentrated
    row wins (highest top-1 probability, the confidence the mixing trusts); ties go to the first worker. Workers
    see disjoint requests at the same time, so "newest" across them has no meaning without a shared clock, while
    confidence is what drafting ranks rows by anyway. Learned acceptance counts (hits, tries): the seed's plus
    what each worker added to it, so every verdict counts once.
    """
    if not states:
        raise ValueError("no memories to merge")
    fingerprints = {(s["method"], s["model"], s["version"]) for s in states}
    if len(fingerprints) > 1:
        raise ValueError(f"memories of different methods or models cannot be merged: {sorted(fingerprints)}")
    parts = [s["state"] for s in states]
    base = seed["state"] if seed is not None else {}
    merged = {}
    for name, first in parts[0].items():
        values = [p[name] for p in parts]
        if first is None:
            merged[name] = None
        elif set(first) == {"ids", "probs"}:
            merged[name] = _merge_table(base.get(name), values)
        elif {"tokens", "lengths", "segments"} <= set(first):  # RECAP's stream memory: text, request by request
            merged[name] = merge_stream_states(base.get(name), values)
        else:
            merged[name] = _merge_counts(base.get(name), values)
    return {**states[0], "state": merged}


def _merge_table(seed: dict | None, tables: list[dict]) -> dict:
    k = max(t["ids"].shape[1] for t in tables + ([seed] if seed else []))
    ids = torch.stack([_pad(t["ids"], k, -1) for t in tables])  # (workers, vocab, k)
    probs = torch.stack([_pad(t["probs"], k, 0.0) for t in tables])
    written = ids[:, :, 0] >= 0
    if seed is not None:
        seed_ids, seed_probs = _pad(seed["ids"], k, -1), _pad(seed["probs"], k, 0.0)
        written &= ~((ids == seed_ids).all(-1) & (probs == seed_probs).all(-1))
    else:
        seed_ids, seed_probs = torch.full_like(ids[0], -1), torch.zeros_like(probs[0])
    score = torch.where(written, probs[:, :, 0], torch.tensor(-1.0))
    best = score.argmax(0)  # the first maximum on ties
    pick = lambda t: t.gather(0, best[None, :, None].expand(1, -1, k))[0]  # noqa: E731
    any_written = written.any(0)[:, None]
    return {"ids": torch.where(any_written, pick(ids), seed_ids),
            "probs": torch.where(any_written, pick(probs), seed_probs)}


def _merge_counts(seed: dict | None, counts: list[dict]) -> dict:
    """seed + sum over workers of (worker - seed): each worker started from the seed."""
    return {key: sum(c[key] for c in counts) - (len(counts) - 1) * seed[key] if seed is not None
            else sum(c[key] for c in counts) for key in counts[0]}


def _pad(t: torch.Tensor, k: int, fill) -> torch.Tensor:
    return t if t.shape[1] == k else torch.cat([t, torch.full((t.shape[0], k - t.shape[1]), fill, dtype=t.dtype)], 1)
