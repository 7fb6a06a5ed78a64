"""How a problem reaches the person at the command line.

`UserError` marks the errors a user causes and can fix (a setting, a file, a
run name, a model folder, a device too small); the modules raising them
subclass it next to their usual base (`ConfigError(UserError, ValueError)`).
`run_command` runs a CLI's body and turns such an error, an OS error (a file
that cannot be read or written) or a `SystemExit("message")` into one line on
stderr and exit code 2. Anything else is a bug: one line naming it and exit
code 1. `--debug` (or RCGRPO_DEBUG=1) lets every exception through with its
traceback.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence

__all__ = ["UserError", "DEBUG_FLAG", "DEBUG_ENV", "one_line", "run_command"]

DEBUG_FLAG = "--debug"
DEBUG_ENV = "RCGRPO_DEBUG"
USAGE_ERROR = 2  # what argparse uses: the input was wrong
INTERNAL_ERROR = 1


class UserError(Exception):
    """A problem with what the user gave (settings, files, names, hardware)."""


def one_line(exc: BaseException | str) -> str:
    """The message on one line: several problems joined by '; '."""
    problems = getattr(exc, "problems", None)
    if problems and len(problems) > 1:  # "what: N problems:\n  - a\n  - b" -> "what: a; b"
        head = str(exc).split(":", 1)[0]
        return f"{head}: " + "; ".join(" ".join(str(p).split()) for p in problems)
    return " ".join(str(exc).split())


def debug_requested(argv: Sequence[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def run_command(prog: str, body: Callable[[list[str]], int], argv: Optional[Sequence[str]] = None) -> int:
    """`body(argv without --debug)`, with its errors as one line (see module doc)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != DEBUG_FLAG]
    try:
        return body(argv)
    except SystemExit as exc:
        if debug or exc.code is None or isinstance(exc.code, int):
            raise  # --help (0), argparse's own usage errors (2, already printed)
        print(f"{prog}: error: {one_line(str(exc.code))}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            raise
        if isinstance(exc, (UserError, OSError)):
            print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
            return USAGE_ERROR
        print(f"{prog}: internal error: {type(exc).__name__}: {one_line(exc)} "
              f"(rerun with {DEBUG_FLAG} or {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
        return INTERNAL_ERROR
