"""Comparison reports: a terminal table, Markdown, JSON and a PNG of per-input speedup distributions."""

from __future__ import annotations

import math
from pathlib import Path
from typing import IO

from PIL import Image, ImageDraw
from rich.console import Console
from rich.table import Table

COLUMNS = [("mean×", "mean_speedup"), ("total×", "total_speedup"), ("wall×", "wall_speedup"), ("p10", "p10"), ("p50", "p50"),
           ("p90", "p90"), ("tok/s", "tokens_per_s"), ("acc/step", "mean_accepted"), ("nodes", "nodes_per_step"),
           ("draft%", "draft_share"), ("match", "match_rate")]


# Width for stderr that is not a terminal (a pipe, a log file): rich would cut tables to 80 columns ("tota…",
# "100.…") and wrap sentences there; a log wants whole lines, and a table is only as wide as its cells.
PIPE_WIDTH = 10_000


def console(file: IO[str] | None = None) -> Console:
    """The console people read (stderr unless ``file``): a terminal's own width, else whole lines."""
    probe = Console(file=file, stderr=file is None)
    if probe.is_terminal:
        return probe
    return Console(file=file, stderr=file is None, width=PIPE_WIDTH, soft_wrap=True)


def _fmt(key: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if key in ("draft_share", "match_rate"):
        return f"{100 * value:.1f}%"
    if key in ("tokens_per_s", "nodes_per_step"):
        return f"{value:.1f}"
    return f"{value:.2f}"


def table(summary: dict, baseline: str, console: Console) -> None:
    for dataset, methods in summary.items():
        t = Table(title=f"{dataset} — speedup over {baseline}", title_justify="left")
        t.add_column("method", overflow="fold", min_width=6)
        for name, _ in COLUMNS:
            t.add_column(name, justify="right", overflow="fold")  # too narrow a terminal folds a number, never cuts it
        for method, s in methods.items():
            t.add_row(method, *(_fmt(k, s.get(k)) for _, k in COLUMNS))
        console.print(t)
        for method, s in methods.items():
            if s["mismatches"]:
                console.print(f"[yellow]{method}: tokens differ from {baseline} on {len(s['mismatches'])} "
                              f"input(s): {', '.join(s['mismatches'][:20])}[/]")


def markdown(summary: dict, baseline: str, header: str = "") -> str:
    lines = [header] if header else []
    for dataset, methods in summary.items():
        lines += [f"### {dataset} (speedup over `{baseline}`)", "",
                  "| method | " + " | ".join(n for n, _ in COLUMNS) + " |",
                  "| --- |" + " ---: |" * len(COLUMNS)]
        for method, s in methods.items():
            lines.append(f"| {method} | " + " | ".join(_fmt(k, s.get(k)) for _, k in COLUMNS) + " |")
        bad = {m: s["mismatches"] for m, s in methods.items() if s["mismatches"]}
        failed = {m: s for m, s in methods.items() if s["errors"]}
        lines.append("")
        for method, ids in bad.items():
            lines.append(f"- `{method}` differs from `{baseline}` on: {', '.join(ids)}")
        for method, s in failed.items():
            lines.append(f"- `{method}` failed on {s['errors']} of {s['inputs']} inputs (left out of the statistics)")
        if bad or failed:
            lines.append("")
    return "\n".join(lines)


def plot(summary: dict, path: Path, width: int = 900, row_h: int = 34) -> None:
    """One row per (dataset, method): every per-input speedup as a dot, the p10-p90 range as a bar, the median
    as a tick; the dashed line marks 1× (the baseline)."""
    rows = [(f"{d} · {m}", s["speedups"], s) for d, ms in summary.items() for m, s in ms.items()]
    values = [v for _, sp, _ in rows for v in sp] or [1.0]
    lo, hi = min(0.5, min(values) * 0.95), max(2.0, max(values) * 1.05)
    left, right, top = 230, 30, 30
    img = Image.new("RGB", (width, top + row_h * len(rows) + 40), "white")
    draw = ImageDraw.Draw(img)

    def x(v: float) -> float:
        return left + (v - lo) / (hi - lo) * (width - left - right)

    for tick in _ticks(lo, hi):
        draw.line([(x(tick), top - 5), (x(tick), top + row_h * len(rows))], fill=(225, 225, 225))
        draw.text((x(tick) - 10, top + row_h * len(rows) + 8), f"{tick:g}x", fill="black")
    for y0 in range(top, top + row_h * len(rows), 6):
        draw.line([(x(1.0), y0), (x(1.0), y0 + 3)], fill=(200, 0, 0))
    for i, (label, speedups, s) in enumerate(rows):
        y = top + row_h * i + row_h // 2
        draw.text((8, y - 6), label[:34], fill="black")
        if not speedups:
            continue
        draw.rectangle([x(s["p10"]), y - 6, x(s["p90"]), y + 6], fill=(205, 220, 245))
        for v in speedups:
            draw.ellipse([x(v) - 2, y - 2, x(v) + 2, y + 2], fill=(40, 80, 160))
        draw.line([(x(s["p50"]), y - 9), (x(s["p50"]), y + 9)], fill="black", width=2)
    draw.text((left, 8), "per-input speedup (dots), p10-p90 (bar), median (tick)", fill="black")
    img.save(path)


def _ticks(lo: float, hi: float) -> list[float]:
    step = 0.25 if hi - lo <= 2 else 0.5 if hi - lo <= 4 else 1.0
    start = math.ceil(lo / step) * step
    return [round(start + i * step, 2) for i in range(int((hi - start) / step) + 1)]
