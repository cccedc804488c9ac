"""The one error contract of the three commands.

| outcome | exit status | output on stderr |
| --- | --- | --- |
| success | 0 | (progress and results on stdout) |
| bad input: flags, paths, files, checkpoints (`UserInputError`), argparse usage | 2 | `<prog>: error: <what to do>` |
| the environment refused (disk full, permissions: `OSError`) or an unexpected error | 1 | `<prog>: error: ...` |
| Ctrl-C (SIGINT), at any time | 130 | `<prog>: interrupted ...` |
| SIGTERM, at any time | 143 | `<prog>: terminated ...` |

Always one line, never a traceback (`--debug` shows it for status 1). Interrupts become exceptions, so the library's
clean-up (removing a half-written output) runs before the command exits.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..errors import UserInputError
from .startup import end_start_up_guard

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that clean-up runs as for Ctrl-C."""


class OneLineParser(argparse.ArgumentParser):
    """argparse with usage errors on one line (`<prog>: error: <message> (see --help)`) and exit status 2."""

    def error(self, message: str) -> None:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def one_line(text: object) -> str:
    """`text` with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(str(text).split())


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an unexpected error")


_Number = TypeVar("_Number", int, float)


def _parsed(text: str, convert: Callable[[str], _Number], what: str) -> _Number:
    """`convert(text)`, or the argparse error that says `text` is not `what`, worded alike for every number flag."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    value = _parsed(text, int, "an integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def positive_float(text: str) -> float:
    value = _parsed(text, float, "a number")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a positive number")
    return value


def seed(text: str) -> int:
    """A random seed: an integer in 0 .. 2**32 - 1, the range every RNG the Trainer seeds accepts."""
    value = _parsed(text, int, "an integer")
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{value} must be between 0 and {2**32 - 1}")
    return value


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def run_command(
    prog: str,
    parser: argparse.ArgumentParser,
    command: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
    *,
    interrupted_note: Callable[[argparse.Namespace], str] | None = None,
) -> int:
    """Parse `argv` and run `command(args)` under the contract above; returns the exit status."""
    handle_term = threading.current_thread() is threading.main_thread()
    if handle_term:
        end_start_up_guard(on_terminate=_raise_terminated)
        # SIGTERM becomes an exception unless someone chose otherwise (ignored, or their own handler).
        handle_term = signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, _raise_terminated)
    if handle_term:
        signal.signal(signal.SIGTERM, _raise_terminated)
    args = None
    try:
        args = parser.parse_args(argv)
        return command(args)
    except UserInputError as error:
        _say(prog, f"error: {error}")
        return EXIT_USAGE
    except KeyboardInterrupt as interrupt:
        what = "terminated" if isinstance(interrupt, Terminated) else "interrupted"
        note = interrupted_note(args) if interrupted_note is not None and args is not None else "nothing was done"
        _say(prog, f"{what}; {note}")
        return EXIT_TERMINATED if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED
    except OSError as error:  # disk full, permissions, ...: the environment, not the input
        if getattr(args, "debug", False):
            raise
        where = f" ({error.filename})" if error.filename else ""
        _say(prog, f"error: {error.strerror or error}{where}")
        return EXIT_FAILURE
    except Exception as error:
        if getattr(args, "debug", False):
            raise
        _say(prog, f"error: unexpected {type(error).__name__}: {error} (rerun with --debug for the traceback)")
        return EXIT_FAILURE
    finally:
        if handle_term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _say(prog: str, message: str) -> None:
    print(f"{prog}: {one_line(message)}", file=sys.stderr, flush=True)


__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "OneLineParser",
    "Terminated",
    "add_debug_flag",
    "one_line",
    "positive_float",
    "positive_int",
    "run_command",
    "seed",
]
