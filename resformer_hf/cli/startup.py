"""Ctrl-C while a command is still importing torch and transformers: one line and exit 130, not a traceback.

`resformer_hf/__init__.py` imports this module before anything heavy (stdlib only), and importing it installs the
guard (`guard_start_up`). It acts only when this process
runs one of the package's commands; their `main` then installs the normal handling (`common.run_command`), which
lets an interrupt clean up before exiting. Nothing has been written before that point, so exiting at once is safe.
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


def guard_start_up() -> None:
    """While a command starts, make SIGINT print one line and exit 130, and keep import-time warnings quiet."""
    prog = running_command()
    if prog is None or threading.current_thread() is not threading.main_thread():
        return
    for name in IMPORT_NOISE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # Ctrl-C is ignored (a background job, nohup) or handled by someone else: leave it so

    def interrupted(signum, frame) -> None:
        sys.stderr.write(f"{prog}: interrupted while starting; nothing was done\n")
        sys.stderr.flush()
        os._exit(130)

    interrupted.start_up_guard = True
    signal.signal(signal.SIGINT, interrupted)


def end_start_up_guard() -> None:
    """From here on Ctrl-C raises `KeyboardInterrupt` again, so clean-up code runs (only if the guard was set)."""
    if getattr(signal.getsignal(signal.SIGINT), "start_up_guard", False):
        signal.signal(signal.SIGINT, signal.default_int_handler)


guard_start_up()
