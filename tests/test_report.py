"""What `recap compare` draws and prints: whole labels in the plot, and a note for every "–" in a table."""

from __future__ import annotations

import io
import math

from PIL import Image, ImageFont

from recap_cli import report


def stats(speedups: list[float], inputs: int = 4, errors: int = 0, accepted: float | None = 2.0) -> dict:
    ok = bool(speedups)
    return {"inputs": inputs, "errors": errors, "mean_speedup": sum(speedups) / len(speedups) if ok else math.nan,
            "total_speedup": 1.1 if ok else math.nan, "wall_speedup": 1.1 if ok else math.nan,
            "p10": min(speedups) if ok else math.nan, "p50": 1.0 if ok else math.nan,
            "p90": max(speedups) if ok else math.nan, "tokens_per_s": 100.0 if ok else math.nan,
            "mean_accepted": accepted if ok else None, "nodes_per_step": 4.0 if ok and accepted else None,
            "draft_share": 0.1 if ok else 0.0, "match_rate": 1.0 if ok else math.nan, "mismatches": [],
            "speedups": speedups}


def test_plot_labels_are_whole(tmp_path):
    long = "recap:mixing=fixed:orders=1:suffix=off:budget=16"
    summary = {"demo_multiturn": {"ar": stats([1.0, 1.0]), long: stats([0.9, 1.4])}}
    report.plot(summary, tmp_path / "p.png")
    img = Image.open(tmp_path / "p.png").convert("L")
    font = ImageFont.load_default(size=report.FONT_SIZE)
    text = report.label("demo_multiturn", long)
    row_h, top = 34, 34
    y = top + row_h + row_h // 2  # the second row's label
    ink = [x for x in range(img.width) for dy in range(-7, 8) if img.getpixel((x, y + dy)) < 128]
    label_end = report.LABEL_X + font.getlength(text)
    # the label's last letter is drawn (a cut at 34 characters ended the old label near x = 180) ...
    assert max(x for x in ink if x < label_end + 4) >= label_end - 8
    # ... and the plot starts after it
    assert report.label_width([(text,)], font) > label_end


def test_every_dash_in_a_table_is_explained():
    summary = {"demo_vqa": {"ar": stats([1.0, 1.0]), "hf": stats([0.7, 0.9], accepted=None),
                            "hf-pld": stats([], inputs=24, errors=24)}}
    out = io.StringIO()
    report.table(summary, "ar", report.console(out))
    text = out.getvalue()
    assert "hf-pld: no figures, it failed on all 24 inputs" in text
    assert "–: no figure for that column" in text
    md = report.markdown(summary, "ar")
    assert "- hf-pld: no figures, it failed on all 24 inputs" in md
    clean = io.StringIO()
    report.table({"d": {"ar": stats([1.0]), "recap": stats([1.2])}}, "ar", report.console(clean))
    assert "no figure" not in clean.getvalue()  # no dash, no note


def test_mismatches_say_where_the_tokens_first_differ_and_the_table_names_a_few():
    found = [{"id": f"q{i}", "turn": 0, "position": i, "token": 9, "expected": i} for i in range(7)]
    found[1] |= {"turn": 1, "token": None}
    wrong = stats([1.0, 1.0]) | {"mismatches": [d["id"] for d in found], "first_differences": found}
    out = io.StringIO()
    report.table({"d": {"ar": stats([1.0, 1.0]), "recap": wrong}}, "ar", report.console(out))
    line = next(x for x in out.getvalue().splitlines() if x.startswith("recap: tokens differ"))
    assert line == ("recap: tokens differ from ar on 7 input(s): q0 at token 0 (9, ar: 0), q1 at answers[1] token 1 "
                    "(end, ar: 1), q2 at token 2 (9, ar: 2), q3 at token 3 (9, ar: 3), q4 at token 4 (9, ar: 4), "
                    "and 2 more")
    md = report.markdown({"d": {"recap": wrong}}, "ar")
    assert "q6 at token 6 (9, ar: 6)" in md and "more" not in md  # the report file names them all
