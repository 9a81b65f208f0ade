"""The command line: parse, call, print. stdout carries data (JSONL); people read stderr."""

from __future__ import annotations

import functools
import os
import secrets
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import IO, TYPE_CHECKING, Optional

import orjson
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import records, report, safety
from .options import (DEFAULT_BATCH, EVERY_DATASET, GENERATION_CONFIGS, METHODS, check_batch, check_loading,
                      check_settings, default_batch, parse_budget, parse_knob, parse_method)
from .registry import FAMILIES, on_disk

# torch and transformers take seconds to import: the modules that need them (models, session, batch, compare) are
# imported where a command first needs them, so --help, `recap models` and usage errors answer at once.
if TYPE_CHECKING:
    from .batch import Totals
    from .compare import Measurement
    from .decoding.sampling import Settings
    from .session import Session

# Help is click's plain layout (rich_markup_mode=None): typer's rich panels give the option names four columns of
# their own beside the type and the help, and at 80 columns rich cut them short ("--memory-cold-on-e…"), which no
# setting of typer's widens; click's puts a name too long for its column on a line of its own, never cut. (Each
# command's short_help is given: click cuts the one it makes from the docstring to the width, "in order...".)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Lossless speculative decoding for image captioning and VQA with vision-language models.")
err: Console = report.console()  # a terminal's width, else whole lines (a log is not cut at 80 columns)
_quiet = False  # --quiet: no progress and no info lines on stderr; warnings and errors still print

EXIT_OK, EXIT_FAILED_RECORDS, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
# 128 + the signal number, what a shell reports for a process that signal ended: `timeout`, systemd and
# `set -o pipefail` then read a SIGTERM or a closed stdout (SIGPIPE) as usual, not as success or failed records.
EXIT_CLOSED_STDOUT, EXIT_TERMINATED = 141, 143
# recap's own failure part way (a bug outside any one request): 1, as the uncaught exception it was exited with.
EXIT_BROKEN = EXIT_FAILED_RECORDS


def fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(EXIT_USAGE)


def info(message: str) -> None:
    """A line for people about what is happening; --quiet silences it."""
    if not _quiet:
        err.print(message, highlight=False)


def _interruptible(command):
    """Ctrl-C (or SIGTERM) where a command does not handle it itself (imports, model loading, start-up) ends it
    with one line and exit code 130 (143), not click's "Aborted!" and exit code 1 (which means failed records)."""

    @functools.wraps(command)
    def guarded(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt as exc:
            terminated = isinstance(exc, safety.Terminated)
            err.print("terminated" if terminated else "interrupted", highlight=False)
            raise typer.Exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED) from None

    return guarded


def _set_output(quiet: bool) -> None:
    """stderr as this command finds it (a terminal or not), and --quiet, which also silences transformers'
    warnings (its errors still print)."""
    global err, _quiet
    err, _quiet = report.console(), quiet
    if quiet and "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    elif quiet:  # read when transformers sets up its logging, on first import (not before it is needed)
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"


MODEL_COLUMNS = ("name", "family", "size", "source", "state", "size on disk")


@app.command(short_help="List the short model names recap knows and whether each is on disk.")
@_interruptible
def models() -> None:
    """List the short model names recap knows, their family and size, and whether each is on disk (tab-separated:
    name, family, size, source, state, size on disk; the header goes to stderr, so stdout is rows only). Any hub
    repo id or local model directory works too."""
    print("\t".join(MODEL_COLUMNS), file=sys.stderr)
    for alias, source, state, size in on_disk():
        family, params = FAMILIES.get(alias, ("?", "?"))
        print(f"{alias}\t{family}\t{params}\t{source}\t{state}\t{_size(size)}")


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


# The decoding settings, the same on `run` and `compare` (docs/sampling.md).
TEMPERATURE = typer.Option(None, help="sample at this temperature (0: greedy) [default: the model's generation "
                           "config, else greedy]")
TOP_P = typer.Option(None, help="sample from the smallest set of tokens holding this much probability")
TOP_K = typer.Option(None, help="sample from the k most likely tokens (0: all; 1: greedy)")
REPETITION_PENALTY = typer.Option(None, help="divide the scores of tokens already in the prompt or answer by this "
                                  "(1: off)")
SEED = typer.Option(None, help="seed of the sampled tokens: the same seed gives the same tokens with every method "
                    "and batch size [default: drawn, written to the records]")
GENERATION_CONFIG = typer.Option("model", help="model: start from the model's generation config, as "
                                 "model.generate() does; greedy: from plain greedy decoding")


