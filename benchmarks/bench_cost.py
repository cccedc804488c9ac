"""Cost of the value residual: training step, memory, prefill and decode of each variant vs Llama, eager and compiled.

For every size and sequence length, HF `LlamaForCausalLM` and each ResFormer variant of the same size are built from
the same seed and timed round-robin in the same process (medians), so the reported ratios survive a busy machine.
The goals (issue 15): training memory <= 1.005 of Llama's (`dense`, which must keep every layer's values: 1.03), step
and prefill time <= 1.02 at the smallest size and <= 1.01 from hidden 512 (`dense`: 1.05), and under `torch.compile`
a training step and a decode step (static KV cache) <= 1.01 of compiled Llama's; eager decode without gradient (the
no-grad path of issue 21) <= 1.01 (`dense` 1.03, SVFormer below 1), with the exact ops each decode step adds.

    python benchmarks/bench_cost.py                                    # CPU defaults, also rewrites the README block
    python benchmarks/bench_cost.py --device cuda --sizes 512x8 1024x12 --seq-lens 1024 2048 --batch-size 8

Memory: on CUDA the peak allocated bytes of a training step (`torch.cuda.max_memory_allocated`); on CPU, where torch
keeps no allocator statistics, the exact bytes a training step must hold at its peak: parameters, gradients, AdamW
state and every tensor autograd saves for the backward pass (counted once per storage with saved-tensor hooks).

Writes `benchmarks/results/cost.{md,png}` and the README's cost paragraph (between `<!-- cost:begin/end -->`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from resformer_hf.configuration_resformer import VARIANTS

from common import (
    BASELINE,
    RESULTS_DIR,
    Decoder,
    add_clock_arg,
    add_device_args,
    build_model,
    clock_of,
    environment_line,
    interleaved_medians,
    markdown_table,
    pyplot,
    rewrite_readme_block,
    setup_device,
)

DEFAULT_VARIANTS = ["identity", "constant", "learnable", "learnable_plus", "sparse", "dense", "svformer", "neutreno"]
METRICS = ("step", "memory", "prefill", "decode")
#: Flags that change what is measured beyond the sizes; the "Regenerate" command names them when not the default.
TIMING_FLAGS = ("variants", "vocab_size", "head_dim", "gqa_groups", "dtype", "repeats", "round_seconds", "max_repeats",
                "rounds", "compile_seq_len", "decode_context", "decode_steps", "seed", "clock")
#: A second Llama, identical to the first, timed like the variants: its ratio is the run's noise floor.
CONTROL = "llama, again"


#: How the value residual stays at Llama's cost; quoted in cost.md and the README block this script writes.
HOW = (
    "The mix keeps no tensor beyond Llama's (`resformer_hf/value_residual.py`): a mixing layer's v_proj and the mix "
    "run as one GEMM (`V' = a·V_0 + h(b·W)ᵀ`) whose custom backward saves only h, W and V_0, which q/k_proj and layer "
    "0 keep anyway, and gets λ_self's gradient `<dV', V_n> = <dV'ᵀh, W>` exactly from the product the weight gradient "
    "needs anyway; `dense` keeps every layer's raw values once, in one buffer whose prefixes are the per-layer stacks "
    "(O(L), still passed positionally for reentrant checkpointing); NeuTRENO recomputes o_proj's corrected input in "
    "backward instead of keeping it. Where v_proj / o_proj is not a plain `nn.Linear` (LoRA, quantised, tensor "
    "parallel, hooked or offloaded) the plain ops run and keep one extra `[B, H_kv, T, D]` tensor per layer. Train "
    "with `use_cache=False`: otherwise transformers builds a KV cache in training too, attention keeps the cache's "
    "copies of the values (Llama as well), and V_0 is then kept once more."
)


def goal(metric: str, variant: str, hidden: int) -> float:
    """The ratio to Llama a variant should stay within (issue 15); cells above it are bold."""
    keeps_all = variant in VARIANTS and VARIANTS[variant].keeps_every_layers_values
    if metric == "memory":
        return 1.03 if keeps_all else 1.005
    if metric in ("compiled step", "compiled decode"):
        return 1.01
    if metric == "decode":  # issue 21: one fused op per mixing layer, at Llama's speed
        if variant in VARIANTS and VARIANTS[variant].drops_value_projections:
            return 1.0
        return 1.03 if keeps_all else 1.01
    return 1.05 if keeps_all else (1.01 if hidden >= 512 else 1.02)


def parse_size(text: str) -> tuple[int, int]:
    """'256x8' -> (hidden 256, 8 layers)."""
    try:
        hidden, layers = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} must look like HIDDENxLAYERS, e.g. 256x8") from None
    return hidden, layers


def size_fields(hidden: int, layers: int, args, max_positions: int) -> dict:
    heads = max(1, hidden // args.head_dim)
    return dict(
        vocab_size=args.vocab_size, hidden_size=hidden, intermediate_size=max(32, round(hidden * 8 / 3 / 32) * 32),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // args.gqa_groups), max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )


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


def training_bytes_cpu(trainer: Trainer) -> int:
    """Parameters + gradients + AdamW state + tensors saved for backward (activations counted once per storage).

    Saved activations are all alive together until backward, so their storages are told apart by address; gradients
    and optimizer state are summed directly because they may reuse the addresses activations had.
    """
    parameters = list(trainer.model.parameters())  # shared (tied) parameters appear once
    parameter_storages = {_storage_key(p) for p in parameters}
    activations: set[tuple[int, int]] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in parameter_storages:
            activations.add(key)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = trainer.model(input_ids=trainer.batch, labels=trainer.batch, use_cache=False).loss
    activation_bytes = sum(nbytes for _, nbytes in activations)
    loss.backward()
    trainer.optimizer.step()
    states = trainer.optimizer.state.values()
    state_bytes = sum(value.nbytes for state in states for value in state.values() if torch.is_tensor(value))
    trainer.optimizer.zero_grad(set_to_none=True)
    parameter_bytes = sum(p.nbytes for p in parameters)
    gradient_bytes = sum(p.nbytes for p in parameters if p.requires_grad)
    return parameter_bytes + gradient_bytes + state_bytes + activation_bytes


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
        name: training_bytes_cuda(t, device) if device.type == "cuda" else training_bytes_cpu(t)
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


# ---- report -------------------------------------------------------------------------------------------------------


def _cell(result: dict, metric: str, name: str) -> str:
    ratio = result[metric][name]
    text = f"**{ratio:.3f}**" if ratio > goal(metric, name, result["hidden"]) else f"{ratio:.3f}"
    rounds = result.get("spread", {}).get(metric, {}).get(name)
    if rounds and len(rounds) > 1:
        text += f" ({min(rounds):.3f}–{max(rounds):.3f})"
    return text


def _label(name: str) -> str:
    return "Llama again (noise floor)" if name == CONTROL else f"`{name}`"


def _census_cell(result: dict, kind: str, name: str) -> str:
    """Extra aten ops per call and the ratio of bytes written, vs Llama (exact counts)."""
    ops, written = result["census"][name][kind]
    base_ops, base_written = result["census"][BASELINE][kind]
    return f"{ops - base_ops:+d}, {written / base_written:.4f}"


def command_line(args) -> str:
    flags = [("sizes", [f"{h}x{n}" for h, n in args.sizes]), ("seq_lens", args.seq_lens),
             ("batch_size", args.batch_size), ("device", args.device)]
    flags += [("threads", args.threads)] if args.threads else []
    if args.compile_size:
        flags += [("compile_size", f"{args.compile_size[0]}x{args.compile_size[1]}")]
    flags += sorted(getattr(args, "changed_timing", {}).items())  # e.g. fewer rounds: the command must say so
    return "python benchmarks/bench_cost.py " + " ".join(
        f"--{key.replace('_', '-')} {' '.join(map(str, value)) if isinstance(value, list) else value}"
        for key, value in flags
    )


def write_report(results: list[dict], compiled: dict | None, args, device: torch.device) -> str:
    memory_kind = "peak allocated (CUDA)" if device.type == "cuda" else "params+grads+AdamW+saved activations"
    lines = [
        "# Cost of the value residual vs Llama (same size, same run)",
        f"Regenerate: `{command_line(args)}` (also rewrites the README's cost paragraph). {environment_line(device)}",
        f"Ratios to HF `LlamaForCausalLM` of the same size, times by the "
        f"{'CPU time of this process' if args.clock == 'cpu' else 'wall clock'} (1.000 = same cost; bold = above "
        "the issue-15 goal: memory 1.005, `dense` 1.03; time 1.02, from hidden 512 on 1.01, `dense` 1.05; compiled "
        "1.01). Step = forward + "
        f"backward + AdamW, median over {args.rounds} rounds of the median of N interleaved repeats (order rotated "
        f"each repeat), with the lowest and highest of the per-round ratios in brackets (the run-to-run spread); "
        f"prefill = no-grad forward with a fresh KV cache; decode = bursts of {args.decode_steps} single tokens "
        "without gradient after the sequence as cached context (default dynamic cache, as `generate()`; issue-21 goal "
        f"1.01, `dense` 1.03, SVFormer 1.0); memory = {memory_kind}, exact. The first row times a second, identical "
        "Llama like the variants: its ratio is the run's noise floor. Ops and bytes: the aten ops one step (prefill, "
        "decode step) dispatches beyond Llama's and the bytes their outputs write relative to Llama's, counted "
        "exactly with a dispatch mode, so unaffected by machine load: extra ops are what small models pay (dispatch "
        "overhead), extra bytes what large ones pay (elementwise memory traffic). Batch "
        f"{args.batch_size}, vocab {args.vocab_size}, head dim {args.head_dim}, {args.dtype}.",
        "",
        HOW,
    ]
    for r in results:
        lines += [
            "",
            f"## hidden {r['hidden']}, {r['layers']} layers, sequence {r['seq_len']}",
            f"Llama: step {r['llama_step_s'] * 1e3:.1f} ms, prefill {r['llama_prefill_s'] * 1e3:.1f} ms, "
            f"decode {r['llama_decode_s'] * 1e3:.2f} ms per token, "
            f"memory {r['llama_bytes'] / 2**20:.1f} MiB, {r['parameters'][BASELINE] / 1e6:.2f}M parameters; "
            f"N = {r['repeats']} (decode {r['decode_repeats']}).",
            "",
            markdown_table(
                ["variant", "train step time", "training memory", "prefill time", "eager decode time",
                 "step: aten ops, bytes written", "prefill: aten ops, bytes written",
                 "decode step: aten ops, bytes written", "parameters"],
                [[_label(n), _cell(r, "step", n), _cell(r, "memory", n), _cell(r, "prefill", n),
                  _cell(r, "decode", n), _census_cell(r, "step", n), _census_cell(r, "prefill", n),
                  _census_cell(r, "decode", n), f"{r['parameters'][n] / r['parameters'][BASELINE]:.3f}"]
                 for n in [CONTROL, *args.variants]],
            ),
        ]
    if compiled:
        c = compiled
        lines += [
            "",
            f"## torch.compile: hidden {c['hidden']}, {c['layers']} layers",
            f"Every model (Llama too) is compiled with `torch.compile` (default mode, inductor). Training step: the "
            f"compiled model's forward and backward at sequence {c['seq_len']}, eager AdamW; Llama "
            f"{c['llama_step_s'] * 1e3:.1f} ms, N = {c['repeats']}. Decode step: one token through the compiled "
            f"forward with a static KV cache holding {c['context']} tokens (batch 1), bursts of {args.decode_steps}; "
            f"Llama {c['llama_decode_s'] * 1e3:.2f} ms per token, N = {c['decode_repeats']}. Compile time "
            f"{min(c['compile_s'].values()):.0f}–{max(c['compile_s'].values()):.0f} s per model (both graphs).",
            "",
            markdown_table(["variant", "compiled train step", "compiled decode step"],
                           [[_label(n), _cell(c, "compiled step", n), _cell(c, "compiled decode", n)]
                            for n in [CONTROL, *args.variants]]),
        ]
    lines += ["", "![cost ratios](cost.png)", ""]
    out = Path(args.out)
    (out / "cost.md").write_text("\n".join(lines))
    plot(results, compiled, args.variants, out / "cost.png")
    return "\n".join(lines)


def readme_block(results: list[dict], compiled: dict | None, args, device: torch.device) -> str:
    """The README's cost paragraph and summary table: the worst ratio over sequence lengths for each size."""
    sizes = list(dict.fromkeys((r["hidden"], r["layers"]) for r in results))

    def worst(metric: str, name: str, size) -> float:
        return max(r[metric][name] for r in results if (r["hidden"], r["layers"]) == size)

    def cell(metric: str, name: str, size) -> str:
        ratio = worst(metric, name, size)
        return f"**{ratio:.3f}**" if ratio > goal(metric, name, size[0]) else f"{ratio:.3f}"

    shown = ("step", "prefill", "decode", "memory")
    header = ["variant"] + [f"{m} {h}×{n}" for m in shown for h, n in sizes]
    names = [CONTROL, *args.variants]
    rows = [[_label(n)] + [cell(m, n, s) for m in shown for s in sizes] for n in names]
    if compiled:
        header += ["compiled step", "compiled decode"]
        for row, name in zip(rows, names):
            row += [_cell({**compiled, "spread": {}}, metric, name) for metric in ("compiled step", "compiled decode")]
    seqs = "/".join(map(str, args.seq_lens))
    text = [
        f"**Cost** (`{command_line(args)}`, [cost.md](benchmarks/results/cost.md); this paragraph and table are "
        "written by that command): training step (forward + backward + AdamW), training memory (parameters + "
        "gradients + AdamW state + activations saved for backward, counted exactly), prefill time and eager decode "
        f"time ({args.decode_steps} tokens after the sequence, no gradient, dynamic cache) of every variant "
        f"as a ratio to a same-size Llama timed round-robin in the same process; the worst of sequence {seqs} for "
        f"each size (hidden × layers), batch {args.batch_size}, {device.type}"
        + (f", {args.threads} thread" + ("s" if args.threads > 1 else "") if args.threads else "")
        + ". Bold marks a ratio above the goal (memory 1.005, `dense` 1.03; time 1.02, 1.01 from hidden 512, `dense` "
        "1.05; decode and compiled 1.01, `dense` decode 1.03, SVFormer decode 1.0). The first row is a second, "
        "identical Llama timed the same way: the noise floor of the run. `cost.md` adds each ratio's run-to-run "
        "spread and the exact count of extra ops and bytes per training "
        "step, prefill and decode step. "
        + HOW
        + (f" Compiled: `torch.compile`d training step at {compiled['hidden']}×{compiled['layers']}, sequence "
           f"{compiled['seq_len']}, and decode step with a static cache of {compiled['context']} tokens, vs compiled "
           "Llama." if compiled else ""),
        "",
        markdown_table(header, rows),
    ]
    return "\n".join(text)


