"""The `recap` command (and `python -m recap_cli`): the command line behind one guard.

Importing the command line and what it needs takes a moment on a cold start; a Ctrl-C then must end the program
with one line and exit code 130, like a Ctrl-C anywhere else, not with a traceback through the import machinery.
This module imports nothing but ``sys`` before the guard is up.
"""

import sys


def main() -> None:
    try:
        from .cli import app

        app()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