@app.command(short_help="Answer every request of INPUTS, one JSON line out per line in, in order.")
@_interruptible
def run(
    inputs: str = typer.Argument(..., help="JSONL file of requests, or - for stdin"),
    model: str = typer.Option("demo", "--model", "-m", help="short name, hub repo id or local directory"),
    method: str = typer.Option("recap", help=f"decoding method: {', '.join(METHODS)}"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="write JSONL here instead of stdout "
                                          "(- : stdout)"),
    root: Optional[Path] = typer.Option(None, help="folder relative image paths start from "
                                        "[default: the input file's folder; the working directory for stdin]"),
    max_new_tokens: int = typer.Option(200, min=1, help="per request, and the most a record's own "
                                       "max_new_tokens gets (the model's context length caps both)"),
    allow_longer: bool = typer.Option(False, help="let a record's own max_new_tokens go past --max-new-tokens"),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N"),
    dtype: str = typer.Option("auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32 or fp64"),
    attn: str = typer.Option("sdpa", help="attention kernel: sdpa or eager"),
    memory: Optional[Path] = typer.Option(None, help="load the persistent draft memory from here; save it at the end"),
    memory_cold_on_error: bool = typer.Option(False, help="start cold (with a warning) when --memory cannot be "
                                              "read, instead of stopping; the run's end overwrites it"),
    resume: bool = typer.Option(False, help="skip lines already in --output (same line and id), but for those with "
                                "only errors a rerun may fix (\"retry\": true); append"),
    retry_errors: bool = typer.Option(False, help="with --resume, answer again every line whose records are only "
                                      "errors, those for good too (after fixing an image or a record)"),
    summary: Optional[Path] = typer.Option(None, help="also write the end-of-run summary here as JSON"),
    budget: Optional[str] = typer.Option(None, help="draft nodes per step: auto (sized by measured step cost, "
                                         "the default for recap and pld), or a number; tr: auto or its template"),
    depth: Optional[int] = typer.Option(None, min=1, help="recap: maximum draft depth"),
    mixing: Optional[str] = typer.Option(None, help="recap: confidence or fixed"),
    orders: Optional[str] = typer.Option(None, help="recap: memory orders to use, e.g. 1,2,3 or 123"),
    suffix: Optional[bool] = typer.Option(None, "--suffix/--no-suffix", help="recap: continuations from the stream "
                                          "memory (exact matches in this and earlier requests)"),
    calibrate: Optional[bool] = typer.Option(None, "--calibrate/--no-calibrate",
                                             help="recap: learn acceptance chances online (else raw probabilities)"),
    early: Optional[bool] = typer.Option(None, "--early/--no-early", help="recap: draft the answer's first tokens "
                                         "into the prompt's own forward pass"),
    compile: str = typer.Option("auto", help="static KV cache + CUDA graphs: auto (on with CUDA at batch 1), on "
                                "(batched too) or off"),
    batch: Optional[int] = typer.Option(None, min=1, help="requests decoding together, each with its own draft "
                                        f"tree (continuous batching) [default: {DEFAULT_BATCH['cpu']} on CPU, "
                                        f"{DEFAULT_BATCH['cuda']} on CUDA]"),
    offline: bool = typer.Option(False, help="never ask the hub; use the local cache only (also HF_HUB_OFFLINE=1)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress, info or summary on stderr (errors still "
                               "print; --summary still writes)"),
    ray: Optional[str] = typer.Option(None, "--ray", help="answer on Ray (needs the ray extra): auto (RAY_ADDRESS, "
                                      "else a Ray on this machine, else a new one), local, or an address"),
    workers: int = typer.Option(1, min=1, help="--ray: sessions answering in parallel, one model each"),
    gpus_per_worker: float = typer.Option(0.0, min=0, help="--ray: GPUs each worker reserves"),
    cpus_per_worker: float = typer.Option(1.0, min=0, help="--ray: CPUs each worker reserves"),
    temperature: Optional[float] = TEMPERATURE,
    top_p: Optional[float] = TOP_P,
    top_k: Optional[int] = TOP_K,
    repetition_penalty: Optional[float] = REPETITION_PENALTY,
    seed: Optional[int] = SEED,
    generation_config: str = GENERATION_CONFIG,
    prefix_cache: Optional[int] = typer.Option(None, "--prefix-cache", min=0, help="MB of prefill results kept "
                                               "for reuse: a prompt that starts like an earlier one (same image, "
                                               "same text before its question; a conversation's next turn) "
                                               "prefills only the rest; 0: off [default: a tenth of the model's "
                                               "weights, at least 64 MB]"),
) -> None:
    """Answer every request of INPUTS, one JSON line out per line in, in order."""
    _set_output(quiet)
    if output == Path("-"):  # as for INPUTS: a pipeline's "-o -" means the standard stream, not a file named "-"
        output = None
    if method not in METHODS:
        fail(f"unknown method '{method}': use one of {', '.join(METHODS)}")
    _check_loading(device, dtype, attn)
    if resume and output is None:
        fail("--resume needs --output (the file to resume; not stdout)")
    if retry_errors and not resume:
        fail("--retry-errors goes with --resume (it answers again the error records of an output being resumed)")
    _check_paths([Path(inputs)], output=output, summary=summary, memory=memory)
    source, base, total = _open_inputs(inputs)
    base = _image_root(root) or base
    knobs = _recap_knobs(method, depth=depth, mixing=mixing, orders=orders, suffix=suffix, calibrate=calibrate,
                         early=early)
    if budget is not None:
        knobs["budget"] = _budget(method, budget)
    if compile not in ("auto", "on", "off"):
        fail("--compile takes auto, on or off")
    if ray is None and (workers, gpus_per_worker, cpus_per_worker) != (1, 0.0, 1.0):
        fail("--workers, --gpus-per-worker and --cpus-per-worker size a --ray run; without --ray one process "
             "answers (add --ray local to run workers on this machine)")
    saved = _memory_file(memory, method, memory_cold_on_error, model)  # a damaged file stops the run before the
    # model loads (and before Ray starts), as does one saved for another model where its config is on this machine
    decoding = _decoding_asked(generation_config, temperature=temperature, top_p=top_p, top_k=top_k,
                               repetition_penalty=repetition_penalty, seed=seed)
    knobs = {"prefix_cache": "auto" if prefix_cache is None else prefix_cache} | knobs  # a Session argument
    if ray is not None:  # what the output holds is read (a torn tail cut) before the cluster starts
        earlier = _resuming(output, retry_errors) if resume and output is not None else None
        job = dict(model=model, method=method, knobs=knobs, compile=compile, device=device, dtype=dtype, attn=attn,
                   max_new_tokens=max_new_tokens, allow_longer=allow_longer, base=base, batch=batch,
                   decoding=decoding)
        _run_on_ray(source, job, dict(address=ray, workers=workers, gpus_per_worker=gpus_per_worker,
                                      cpus_per_worker=cpus_per_worker), output, earlier, memory, summary,
                    total, warm=saved is not None)
    adapter = _loaded(model, offline, device=device, dtype=dtype, attn=attn)
    from .batch import Totals, answer_all, run_figures
    from .models import ModelError
    from .session import MemoryFileError

    batch = batch or default_batch(adapter.device.type)
    if compile == "on" and adapter.device.type != "cuda":  # honoured (it is tested so), but rarely what is wanted
        _warn("--compile on without CUDA: compiling takes a minute or more, and on a CPU the compiled steps are "
              "no faster than eager ones (CUDA graphs are what they are for)")
    settings = _settings(adapter, decoding)
    try:
        session = _session(adapter, method, knobs, compile == "on" or (compile == "auto" and batch == 1 and
                                                                    adapter.device.type == "cuda"), batch, settings)
    except (ModelError, ValueError) as exc:
        fail(str(exc))
    if session.prefix_refusal:
        info(f"prefix reuse is off: {session.prefix_refusal}")
    if saved is not None:
        try:
            session.load_memory(memory, saved)  # what needs the model: its fingerprint, the drafter's own payload
            info(f"warm start: drafter memory loaded from {memory}")
        except MemoryFileError as exc:
            _memory_failed(exc, memory_cold_on_error)
    earlier = _resuming(output, retry_errors) if resume and output is not None else records.Earlier()
    failed_before: list[int] = []  # lines skipped whose records are only errors of earlier runs
    totals = Totals()
    stop = None  # the exit code of a run that did not reach the end of its input
    # A stop signal after the last record, or during the memory save and the summary, waits for them: the save
    # finishes (the temp file never stays), the summary is written, and the run exits with the signal's code.
    with safety.stops_held() as held:
        with safety.terminate_as_interrupt(), \
                _sink(output, resume) as sink, \
                _progress(total) as progress:
            task = progress.add_task("answering", total=total)

            def todo() -> Iterator[records.Request]:
                capped, warned = False, set()
                for req in records.read(source, base):
                    _warn_unknown(req.line, req.unknown, warned)
                    if (skipped := earlier.skips(records.answer_key(req))) is not None:
                        if skipped == records.FAILED:
                            failed_before.append(req.line)
                        progress.advance(task)
                        continue
                    if records.cap_new_tokens(req, max_new_tokens, allow_longer) and not capped:
                        capped = True
                        _say_capped(req.line, max_new_tokens)
                    yield req

            t0 = time.perf_counter()
            failure = None  # why the run stopped part way (a full disk, recap's own failure), if it did
            try:
                for record, _ in answer_all(session, todo(), model, max_new_tokens):
                    with safety.whole_lines():
                        _write_or_raise(sink, record)
                        totals.add(record)
                        progress.advance(task)
            except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the request in flight is dropped; lines stay whole
                stop = EXIT_TERMINATED if isinstance(exc, safety.Terminated) else EXIT_INTERRUPTED
            except BrokenPipeError:  # the reader of stdout went away (`| head`): nobody can take more answers
                safety.silence_stdout()
                stop = EXIT_CLOSED_STDOUT
            except _OutputFailed as exc:  # a full disk: stop as an interrupt does, memory saved, summary printed
                if output is None:  # what stdout's buffer still holds must not fail again at exit
                    safety.silence_stdout()
                failure = (f"{'-o ' + str(output) if output else 'stdout'}: cannot write more records "
                           f"({exc.reason}) after {totals.items} records"
                           + ("; free space, then --resume picks up after the last whole record" if output else ""))
                stop = EXIT_USAGE
            except Exception as exc:  # noqa: BLE001 - recap's own failure outside any one request (a bug): the
                failure = _broken(exc, totals.items, output)  # memory and summary are kept all the same
                stop = EXIT_BROKEN
        kept = _save_memory(session, memory) if memory is not None else False
        if kept:
            info(f"memory saved to {memory}")
        stop = stop or _stopped_by(held)
        figures = run_figures(totals, time.perf_counter() - t0, session.batch, session.occupancy)
        written = _report(totals, summary, stop,
                          {**figures, "decoding": {**settings.describe(), "seed": settings.seed},
                           **({"errors_before": len(failed_before)} if resume else {})})
        _say_failed_before(failed_before, output)
        if failure:
            err.print(f"[bold red]error:[/] {escape(failure)}", highlight=False)
    # A file the run was asked to write and could not (said above) is exit 2, as an unwritable path found before.
    stop = stop or _stopped_by(held) or (EXIT_USAGE if kept is None or not written else None)
    if stop is not None:
        raise typer.Exit(stop)
    raise typer.Exit(EXIT_FAILED_RECORDS if totals.errors or failed_before else EXIT_OK)


