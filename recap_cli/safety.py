"""What keeps a run from losing data: path checks made before the model loads, and stops (SIGTERM, a closed
stdout) that end a run the way Ctrl-C does, with the memory saved and the summary printed."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be, so both take the same way out."""


def same_file(a: Path, b: Path) -> bool:
    """True when writing ``b`` would overwrite ``a``: the same inode (symlinks and hard links included), or the
    same resolved path when one of them does not exist yet."""
    try:
        sa, sb = a.stat(), b.stat()
    except OSError:
        return a.resolve() == b.resolve()
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def clashes(inputs: list[Path], targets: dict[str, Path | None]) -> str | None:
    """The sentence saying which file would overwrite an input or another output, or None (``-`` among the
    inputs is stdin)."""
    named = [(flag, path) for flag, path in targets.items() if path is not None]
    files = [source for source in inputs if str(source) != "-"]
    for i, (flag, path) in enumerate(named):
        if any(same_file(source, path) for source in files):
            return f"{flag} {path} is the input file: writing it would destroy the requests; pick another path"
        for other_flag, other in named[i + 1:]:
            if same_file(path, other):
                return f"{flag} and {other_flag} name the same file ({path}); pick two paths"
    return None


def unwritable(path: Path, flag: str, atomic: bool = False) -> str | None:
    """The sentence saying why ``path`` cannot be written, or None. Checked before the model loads, so a typo
    in a path costs neither a model load nor a whole run's answers. An ``atomic`` write (temp file + rename)
    needs a writable folder even when the file exists. ``-`` names stdout only for the records (``-o -``): any
    other file there would be mixed into them, and a file named "-" is never what was meant."""
    if str(path) == "-":
        return f"{flag} -: stdout carries the records; name a file"
    if path.is_dir():
        return f"{flag} {path} is a folder, not a file"
    folder = (path.resolve() if atomic else path).parent  # a symlink's target is what an atomic write replaces
    if not folder.is_dir():
        return f"{flag} {path}: the folder {folder} does not exist"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{flag} {path} is read-only"
    if (atomic or not path.exists()) and not os.access(folder, os.W_OK | os.X_OK):
        return f"{flag} {path}: the folder {folder} is read-only"
    return None


def unmakeable_folder(path: Path, flag: str, holds: str) -> str | None:
    """The sentence saying why the folder ``path`` (for the files ``holds`` names) cannot be made or written in,
    or None: what a report is written to at the end of a comparison, checked before it starts."""
    if str(path) == "-" or path.exists() and not path.is_dir():
        return f"{flag} {path}: name a folder (for {holds})"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{flag} {path}: {existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{flag} {path}: the folder {existing} is read-only"
    return None


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises ``Terminated`` (a KeyboardInterrupt) and SIGINT a KeyboardInterrupt, except
    within ``whole_lines``, which they wait for; the previous handlers come back after (``stops_held``'s, around
    a run, so a signal during the final memory save waits for it)."""
    try:
        previous = {sig: signal.signal(sig, handler) for sig, handler in
                    ((signal.SIGTERM, _stop_as(Terminated)), (signal.SIGINT, _stop_as(KeyboardInterrupt)))}
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def stops_held() -> Iterator[list[int]]:
    """SIGINT and SIGTERM that arrive inside are noted, not acted on: the list yielded gets their numbers, for the
    caller to exit with after what must finish (the memory save, the summary) has. A ``terminate_as_interrupt``
    inside takes over until it ends, then these handlers are back: no moment in between is unguarded."""
    held: list[int] = []
    try:
        previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
                    for sig in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread: signals cannot be handled here
        yield held
        return
    try:
        yield held
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_writing: list[bool] = [False]
_pending: list[KeyboardInterrupt] = []


def _stop_as(kind: type[KeyboardInterrupt]):
    def handler(signum, frame) -> None:
        if _writing[0]:
            _pending.append(kind())
            return
        raise kind
    return handler


@contextmanager
def whole_lines() -> Iterator[None]:
    """A stop signal that arrives inside waits until the block is done: a record is written (and counted) whole.
    Raised inside a buffered write, it could leave half a line on stdout and the rest after it."""
    _writing[0] = True
    try:
        yield
    finally:
        _writing[0] = False
        if _pending:
            stop = _pending[0]
            _pending.clear()
            raise stop


def silence_stdout() -> None:
    """After the reader of stdout went away, point stdout at /dev/null so the interpreter's final flush does not
    print "Exception ignored ... BrokenPipeError" (what the Python docs advise for SIGPIPE)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (e.g. a test runner's buffer)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
