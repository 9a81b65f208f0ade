"""JSONL requests in, JSONL results out, and every way an input line can be wrong.

A bad line never stops a run: it becomes a ``Request`` with ``error`` set, and later an output record with that
error, so every input line yields exactly one output line.
"""

from __future__ import annotations

import codecs
import difflib
import errno
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson
from PIL import Image, ImageOps, UnidentifiedImageError

from .options import check_settings

if TYPE_CHECKING:  # a type only: importing adapters would load torch, which `recap --help` must not wait for
    from .adapters import Message

CAPTION_PROMPT = "Describe this image in detail."
SETTINGS = ("temperature", "top_p", "top_k", "repetition_penalty", "seed")  # a record's own decoding settings
KEYS = ("id", "image", "question", "prompt", "messages", "max_new_tokens", "dataset") + SETTINGS
MESSAGE_KEYS = ("role", "content")  # what a message of 'messages' gives recap; its other keys are left unread
MAX_IMAGE_PIXELS = 40_000_000


@dataclass
class Request:
    """One input line. ``turns`` are the user turns to answer in order; ``history`` holds given earlier turns."""

    line: int
    id: Any
    image: Path | None = None
    root: Path | None = None  # where a relative image path was resolved; None for an absolute one
    turns: list[str] = field(default_factory=list)
    history: list[Message] = field(default_factory=list)
    max_new_tokens: int | None = None
    dataset: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)  # its own temperature, top_p, ... over the run's
    error: str | None = None
    retry: bool = False  # its error lies outside the line (recap's own failure): a rerun may answer it
    unknown: list[str] = field(default_factory=list)  # keys recap does not read (a typo drops what it meant)


def read(source: IO[bytes], base: Path) -> Iterator[Request]:
    """Every non-blank line of a JSONL stream as a Request, numbered from 1."""
    for line_no, raw in numbered_lines(source):
        yield parse_line(raw, line_no, base)


def numbered_lines(source: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, raw bytes) of every non-blank line, the stream closed at the end; a UTF-8 byte order
    mark (what some Windows editors write) is not part of line 1."""
    with source:
        for line_no, raw in enumerate(source, start=1):
            if line_no == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if raw.strip():
                yield line_no, raw


def glance(raw: bytes) -> tuple[list[str], int | None]:
    """One line's record, parsed once for a driver that hands lines to workers unparsed (``--ray``) and still warns
    as a local run does: the keys recap does not read, and its own max_new_tokens where it gives a number (neither
    where the line is no JSON object: its record says so; the workers parse and cap the requests themselves)."""
    try:
        rec = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return [], None
    if not isinstance(rec, dict):
        return [], None
    asked = rec.get("max_new_tokens")
    return _unknown(rec), asked if isinstance(asked, int) and not isinstance(asked, bool) else None


# Keys a record's shape leaves unread: 'messages' holds the whole conversation, 'question' the one question (of
# which 'prompt' is the other name). A record that gives both was answered from one without a word of the other.
SHADOWED_BY = {"question": ("messages",), "prompt": ("messages", "question")}


def _unknown(rec: dict) -> list[str]:
    """The keys recap leaves unread in ``rec``: those it never reads, a question beside what takes its place, and
    a message's own (``"name"``, a ``"contents"`` typo), as ``messages[i].key``."""
    keys = [key for key in rec if key not in KEYS or any(other in rec for other in SHADOWED_BY.get(key, ()))]
    messages = rec.get("messages")
    if isinstance(messages, list):
        keys += [f"messages[{i}].{key}" for i, m in enumerate(messages) if isinstance(m, dict)
                 for key in m if key not in MESSAGE_KEYS]
    return keys


_IN_MESSAGE = re.compile(r"messages\[(\d+)\]\.(.*)", re.DOTALL)