def _resuming(output: Path, retry_errors: bool = False) -> records.Earlier:
    """What --resume finds in the output (a torn last line cut), and what people should know of it before the
    run: records no line is matched to, and lines answered again because their errors may pass (``retry_errors``:
    every error)."""
    earlier = records.answered(output)
    if retry_errors:
        earlier.retry_every_error()
    if earlier.unnumbered:
        err.print(f"[yellow]warning:[/] {earlier.unnumbered} records in {escape(str(output))} carry no line number "
                  "(an older recap wrote them): their lines are answered again", highlight=False)
    if earlier.retry:
        n = len(earlier.retry)
        info(f"{n} line{'s' if n != 1 else ''} of {escape(str(output))} failed with "
             + ("errors" if retry_errors else "errors a rerun may fix (out of memory, ...)")
             + ": answered again, after their error records")
    return earlier


def _say_failed_before(lines: list[int], output: Path | None, shown: int = 5) -> None:
    """The lines --resume skipped whose records are only errors of earlier runs, errors a rerun would repeat:
    the summary counts this run's errors only, yet the output still lacks their answers (so the run exits 1, as
    the run that wrote them did)."""
    if not lines:
        return
    named = ", ".join(map(str, lines[:shown])) + (f" and {len(lines) - shown} more" if len(lines) > shown else "")
    many = len(lines) != 1
    them = "them" if many else "it"
    err.print(f"[yellow]warning:[/] {escape(str(output))} holds only error records for {len(lines)} "
              f"line{'s' if many else ''} of the input ({named}), from earlier runs: errors a rerun would repeat "
              f"(a bad record, an unreadable image), so --resume skipped {them} (once fixed, --resume "
              f"--retry-errors answers {them} again)", highlight=False)


