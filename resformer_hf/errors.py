"""The one exception type for problems a user can fix, shared by the converter, the quickstart and the analysis."""

from __future__ import annotations


class UserInputError(ValueError):
    """A problem with what the user passed (paths, files, options, checkpoints); the message is one line that says
    what to do. The commands print it as `<prog>: error: <message>` and exit with status 2."""


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message (its type's name if it has none), for quoting a library's error inside a
    one-line `UserInputError`."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


__all__ = ["UserInputError", "first_line"]
