"""A synthetic visual world for the demo model: shape scenes, signs and bar charts, with captions and Q&A.

Every image comes with the facts it shows, so text is generated from facts and answers can be checked.
Answers are deterministic given the image and the question wording (each question template has its answer
template), which keeps the trained model's greedy outputs confident; wording varies across templates.

The background is a faint left-to-right / top-to-bottom colour gradient: Qwen2.5-VL's vision tower adds no
absolute position to patch features, so this lets every patch see where it is.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from PIL import Image, ImageDraw, ImageFont

SIZE = 112
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35), "green": (30, 150, 50), "blue": (35, 70, 215),
    "yellow": (230, 195, 20), "purple": (130, 45, 175), "orange": (240, 120, 20),
}
SHAPES = ["circle", "square", "triangle", "diamond"]
PLACES = ["top left", "top middle", "top right", "middle left", "centre", "middle right",
          "bottom left", "bottom middle", "bottom right"]
WORDS = ["STOP", "OPEN", "EXIT", "SALE", "CAFE", "BANK", "PARK", "SHOP",
         "TAXI", "INFO", "GATE", "FOOD", "BOOK", "PLAY", "SLOW", "HELP"]
NUMBERS = [str(n) for n in range(10, 100)]
LETTERS = "ABCD"
COUNT_WORDS = ["no", "one", "two", "three", "four", "five"]
KINDS = ["shapes", "sign", "chart"]
QUESTION_KINDS = ["caption", "colour", "count", "position", "place", "sign", "chart"]


@dataclass
class Thing:
    shape: str
    colour: str
    cell: int  # 0..8 on a 3x3 grid, row-major
    dx: float = 0.0  # jitter of the centre (pixels) and radius: sampled with the scene, so facts know them
    dy: float = 0.0
    r: float = 12.0

    @property
    def centre(self) -> tuple[float, float]:
        step = SIZE / 3
        return (self.cell % 3 + 0.5) * step + self.dx, (self.cell // 3 + 0.5) * step + self.dy

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"


@dataclass
class Scene:
    kind: str
    things: list[Thing] = field(default_factory=list)
    sign_text: str = ""
    sign_colour: str = ""
    bars: list[int] = field(default_factory=list)  # heights, left to right, labelled A, B, ...
    bar_colour: str = ""


@dataclass
class QA:
    kind: str  # one of QUESTION_KINDS
    question: str
    answer: str


# ---------------------------------------------------------------- sampling


def sample_scene(rng: random.Random, kind: str | None = None) -> Scene:
    kind = kind or rng.choice(KINDS)
    if kind == "shapes":
        cells = rng.sample(range(9), rng.randint(1, 4))
        things = [Thing(rng.choice(SHAPES), rng.choice(list(COLOURS)), c, rng.uniform(-5, 5), rng.uniform(-5, 5),
                        rng.uniform(10, 14)) for c in sorted(cells)]
        return Scene("shapes", things=things)
    if kind == "sign":
        text = rng.choice(WORDS) if rng.random() < 0.6 else rng.choice(NUMBERS)
        return Scene("sign", sign_text=text, sign_colour=rng.choice(list(COLOURS)))
    n = rng.randint(3, 4)
    return Scene("chart", bars=rng.sample(range(1, 10), n), bar_colour=rng.choice(list(COLOURS)))


# ---------------------------------------------------------------- rendering


def _font(size: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _background() -> Image.Image:
    img = Image.new("RGB", (SIZE, SIZE))
    px = img.load()
    for y in range(SIZE):
        for x in range(SIZE):
            px[x, y] = (185 + 70 * x // SIZE, 185 + 70 * y // SIZE, 225)
    return img


_BACKGROUND: Image.Image | None = None


def render(scene: Scene, rng: random.Random) -> Image.Image:
    """Draw a scene; rng adds jitter to signs and charts so the same facts look different."""
    global _BACKGROUND
    if _BACKGROUND is None:
        _BACKGROUND = _background()
    img = _BACKGROUND.copy()
    draw = ImageDraw.Draw(img)
    if scene.kind == "shapes":
        for t in scene.things:
            _draw_thing(draw, t)
    elif scene.kind == "sign":
        _draw_sign(draw, scene, rng)
    else:
        _draw_chart(draw, scene, rng)
    return img


def _draw_thing(draw: ImageDraw.ImageDraw, t: Thing) -> None:
    (cx, cy), r = t.centre, t.r
    fill = COLOURS[t.colour]
    if t.shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif t.shape == "square":
        s = r * 0.9
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
    elif t.shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r * 0.8), (cx + r, cy + r * 0.8)], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)


def _draw_sign(draw: ImageDraw.ImageDraw, scene: Scene, rng: random.Random) -> None:
    w, h = rng.randint(92, 104), rng.randint(38, 44)
    x0, y0 = rng.randint(2, SIZE - w - 2), rng.randint(6, 40)
    draw.rectangle([x0 + w // 2 - 3, y0 + h, x0 + w // 2 + 3, SIZE - 4], fill=(110, 90, 70))  # post
    draw.rectangle([x0, y0, x0 + w, y0 + h], fill=COLOURS[scene.sign_colour], outline=(60, 60, 60), width=2)
    ink = (20, 20, 20) if scene.sign_colour in ("yellow", "orange") else (250, 250, 250)
    draw.text((x0 + w / 2, y0 + h / 2), scene.sign_text, fill=ink, font=_font(28), anchor="mm")


def _draw_chart(draw: ImageDraw.ImageDraw, scene: Scene, rng: random.Random) -> None:
    base, left = 94, 10
    draw.line([(left, 8), (left, base), (SIZE - 6, base)], fill=(60, 60, 60), width=2)
    width = (SIZE - left - 10) / len(scene.bars)
    font = _font(14)
    for i, value in enumerate(scene.bars):
        x0 = left + 4 + i * width + rng.uniform(0, 2)
        x1 = x0 + width * 0.62
        draw.rectangle([x0, base - value * 9, x1, base - 1], fill=COLOURS[scene.bar_colour])
        draw.text(((x0 + x1) / 2, base + 9), LETTERS[i], fill=(30, 30, 30), font=font, anchor="mm")


# ---------------------------------------------------------------- text


def _count(n: int, noun: str) -> str:
    if n == 1:
        return f"one {noun}"
    return f"{COUNT_WORDS[n]} {noun}s"


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _place(cell: int) -> str:
    return "in the centre" if cell == 4 else f"at the {PLACES[cell]}"


def _relation(a: Thing, b: Thing) -> str:
    """Where a is relative to b: columns decide first, rows when they share a column."""
    ax, ay, bx, by = a.cell % 3, a.cell // 3, b.cell % 3, b.cell // 3
    if ax != bx:
        return "left of" if ax < bx else "right of"
    return "above" if ay < by else "below"


def caption(scene: Scene, style: int) -> str:
    """Several sentences stating the scene's facts; style picks the opening (it follows the prompt)."""
    if scene.kind == "shapes":
        n = len(scene.things)
        head = [f"The picture shows {_count(n, 'shape')}.", f"There {'is' if n == 1 else 'are'} "
                f"{_count(n, 'shape')} in this picture."][style]
        body = " ".join(f"{_a(t.name).capitalize()} is {_place(t.cell)}." for t in scene.things)
        return f"{head} {body}"
    if scene.kind == "sign":
        what = "word" if scene.sign_text.isalpha() else "number"
        sign = _a(f"{scene.sign_colour} sign")
        head = [f"The picture shows {sign} on a post.", f"There is {sign} in this picture."][style]
        return f"{head} The sign reads {scene.sign_text}. It shows {_a(what)}."
    n = len(scene.bars)
    tall = LETTERS[scene.bars.index(max(scene.bars))]
    short = LETTERS[scene.bars.index(min(scene.bars))]
    head = [f"The picture shows a bar chart with {_count(n, 'bar')}.",
            f"There is a bar chart with {_count(n, 'bar')} in this picture."][style]
    return (f"{head} The bars are {scene.bar_colour} and labelled A to {LETTERS[n - 1]}. "
            f"Bar {tall} is the tallest and bar {short} is the shortest.")


