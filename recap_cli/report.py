"""Comparison reports: a terminal table, Markdown, JSON and a PNG of per-input speedup distributions."""

from __future__ import annotations

import math
from pathlib import Path
from typing import IO

from PIL import Image, ImageDraw, ImageFont
from rich.console import Console
from rich.markup import escape
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


def table(summary: dict, baseline: str, console: Console, checked: str | None = None) -> None:
    """Each dataset's figures over ``baseline``, and the methods whose tokens differ from those of ``checked``,
    the method tokens are checked against (the baseline unless that is hf: compare.reference)."""
    for dataset, methods in summary.items():
        t = Table(title=f"{dataset} — speedup over {baseline}", title_justify="left")
        t.add_column("method", overflow="fold", min_width=6)
        for name, _ in COLUMNS:
            t.add_column(name, justify="right", overflow="fold")  # too narrow a terminal folds a number, never cuts it
        for method, s in methods.items():
            t.add_row(method, *(_fmt(k, s.get(k)) for _, k in COLUMNS))
        console.print(t)
        for note in blank_notes(methods):
            console.print(note, highlight=False, markup=False)
        for method, s in methods.items():
            if s["mismatches"]:
                console.print(f"[yellow]{escape(method)}: tokens differ from {escape(checked or baseline)} on "
                              f"{len(s['mismatches'])} input(s): {escape(differences(s, checked or baseline))}[/]")


SHOWN_DIFFERENCES = 5  # mismatches a terminal table names (the rest are counted; --json has them all)


def differences(stats: dict, checked: str, shown: int | None = SHOWN_DIFFERENCES) -> str:
    """A method's mismatching inputs, each with where its tokens first differ from those of ``checked`` (the
    position from 0, in a later turn with the turn: answers[1]) and the two tokens there ("end" where one had
    ended): ``r3 at token 2 (9, ar: 3)``; past ``shown`` of them, how many more."""
    found = stats.get("first_differences") or [{"id": i} for i in stats["mismatches"]]
    said = []
    for d in found[:shown]:
        if "position" not in d:  # a row without its tokens to compare (built by hand)
            said.append(str(d["id"]))
            continue
        where = f" answers[{d['turn']}]" if d["turn"] else ""
        token, expected = ("end" if t is None else t for t in (d["token"], d["expected"]))
        said.append(f"{d['id']} at{where} token {d['position']} ({token}, {checked}: {expected})")
    more = len(found) - len(said)
    return ", ".join(said) + (f", and {more} more" if more else "")


def blank_notes(methods: dict) -> list[str]:
    """What a "–" in a dataset's table means: a row of nothing but "–" is a method with no input to measure; a
    few are columns the method has no figure for."""
    notes, partly = [], False
    for method, s in methods.items():
        if _fmt("mean_speedup", s.get("mean_speedup")) == "–":  # no input timed against the baseline's
            why = (f"it failed on all {s['inputs']} inputs" if s.get("inputs") and s.get("errors") == s["inputs"]
                   else "no input that it and the baseline both answered")
            notes.append(f"{method}: no figures, {why} (its error records are on stdout and in --json)")
        elif any(_fmt(k, s.get(k)) == "–" for _, k in COLUMNS):
            partly = True
    if partly:
        notes.append("–: no figure for that column (generate() methods take no verification steps to count)")
    return notes


def markdown(summary: dict, baseline: str, header: str = "", checked: str | None = None) -> str:
    lines = [header] if header else []
    for dataset, methods in summary.items():
        lines += [f"### {dataset} (speedup over `{baseline}`)", "",
                  "| method | " + " | ".join(n for n, _ in COLUMNS) + " |",
                  "| --- |" + " ---: |" * len(COLUMNS)]
        for method, s in methods.items():
            lines.append(f"| {method} | " + " | ".join(_fmt(k, s.get(k)) for _, k in COLUMNS) + " |")
        bad = {m: s for m, s in methods.items() if s["mismatches"]}
        failed = {m: s for m, s in methods.items() if s["errors"]}
        lines.append("")
        if notes := blank_notes(methods):
            lines += [f"- {note}" for note in notes] + [""]
        for method, s in bad.items():
            lines.append(f"- `{method}` differs from `{checked or baseline}` on: "
                         + differences(s, checked or baseline, shown=None))
        for method, s in failed.items():
            lines.append(f"- `{method}` failed on {s['errors']} of {s['inputs']} inputs (left out of the statistics)")
        if bad or failed:
            lines.append("")
    return "\n".join(lines)


FONT_SIZE = 14  # Pillow's default font at its default 10 px draws spaces 3 px wide: "per-input speedup" ran together


def plot(summary: dict, path: Path, width: int = 900, row_h: int = 34) -> None:
    """One row per (dataset, method): every per-input speedup as a dot, the p10-p90 range as a bar, the median
    as a tick; the dashed line marks 1× (the baseline). The label column is as wide as the longest label."""
    rows = [(label(d, m), s["speedups"], s) for d, ms in summary.items() for m, s in ms.items()]
    values = [v for _, sp, _ in rows for v in sp] or [1.0]
    lo, hi = min(0.5, min(values) * 0.95), max(2.0, max(values) * 1.05)
    font = ImageFont.load_default(size=FONT_SIZE)
    left, right, top = label_width(rows, font), 30, 34
    img = Image.new("RGB", (max(width, left + 400), top + row_h * len(rows) + 40), "white")
    width = img.width
    draw = ImageDraw.Draw(img)

    def x(v: float) -> float:
        return left + (v - lo) / (hi - lo) * (width - left - right)

    for tick in _ticks(lo, hi):
        draw.line([(x(tick), top - 5), (x(tick), top + row_h * len(rows))], fill=(225, 225, 225))
        draw.text((x(tick) - 10, top + row_h * len(rows) + 8), f"{tick:g}x", fill="black", font=font)
    for y0 in range(top, top + row_h * len(rows), 6):
        draw.line([(x(1.0), y0), (x(1.0), y0 + 3)], fill=(200, 0, 0))
    for i, (text, speedups, s) in enumerate(rows):
        y = top + row_h * i + row_h // 2
        draw.text((LABEL_X, y - FONT_SIZE // 2), text, fill="black", font=font)
        if not speedups:
            draw.text((left, y - FONT_SIZE // 2), "no figures: no input answered", fill=(120, 120, 120), font=font)
            continue
        draw.rectangle([x(s["p10"]), y - 6, x(s["p90"]), y + 6], fill=(205, 220, 245))
        for v in speedups:
            draw.ellipse([x(v) - 2, y - 2, x(v) + 2, y + 2], fill=(40, 80, 160))
        draw.line([(x(s["p50"]), y - 9), (x(s["p50"]), y + 9)], fill="black", width=2)
    draw.text((LABEL_X, 8), "per-input speedup over the baseline: dots are inputs, the bar spans p10-p90, the tick is "
              "the median", fill="black", font=font)
    img.save(path)


LABEL_X = 8


def label(dataset: str, method: str) -> str:
    return f"{dataset} · {method}"


def label_width(rows: list, font: ImageFont.FreeTypeFont) -> int:
    """Where the plot starts: after the longest label, whole (a fixed 230 px cut "recap:mixing=fixed" short)."""
    widest = max((font.getlength(text) for text, *_ in rows), default=0)
    return LABEL_X + math.ceil(widest) + 16


def _ticks(lo: float, hi: float) -> list[float]:
    step = 0.25 if hi - lo <= 2 else 0.5 if hi - lo <= 4 else 1.0
    start = math.ceil(lo / step) * step
    return [round(start + i * step, 2) for i in range(int((hi - start) / step) + 1)]
