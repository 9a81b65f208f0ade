"""Inputs prepared ahead: image decoding, EXIF, the processor and tokenization on a few threads, overlapping decoding.

Threads rather than processes: the work is mostly PIL and tensor code that releases the GIL, its results are
tensors a process would have to pickle across, and a process would need its own copy of the processor (and, for
Qwen's M-RoPE positions, of the model's position code). Each thread runs torch ops on one intra-op thread, so
the processor's small tensors do not spin a second team of threads against the model's on the same cores.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class Preparer:
    """Runs preparation jobs on ``workers`` threads, or inline with 0. Counts the seconds jobs took (``busy_s``)
    and the seconds the decoding thread spent waiting for them or running them itself (``waited_s``): the share
    of wall time preparation costs a run."""

    def __init__(self, workers: int = 2):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="recap-prepare", initializer=_one_thread) \
            if workers > 0 else None
        self.busy_s = self.waited_s = 0.0
        self.jobs = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future:
        """``fn(*args)`` on a worker thread (at once, inline, without one)."""
        if self.pool is None:
            return self.done(self.call(fn, *args))
        return self.pool.submit(self._timed, fn, *args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on this (the decoding) thread, counted as waiting."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            spent = time.perf_counter() - t0
            with self._lock:
                self.busy_s += spent
                self.waited_s += spent
                self.jobs += 1

    @staticmethod
    def done(value: T) -> Future:
        """A job already done: its ``value``."""
        future: Future = Future()
        future.set_result(value)
        return future

    def result(self, future: Future) -> Any:
        """A job's value, waiting for it if it is not done (a KeyboardInterrupt raised in the job comes here)."""
        if future.done():
            return future.result()
        t0 = time.perf_counter()
        try:
            return future.result()
        finally:
            self.waited_s += time.perf_counter() - t0

    def wait_any(self, futures: Iterable[Future], timeout: float | None = None) -> bool:
        """Until one of ``futures`` is done (True) or ``timeout`` seconds have passed (False)."""
        t0 = time.perf_counter()
        done, _ = wait_for(list(futures), timeout=timeout, return_when=FIRST_COMPLETED)
        self.waited_s += time.perf_counter() - t0
        return bool(done)

    def patience(self) -> float:
        """How long to wait for the next job before calling it slow: a few usual jobs' time (10 ms at least)."""
        return max(0.01, 4 * self.busy_s / self.jobs) if self.jobs else 0.05

    def _timed(self, fn: Callable[..., T], *args: Any) -> T:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            with self._lock:
                self.busy_s += time.perf_counter() - t0
                self.jobs += 1

    def close(self) -> None:
        """Jobs not started are dropped; a job running finishes on its own (threads cannot be stopped)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "Preparer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _one_thread() -> None:
    torch.set_num_threads(1)  # per thread: OpenMP's thread count is a per-thread setting
