"""Regression gate (issue 32): an eager decode step of every variant executes no more instructions, relative to
Llama's, than when last measured, and never more than its goal allows once the goal is reached.

Instructions, counted by valgrind's callgrind (`benchmarks/instructions.py`), are deterministic where timings are not:
one extra aten op per layer (~29 k instructions of dispatch at this size, +1.6 % of a step) moves the ratio by more
than the margin, whatever else runs on the machine. One valgrind process counts Llama and every variant.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from resformer_hf.configuration_resformer import VARIANTS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from cost_settings import goal  # noqa: E402
from instructions import Job, callgrind_missing, count_instructions  # noqa: E402

#: The issue's size: a decode step is ~14.4 M instructions, deep enough that per-layer ops outweigh per-forward ones.
HIDDEN, LAYERS = 256, 8
#: Ratios to Llama measured at this setting (256×8, batch 1, 64 cached tokens) on the committed code (2026-11-25, after
#: the DenseFormer/CLA options joined the attention forward), where they are above the goal (issue 32 is not closed):
#: the gate holds them there until the goal is reached. `none` (1.0059) and SVFormer (0.9513) meet their goals.
MEASURED_ABOVE_GOAL = {"identity": 1.0246, "constant": 1.0240, "sparse": 1.0159, "learnable": 1.0322,
                       "learnable_plus": 1.0335, "neutreno": 1.0331, "dense": 1.0388, "denseformer": 1.1088}
#: Room for what moves between machines and library builds (hash seed fixed); an op per layer is ~0.016.
MARGIN = 0.004


def limit(name: str) -> float:
    return max(goal("decode", name, HIDDEN), MEASURED_ABOVE_GOAL.get(name, 0.0) + MARGIN)


@pytest.mark.slow
@pytest.mark.skipif(callgrind_missing() is not None, reason=f"needs valgrind: {callgrind_missing()}")
def test_a_decode_step_stays_within_its_instruction_limit():
    names = ["llama", *VARIANTS]
    jobs = {name: Job(name, HIDDEN, LAYERS, batch=1, kind="decode", context=64, number=4) for name in names}
    counts = count_instructions(list(jobs.values()), timeout=3600)
    ratios = {name: counts[job] / counts[jobs["llama"]] for name, job in jobs.items()}
    over = {name: round(ratio, 4) for name, ratio in ratios.items() if name != "llama" and ratio > limit(name)}
    assert not over, f"decode instructions above the limit relative to Llama's: {over} (all: {ratios})"