def _say_capped(line: int, ceiling: int) -> None:
    """The first record whose own max_new_tokens the run's ceiling cut (said once a run)."""
    err.print(f"line {line} asks for more than --max-new-tokens {ceiling}: capped (--allow-longer lets records go "
              "past it)", highlight=False)


class _OutputFailed(Exception):
    """The records' output refused a write (a full disk, a quota): not a closed stdout, which stops quietly."""

    def __init__(self, exc: OSError):
        super().__init__(exc)
        self.reason = _reason(exc)


def _reason(exc: OSError) -> str:
    """Why a write failed, as the system says it ("No space left on device"), without the errno around it."""
    return exc.strerror or str(exc)


def _cannot_write(flag: str, path: Path, exc: OSError) -> str:
    """The sentence for a file the run was asked to write and could not (markup-safe: a path may hold brackets)."""
    return f"{flag} {escape(str(path))}: cannot write it ({escape(_reason(exc))})"


def _broken(exc: Exception, written: int, output: Path | None) -> str:
    """The one line for a failure of recap's own that ended a run part way: what failed and where it was raised
    (enough for a bug report, where a traceback would bury the lines that say what was kept), and what was kept."""
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
    return f"recap failed after {written} records: {type(exc).__name__}: {records.first_line(exc)}{at}" + _kept(output)


def _kept(output: Path | None) -> str:
    """What a run that failed part way leaves behind, said after its failure (a file to resume; stdout is gone)."""
    return "; the records written are whole, and --resume picks up after them" if output else ""


def _write_or_raise(sink: IO[bytes], record: dict) -> None:
    try:
        _write(sink, record)
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise _OutputFailed(exc) from exc


def _save_memory(session: Session, memory: Path) -> bool | None:
    """Save the drafter's memory: True when saved, False when the method keeps none, None when the save failed
    (a full disk): one sentence, the file as it was (the save is atomic), and the run still prints its summary."""
    try:
        return session.save_memory(memory)
    except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as a RuntimeError
        err.print(f"[bold red]error:[/] --memory {escape(str(memory))}: cannot save the drafter memory "
                  f"({escape(records.first_line(exc))}); the file is as it was", highlight=False)
        return None


def _memory_file(memory: Path | None, method: str, cold_on_error: bool, model: str) -> dict | None:
    """The --memory file read and checked as far as no loaded model is needed (the model's config, where this
    machine has it, says which model it is); None: start cold (no file yet, a method that keeps nothing across
    requests, or a damaged file or one of another model with --memory-cold-on-error)."""
    if memory is None:
        return None
    from .models import architecture
    from .session import MemoryFileError, check_model, fingerprint, keeps_memory, read_memory

    if not keeps_memory(method):  # said, not silently ignored: a user may count on a warm next run
        info(f"--memory is not used: {method} keeps no drafter memory to load or save")
        return None
    if not memory.is_file():
        return None
    try:
        saved = read_memory(memory, method)
        if (known := architecture(model)) is not None:
            check_model(saved, memory, fingerprint(*known))
        return saved
    except MemoryFileError as exc:
        _memory_failed(exc, cold_on_error)
    return None


def _memory_failed(exc: Exception, cold_on_error: bool) -> None:
    if not cold_on_error:
        fail(f"cannot load memory: {exc} (--memory-cold-on-error starts cold and overwrites it)")
    err.print(f"[yellow]warning:[/] cannot load memory: {exc}; starting cold, the end of the run overwrites it",
              highlight=False)


def _check_loading(device: str, dtype: str, attn: str) -> None:
    try:
        check_loading(device, dtype, attn)
    except ValueError as exc:
        fail(str(exc))