def unknown_kind(key: str) -> str:
    """What a run warns of once: a record's key, or a message's key whatever message it is in (``messages[].name``
    for ``messages[3].name``)."""
    inside = _IN_MESSAGE.fullmatch(key)
    return f"messages[].{inside[2]}" if inside else key


def parse_line(raw: bytes, line: int, base: Path) -> Request:
    """Validate one JSONL line; relative image paths resolve against ``base`` (the JSONL file's folder or
    ``--root``)."""
    try:
        rec = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # The position within this input line (orjson counts a stray carriage return as a line of its own).
        return Request(line, line, error=f"line {line}: not valid JSON ({exc.msg}, at column {exc.pos + 1})")
    if not isinstance(rec, dict):
        return Request(line, line, error=f"line {line}: expected a JSON object, got {type(rec).__name__}")
    rid = rec.get("id", line)
    req = Request(line, rid, unknown=_unknown(rec))
    try:
        _fill(req, rec, base)
    except ValueError as exc:
        req.error = str(exc)
    return req


def _fill(req: Request, rec: dict, base: Path) -> None:
    if not isinstance(req.id, (str, int)) or isinstance(req.id, bool):
        raise ValueError("'id' must be a string or an integer")
    image = rec.get("image")
    if image is not None:
        if not isinstance(image, str) or not image.strip():
            raise ValueError("'image' must be a file path (string) or null")
        if image.startswith(("http://", "https://")):
            raise ValueError("'image' is a URL: recap reads image files (download it first)")
        path = Path(image).expanduser()
        if not path.is_absolute():
            req.root, path = base, base / path
        req.image = path
    dataset = rec.get("dataset")
    if dataset is not None and not isinstance(dataset, str):
        raise ValueError("'dataset' must be a string")
    req.dataset = dataset
    limit = rec.get("max_new_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError("'max_new_tokens' must be a positive integer")
    req.max_new_tokens = limit
    req.settings = {key: rec[key] for key in SETTINGS if rec.get(key) is not None}
    check_settings(req.settings, name="'{}'")
    if "messages" in rec:
        req.history, req.turns = _conversation(rec["messages"])
        return
    text = rec.get("question", rec.get("prompt"))
    if text is None:
        if req.image is None:
            raise ValueError("nothing to answer: give a 'question', a 'prompt', 'messages' or an 'image'")
        text = CAPTION_PROMPT
    if not isinstance(text, str):
        raise ValueError("'question'/'prompt' must be a string")
    if not text.strip():
        raise ValueError("the question is empty")
    req.turns = [text]


def _conversation(messages: Any) -> tuple[list[Message], list[str]]:
    """Split ``messages`` into given context (up to the first user turn without an answer) and turns to answer.

    Assistant turns that are given stay as they are; every user turn after the last given assistant turn is
    answered in order, each seeing the answers before it (MMSpec's multi-turn protocol).
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    parsed = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise ValueError("each message needs a 'role' of user, assistant or system")
        if not isinstance(m.get("content"), str) or not m["content"].strip():
            raise ValueError("each message needs a non-empty string 'content'")
        parsed.append({"role": m["role"], "content": m["content"]})
    last_given = max((i for i, m in enumerate(parsed) if m["role"] == "assistant"), default=-1)
    # System messages ahead of the turns to answer are context too (the common chat shape: system, then user).
    while last_given + 1 < len(parsed) and parsed[last_given + 1]["role"] == "system":
        last_given += 1
    history, tail = parsed[: last_given + 1], parsed[last_given + 1:]
    if not tail:
        raise ValueError("'messages' must end with user turns to answer")
    if any(m["role"] != "user" for m in tail):
        raise ValueError("'messages': a system message goes before the user turns to answer, not between them")
    return history, [m["content"] for m in tail]


def unknown_key(key: str) -> str:
    """What to tell a user about a key recap ignores: a near miss names the key it likely meant, a key the record's
    shape left unread what took its place; a message's key (``messages[i].key``) is named with its message."""
    if inside := _IN_MESSAGE.fullmatch(key):
        index, key = inside.groups()
        near = difflib.get_close_matches(key.lower(), MESSAGE_KEYS, n=1, cutoff=0.7)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        return f"key '{key}' in messages[{index}] is not one recap reads: ignored{hint}"
    if key in SHADOWED_BY:
        return f"key '{key}' is read only without " + " and ".join(f"'{k}'" for k in SHADOWED_BY[key]) + ": ignored"
    near = difflib.get_close_matches(key.lower(), KEYS, n=1, cutoff=0.7)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return f"key '{key}' is not one recap reads: ignored{hint}"


class TransientError(ValueError):
    """A request's failure said as plainly as a bad input's (its message is the record's error) whose cause lies
    outside the request, so that a rerun may succeed: ``--resume`` answers its line again."""


# The system's errors of a file that may read on a second try (a network file system that timed out or lost its
# server, a machine short of memory or file handles), unlike a missing or damaged file. Names some systems lack
# are left out.
TRANSIENT_ERRNOS = frozenset(getattr(errno, name) for name in (
    "EAGAIN", "EBUSY", "EINTR", "EIO", "EMFILE", "ENFILE", "ENOMEM", "ENOBUFS", "ESTALE", "ETIMEDOUT",
    "ECONNABORTED", "ECONNREFUSED", "ECONNRESET", "EHOSTDOWN", "EHOSTUNREACH", "ENETDOWN", "ENETUNREACH",
    "ENOLINK", "EREMOTEIO") if hasattr(errno, name))


def load_image(path: Path, max_pixels: int = MAX_IMAGE_PIXELS, root: Path | None = None) -> Image.Image:
    """An RGB image the way it is meant to be seen (EXIF orientation applied: phone photos are stored sideways),
    or a ValueError that says what is wrong with the file; ``root`` is where a relative path was resolved."""
    if path.is_dir():
        raise ValueError(f"image {path} is a folder, not an image file")
    if not path.is_file():
        where = f" (a relative path, resolved against {root}; `--root` sets that folder)" if root else ""
        raise ValueError(f"image not found: {path}{where}")
    try:
        with Image.open(path) as img:
            w, h = img.size  # read from the header: a huge image is refused before it is decoded
            if w * h > max_pixels:
                raise ValueError(f"image too large: {w}x{h} pixels (limit {max_pixels})")
            return _eight_bit(_upright(img)).convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise ValueError(f"cannot read image {path}: {exc}") from exc
    except OSError as exc:  # PIL's own (a truncated file) carry no errno: the file is what it is
        kind = TransientError if exc.errno in TRANSIENT_ERRNOS else ValueError
        raise kind(f"cannot read image {path}: {exc}") from exc


def _upright(img: Image.Image) -> Image.Image:
    """The image turned as its EXIF orientation says; a damaged EXIF block leaves it as stored."""
    try:
        return ImageOps.exif_transpose(img)
    except (SyntaxError, ValueError, TypeError, KeyError, IndexError, struct.error):
        return img


def _eight_bit(img: Image.Image) -> Image.Image:
    """A 16-bit grayscale image scaled to 8 bits: PNG and TIFF open in PIL's I;16 modes, a 16-bit PGM as mode I
    (taken as 16-bit when a value is over 255). PIL converts them to RGB by clipping every value over 255, so a
    scan or a medical image would reach the model as a white page."""
    if not (img.mode.startswith("I;16") or img.mode == "I" and img.getextrema()[1] > 255):
        return img
    return img.convert("I").point(lambda v: v / 256).convert("L")


def user_message(text: str, with_image: bool) -> Message:
    if not with_image:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def as_parts(message: Message) -> Message:
    """Chat templates of vision models take list-of-parts content."""
    if isinstance(message["content"], str):
        return {"role": message["role"], "content": [{"type": "text", "text": message["content"]}]}
    return message


def first_line(exc: BaseException) -> str:
    """An exception as one line for a record or a message: its first line, else its type."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def dumps(record: dict) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS) + b"\n"


def cap_new_tokens(req: Request, ceiling: int, allow_longer: bool) -> bool:
    """Hold a record's own ``max_new_tokens`` to the run's ceiling unless the user allowed longer; True when it
    was cut. (The model's context length caps every request anyway, in the session.)"""
    if allow_longer or req.max_new_tokens is None or req.max_new_tokens <= ceiling:
        return False
    req.max_new_tokens = ceiling
    return True


Key = tuple[int, bytes]  # a line's number and its id as JSON: what --resume matches records on


def answer_key(req: Request) -> Key:
    """What --resume matches on: the input line and its id. The line alone is unique by construction; the id
    guards against an input file edited between runs; ids alone repeat, and a line without one takes its
    number, which another line may use as an explicit id."""
    return req.line, orjson.dumps(req.id)


# What a line's records in an output file come to, strongest first: an answer is never redone, an error a rerun
# would repeat is not tried again, and only a line with nothing but errors a rerun may fix is.
ANSWERED, FAILED, RETRY = 0, 1, 2


def verdict(record: dict) -> int:
    """What one output record says of its line. An error record counts as one a rerun may fix only where it says
    so (``"retry": true``): older recaps wrote no ``retry``, and their errors stay skipped as they always were."""
    if record.get("error") is None:
        return ANSWERED
    return RETRY if record.get("retry") is True else FAILED


@dataclass
class Earlier:
    """What an output file already holds for --resume, by line key (``answer_key``)."""

    done: set[Key] = field(default_factory=set)  # lines not to answer again: an answer, or an error for good
    failed: set[Key] = field(default_factory=set)  # of those, the lines with error records only
    retry: set[Key] = field(default_factory=set)  # lines with only errors a rerun may fix: answered again
    unnumbered: int = 0  # records without a line number (from an older recap): their lines are answered again

    def skips(self, key: Key) -> int | None:
        """Why --resume skips the line ``key``: ANSWERED (an answer, never redone) or FAILED (only errors a rerun
        would repeat, which the run's end names); None where the line is answered (again)."""
        if key not in self.done:
            return None
        return FAILED if key in self.failed else ANSWERED

    def retry_every_error(self) -> None:
        """Lines with errors for good are answered again too (``--retry-errors``): a rerun would repeat them only
        until someone fixes the image or the record, which recap cannot see."""
        self.done -= self.failed
        self.retry |= self.failed
        self.failed = set()


def answered(output: Path) -> Earlier:
    """What the records already in an output file say of each line (for --resume), after cutting a torn last
    line left by a crash. Records are only ever appended, so a line answered again after an error a rerun may fix
    has both records: the line counts as answered if any of its records is an answer (``verdict``).

    The file is read line by line (never whole: outputs grow to hundreds of megabytes) and a torn tail is cut by
    truncating in place: every whole record stays where it is whatever stops the cut (rewriting the file would
    empty it first, and a kill then would leave nothing)."""
    earlier = Earlier()
    if not output.is_file():
        return earlier
    verdicts: dict[Key, int] = {}
    whole, torn = 0, False
    with open(output, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):  # only the last line can lack its newline
                torn = True
                break
            whole += len(raw)
            try:
                rec = orjson.loads(raw)
                line = rec.get("line")
                if isinstance(line, int) and "id" in rec:
                    key = (line, orjson.dumps(rec["id"]))
                    verdicts[key] = min(verdicts.get(key, RETRY), verdict(rec))
                else:
                    earlier.unnumbered += 1
            except (orjson.JSONDecodeError, AttributeError):
                continue
    if torn:
        os.truncate(output, whole)
    for key, said in verdicts.items():
        (earlier.retry if said == RETRY else earlier.done).add(key)
        if said == FAILED:
            earlier.failed.add(key)
    return earlier
