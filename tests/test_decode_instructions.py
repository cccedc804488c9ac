"""Regression gate (issue 32): an eager decode step of every variant executes at most its goal of Llama's instructions.

Instructions, counted by valgrind's callgrind (`benchmarks/instructions.py`), are deterministic where timings are not:
one extra aten op per layer (~29 k instructions of dispatch at these sizes) moves the ratio by more than the
tolerance of any goal, whatever else runs on the machine. One valgrind process counts Llama and every variant.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from resformer_hf.configuration_resformer import VARIANTS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from cost_settings import goal  # noqa: E402
from instructions import Job, callgrind_missing, count_instructions  # noqa: E402

#: Small enough for CI (a decode step is ~15 M instructions), deep enough that per-layer ops outweigh per-forward ones.
HIDDEN, LAYERS = 256, 8


@pytest.mark.slow
@pytest.mark.skipif(callgrind_missing() is not None, reason=f"needs valgrind: {callgrind_missing()}")
def test_a_decode_step_stays_within_its_instruction_goal():
    names = ["llama", *VARIANTS]
    jobs = {name: Job(name, HIDDEN, LAYERS, batch=1, kind="decode", context=32, number=2) for name in names}
    counts = count_instructions(list(jobs.values()), timeout=1800)
    ratios = {name: counts[job] / counts[jobs["llama"]] for name, job in jobs.items()}
    over = {name: round(ratio, 4) for name, ratio in ratios.items() if ratio > goal("decode", name, HIDDEN)}
    assert not over, f"decode instructions above the goal of Llama's: {over} (all: {ratios})"