def _warn_unknown(line: int, keys: list[str], warned: set[str]) -> None:
    """Each key a record has and recap ignores, once a run: `"images": [...]` or `"Question"` must not pass as a
    caption or a text-only answer without a word; a message's key once whatever message it is in."""
    for key in keys:
        if (kind := records.unknown_kind(key)) not in warned:
            warned.add(kind)
            err.print(f"[yellow]warning:[/] line {line}: {escape(records.unknown_key(key))}", highlight=False)


def _stopped_by(held: list[int]) -> int | None:
    """The exit code of the first stop signal held back, if any (as if it had ended the run)."""
    return {signal.SIGINT: EXIT_INTERRUPTED, signal.SIGTERM: EXIT_TERMINATED}.get(held[0]) if held else None


def _image_root(root: Path | None) -> Path | None:
    """--root, resolved, where relative image paths start instead of the input file's folder."""
    if root is not None and not root.is_dir():
        fail(f"--root {root} is not a folder")
    return root.resolve() if root is not None else None


def _check_paths(inputs: list[Path], **targets: Path | None) -> None:
    """Refuse, before the model loads, every path the run would write but cannot, or must not (an input)."""
    named = {f"--{flag}" if flag != "output" else "-o": path for flag, path in targets.items()}
    problem = safety.clashes(inputs, named)
    for flag, path in named.items():
        problem = problem or (safety.unwritable(path, flag, atomic=flag == "--memory") if path else None)
    if problem:
        fail(problem)


@app.command(short_help="Run every method on the same inputs, interleaved, and report speedups over the "
             "baseline.")
