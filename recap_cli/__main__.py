"""The `recap` command (and `python -m recap_cli`): the command line behind one guard.

Importing the command line and what it needs takes a moment on a cold start; a Ctrl-C then must end the program
with one line and exit code 130, like a Ctrl-C anywhere else, not with a traceback through the import machinery.
This module imports nothing but ``signal`` and ``sys`` before the guard is up.
"""

import signal
import sys


def main() -> None:
    try:
        from .cli import app

        app()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        _second_ctrl_c_ends_at_once()


def _second_ctrl_c_ends_at_once() -> None:
    """While the interpreter shuts down (torch's exit hooks take a moment after an early Ctrl-C), a second Ctrl-C
    ends the process as the signal does by default, silently, where a KeyboardInterrupt raised in an exit hook
    printed a traceback under the one line. Not ignored: an exit that hangs must still yield to Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


if __name__ == "__main__":
    main()
