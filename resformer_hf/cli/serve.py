"""`resformer-serve FOLDER [options of transformers serve]`: Hugging Face's OpenAI-compatible server
(`transformers serve`) for a ResFormer folder or Hub id, loaded with the plugin's classes.

Every option is `transformers serve`'s own (parsed by its own command-line definition, so the options are exactly
those of the installed release); FOLDER is the model it preloads and serves. See `resformer_hf.serving.server` for the
things added: the plugin's classes made loadable by the server, request checks (400s), `n` and token-id prompts, and
an exit with status 1 when the continuous-batching worker dies.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ..errors import UserInputError
from .common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, OneLineParser, add_debug_flag, one_line, run_command

PROG = "resformer-serve"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Serve a ResFormer folder (or Hub id) with Hugging Face's OpenAI-compatible server "
        "(`transformers serve`), using the plugin's classes.",
        epilog="Every option of `transformers serve` is accepted after FOLDER (e.g. --port, --host, --device, "
        "--continuous-batching, --cb-num-blocks); `resformer-serve FOLDER --help` lists them.",
    )
    parser.add_argument("folder", metavar="FOLDER", help="model folder or Hub id (owner/name) to serve")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options of `transformers serve`")
    add_debug_flag(parser)
    return parser


def check_model_source(source: str) -> str:
    """`source` if it names a model folder (one with config.json) or looks like a Hub id; a `UserInputError` that
    says what to give otherwise."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserInputError(f"{source} is a file: give a model folder (with config.json) or a Hub id")
        if not (path / "config.json").is_file():
            raise UserInputError(f"{source} has no config.json: give a folder written by save_pretrained, "
                                 "resformer-convert or resformer-quickstart, or a Hub id")
        return str(path)
    looks_local = source.startswith((".", "/", "~")) or source.endswith("/") or source.count("/") > 1 or os.sep != "/"
    if looks_local or source.count("/") != 1:
        raise UserInputError(f"no folder {source}: give an existing model folder or a Hub id (owner/name)")
    return source


def _serve_command():
    """transformers' own `serve` command (a click command built by typer from `transformers.cli.serve.Serve`)."""
    import typer
    from transformers.cli.serve import Serve

    app = typer.Typer(add_completion=False)
    app.command(name="serve")(Serve)
    return typer.main.get_command(app)


def _serve(args: argparse.Namespace) -> int:
    options = list(args.options)
    if "--debug" in options:  # after FOLDER, argparse hands it over with the server's options
        options.remove("--debug")
        args.debug = True
    source = check_model_source(args.folder)

    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise UserInputError("serving needs FastAPI, uvicorn, pydantic and openai: pip install -e '.[serve]' "
                             "(or pip install 'transformers[serving]')")

    import resformer_hf  # noqa: F401 - registers the Auto classes

    from ..serving.server import checked_requests, expose_plugin_classes

    expose_plugin_classes()
    command = _serve_command()
    try:
        context = command.make_context(PROG, [source, *options])
    except Exception as error:  # click's exceptions, or typer's vendored copy of click (typer >= 0.24)
        if type(error).__name__ == "Exit":  # --help was printed
            return getattr(error, "exit_code", EXIT_OK)
        if hasattr(error, "format_message"):  # a usage error: unknown option, bad value
            raise UserInputError(f"{one_line(error.format_message())} (see {PROG} FOLDER --help)") from None
        raise
    with context, checked_requests(source, batching=bool(context.params.get("continuous_batching"))) as state:
        args.server_state = state  # what `_stopped_note` reports on Ctrl-C or SIGTERM
        command.invoke(context)
    if state.worker_died is not None:
        print(f"{PROG}: error: the continuous-batching worker died (its error is in the log above) and the server "
              "stopped instead of answering 503 to every request; start it again", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(PROG, build_parser(), _serve, argv, interrupted_note=_stopped_note)


def _stopped_note(args: argparse.Namespace) -> str:
    """What the server had done when Ctrl-C or SIGTERM stopped it (the server finishes shutting down first)."""
    state = getattr(args, "server_state", None)
    if state is None:
        return "nothing was done"
    if state.server is None or not getattr(state.server, "started", False):
        return f"stopped while loading {args.folder}; no request was answered"
    count = f"{state.answered} generation request{'' if state.answered == 1 else 's'}"
    return f"the server stopped after answering {count}"


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["EXIT_USAGE", "check_model_source", "main"]