@_interruptible
def compare(
    inputs: list[Path] = typer.Argument(..., help="JSONL files; each is a dataset unless records name one"),
    baseline: str = typer.Option("ar", help="the method speedups are measured against"),
    methods: str = typer.Option("recap,tr,pld", help="comma-separated; recap variants as "
                                "recap:mixing=fixed, recap:orders=1, recap:suffix=off, recap:budget=16, "
                                "tr:budget=auto, pld:budget=10"),
    model: str = typer.Option("demo", "--model", "-m", help="short name, hub repo id or local directory"),
    root: Optional[Path] = typer.Option(None, help="folder relative image paths start from [default: each "
                                        "input file's folder; the working directory for stdin]"),
    max_new_tokens: int = typer.Option(200, min=1, help="new tokens per input (a record's own max_new_tokens "
                                       "goes first)"),
    warmup: int = typer.Option(1, min=0, help="inputs run untimed through every method first"),
    keep_memory: bool = typer.Option(False, help="keep drafter memory across datasets (default: clear it)"),
    batch: int = typer.Option(1, min=1, help="requests decoding together for every method (recap run --batch); "
                              "speedups then also show throughput over wall time (wall×)"),
    repeats: int = typer.Option(1, min=1, help="runs of each input per method, each from the same memories, the "
                                "fastest kept (batch 1): steadier per-input speedups (p10) on a busy machine"),
    report_dir: Optional[Path] = typer.Option(None, "--report", help="write report.md and speedups.png here"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the summary and every measurement here"),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N"),
    dtype: str = typer.Option("auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32 or fp64"),
    attn: str = typer.Option("sdpa", help="attention kernel: sdpa or eager"),
    offline: bool = typer.Option(False, help="never ask the hub; use the local cache only (also HF_HUB_OFFLINE=1)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress or info lines on stderr (the result "
                               "tables and errors still print)"),
    allow_failures: bool = typer.Option(False, help="exit 0 even when a method failed on inputs another answered "
                                        "(the failures are still named on stderr)"),
    temperature: Optional[float] = TEMPERATURE,
    top_p: Optional[float] = TOP_P,
    top_k: Optional[int] = TOP_K,
    repetition_penalty: Optional[float] = REPETITION_PENALTY,
    seed: Optional[int] = SEED,
    generation_config: str = GENERATION_CONFIG,
    prefix_cache: Optional[int] = typer.Option(None, "--prefix-cache", min=0, help="MB of prefill results every "
                                               "method keeps for reuse (0: off; a method's own: ar:prefix=0) "
                                               "[default: as recap run]"),
) -> None:
    """Run every method on the same inputs, interleaved, and report speedups over the baseline.

    stdout gets one JSON line per (input, method) measurement; the tables go to stderr. Exit 1 when a method's
    tokens differ from the baseline's (hf's sampled tokens excepted), or when a method failed on an input another
    method answered."""
    _set_output(quiet)
    _check_loading(device, dtype, attn)
    if repeats > 1 and batch > 1:
        fail("--repeats times one request at a time; a batch is timed by its wall time over the whole dataset "
             "(use --batch 1, or run the comparison again)")
    _check_paths(inputs, json=json_out)  # a typo in a path must not cost the whole comparison's results
    if report_dir is not None and (problem := safety.unmakeable_folder(report_dir, "--report",
                                                                      "report.md and speedups.png")):
        fail(problem)
    labels = list(dict.fromkeys([baseline] + [m.strip() for m in methods.split(",") if m.strip()]))
    if len(labels) < 2:
        fail(f"--methods names no method besides the baseline ({baseline}): nothing to compare it with")
    try:
        for label in labels:
            if label.isdigit():  # `recap:orders=1,2`: the comma ended the variant ("unknown method '2'" misled)
                raise ValueError(f"'{label}' in --methods is no method: commas separate methods, so a variant "
                                 "gives its orders as digits (recap:orders=12)")
            check_batch(parse_method(label)[0], batch)
    except ValueError as exc:
        fail(str(exc))
    decoding = _decoding_asked(generation_config, temperature=temperature, top_p=top_p, top_k=top_k,
                               repetition_penalty=repetition_penalty, seed=seed)
    folder = _image_root(root)
    requests, warned = [], set()
    stems = {}
    for path in inputs:
        if stems.setdefault(path.stem, path) != path:  # said, since a table per file is what most expect
            _warn(f"{stems[path.stem]} and {path} are one dataset, '{path.stem}' (named by file): their inputs share "
                  "its table (a 'dataset' field in the records keeps them apart)")
        source, base, _ = _open_inputs(str(path))
        for req in records.read(source, folder or base):
            _warn_unknown(req.line, req.unknown, warned)
            req.dataset = req.dataset or path.stem
            requests.append(req)
    if not requests:  # an empty file: no table, no rows, and a 0 that says all is well
        fail(f"no requests in {', '.join(map(str, inputs))}: nothing to compare")
    datasets = {req.dataset for req in requests}
    if EVERY_DATASET in datasets and len(datasets) > 1:  # its figures would be lost under every dataset's
        fail(f"a dataset is named '{EVERY_DATASET}', the name of the table of every dataset together: rename it "
             "(its records' 'dataset', or its file)")
    adapter = _loaded(model, offline, device=device, dtype=dtype, attn=attn)
    from . import compare as comparison
    from .decoding import sampling

    settings = _settings(adapter, decoding)
    try:
        sessions = {label: comparison.make_session(adapter, label, batch, settings,
                                                   "auto" if prefix_cache is None else prefix_cache)
                    for label in labels}
    except ValueError as exc:
        fail(str(exc))
    checked = comparison.reference(labels, baseline)  # what tokens are checked against: the run's and the reports'
    rows: list[Measurement] = []  # every input measured so far: what an interrupted comparison still reports
    stop = None
    with safety.terminate_as_interrupt(), _progress(len(requests)) as progress:
        task = progress.add_task("comparing", total=len(requests))

        def emit(batch: list) -> None:
            with safety.whole_lines():
                rows.extend(batch)
                for row in comparison.rows_as_dicts(batch):
                    _write(sys.stdout.buffer, row)
            progress.advance(task)

        try:
            comparison.run(sessions, requests, baseline, model, max_new_tokens, warmup, keep_memory, emit, repeats,
                           checked)
        except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the inputs measured so far are still reported
            stop = EXIT_TERMINATED if isinstance(exc, safety.Terminated) else EXIT_INTERRUPTED
        except BrokenPipeError:  # the reader of stdout went away (`| head`): as `recap run`, 141, not click's 1
            safety.silence_stdout()
            stop = EXIT_CLOSED_STDOUT
    measured = len({r.input for r in rows})
    if stop is not None:
        err.print(f"{STOPS[stop]} after {measured} of "
                  f"{len(requests)} inputs" + (": the results cover those" if rows else ""), highlight=False)
        if not rows:
            raise typer.Exit(stop)
    summary = comparison.summarize(rows, baseline)
    report.table(summary, baseline, err, checked)
    timed = f", fastest of {repeats} runs per input" if repeats > 1 else ""
    header = (f"model `{model}`, {measured} inputs" + (f" of {len(requests)} (interrupted)" if stop else "") +
              f", batch {batch}{timed}, max {max_new_tokens} new tokens, "
              f"device {adapter.device}, dtype {str(adapter.model.dtype).removeprefix('torch.')}, "
              f"{sampling.sentence(settings)}")
    if json_out is not None:
        json_out.write_bytes(orjson.dumps({"setup": header, "baseline": baseline, "checked_against": checked,
                                           "summary": summary,
                                           "rows": comparison.rows_as_dicts(rows), "interrupted": stop is not None},
                                          option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    if report_dir is not None:
        try:
            report_dir.mkdir(parents=True, exist_ok=True)
            (report_dir / "report.md").write_text(report.markdown(summary, baseline, header, checked) + "\n")
            report.plot(summary, report_dir / "speedups.png")
            info(f"report written to {report_dir}")
        except OSError as exc:  # what the checks before the model could not foresee (a full disk, /proc)
            fail(_cannot_write("--report", report_dir, exc) + "; the rows on stdout"
                 + (" and --json" if json_out is not None else "") + " have the results")
    # Sampled tokens of hf come from torch's generator, not recap's draws: their mismatches are shown, not failures.
    mismatched = bool(comparison.unexpected(rows))
    failed, uneven = comparison.failures(rows)
    _name_failures(failed, uneven, measured, allow_failures)
    nothing = all(r.error is not None for r in rows)
    if nothing:  # not even --allow-failures makes an empty comparison a result
        err.print("[bold red]error:[/] every method failed on every input: nothing was compared", highlight=False)
    if stop is not None:
        raise typer.Exit(stop)
    raise typer.Exit(EXIT_FAILED_RECORDS if mismatched or nothing or (uneven and not allow_failures) else EXIT_OK)


def _name_failures(failed: dict[str, list[Measurement]], uneven: dict[str, int], inputs: int,
                   allowed: bool, shown: int = 10) -> None:
    """Each method's failed inputs on stderr (its file and line, its id, the error's first line): they are left
    out of the statistics, so nobody should read the table without knowing. A method that failed where another
    answered is an error (exit 1) unless --allow-failures."""
    for method, rows in failed.items():
        kind = "[bold red]error:[/]" if method in uneven and not allowed else "[yellow]warning:[/]"
        where = (f" ({uneven[method]} answered by another method)" if method in uneven
                 else " (every method failed on them)")
        err.print(f"{kind} {escape(method)} failed on {len(rows)} of {inputs} inputs{where}; they are left out of "
                  "the statistics", highlight=False)
        for r in rows[:shown]:
            first = next(iter((r.error or "").strip().splitlines()), "")
            err.print(f"  {escape(r.dataset)} line {r.line} (id {escape(r.id)}): {escape(first)}", highlight=False)
        if len(rows) > shown:
            err.print(f"  and {len(rows) - shown} more (every failure is in the JSON lines on stdout)", highlight=False)
    if uneven and not allowed:
        err.print("(--allow-failures exits 0 all the same)", highlight=False)


def _loaded(model: str, offline: bool, **how):
    """The model's adapter, downloaded first when the cache lacks it (huggingface_hub's bars on a terminal),
    then loaded as a progress stage."""
    from .models import ModelError, freeze_loaded, load, locate

    try:
        path = locate(model, offline=offline, progress=err.is_terminal and not _quiet, notify=info)
        with _progress(None) as progress:
            stage = progress.add_task(f"loading {model}", total=None)
            adapter = load(path, **how)
            freeze_loaded()
            progress.update(stage, total=1, completed=1)
        return adapter
    except ModelError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        err.print("interrupted before any request was answered (a download resumes on the next run)")
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _run_on_ray(source: IO[bytes], job: dict, cluster: dict, output: Path | None, earlier: records.Earlier | None,
                memory: Path | None, summary: Path | None, total: int | None, warm: bool = True) -> None:
    """``earlier``: with --resume, what the output already holds (``_resuming``); ``warm``: the workers start
    from --memory's file; False when the checks before the model chose a cold start (--memory-cold-on-error on a
    damaged file), which the run's end then overwrites."""
    try:
        from . import scale
    except ImportError:
        fail(escape("--ray needs Ray: pip install 'recap-cli[ray]' (or -e \".[ray]\" in a checkout)"))
    with _LateSink(output, earlier is not None) as sink, \
            _progress(total) as progress:
        task = progress.add_task("answering", total=total)
        try:
            outcome = scale.run(source, scale.Job(**job, fault_after=scale.fault_after()), scale.Cluster(**cluster),
                                sink, earlier, memory, lambda: progress.advance(task),
                                functools.partial(_warn_unknown, warned=set()),
                                functools.partial(_say_capped, ceiling=job["max_new_tokens"]), warm=warm)
        except (scale.ScaleError, ValueError) as exc:
            fail(escape(str(exc)))
        if not outcome.interrupted:
            sink.open()  # a run with nothing to write still leaves its output, as a local run does
    if outcome.memories_merged:
        stale = "" if outcome.memories_final else " (some workers' last requests missing: they did not stop cleanly)"
        err.print(f"memories of {outcome.memories_merged} workers merged into {memory}{stale}")
    stop = EXIT_INTERRUPTED if outcome.interrupted else EXIT_BROKEN if outcome.failure else None
    written = _report(outcome.totals, summary, stop,
                      {**scale.extra_summary(outcome),
                       **({"errors_before": len(outcome.failed_before)} if earlier is not None else {})})
    for worker, line in scale.worker_lines(outcome):
        err.print(f"  worker {worker}: {line}", highlight=False)
    _say_failed_before(outcome.failed_before, output)
    if outcome.failure:  # as recap's own failure part way in a local run (``_broken``): what was kept
        err.print(f"[bold red]error:[/] {escape(outcome.failure + _kept(output))}", highlight=False)
    if stop is not None:
        raise typer.Exit(stop)
    if not written:  # the summary file could not be written (said above): as a local run, exit 2
        raise typer.Exit(EXIT_USAGE)
    raise typer.Exit(EXIT_FAILED_RECORDS if outcome.totals.errors or outcome.failed_before else EXIT_OK)


def _decoding_asked(mode: str, **given) -> dict:
    """The decoding settings asked for on the command line, checked before the model loads, with the run's seed
    (drawn when not given: one for the whole run, every worker included)."""
    try:
        if mode not in GENERATION_CONFIGS:
            raise ValueError(f"--generation-config takes {' or '.join(GENERATION_CONFIGS)}, not '{mode}'")
        check_settings(given, name="--{}")
    except ValueError as exc:
        fail(str(exc))
    return {"mode": mode, **given, "seed": secrets.randbits(32) if given["seed"] is None else given["seed"]}


def _settings(adapter, decoding: dict) -> Settings:
    """The run's settings from the model's generation config and the command line: a setting recap cannot honour
    exactly stops the run here, before any request is decoded."""
    from .decoding import sampling

    try:
        settings = sampling.resolve(getattr(adapter.model, "generation_config", None), **decoding)
    except ValueError as exc:
        fail(str(exc))
    words = sampling.sentence(settings)
    if words != "greedy":  # plain greedy is what a reader expects: only a departure from it earns a line
        info(f"decoding: {words}")
    return settings


def _session(adapter, method: str, knobs: dict, compiled: bool, batch: int = 1,
             settings: Settings | None = None) -> Session:
    """The run's session (compiled when asked, eager if compiling fails); its warnings and info lines go to stderr."""
    from .session import start_session

    return start_session(adapter, method, knobs, compiled, batch, settings, warn=_warn, info=info)


def _warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", highlight=False)


def _open_inputs(inputs: str) -> tuple[IO[bytes], Path, int | None]:
    if inputs == "-":
        return sys.stdin.buffer, Path.cwd(), None
    path = Path(inputs)
    if path.is_dir():
        fail(f"input {inputs} is a folder: name a JSONL file")
    if not path.exists():
        fail(f"input file not found: {inputs}")
    if not path.is_file():  # a pipe (`<(cmd)`, /dev/stdin): read once, as stdin is; image paths from here
        return open(path, "rb"), Path.cwd(), None
    data = path.read_bytes()
    return open(path, "rb"), path.resolve().parent, sum(1 for line in data.splitlines() if line.strip())


def _recap_knobs(method: str, **given) -> dict:
    knobs = {k: v for k, v in given.items() if v is not None}
    if knobs and method != "recap":
        fail(f"--{'/--'.join(sorted(knobs))} appl{'y' if len(knobs) > 1 else 'ies'} to --method recap only")
    for key in ("mixing", "orders"):  # checked as `recap compare`'s variants are, before the model loads
        if key in knobs:
            try:
                knobs[key] = parse_knob(key, knobs[key])
            except ValueError as exc:
                fail(f"--{exc}")
    return knobs


def _budget(method: str, value: str) -> int | str:
    try:
        return parse_budget(method, value)
    except ValueError as exc:
        fail(f"--budget: {exc}")


def _sink(output: Path | None, resume: bool):
    """Where records go: --output (appended to when resuming), else stdout. A path the checks before the model
    passed can still refuse to open (a special file system such as /proc): one sentence, not a traceback."""
    if not output:
        return nullcontext(sys.stdout.buffer)
    try:
        return _closing_quietly(open(output, "ab" if resume else "wb"))
    except OSError as exc:
        fail(_cannot_write("-o", output, exc))


@contextmanager
def _closing_quietly(file: IO[bytes]) -> Iterator[IO[bytes]]:
    """The output file, closed at the end. Every record was flushed as it was written, so closing can only fail
    where a write already did (a full disk: said then, the run stopped): that tail is not raised again."""
    try:
        yield file
    finally:
        try:
            file.close()
        except OSError:
            pass


class _LateSink:
    """--ray's output, opened (emptied, or appended to with --resume) only when the first record is ready: what
    can still fail with a usage error before it (the cluster, the workers' model and memory) then leaves an
    existing file as it was. stdout without --output."""

    def __init__(self, output: Path | None, resume: bool):
        self.output, self.mode, self.file = output, "ab" if resume else "wb", None

    def open(self) -> IO[bytes]:
        if self.file is None:
            self.file = open(self.output, self.mode) if self.output else sys.stdout.buffer
        return self.file

    def write(self, data: bytes) -> int:
        return self.open().write(data)

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def __enter__(self) -> _LateSink:
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None and self.output:
            self.file.close()


def _write(sink: IO[bytes], record: dict) -> None:
    sink.write(records.dumps(record))  # one write per line, flushed at once: pipelines see each answer
    sink.flush()


def _progress(total: int | None) -> Progress:
    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=err, transient=False, disable=_quiet or not err.is_terminal)


STOPS = {EXIT_INTERRUPTED: "interrupted", EXIT_TERMINATED: "terminated", EXIT_CLOSED_STDOUT: "stdout closed",
         EXIT_USAGE: "output failed", EXIT_BROKEN: "recap failed"}


def _report(totals: Totals, summary: Path | None, stop: int | None, extra: dict | None = None) -> bool:
    s = {**totals.summary(), **(extra or {})}
    interrupted = stop is not None
    note = f" ({STOPS[stop]})" if interrupted else ""
    if "wall_s" in s:  # what a batch of work is measured by: wall time
        rate = (f"in {s['wall_s']:.1f} s, {s['requests_per_hour']:.0f} requests/hour, "
                f"{s['wall_tokens_per_s']:.1f} tokens/s")
    else:
        rate = f"{s['tokens_per_s']:.1f} tokens/s"
    rows = f", batch {s['batch']} ({s['mean_occupancy']:.1f} rows in flight)" if s.get("mean_occupancy") else ""
    reuse = f", {s['prefix_reuse']:.0%} of prompt tokens reused" if s.get("prefix_reuse") else ""
    if s["answered"]:
        info(f"{s['items']} items, {s['errors']} errors, {s['new_tokens']} tokens {rate}, "
             f"mean accepted {s['mean_accepted']:.2f}{rows}{reuse}{note}")
    else:  # no rates of nothing (an empty resume, every line failed): "0 requests/hour, mean accepted 0.00"
        info(f"{s['items']} items, {s['errors']} errors: nothing was answered{note}")
    if "workers" in s:
        restarts = f" ({s['restarts']} restarted)" if s["restarts"] else ""
        info(f"{s['workers']} worker{'s' if s['workers'] != 1 else ''}{restarts}")
    if summary is not None:
        try:
            summary.write_bytes(orjson.dumps({**s, "interrupted": interrupted}, option=orjson.OPT_INDENT_2))
        except OSError as exc:  # a full disk, a special file system: one sentence, not a traceback after the run
            err.print(f"[bold red]error:[/] {_cannot_write('--summary', summary, exc)}", highlight=False)
            return False
    return True

