"""Cost of the value residual: training step, memory, prefill and decode of each variant vs Llama, eager and compiled.

For every size and sequence length, HF `LlamaForCausalLM` and each ResFormer variant of the same size are built from
the same seed and timed round-robin in the same process (medians), so the reported ratios survive a busy machine.
The goals: training memory <= 1.005 of Llama's (`dense`, which must keep every layer's values: 1.03), step
and prefill time <= 1.02 at the smallest size and <= 1.01 from hidden 512 (`dense`: 1.05), and under `torch.compile`
a training step and a decode step (static KV cache) <= 1.01 of compiled Llama's; eager decode without gradient (the
no-grad path) <= 1.01 (`dense` 1.03, SVFormer below 1), with the exact ops each decode step adds.

    python -m benchmarks.cost.bench_cost                            # CPU defaults, also rewrites the README block
    python -m benchmarks.cost.bench_cost --device cuda --sizes 512x8 1024x12 --seq-lens 1024 2048 --batch-size 8

Memory: on CUDA the peak allocated bytes of a training step (`torch.cuda.max_memory_allocated`); on CPU, where torch
keeps no allocator statistics, the exact bytes a training step must hold at its peak: parameters, gradients, AdamW
state and every tensor autograd saves for the backward pass (counted once per storage with saved-tensor hooks).

Instructions: callgrind counts each variant's and Llama's instructions per eager decode step, compiled
decode step and prefill (`instruction_report.py`, `instructions.py`): deterministic, unlike the timings. Goals for
both decode steps: 1.01 of Llama's, `dense` 1.03, NeuTRENO 1.02, SVFormer 1.00.

Writes `benchmarks/results/cost.{md,png}` and the README's cost paragraphs (between `<!-- cost:begin/end -->` and
`<!-- cost-instructions:begin/end -->`); `--only-instructions` rewrites only the instruction blocks, and
`--instructions-from-store` rewrites them from the counts already stored, counting nothing.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import BASELINE, RESULTS_DIR, add_device_args, build_model, rewrite_readme_block, setup_device
from benchmarks.cost.instruction_report import (
    instruction_readme_block,
    instruction_section,
    load_counts,
    measure_instructions,
    save_counts,
)
from benchmarks.cost.instructions import KINDS
from benchmarks.cost.report import readme_block, write_report
from benchmarks.cost.settings import CONTROL, DEFAULT_VARIANTS, METRICS, add_model_args, parse_size
from benchmarks.cost.settings import size_fields as _size_fields
from benchmarks.cost.timing import Decoder, add_clock_arg, clock_of, interleaved_medians

#: Flags that change what is measured beyond the sizes; the "Regenerate" command names them when not the default.
TIMING_FLAGS = ("variants", "vocab_size", "head_dim", "gqa_groups", "dtype", "repeats", "round_seconds", "max_repeats",
                "rounds", "compile_seq_len", "decode_context", "decode_steps", "seed", "clock")


def size_fields(hidden: int, layers: int, args, max_positions: int) -> dict:
    return _size_fields(hidden, layers, args.vocab_size, args.head_dim, max_positions, args.gqa_groups)


class Trainer:
    """One model with its own AdamW, stepping on fixed random tokens."""

    def __init__(self, model, batch: torch.Tensor, forward=None):
        self.model = model.train()
        self.forward = model if forward is None else forward
        self.batch = batch
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(self) -> None:
        loss = self.forward(input_ids=self.batch, labels=self.batch, use_cache=False).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def prefill(self) -> None:
        self.model.eval()
        self.model(input_ids=self.batch, use_cache=True)
        self.model.train()


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class TrainingBytes(NamedTuple):
    total: int  #: parameters + gradients + AdamW state + saved activations
    saved_activations: int


def training_bytes_cpu(trainer: Trainer) -> TrainingBytes:
    """Parameters + gradients + AdamW state + tensors saved for backward (activations counted once per storage),
    after one training step (AdamW's state exists from then on).

    Saved activations are all alive together until backward, so their storages are told apart by address; gradients
    and optimizer state are summed directly because they may reuse the addresses activations had.
    """
    parameters = list(trainer.model.parameters())  # shared (tied) parameters appear once
    activation_bytes, loss = saved_activation_bytes(trainer)
    loss.backward()
    trainer.optimizer.step()
    states = trainer.optimizer.state.values()
    state_bytes = sum(value.nbytes for state in states for value in state.values() if torch.is_tensor(value))
    trainer.optimizer.zero_grad(set_to_none=True)
    parameter_bytes = sum(p.nbytes for p in parameters)
    gradient_bytes = sum(p.nbytes for p in parameters if p.requires_grad)
    return TrainingBytes(parameter_bytes + gradient_bytes + state_bytes + activation_bytes, activation_bytes)


def saved_activation_bytes(trainer: Trainer) -> tuple[int, torch.Tensor]:
    """Bytes of the tensors a training forward saves for backward, each storage once, parameters excluded; and the
    loss, whose backward frees them."""
    parameter_storages = {_storage_key(p) for p in trainer.model.parameters()}
    activations: set[tuple[int, int]] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in parameter_storages:
            activations.add(key)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = trainer.model(input_ids=trainer.batch, labels=trainer.batch, use_cache=False).loss
    return sum(nbytes for _, nbytes in activations), loss


def training_bytes_cuda(trainer: Trainer, device: torch.device) -> int:
    trainer.step()  # AdamW state exists from here on
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    trainer.step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


class OpCensus(TorchDispatchMode):
    """Counts the aten ops a step dispatches and the bytes their outputs write (views write none).

    Exact and independent of machine load, unlike timings: what a variant adds to a step in op-dispatch overhead
    (what dominates small models) and in memory traffic (what dominates elementwise work in large ones).
    """

    def __init__(self):
        super().__init__()
        self.ops = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if not func.is_view and not func.__name__.startswith(("empty", "new_empty")):  # allocations write nothing
            tensors = out if isinstance(out, (tuple, list)) else [out]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        return out


def census(action) -> tuple[int, int]:
    """(aten ops, bytes written) of one call of `action`."""
    with OpCensus() as counter:
        action()
    return counter.ops, counter.bytes


def repeats_for(action, names: list[str], args, device: torch.device) -> int:
    """Small models take milliseconds per step: time them more often so each round spans about --round-seconds."""
    probe = interleaved_medians({BASELINE: action}, 3, 1, device, clock=clock_of(args, device))[BASELINE]
    return min(args.max_repeats, max(args.repeats, math.ceil(args.round_seconds / (len(names) * probe))))


def round_robin_ratios(actions: dict, repeats: int, args, device: torch.device) -> tuple[dict, list[float]]:
    """Per-round ratios to Llama of each action's median time (several interleaved rounds), and Llama's seconds."""
    ratios: dict[str, list[float]] = {name: [] for name in actions}
    seconds = []
    for _ in range(args.rounds):
        medians = interleaved_medians(actions, repeats, 1, device, clock=clock_of(args, device))
        seconds.append(medians[BASELINE])
        for name in actions:
            ratios[name].append(medians[name] / medians[BASELINE])
    return ratios, seconds


def measure(hidden: int, layers: int, seq_len: int, args, device: torch.device) -> dict:
    size = size_fields(hidden, layers, args, max(args.seq_lens) + args.decode_steps)
    batch = torch.randint(0, args.vocab_size, (args.batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    batch = batch.to(device)
    names = [BASELINE, CONTROL] + args.variants
    trainers = {}
    for name in names:
        torch.manual_seed(args.seed)
        variant = BASELINE if name == CONTROL else name
        trainers[name] = Trainer(build_model(variant, device, dtype=getattr(torch, args.dtype), **size), batch)
    memory = {
        name: training_bytes_cuda(t, device) if device.type == "cuda" else training_bytes_cpu(t).total
        for name, t in trainers.items()
    }
    counts = {name: {"step": census(t.step), "prefill": census(t.prefill)} for name, t in trainers.items()}
    repeats = repeats_for(trainers[BASELINE].step, names, args, device)
    steps, step_seconds = round_robin_ratios({n: t.step for n, t in trainers.items()}, repeats, args, device)
    prefills, prefill_seconds = round_robin_ratios({n: t.prefill for n, t in trainers.items()}, repeats, args, device)
    # Eager decode (no gradient, dynamic cache): single tokens after the sequence as context, as generate() runs them.
    decoders = {n: Decoder(t.model, args.batch_size, seq_len, args.decode_steps, False, device)
                for n, t in trainers.items()}
    for name, decoder in decoders.items():
        counts[name]["decode"] = census(decoder.step)
    decode_repeats = repeats_for(decoders[BASELINE].burst, names, args, device)
    decodes, decode_seconds = round_robin_ratios({n: d.burst for n, d in decoders.items()}, decode_repeats, args,
                                                 device)
    del decoders
    return {
        "hidden": hidden, "layers": layers, "seq_len": seq_len, "repeats": repeats, "decode_repeats": decode_repeats,
        "parameters": {n: sum(p.numel() for p in t.model.parameters()) for n, t in trainers.items()},
        "llama_step_s": statistics.median(step_seconds),
        "llama_prefill_s": statistics.median(prefill_seconds),
        "llama_decode_s": statistics.median(decode_seconds) / args.decode_steps,
        "llama_bytes": memory[BASELINE],
        "step": {n: statistics.median(r) for n, r in steps.items()},
        "prefill": {n: statistics.median(r) for n, r in prefills.items()},
        "decode": {n: statistics.median(r) for n, r in decodes.items()},
        "memory": {n: memory[n] / memory[BASELINE] for n in names},
        "spread": {"step": steps, "prefill": prefills, "decode": decodes},
        "census": counts,
    }


# ---- torch.compile ------------------------------------------------------------------------------------------------


def measure_compiled(hidden: int, layers: int, args, device: torch.device) -> dict:
    """Compiled training step (forward + backward by AOTAutograd, eager AdamW) and compiled decode step vs Llama."""
    # Every model's forward runs through the same transformers wrapper code, and dynamo caches graphs per code object:
    # with the default limit of 8 the later models would silently fall back to eager.
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 1024
    size = size_fields(hidden, layers, args, max(args.compile_seq_len, args.decode_context + args.decode_steps))
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, args.vocab_size, (args.batch_size, args.compile_seq_len), generator=generator).to(device)
    names = [BASELINE, CONTROL] + args.variants
    trainers, decoders, compile_seconds = {}, {}, {}
    for name in names:
        start = time.perf_counter()
        variant = BASELINE if name == CONTROL else name
        torch.manual_seed(args.seed)
        model = build_model(variant, device, dtype=getattr(torch, args.dtype), **size)
        trainers[name] = Trainer(model, batch, forward=torch.compile(model))
        trainers[name].step()  # compiles forward and backward
        torch.manual_seed(args.seed)
        decoder_model = build_model(variant, device, dtype=getattr(torch, args.dtype), **size)
        decoders[name] = Decoder(decoder_model, 1, args.decode_context, args.decode_steps, True, device)
        decoders[name].burst()  # compiles the decode step
        compile_seconds[name] = time.perf_counter() - start
        print(f"  compiled {name} in {compile_seconds[name]:.0f} s", flush=True)
    repeats = repeats_for(trainers[BASELINE].step, names, args, device)
    steps, step_seconds = round_robin_ratios({n: t.step for n, t in trainers.items()}, repeats, args, device)
    decode_repeats = max(args.repeats, repeats // 2)
    decodes, decode_seconds = round_robin_ratios({n: d.burst for n, d in decoders.items()}, decode_repeats, args,
                                                 device)
    return {
        "hidden": hidden, "layers": layers, "seq_len": args.compile_seq_len, "context": args.decode_context,
        "repeats": repeats, "decode_repeats": decode_repeats,
        "llama_step_s": statistics.median(step_seconds),
        "llama_decode_s": statistics.median(decode_seconds) / args.decode_steps,
        "compile_s": compile_seconds,
        "compiled step": {n: statistics.median(r) for n, r in steps.items()},
        "compiled decode": {n: statistics.median(r) for n, r in decodes.items()},
        "spread": {"compiled step": steps, "compiled decode": decodes},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(parser)
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[(128, 4), (256, 8), (512, 12)],
                        metavar="HIDDENxLAYERS")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--batch-size", type=int, default=2)
    add_model_args(parser)
    parser.add_argument("--round-seconds", type=float, default=6.0,
                        help="raise repeats for fast models until a round of steps takes about this long (default 6)")
    parser.add_argument("--max-repeats", type=int, default=40)
    parser.add_argument("--compile-size", type=parse_size, default=(256, 8), metavar="HIDDENxLAYERS",
                        help="size of the torch.compile section (default 256x8)")
    parser.add_argument("--no-compile", dest="compile_size", action="store_const", const=None,
                        help="skip the torch.compile section")
    parser.add_argument("--compile-seq-len", type=int, default=256, help="compiled training sequence (default 256)")
    parser.add_argument("--decode-context", type=int, default=512, help="tokens in the static cache (default 512)")
    parser.add_argument("--decode-steps", type=int, default=16, help="tokens per timed decode burst (default 16)")
    add_clock_arg(parser)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite the README's cost paragraph")
    parser.add_argument("--instruction-sizes", nargs="+", type=parse_size, default=[(256, 8), (512, 12)],
                        metavar="HIDDENxLAYERS", help="sizes callgrind counts (default 256x8 512x12)")
    parser.add_argument("--instruction-batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--instruction-kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--instruction-runs", type=int, default=2, help="fresh processes per count (default 2)")
    parser.add_argument("--no-instructions", action="store_true", help="skip the instruction counts (valgrind)")
    parser.add_argument("--instructions-from-store", action="store_true",
                        help="count and time nothing: rewrite the instruction blocks from instructions.json")
    parser.add_argument("--only-instructions", action="store_true",
                        help="count instructions only; rewrite just their blocks of cost.md and the README")
    args = parser.parse_args(argv)
    args.changed_timing = {key: getattr(args, key) for key in TIMING_FLAGS
                           if getattr(args, key) != parser.get_default(key)}
    device = setup_device(args)
    clock_of(args, device)  # refuses --clock cpu on a GPU before anything is built
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not (args.only_instructions or args.instructions_from_store):
        timings(args, device)
    if not args.no_instructions:
        instructions(args)


def instructions(args) -> None:
    """Count instructions (`instruction_report.py`), add them to the store beside cost.md and rewrite the instruction
    blocks of cost.md and the README from everything the store holds."""
    store = Path(args.out) / "instructions.json"
    if args.instructions_from_store:
        result = load_counts(store)
        if result is None:
            raise SystemExit(f"--instructions-from-store: {store} does not exist; count first (--only-instructions)")
    else:
        result = measure_instructions(args.instruction_sizes, args.instruction_batches, args.variants,
                                      args.instruction_kinds, args.instruction_runs, vocab_size=args.vocab_size,
                                      head_dim=args.head_dim)
        command = "python -m benchmarks.cost.bench_cost --only-instructions " + " ".join([
            "--instruction-sizes", *(f"{h}x{n}" for h, n in args.instruction_sizes), "--instruction-batches",
            *map(str, args.instruction_batches), "--instruction-kinds", *(f"'{k}'" for k in args.instruction_kinds),
            "--instruction-runs", str(args.instruction_runs),
            *(["--variants", *args.variants] if args.variants != DEFAULT_VARIANTS else [])])
        result = save_counts({**result, "commands": [command]}, store)  # joins what side-by-side commands stored
    commands = " then ".join(f"`{c}`" for c in result["commands"])
    rewrite_readme_block("instructions", f"Regenerate: {commands} (each adds its counts to "
                         "`instructions.json`).\n\n" + instruction_section(result), page=Path(args.out) / "cost.md")
    print(f"rewrote the instruction block of {Path(args.out) / 'cost.md'}")
    if not args.no_readme:
        rewrite_readme_block("cost-instructions", instruction_readme_block(result, commands))
        print("rewrote the README's instruction paragraph")


def timings(args, device) -> None:
    """Timings, memory and op census (the first part of cost.md and the README's cost paragraph)."""
    results = []
    for hidden, layers in args.sizes:
        for seq_len in args.seq_lens:
            print(f"hidden {hidden}, {layers} layers, sequence {seq_len} ...", flush=True)
            result = measure(hidden, layers, seq_len, args, device)
            for metric in METRICS:
                print(f"  {metric} " + ", ".join(f"{n} {v:.3f}" for n, v in result[metric].items()), flush=True)
            results.append(result)
    compiled = None
    if args.compile_size:
        print(f"torch.compile, hidden {args.compile_size[0]}, {args.compile_size[1]} layers ...", flush=True)
        compiled = measure_compiled(*args.compile_size, args, device)
        for metric in ("compiled step", "compiled decode"):
            print(f"  {metric} " + ", ".join(f"{n} {v:.3f}" for n, v in compiled[metric].items()), flush=True)
    write_report(results, compiled, args, device)
    print(f"wrote {Path(args.out) / 'cost.md'}")
    if not args.no_readme:
        rewrite_readme_block("cost", readme_block(results, compiled, args, device))
        print("rewrote the README's cost paragraph")


if __name__ == "__main__":
    sys.exit(main())