CAPTION_PROMPTS = ["Describe this image in detail.", "What is in this picture?"]  # the first is recap's default


def questions(scene: Scene, rng: random.Random) -> list[QA]:
    """Every question the scene supports (one wording each, picked by rng); callers sample from these."""
    style = rng.randrange(2)
    out = [QA("caption", CAPTION_PROMPTS[style], caption(scene, style))]
    pick = rng.randrange
    if scene.kind == "shapes":
        out += _shape_questions(scene, rng)
    elif scene.kind == "sign":
        t, c = scene.sign_text, scene.sign_colour
        out.append([QA("sign", "What does the sign say?", f"The sign says {t}."),
                    QA("sign", "What is written on the sign?", f"The sign reads {t}."),
                    QA("sign", "Read the sign.", f"It reads {t}.")][pick(3)])
        out.append([QA("colour", "What colour is the sign?", f"The sign is {c}."),
                    QA("colour", "Which colour does the sign have?", f"It is {c}.")][pick(2)])
    else:
        n = len(scene.bars)
        tall = LETTERS[scene.bars.index(max(scene.bars))]
        short = LETTERS[scene.bars.index(min(scene.bars))]
        out.append([QA("chart", "Which bar is the tallest?", f"Bar {tall} is the tallest."),
                    QA("chart", "Which bar is highest?", f"The highest bar is {tall}.")][pick(2)])
        out.append(QA("chart", "Which bar is the shortest?", f"Bar {short} is the shortest."))
        out.append([QA("count", "How many bars are there?", f"There are {_count(n, 'bar')}."),
                    QA("count", "How many bars does the chart have?", f"The chart has {_count(n, 'bar')}.")][pick(2)])
        out.append(QA("colour", "What colour are the bars?", f"The bars are {scene.bar_colour}."))
    return out


