"""Ctrl-C or SIGTERM while a command is still importing torch and transformers (the converter's ~20 s start-up): one
line and exit 130 or 143, not a traceback and not a silent exit.

`resformer_hf/__init__.py` imports this module before anything heavy (stdlib only), and importing it installs the
guard (`guard_start_up`). It acts only when this process runs one of the package's commands; their `main` then
installs the normal handling (`common.run_command`), which lets an interrupt clean up before exiting. Nothing has been
written before that point, so exiting at once is safe.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

#: Program names (console scripts, the conversion/ wrapper script, `python -m` modules) -> the name in messages.
COMMANDS = {
    "resformer-convert": "resformer-convert",
    "convert_llama_to_resformer": "resformer-convert",
    "resformer_hf.cli.convert": "resformer-convert",
    "resformer-quickstart": "resformer-quickstart",
    "resformer_hf.cli.quickstart": "resformer-quickstart",
    "resformer-analyze": "resformer-analyze",
    "resformer_hf.cli.analyze": "resformer-analyze",
    "resformer-serve": "resformer-serve",
    "resformer_hf.cli.serve": "resformer-serve",
}


def running_command() -> str | None:
    """The command this process runs, or None when the package is imported by other code."""
    program = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
    if program in COMMANDS:
        return COMMANDS[program]
    original = list(getattr(sys, "orig_argv", []))
    if "-m" in original[:-1]:
        return COMMANDS.get(original[original.index("-m") + 1])
    return None


#: Loggers that warn while transformers imports optional backends (torchao 0.18's prebuilt kernels on torch 2.13,
#: torch's pytree deprecations raised from torchao): noise a command's one-line contract must not print.
IMPORT_NOISE_LOGGERS = ("torchao", "torch.utils._pytree")


#: Each guarded signal: the handler it must have for the guard to take it (else it is ignored, as in a background job,
#: or someone else's), the word in the message, the exit status.
GUARDED = {signal.SIGINT: (signal.default_int_handler, "interrupted", 130),
           signal.SIGTERM: (signal.SIG_DFL, "terminated", 143)}


def guard_start_up() -> None:
    """While a command starts, make SIGINT and SIGTERM print one line and exit 130 / 143, and keep import-time
    warnings quiet."""
    prog = running_command()
    if prog is None or threading.current_thread() is not threading.main_thread():
        return
    for name in IMPORT_NOISE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)

    def stopped(signum, frame) -> None:
        _, word, status = GUARDED[signum]
        sys.stderr.write(f"{prog}: {word} while starting; nothing was done\n")
        sys.stderr.flush()
        os._exit(status)

    stopped.start_up_guard = True
    for signum, (expected, _, _) in GUARDED.items():
        if signal.getsignal(signum) is expected:
            signal.signal(signum, stopped)


def end_start_up_guard(on_terminate=signal.SIG_DFL) -> None:
    """From here on Ctrl-C raises `KeyboardInterrupt` again and SIGTERM goes to `on_terminate`, so clean-up code runs
    (each only if the guard holds it; swapped in one call, so no SIGTERM finds the default in between)."""
    for signum, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, on_terminate)):
        if getattr(signal.getsignal(signum), "start_up_guard", False):
            signal.signal(signum, handler)


guard_start_up()