def plot(results: list[dict], compiled: dict | None, variants: list[str], path: Path) -> None:
    plt = pyplot()
    titles = ("train step time", "training memory", "prefill time", "eager decode time")
    panels = list(zip(METRICS, titles))
    if compiled:
        panels.append(("compiled", "torch.compile"))
    figure, axes_row = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), sharey=True)
    width = 0.8 / len(results)
    for axes, (key, title) in zip(axes_row, panels):
        if key == "compiled":
            for index, metric in enumerate(("compiled step", "compiled decode")):
                positions = [v + (index - 0.5) * 0.4 for v in range(len(variants))]
                axes.bar(positions, [compiled[metric][n] for n in variants], 0.4, label=metric)
            axes.axhline(1.01, color="red", ls="--", lw=1, label="goal 1.01")
        else:
            for index, r in enumerate(results):
                positions = [v + (index - (len(results) - 1) / 2) * width for v in range(len(variants))]
                label = f"h{r['hidden']}×{r['layers']}L, T={r['seq_len']}"
                axes.bar(positions, [r[key][n] for n in variants], width, label=label)
            axes.axhline(1.005 if key == "memory" else 1.01, color="red", ls="--", lw=1,
                         label="goal (1.005)" if key == "memory" else "goal (1.01 at hidden ≥ 512)")
        axes.axhline(1.0, color="black", lw=1)
        axes.set_xticks(range(len(variants)), variants, rotation=45, ha="right")
        axes.set_title(f"{title} / Llama")
        axes.grid(axis="y", alpha=0.3)
        axes.legend(fontsize="x-small")
    axes_row[0].set_ylabel("ratio to LlamaForCausalLM")
    values = [r[k][n] for r in results for k in METRICS for n in variants]
    if compiled:
        values += [compiled[k][n] for k in ("compiled step", "compiled decode") for n in variants]
    axes_row[0].set_ylim(min(0.9, min(values) - 0.02), max(1.1, max(values) + 0.02))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(parser)
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[(128, 4), (256, 8), (512, 12)],
                        metavar="HIDDENxLAYERS")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--gqa-groups", type=int, default=1, help="query heads per kv head (default 1: MHA)")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timings per round (default 5)")
    parser.add_argument("--round-seconds", type=float, default=6.0,
                        help="raise repeats for fast models until a round of steps takes about this long (default 6)")
    parser.add_argument("--max-repeats", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5, help="rounds; ratios are medians over rounds (default 5)")
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
    args = parser.parse_args(argv)
    args.changed_timing = {key: getattr(args, key) for key in TIMING_FLAGS
                           if getattr(args, key) != parser.get_default(key)}
    device = setup_device(args)
    clock_of(args, device)  # refuses --clock cpu on a GPU before anything is built
    Path(args.out).mkdir(parents=True, exist_ok=True)
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
