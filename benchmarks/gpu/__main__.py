"""The GPU run: correctness, training speed and memory, decoding and SVFormer's serving capacity on one
CUDA GPU, every variant against a same-shape HF `LlamaForCausalLM` in the same process.

It installs nothing. On a lent GPU machine (with the torch installed there; transformers 5.24.0 carried as a
wheel, with whatever that machine lacks), from the repository root:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu --out $OUT

Every result is a JSON line in `OUT/gpu.jsonl`, flushed as it is measured, so a run stopped at its time limit keeps
what it measured; `--seconds` (default 390) is shared out between the parts, which each stop starting work when
their share is spent and record what they skipped. Then, here:

    python -m benchmarks.gpu --report benchmarks/results/gpu/run*.jsonl   # writes benchmarks/results/gpu.md

`--smoke` runs every part at toy size on the CPU in about a minute (compiling with dynamo's eager backends): CI runs
it (tests/test_gpu_run.py), so the prepared command never rots between the sessions that have a GPU.

Part `pretrain` (`pretrain.py`; not in the default run: it needs a whole device session) pre-trains Llama and
`learnable_plus` at 82M parameters on 100M tokens each: with its data and compiling, more than one call's
`--seconds 540` (docs/results.md has the estimate), so plan two calls.
Carry `.whl` (transformers 5.24.0's wheel: `python3 -m pip download --no-deps --only-binary=:all: -d .whl
transformers==5.24.0` here) and run, with timeout_s 600:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 || exit; \
        python3 -m benchmarks.gpu --parts pretrain --seconds 540 --out $OUT 2>&1 | tee $OUT/log.txt

If it stops at its deadline (a `pretrain/paused` line), run the same command again at once (a machine stays warm
for only 30 s after a call), with `--seconds` what the session has left less a minute: it continues from the
checkpoint in `.pretrain-work/` (its compiled kernels cached in /tmp). With time left over after both arms finish,
`--arms svformer llama@1` adds SVFormer and a second Llama seed. Keep each call's `OUT/gpu.jsonl` as
`benchmarks/results/gpu/runN.jsonl` and `OUT/corpus-files.tsv.gz` (every file by digest, and which were read)
beside them; `--report` then adds the comparison to gpu.md (and `gpu_pretrain.png`) and stores each finished arm in
the run store (`--store`, default `benchmarks/results/runs/`) as a run of the device it ran on. `--smoke --parts
pretrain` rehearses it on the CPU in about half a minute (tests/test_gpu_pretrain.py).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from . import correctness, decode, pretrain, training
from benchmarks.records import open_run

#: The parts in the order they run: SVFormer's capacity before the decode speeds, whose compiling can take any time;
#: `pretrain` runs only when asked for (`--parts pretrain`).
PARTS = {"correctness": correctness.run, "training": training.run, "capacity": decode.capacity,
         "decode": decode.decode_speed, "pretrain": pretrain.run}
DEFAULT_PARTS = ["correctness", "training", "capacity", "decode"]
#: Shares of the run's time (compiling dominates training and decoding).
SHARES = {"correctness": 0.22, "training": 0.40, "capacity": 0.12, "decode": 0.26, "pretrain": 1.0}


@dataclass(frozen=True)
class Plan:
    """What a part runs on and which models it covers: `smoke` runs toy sizes on the CPU with a few models, and
    `variants` (a rerun that fills in what an earlier run skipped) narrows every part to them and the Llama control."""

    device: torch.device
    smoke: bool = False
    variants: tuple[str, ...] = ()
    pretrain: object = None  #: the `pretrain` part's options (`pretrain.Options`; None: its defaults)

    def pick(self, priority: list[str], smoke_subset: list[str]) -> list[str]:
        """`priority` in order, narrowed to the smoke subset or to `variants` (the first entry, the control, stays)."""
        if self.variants:
            return [priority[0], *[name for name in priority[1:] if name in self.variants]]
        return [name for name in priority if name in smoke_subset] if self.smoke else list(priority)


def allow_recompiles() -> None:
    """Every variant compiles the same `forward` code objects with other guards: past dynamo's default of 8 graphs
    per code object the later variants would run eagerly, silently, and time as if compiled."""
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-run"), help="folder for gpu.jsonl (default ./gpu-run)")
    parser.add_argument("--seconds", type=float, default=390.0, help="time for the whole run (default 390)")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=DEFAULT_PARTS,
                        help=f"parts to run, in order (default {' '.join(DEFAULT_PARTS)})")
    parser.add_argument("--smoke", action="store_true", help="every part at toy size on the CPU")
    parser.add_argument("--variants", nargs="+", default=[], metavar="NAME",
                        help="only these variants (and the Llama control): a rerun for what a run skipped")
    parser.add_argument("--arms", nargs="+", default=list(pretrain.Options.arms), metavar="VARIANT[@SEED]",
                        help="pretrain: the models trained side by side (default: llama learnable_plus, seed 0)")
    parser.add_argument("--tokens", type=int, default=None, help="pretrain: training tokens per arm (default 100M)")
    parser.add_argument("--work", type=Path, default=pretrain.Options.work,
                        help="pretrain: folder for its data cache and checkpoint (default .pretrain-work)")
    parser.add_argument("--pause-after", type=int, default=None, metavar="STEPS",
                        help="pretrain: checkpoint and stop after this many steps (rehearses a run cut off)")
    parser.add_argument("--report", type=Path, nargs="+", metavar="JSONL",
                        help="write benchmarks/results/gpu.md from these runs (later rows replace earlier) and store "
                             "their finished pre-training arms")
    parser.add_argument("--store", type=Path, default=None, help="with --report: the run store (default "
                        "benchmarks/results/runs)")
    args = parser.parse_args(argv)
    if args.report:
        from .pretrain_report import store_runs
        from .report import write_report
        from benchmarks.studies.store import DEFAULT_STORE, RunStore

        print(f"wrote {write_report(*args.report)}")
        for path in store_runs(args.report, RunStore(args.store or DEFAULT_STORE)):
            print(f"stored {path}")
        return
    command = " ".join(["python -m benchmarks.gpu", *(sys.argv[1:] if argv is None else argv)])
    device, recorder, schedule = open_run(args.out / "gpu.jsonl", args.smoke, args.seconds,
                                          {part: SHARES[part] for part in args.parts}, parts=args.parts,
                                          variants=args.variants, command=command)
    allow_recompiles()
    options = pretrain.Options(tuple(args.arms), args.tokens, args.work, args.pause_after)
    plan = Plan(device, args.smoke, tuple(args.variants), options)
    for part in args.parts:
        schedule.begin(part)
        with recorder.guarded(part, "part"):
            PARTS[part](recorder, schedule, plan)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    recorder.done(schedule)


if __name__ == "__main__":
    main()
