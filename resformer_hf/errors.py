"""The one exception type for problems a user can fix, shared by the converter, the quickstart and the analysis."""

from __future__ import annotations


class UserInputError(ValueError):
    """A problem with what the user passed (paths, files, options, checkpoints); the message is one line that says
    what to do. The commands print it as `<prog>: error: <message>` and exit with status 2."""


__all__ = ["UserInputError"]
