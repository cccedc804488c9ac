"""Old import path of the `resformer-convert` command; it lives in `resformer_hf.cli.convert`."""

from .cli.convert import PROG, build_parser, main

__all__ = ["PROG", "build_parser", "main"]
