"""Regression gate (issues 32, 55): an eager decode step of every variant executes no more instructions, relative to
Llama's, than its goal allows (`benchmarks/cost/settings.py: goal`).

Instructions, counted by valgrind's callgrind (`benchmarks/cost/instructions.py`), move by tenths of a percent between
runs where timings move by several percent: one extra aten op per layer (~29 k instructions of dispatch at this size,
+1.6 % of a step) moves the ratio by more than the margin, whatever else runs on the machine. Why the goals are not a
user's cost: at hidden 256 × 8 layers a CPU decode step is ~95 % dispatch overhead, so each op shows; the learnable λ
are read as tensors every step (one decode path on every device, no cache of λ that a write through `.data` leaves
stale), and CUDA, compiled and sharded models run the same ops, where the decode kernel budget
(`test_kernel_budgets.py`) holds their count. At the widths people decode on a CPU a step is bound by reading the
weights. One valgrind process counts Llama and every variant in ~2 CPU-minutes: 13 s for a native process to build and
prefill the models, then under valgrind a minute importing transformers (which imports torch._dynamo, and hqq and
torchao where installed) and 45 s loading, warming up and counting.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from resformer_hf.remote_code._compat import with_cache
from resformer_hf.remote_code.variants import VARIANTS

from benchmarks.cost.instructions import Job, callgrind_missing, count_instructions
from benchmarks.cost.settings import goal

#: The issue's size: a decode step is ~14.4 M instructions, deep enough that per-layer ops outweigh per-forward ones.
HIDDEN, LAYERS = 256, 8
#: Cached tokens before the counted steps, as in cost.md. The models and their filled caches come from a native
#: process (`instructions.py`): built and prefilled under valgrind, where MKL's FMA GEMMs are emulated ~50x slower,
#: they took most of the gate's minutes.
CONTEXT = 64
#: Ratios to Llama measured at this setting above or at the edge of their decode goal, held so that they cannot grow:
#: with one path a formula, decoding runs the fused functions' forward, whose layouts serve training, where decode-only
#: twins per variant ran before at 1.014-1.023 (`dense`), 1.046-1.050 (gated) and 1.016-1.023 (DenseFormer).
#: Counted 2026-11-29, after value embeddings' call joined every layer (issue 56): identity 1.0206, SVFormer 0.940,
#: learnable_plus 1.0328, learnable 1.0278, NeuTRENO 1.0632, `dense` 1.1143, gated 1.1170, DenseFormer 1.1386.
#: Counted 2026-12-01, after issue 66 (the value code takes v_proj's output through the attention's `values`, the gate
#: reads 12 channels: gated −0.034) and issue 67 (the attention reads its base's facts, its q/k norm branch and RoPE
#: function chosen once in `__init__`): `none` 1.0181, ~100 Python calls a step over Llama's.
#: Counted 2026-12-02 (below): what a layer reads of its role and the model of its layer types is read once in
#: `__init__` (the fixed λ per layer, the mask kinds, whether a layer calls `values`, has a table, hands K/V on):
#: no aten op and 9 Python calls more than Llama for `none` (1.0059, within its goal again), every variant −0.010 to
#: −0.013.
MEASURED_ABOVE_GOAL = {"learnable_plus": 1.0416, "learnable": 1.0341, "neutreno": 1.0681, "dense": 1.1195,
                       "gated": 1.0741, "denseformer": 1.1428}
#: Room for what moves between environments: the same count in the same environment agrees to the instruction (again
#: a day later), but the gate inside a CI rehearsal's suite counted every ratio 0.001-0.005 higher than a count run
#: alone (gated 1.1213, DenseFormer 1.1423, NeuTRENO 1.0654). What moves it is the counting process's state, not the
#: machine's load: the same models counted beside other ones read up to 0.004 apart (learnable_plus 1.0368 beside
#: three models, 1.0328 beside all twelve; gated 1.1176-1.1185 beside three), a clone at a longer path moved them by
#: up to 0.001, the suite's environment variables by 0.0008. An op per layer is ~0.016.
MARGIN = 0.008


def limit(name: str) -> float:
    return max(goal("decode", name, HIDDEN), MEASURED_ABOVE_GOAL.get(name, 0.0) + MARGIN)


@pytest.mark.slow
@pytest.mark.skipif(callgrind_missing() is not None, reason=f"needs valgrind: {callgrind_missing()}")
def test_a_decode_step_stays_within_its_instruction_limit():
    names = ["llama", *VARIANTS]
    jobs = {name: Job(name, HIDDEN, LAYERS, batch=1, kind="decode", context=CONTEXT, number=2) for name in names}
    counts = count_instructions(list(jobs.values()), timeout=3600)
    ratios = {name: counts[job] / counts[jobs["llama"]] for name, job in jobs.items()}
    over = {name: round(ratio, 4) for name, ratio in ratios.items() if name != "llama" and ratio > limit(name)}
    assert not over, f"decode instructions above the limit relative to Llama's: {over} (all: {ratios})"


def test_the_report_compares_repeated_counts_of_the_first_group_only():
    """Runs after the first hold the first size and batch only (a valgrind process costs minutes): the agreement is
    taken over what was counted twice, and every group's table still comes from the first run."""
    from benchmarks.cost.instruction_report import agreement, instruction_section

    key = ("llama", 256, 8, 1, "decode")
    first = {key: 1_000_000.0, ("identity", 256, 8, 1, "decode"): 1_040_000.0,
             ("llama", 512, 12, 1, "decode"): 3_000_000.0, ("identity", 512, 12, 1, "decode"): 2_970_000.0}
    result = {"counts": [first, {key: 1_000_050.0}], "sizes": [(256, 8), (512, 12)], "batches": [1],
              "names": ["identity"], "kinds": ["decode"], "number": 4}
    assert agreement(result) == pytest.approx(5e-5)
    section = instruction_section(result)
    assert "agree to 5.0e-05 relative" in section and "counted 2 times" in section
    assert "decode 1.0000 / 1.0001 M" in section and "decode 3.0000 M" in section  # Llama per run where counted
    assert "| `identity` | **1.0400** |" in section and "| `identity` | 0.9900 |" in section  # bold above 1.03


