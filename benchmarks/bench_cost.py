"""Cost of the value residual: training-step time, training memory and prefill time of each variant vs Llama.

For every size and sequence length, HF `LlamaForCausalLM` and each ResFormer variant of the same size are built from
the same seed and timed round-robin in the same process (medians), so the reported ratios survive a busy machine.
The paper claims "similar memory usage and computational cost"; the goal is a ratio <= 1.03.

    python benchmarks/bench_cost.py                                    # CPU defaults (a few minutes)
    python benchmarks/bench_cost.py --device cuda --sizes 512x8 1024x12 --seq-lens 1024 2048 --batch-size 8

Memory: on CUDA the peak allocated bytes of a training step (`torch.cuda.max_memory_allocated`); on CPU, where torch
keeps no allocator statistics, the exact bytes a training step must hold at its peak: parameters, gradients, AdamW
state and every tensor autograd saves for the backward pass (counted once per storage with saved-tensor hooks).

Writes `benchmarks/results/cost.{md,png}`.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import torch
from common import BASELINE, RESULTS_DIR, add_device_args, build_model, environment_line, interleaved_medians
from common import markdown_table, pyplot, setup_device

DEFAULT_VARIANTS = ["identity", "constant", "learnable", "learnable_plus", "sparse", "dense", "svformer", "neutreno"]
GOAL = 1.03


def parse_size(text: str) -> tuple[int, int]:
    """'256x8' -> (hidden 256, 8 layers)."""
    try:
        hidden, layers = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} must look like HIDDENxLAYERS, e.g. 256x8") from None
    return hidden, layers


def size_fields(hidden: int, layers: int, args) -> dict:
    heads = max(1, hidden // args.head_dim)
    return dict(
        vocab_size=args.vocab_size, hidden_size=hidden, intermediate_size=max(32, round(hidden * 8 / 3 / 32) * 32),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // args.gqa_groups), max_position_embeddings=max(args.seq_lens),
        tie_word_embeddings=False,
    )


class Trainer:
    """One model with its own AdamW, stepping on fixed random tokens."""

    def __init__(self, model, batch: torch.Tensor):
        self.model = model.train()
        self.batch = batch
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(self) -> None:
        loss = self.model(input_ids=self.batch, labels=self.batch, use_cache=False).loss
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
    state_bytes = sum(
        value.nbytes for state in trainer.optimizer.state.values() for value in state.values() if torch.is_tensor(value)
    )
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


def measure(hidden: int, layers: int, seq_len: int, args, device: torch.device) -> dict:
    size = size_fields(hidden, layers, args)
    batch = torch.randint(0, args.vocab_size, (args.batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    batch = batch.to(device)
    names = [BASELINE] + args.variants
    trainers = {}
    for name in names:
        torch.manual_seed(args.seed)
        model = build_model(name, device, dtype=getattr(torch, args.dtype), **size)
        if args.compile:
            model.forward = torch.compile(model.forward)
        trainers[name] = Trainer(model, batch)
    memory = {
        name: training_bytes_cuda(t, device) if device.type == "cuda" else training_bytes_cpu(t)
        for name, t in trainers.items()
    }
    # Several interleaved rounds; the reported ratio is the median over rounds of per-round median ratios.
    step_ratios = {name: [] for name in names}
    prefill_ratios = {name: [] for name in names}
    step_seconds, prefill_seconds = [], []
    # Small models take milliseconds per step: time them more often so each round spans about --round-seconds.
    probe = interleaved_medians({BASELINE: trainers[BASELINE].step}, 3, 1, device)[BASELINE]
    repeats = min(args.max_repeats, max(args.repeats, math.ceil(args.round_seconds / (len(names) * probe))))
    for _ in range(args.rounds):
        steps = interleaved_medians({n: t.step for n, t in trainers.items()}, repeats, 1, device)
        prefills = interleaved_medians({n: t.prefill for n, t in trainers.items()}, repeats, 1, device)
        step_seconds.append(steps[BASELINE])
        prefill_seconds.append(prefills[BASELINE])
        for name in names:
            step_ratios[name].append(steps[name] / steps[BASELINE])
            prefill_ratios[name].append(prefills[name] / prefills[BASELINE])
    return {
        "hidden": hidden, "layers": layers, "seq_len": seq_len, "repeats": repeats,
        "parameters": {n: sum(p.numel() for p in t.model.parameters()) for n, t in trainers.items()},
        "llama_step_s": statistics.median(step_seconds),
        "llama_prefill_s": statistics.median(prefill_seconds),
        "llama_bytes": memory[BASELINE],
        "step": {n: statistics.median(r) for n, r in step_ratios.items()},
        "prefill": {n: statistics.median(r) for n, r in prefill_ratios.items()},
        "memory": {n: memory[n] / memory[BASELINE] for n in names},
    }


def _cell(ratio: float) -> str:
    return f"**{ratio:.3f}**" if ratio > GOAL else f"{ratio:.3f}"


def write_report(results: list[dict], args, device: torch.device) -> None:
    memory_kind = "peak allocated (CUDA)" if device.type == "cuda" else "params+grads+AdamW+saved activations"
    lines = [
        "# Cost of the value residual vs Llama (same size, same run)",
        "Regenerate: `python benchmarks/bench_cost.py "
        + " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                   for k, v in (("sizes", [f"{h}x{l}" for h, l in args.sizes]), ("seq_lens", args.seq_lens),
                                ("batch_size", args.batch_size), ("device", args.device))
                   + ((("threads", args.threads),) if args.threads else ()))
        + "`. " + environment_line(device),
        f"Ratios to HF `LlamaForCausalLM` of the same size (1.000 = same cost; bold = above the {GOAL} goal). Step = "
        f"forward + backward + AdamW, median over {args.rounds} rounds of the median of N interleaved repeats (order rotated "
        f"each repeat); prefill = "
        f"no-grad forward with a fresh KV cache; memory = {memory_kind}. Batch {args.batch_size}, vocab "
        f"{args.vocab_size}, head dim {args.head_dim}, {args.dtype}.",
    ]
    for r in results:
        lines += [
            "",
            f"## hidden {r['hidden']}, {r['layers']} layers, sequence {r['seq_len']}",
            f"Llama: step {r['llama_step_s'] * 1e3:.1f} ms, prefill {r['llama_prefill_s'] * 1e3:.1f} ms, "
            f"memory {r['llama_bytes'] / 2**20:.1f} MiB, {r['parameters'][BASELINE] / 1e6:.2f}M parameters; "
            f"N = {r['repeats']}.",
            "",
            markdown_table(
                ["variant", "train step time", "training memory", "prefill time", "parameters"],
                [[f"`{n}`", _cell(r["step"][n]), _cell(r["memory"][n]), _cell(r["prefill"][n]),
                  f"{r['parameters'][n] / r['parameters'][BASELINE]:.3f}"] for n in args.variants],
            ),
        ]
    lines += ["", "![cost ratios](cost.png)", ""]
    out = Path(args.out)
    (out / "cost.md").write_text("\n".join(lines))
    plot(results, args.variants, out / "cost.png")


def plot(results: list[dict], variants: list[str], path: Path) -> None:
    plt = pyplot()
    figure, axes_row = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    width = 0.8 / len(results)
    for axes, key, title in zip(axes_row, ("step", "memory", "prefill"),
                                ("train step time", "training memory", "prefill time")):
        for index, r in enumerate(results):
            positions = [v + (index - (len(results) - 1) / 2) * width for v in range(len(variants))]
            label = f"h{r['hidden']}×{r['layers']}L, T={r['seq_len']}"
            axes.bar(positions, [r[key][n] for n in variants], width, label=label)
        axes.axhline(1.0, color="black", lw=1)
        axes.axhline(GOAL, color="red", ls="--", lw=1, label=f"goal {GOAL}")
        axes.set_xticks(range(len(variants)), variants, rotation=45, ha="right")
        axes.set_title(f"{title} / Llama")
        axes.grid(axis="y", alpha=0.3)
    axes_row[0].set_ylabel("ratio to LlamaForCausalLM")
    low = min(min(r[k][n] for n in variants) for r in results for k in ("step", "memory", "prefill"))
    high = max(max(r[k][n] for n in variants) for r in results for k in ("step", "memory", "prefill"))
    axes_row[0].set_ylim(min(0.9, low - 0.02), max(1.1, high + 0.02))
    axes_row[-1].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(parser)
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[(128, 4), (256, 8)], metavar="HIDDENxLAYERS")
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
    parser.add_argument("--compile", action="store_true", help="torch.compile every model's forward")
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    device = setup_device(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = []
    for hidden, layers in args.sizes:
        for seq_len in args.seq_lens:
            print(f"hidden {hidden}, {layers} layers, sequence {seq_len} ...", flush=True)
            result = measure(hidden, layers, seq_len, args, device)
            print("  step " + ", ".join(f"{n} {v:.3f}" for n, v in result["step"].items()), flush=True)
            print("  memory " + ", ".join(f"{n} {v:.3f}" for n, v in result["memory"].items()), flush=True)
            print("  prefill " + ", ".join(f"{n} {v:.3f}" for n, v in result["prefill"].items()), flush=True)
            results.append(result)
    write_report(results, args, device)
    print(f"wrote {Path(args.out) / 'cost.md'}")


if __name__ == "__main__":
    main()