def _shape_questions(scene: Scene, rng: random.Random) -> list[QA]:
    pick = rng.randrange
    things = scene.things
    out = []
    shape = rng.choice(SHAPES)
    n = sum(t.shape == shape for t in things)
    verb = "is" if n == 1 else "are"
    out.append([QA("count", f"How many {shape}s are there?", f"There {verb} {_count(n, shape)}."),
                QA("count", f"How many {shape}s can you see?", f"I can see {_count(n, shape)}.")][pick(2)])
    total = len(things)
    out.append(QA("count", "How many shapes are there?",
                  f"There {'is' if total == 1 else 'are'} {_count(total, 'shape')}."))
    unique = [t for t in things if sum(u.shape == t.shape for u in things) == 1]
    if unique:
        t = rng.choice(unique)
        out.append([QA("colour", f"What colour is the {t.shape}?", f"The {t.shape} is {t.colour}."),
                    QA("colour", f"Which colour is the {t.shape}?", f"It is {t.colour}.")][pick(2)])
    named = [t for t in things if sum(u.name == t.name for u in things) == 1]
    if len(named) >= 2:
        a, b = rng.sample(named, 2)
        rel = _relation(a, b)
        out.append([QA("position", f"Where is the {a.name} relative to the {b.name}?",
                       f"The {a.name} is {rel} the {b.name}."),
                    QA("position", f"Is the {a.name} left of, right of, above or below the {b.name}?",
                       f"It is {rel} the {b.name}.")][pick(2)])
    t = rng.choice(named or things)
    out.append(QA("place", f"Where is the {t.name}?", f"The {t.name} is {_place(t.cell)}."))
    return out


def conversation(scene: Scene, rng: random.Random, turns: int, weights: dict[str, float] | None = None) -> list[QA]:
    """A few distinct questions about one image, in random order (the first turn carries the image).

    ``weights`` per question kind favour some kinds: an ordering by ``u ** (1 / w)`` with uniform u is a weighted
    draw without replacement (Efraimidis and Spirakis)."""
    qas = questions(scene, rng)
    if weights:
        qas.sort(key=lambda qa: -rng.random() ** (1 / weights.get(qa.kind, 1.0)))
    else:
        rng.shuffle(qas)
    return qas[:turns]