def test_later_counts_join_the_store_and_cells_not_counted_show_a_dash(tmp_path, monkeypatch):
    """A command counting one more kind at one size adds to what the store holds (commands may run side by side); the
    report marks what no command counted, and a store of other settings is replaced, not mixed in."""
    from benchmarks.cost import instruction_report

    fake = {"llama": 100.0, "identity": 99.0}
    monkeypatch.setattr(instruction_report, "count_instructions",
                        lambda jobs: {job: fake[job.name] * job.layers * (2 if job.kind == "prefill" else 1)
                                      for job in jobs})
    store = tmp_path / "instructions.json"
    first = instruction_report.measure_instructions([(256, 8), (512, 12)], [1], ["identity"], ["decode"], runs=1)
    instruction_report.save_counts({**first, "commands": ["first"]}, store)
    second = instruction_report.measure_instructions([(256, 8)], [1], ["identity"], ["prefill"], runs=1)
    both = instruction_report.save_counts({**second, "commands": ["second"]}, store)
    assert both == instruction_report.load_counts(store)
    assert both["kinds"] == ["decode", "prefill"] and both["sizes"] == [(256, 8), (512, 12)]
    assert both["commands"] == ["first", "second"]
    assert both["counts"][0][("identity", 512, 12, 1, "decode")] == 99.0 * 12
    section = instruction_report.instruction_section(both)
    assert "| `identity` | 0.9900 | 0.9900 |" in section and "| `identity` | 0.9900 | – |" in section
    batch_8 = instruction_report.measure_instructions([(256, 8)], [8], ["identity"], ["decode"], runs=1)
    with_batch_8 = instruction_report.instruction_section(instruction_report.save_counts(batch_8, store))
    assert "### hidden 256, 8 layers, batch 8" in with_batch_8  # counted at one size only:
    assert "### hidden 512, 12 layers, batch 8" not in with_batch_8  # a size no command counted has no table
    other = instruction_report.measure_instructions([(256, 8)], [1], ["identity"], ["prefill"], runs=1, number=2)
    replaced = instruction_report.save_counts(other, store)
    assert replaced["kinds"] == ["prefill"] and ("identity", 512, 12, 1, "decode") not in replaced["counts"][0]


@pytest.mark.parametrize("name, kind", [("learnable_plus", "decode"), ("svformer", "decode"),
                                        ("svformer", "compiled decode"), ("identity", "prefill")])
def test_a_prepared_call_computes_what_a_model_built_in_this_process_computes(tmp_path, name, kind):
    """The counting process loads model, prompt and prefilled cache that a native process saved (valgrind would
    emulate the prefill's GEMMs ~50x slower): the counted call must be the step a fresh build takes, every time it
    is rewound and called again."""
    from benchmarks.common import build_model
    from benchmarks.cost import instructions
    from benchmarks.cost.settings import size_fields

    job = Job(name, 64, 2, batch=2, kind=kind, context=8, number=2, vocab_size=256, head_dim=16)
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps([dataclasses.asdict(job)]))
    instructions._prepare(spec)
    torch.manual_seed(0)
    model = build_model(name, **size_fields(64, 2, vocab_size=256, head_dim=16, max_positions=11)).eval()
    prompt = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(prompt, use_cache=True)
        if kind != "prefill":
            expected = model(prompt[:, -1:], **with_cache(expected.past_key_values), use_cache=True)
        rewind, call = instructions._action(job, *instructions._load(instructions._prepared_file(spec, 0)))
        for _ in range(2):
            rewind()
            call()
        rewind()
        got = call()
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
