"""The GPU run (issue 40): correctness, training speed and memory, decoding and SVFormer's serving capacity on one
CUDA GPU, every variant against a same-shape HF `LlamaForCausalLM` in the same process.

It installs nothing. On a lent GPU machine (torch 2.11 there; transformers 5.24.0 carried as a wheel, with whatever
that machine lacks), from the repository root:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu --out $OUT

Every result is a JSON line in `OUT/gpu.jsonl`, flushed as it is measured, so a run stopped at its time limit keeps
what it measured; `--seconds` (default 390) is shared out between the parts, which each stop starting work when
their share is spent and record what they skipped. Then, here:

    python -m benchmarks.gpu --report benchmarks/results/gpu/run*.jsonl   # writes benchmarks/results/gpu.md

`--smoke` runs every part at toy size on the CPU in about a minute (compiling with dynamo's eager backends): CI runs
it (tests/test_gpu_run.py), so the prepared command never rots between the sessions that have a GPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch
import transformers

import resformer_hf

from . import correctness, decode, training
from .record import Plan, Recorder, Schedule

#: The parts in the order they run: SVFormer's capacity before the decode speeds, whose compiling can take any time.
PARTS = {"correctness": correctness.run, "training": training.run, "capacity": decode.capacity,
         "decode": decode.decode_speed}
#: Shares of the run's time (compiling dominates training and decoding).
SHARES = {"correctness": 0.22, "training": 0.40, "capacity": 0.12, "decode": 0.26}


def environment(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "CPU")
    return dict(device=name, torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
                resformer_hf=resformer_hf.__version__, python=platform.python_version(),
                date=time.strftime("%Y-%m-%d"), cpus=os.cpu_count())


def open_run(path: Path, smoke: bool, **fields) -> tuple[torch.device, Recorder]:
    """The device a run measures on (the CPU for `smoke`, else a CUDA GPU, or exit saying so) and its recorder, whose
    first line is the environment and `fields`."""
    device = torch.device("cpu" if smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: this run needs one (use --smoke to rehearse it on the CPU)")
    recorder = Recorder(path, time.monotonic())
    recorder.write("run", "environment", ok=None, smoke=smoke, **fields, **environment(device))
    return device, recorder


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
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS), help="parts to run, in order")
    parser.add_argument("--smoke", action="store_true", help="every part at toy size on the CPU")
    parser.add_argument("--variants", nargs="+", default=[], metavar="NAME",
                        help="only these variants (and the Llama control): a rerun for what a run skipped")
    parser.add_argument("--report", type=Path, nargs="+", metavar="JSONL",
                        help="write benchmarks/results/gpu.md from these runs (later rows replace earlier)")
    args = parser.parse_args(argv)
    if args.report:
        from .report import write_report

        print(f"wrote {write_report(*args.report)}")
        return
    device, recorder = open_run(args.out / "gpu.jsonl", args.smoke, parts=args.parts, variants=args.variants,
                                seconds=args.seconds)
    allow_recompiles()
    plan = Plan(device, args.smoke, tuple(args.variants))
    schedule = Schedule(args.seconds, {part: SHARES[part] for part in args.parts})
    for part in args.parts:
        schedule.begin(part)
        with recorder.guarded(part, "part"):
            PARTS[part](recorder, schedule, plan)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    recorder.write("run", "done", ok=None, elapsed_s=round(schedule.elapsed(), 1))


if __name__ == "__main__":
    main()
