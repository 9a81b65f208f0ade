"""The command line: parse, call, print. stdout carries data (JSONL); people read stderr."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import IO, Iterator, Optional

import orjson
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import compare as comparison
from . import records, report
from .batch import Totals, answer
from .drafters import METHODS
from .models import FAMILIES, REGISTRY, ModelError, load
from .session import Session

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Lossless speculative decoding for image captioning and VQA with vision-language models.")
err = Console(stderr=True)

EXIT_OK, EXIT_FAILED_RECORDS, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(EXIT_USAGE)


@app.command()
def models() -> None:
    """List the short model names recap knows (any local model directory works too)."""
    for alias, repo in REGISTRY.items():
        family, size = FAMILIES.get(alias, ("?", "?"))
        print(f"{alias}\t{family}\t{size}\t{repo}")


@app.command()
def run(
    inputs: str = typer.Argument(..., help="JSONL file of requests, or - for stdin"),
    model: str = typer.Option("demo", "--model", "-m", help="short name, hub repo id or local directory"),
    method: str = typer.Option("recap", help=f"decoding method: {', '.join(METHODS)}"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="write JSONL here instead of stdout"),
    max_new_tokens: int = typer.Option(200, min=1, help="default per request (a record may set its own)"),
    device: str = typer.Option("auto", help="auto, cpu or cuda"),
    dtype: str = typer.Option("auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16 or fp32"),
    attn: str = typer.Option("sdpa", help="attention kernel: sdpa or eager"),
    memory: Optional[Path] = typer.Option(None, help="load the persistent draft memory from here; save it at the end"),
    resume: bool = typer.Option(False, help="skip ids already in --output and append"),
    summary: Optional[Path] = typer.Option(None, help="also write the end-of-run summary here as JSON"),
    budget: Optional[int] = typer.Option(None, min=0, help="recap: draft nodes per step"),
    depth: Optional[int] = typer.Option(None, min=1, help="recap: maximum draft depth"),
    mixing: Optional[str] = typer.Option(None, help="recap: confidence or fixed"),
    orders: Optional[str] = typer.Option(None, help="recap: memory orders to use, e.g. 1,2,3"),
    suffix: Optional[bool] = typer.Option(None, "--suffix/--no-suffix", help="recap: suffix continuations"),
    calibrate: Optional[bool] = typer.Option(None, "--calibrate/--no-calibrate",
                                             help="recap: learn acceptance chances online (else raw probabilities)"),
    compile: str = typer.Option("auto", help="static KV cache + CUDA graphs: auto (on with CUDA), on or off"),
) -> None:
    """Answer every request of INPUTS, one JSON line out per line in, in order."""
    if method not in METHODS:
        fail(f"unknown method '{method}': use one of {', '.join(METHODS)}")
    if resume and output is None:
        fail("--resume needs --output (the file to resume)")
    source, base, total = _open_inputs(inputs)
    knobs = _recap_knobs(method, budget=budget, depth=depth, mixing=mixing, orders=orders, suffix=suffix,
                         calibrate=calibrate)
    if compile not in ("auto", "on", "off"):
        fail("--compile takes auto, on or off")
    try:
        adapter = load(model, device=device, dtype=dtype, attn=attn)
        session = _session(adapter, method, knobs, compile == "on" or (compile == "auto" and
                                                                    adapter.device.type == "cuda"))
    except (ModelError, ValueError) as exc:
        fail(str(exc))
    if memory is not None and memory.is_file():
        try:
            session.load_memory(memory)
        except (ValueError, RuntimeError, OSError) as exc:
            fail(f"cannot load memory {memory}: {exc}")
    skip = records.done_ids(output) if resume and output is not None else set()
    totals = Totals()
    interrupted = False
    with (open(output, "ab" if resume else "wb") if output else nullcontext(sys.stdout.buffer)) as sink, \
            _progress(total) as progress:
        task = progress.add_task("answering", total=total)
        try:
            for req in _requests(source, base):
                if str(req.id) in skip:
                    progress.advance(task)
                    continue
                record = answer(session, req, model, max_new_tokens)
                _write(sink, record)
                totals.add(record)
                progress.advance(task)
        except KeyboardInterrupt:
            interrupted = True  # the request in flight is dropped; every written line is whole
    if memory is not None and session.save_memory(memory):
        err.print(f"memory saved to {memory}")
    _report(totals, summary, interrupted)
    if interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)
    raise typer.Exit(EXIT_FAILED_RECORDS if totals.errors else EXIT_OK)


@app.command()
def compare(
    inputs: list[Path] = typer.Argument(..., help="JSONL files; each is a dataset unless records name one"),
    baseline: str = typer.Option("ar", help="the method speedups are measured against"),
    methods: str = typer.Option("recap,tr,pld", help="comma-separated; recap variants as "
                                "recap:mixing=fixed, recap:orders=1, recap:suffix=off, recap:budget=16"),
    model: str = typer.Option("demo", "--model", "-m", help="short name, hub repo id or local directory"),
    max_new_tokens: int = typer.Option(200, min=1),
    warmup: int = typer.Option(1, min=0, help="inputs run untimed through every method first"),
    keep_memory: bool = typer.Option(False, help="keep drafter memory across datasets (default: clear it)"),
    report_dir: Optional[Path] = typer.Option(None, "--report", help="write report.md and speedups.png here"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the summary and every measurement here"),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
    attn: str = typer.Option("sdpa"),
) -> None:
    """Run every method on the same inputs, interleaved, and report speedups over the baseline.

    stdout gets one JSON line per (input, method) measurement; the tables go to stderr."""
    labels = list(dict.fromkeys([baseline] + [m.strip() for m in methods.split(",") if m.strip()]))
    try:
        for label in labels:
            comparison.parse_method(label)
    except ValueError as exc:
        fail(str(exc))
    requests = []
    for path in inputs:
        source, base, _ = _open_inputs(str(path))
        for req in _requests(source, base):
            req.dataset = req.dataset or path.stem
            requests.append(req)
    try:
        adapter = load(model, device=device, dtype=dtype, attn=attn)
    except ModelError as exc:
        fail(str(exc))
    sessions = {label: comparison.make_session(adapter, label) for label in labels}
    with _progress(len(requests)) as progress:
        task = progress.add_task("comparing", total=len(requests))

        def emit(batch: list[comparison.Measurement]) -> None:
            for row in comparison.rows_as_dicts(batch):
                _write(sys.stdout.buffer, row)
            progress.advance(task)

        rows = comparison.run(sessions, requests, baseline, model, max_new_tokens, warmup, keep_memory, emit)
    summary = comparison.summarize(rows, baseline)
    report.table(summary, baseline, err)
    header = (f"model `{model}`, {len(requests)} inputs, max {max_new_tokens} new tokens, "
              f"device {adapter.device}, dtype {str(adapter.model.dtype).removeprefix('torch.')}")
    if json_out is not None:
        json_out.write_bytes(orjson.dumps({"setup": header, "baseline": baseline, "summary": summary,
                                           "rows": comparison.rows_as_dicts(rows)},
                                          option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    if report_dir is not None:
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / "report.md").write_text(report.markdown(summary, baseline, header) + "\n")
        report.plot(summary, report_dir / "speedups.png")
        err.print(f"report written to {report_dir}")
    mismatched = any(s["mismatches"] for ms in summary.values() for s in ms.values())
    raise typer.Exit(EXIT_FAILED_RECORDS if mismatched else EXIT_OK)


def _session(adapter, method: str, knobs: dict, compiled: bool) -> Session:
    """The run's session; with ``compiled``, every step shape is compiled up front, and a failure to compile
    falls back to eager decoding (the fast path must never cost a user the run)."""
    if not compiled:
        return Session(adapter, method, **knobs)
    session = Session(adapter, method, static=True, compile=True, **knobs)
    try:
        seconds = session.warm_up([records.as_parts(records.user_message("Hello.", False))], [])
    except Exception as exc:  # noqa: BLE001 - see the docstring
        err.print(f"[yellow]warning:[/] compiling the decoding steps failed ({type(exc).__name__}: "
                  f"{records.first_line(exc)}); decoding eagerly")
        return Session(adapter, method, **knobs)
    err.print(f"compiled the decoding steps in {seconds:.1f} s (once per run)")
    return session


def _open_inputs(inputs: str) -> tuple[IO[bytes], Path, int | None]:
    if inputs == "-":
        return sys.stdin.buffer, Path.cwd(), None
    path = Path(inputs)
    if not path.is_file():
        fail(f"input file not found: {inputs}")
    data = path.read_bytes()
    return open(path, "rb"), path.resolve().parent, sum(1 for line in data.splitlines() if line.strip())


def _requests(source: IO[bytes], base: Path) -> Iterator[records.Request]:
    line_no = 0
    with source:
        for raw in source:
            line_no += 1
            if raw.strip():
                yield records.parse_line(raw, line_no, base)


def _recap_knobs(method: str, **given) -> dict:
    knobs = {k: v for k, v in given.items() if v is not None}
    if knobs and method != "recap":
        fail(f"--{'/--'.join(sorted(knobs))} apply to --method recap only")
    if "orders" in knobs:
        try:
            knobs["orders"] = tuple(int(o) for o in knobs["orders"].split(","))
        except ValueError:
            fail("--orders takes a comma-separated subset of 1,2,3")
    return knobs


def _write(sink: IO[bytes], record: dict) -> None:
    sink.write(records.dumps(record))  # one write per line, flushed at once: pipelines see each answer
    sink.flush()


def _progress(total: int | None) -> Progress:
    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=err, transient=False, disable=not err.is_terminal)


def _report(totals: Totals, summary: Path | None, interrupted: bool) -> None:
    s = totals.summary()
    note = " (interrupted)" if interrupted else ""
    err.print(f"{s['items']} items, {s['errors']} errors, {s['new_tokens']} tokens, "
              f"{s['tokens_per_s']:.1f} tokens/s, mean accepted {s['mean_accepted']:.2f}{note}", highlight=False)
    if summary is not None:
        summary.write_bytes(orjson.dumps({**s, "interrupted": interrupted}, option=orjson.OPT_INDENT_2))


def main() -> None:
    app()
