"""Is converting my Llama worth it? Uptraining a converted checkpoint vs continuing the Llama (CPU scale).

Pre-trains one Llama, saves it, converts it with the real converter (`resformer_hf.convert_llama_checkpoint`) into
each ResFormer arm, and continues training every arm — and the Llama itself — for the same further budget on the same
continuation data (blocks the pre-training never saw), with several continuation seeds (batch order). Reports the
validation-loss difference of each arm to the continued Llama over the continuation (paired per seed), how the λ
moved, and the gradient every λ receives at the converted starting point (the `learnable_plus` preserve init starts
at λ_scale = 0, where the softmax logits get exactly zero gradient).

    python benchmarks/bench_uptrain.py                        # default arms, 3 continuation seeds, ~45 min
    python benchmarks/bench_uptrain.py --arms llama learnable_plus-preserve learnable_plus-preserve-lambda-lr30
    python benchmarks/bench_uptrain.py --device cuda --hidden-size 512 --layers 8 --pretrain-tokens 50000000 \\
        --tokens 10000000

Checkpoints (the pre-trained Llama and the converted arms) live in `--work-dir` (default: a folder in the system temp
directory named after the settings) and are reused by a rerun, like the finished runs saved in the JSON. Writes
`benchmarks/results/uptrain.{json,md,png}`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForCausalLM
from transformers.utils import logging as hf_logging

from resformer_hf import ResFormerForCausalLM, convert_llama_checkpoint

from common import BASELINE, RESULTS_DIR, add_device_args, markdown_table, pyplot
from run_store import RunStore
from study_cli import (
    add_study_args,
    budget_from_args,
    open_study,
    prepare_training,
    seeds_from_args,
    size_from_args,
    study_config,
)
from study_data import Data, batch_order
from study_statistics import interpolate_curve, paired_difference, spread
from study_training import Budget, lambda_parameters, seeded_model, train

NAME = "uptrain"


@dataclass(frozen=True)
class Arm:
    """One way to continue from the pre-trained Llama."""

    variant: str  # BASELINE: the Llama itself, continued
    init: str | None = None  # the converter's --init
    lambda_overrides: dict = field(default_factory=dict)  # config fields changed after conversion (other inits)
    lambda_lr_scale: float = 1.0  # λ learning rate = continuation lr × this
    description: str = ""


ARMS = {
    "llama": Arm(BASELINE, description="(a) the Llama, continued as it is"),
    "learnable-preserve": Arm("learnable", "preserve", description="(b) converted, λ_first = 0, λ_self = 1"),
    "learnable_plus-preserve": Arm("learnable_plus", "preserve",
                                   description="(c) converted, λ_scale = 0, λ_self = 1 (zero logit gradient)"),
    "learnable_plus-paper": Arm("learnable_plus", "paper",
                                description="(d) converted with the paper's init: λ_scale = layers, λ_self = 0.5"),
    "learnable-paper": Arm("learnable", "paper", description="converted with the paper's init: λ = 0.5, 0.5"),
    "learnable_plus-scale0.1": Arm("learnable_plus", "preserve", {"value_residual_lambda_scale": 0.1},
                                   description="nearly preserving: λ_scale = 0.1, λ_self = 1"),
    "learnable_plus-preserve-lambda-lr30": Arm("learnable_plus", "preserve", lambda_lr_scale=30.0,
                                               description="preserve init, λ learning rate ×30"),
    "learnable-preserve-lambda-lr30": Arm("learnable", "preserve", lambda_lr_scale=30.0,
                                          description="preserve init, λ learning rate ×30"),
}
DEFAULT_ARMS = ["llama", "learnable-preserve", "learnable_plus-preserve", "learnable_plus-paper",
                "learnable_plus-preserve-lambda-lr30"]


# ---- data and checkpoints ------------------------------------------------------------------------------------------


def split_blocks(data: Data, continue_fraction: float, seed: int) -> tuple[Data, Data]:
    """(pre-training, continuation) data: a seeded random partition of the training blocks, so the continuation
    trains on text the Llama never saw, from the same distribution; validation is shared."""
    permutation = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(seed))
    cut = int(len(permutation) * (1 - continue_fraction))
    return (Data(data.tokenizer, data.train[permutation[:cut]], data.val),
            Data(data.tokenizer, data.train[permutation[cut:]], data.val))


def work_dir(args) -> Path:
    if args.work_dir:
        return Path(args.work_dir)
    key = hashlib.sha1(json.dumps(study_config(args, "pretrain_tokens", "pretrain_lr", "continue_fraction",
                                               "pretrain_seed"), sort_keys=True).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"resformer-bench-uptrain-{key}"


def checkpoint_folder(store: RunStore, folder: Path) -> Path:
    """Where the stored pre-training run's Llama and its conversions live: named after its validation curve, so a
    retrained Llama never meets conversions of an earlier one."""
    digest = hashlib.sha1(json.dumps(store["pretrain"]["curve"]).encode()).hexdigest()[:10]
    return folder / f"pretrained-{digest}"


def pretrain_llama(store: RunStore, args, data: Data, folder: Path, device) -> Path:
    """The pre-trained Llama's folder, training and saving it first if needed."""
    if "pretrain" in store and (checkpoint_folder(store, folder) / "llama" / "config.json").is_file():
        return checkpoint_folder(store, folder) / "llama"
    budget = Budget(tokens=args.pretrain_tokens, batch_size=args.batch_size, seq_len=args.seq_len,
                    lr=args.pretrain_lr, warmup=args.warmup, weight_decay=args.weight_decay,
                    eval_every=args.eval_every)
    print("pre-training the Llama", flush=True)
    model = seeded_model(BASELINE, size_from_args(args), data, args.seq_len, args.pretrain_seed, device)
    order = batch_order(len(data.train), budget.batch_size, budget.steps, args.pretrain_seed)
    result = train(model, data, budget, order, device, label="llama pre-training")
    result["budget"] = budget.describe()
    store.runs["pretrain"] = result
    checkpoint = checkpoint_folder(store, folder) / "llama"
    model.save_pretrained(checkpoint)
    store.save()  # after the checkpoint: a stored pre-training run always has its Llama on disk
    return checkpoint


def converted(arm_name: str, llama: Path) -> Path:
    """The arm's converted checkpoint, made once (beside the Llama) with the real converter."""
    arm = ARMS[arm_name]
    if arm.variant == BASELINE:
        return llama
    destination = llama.parent / f"{arm.variant}-{arm.init}"
    if not (destination / "config.json").is_file():
        report = convert_llama_checkpoint(llama, destination, variant=arm.variant, init=arm.init,
                                          verify=arm.init == "preserve", progress=False)
        print(report.summary(), flush=True)
    return destination


def load_arm(arm_name: str, checkpoint: Path, device):
    arm = ARMS[arm_name]
    if arm.variant == BASELINE:
        return LlamaForCausalLM.from_pretrained(checkpoint).to(device)
    return ResFormerForCausalLM.from_pretrained(checkpoint, **arm.lambda_overrides).to(device)


# ---- λ ---------------------------------------------------------------------------------------------------------


def lambda_state(model) -> dict | None:
    """Effective (λ_first, λ_self) per layer and the raw λ parameters (offsets from the config's initial values)."""
    if not hasattr(model, "value_residual_lambdas"):
        return None
    raw = {name: param.detach().cpu().float().reshape(-1).tolist()
           for name, param in model.base_model.value_residual.named_parameters()}
    return {"table": model.value_residual_lambdas().tolist(), "raw": raw}


def initial_gradients(model, data: Data, args, device) -> dict:
    """max |∂loss/∂p| of every λ parameter on the first continuation batches, at the converted starting point."""
    if not lambda_parameters(model):
        return {}
    model.train()
    batch = data.train[: args.batch_size].to(device)
    model.zero_grad(set_to_none=True)
    model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
    gradients = {name: float(p.grad.abs().max()) if p.grad is not None else 0.0
                 for name, p in model.base_model.value_residual.named_parameters()}
    model.zero_grad(set_to_none=True)
    return gradients


def run_arm(arm_name: str, seed: int, args, data: Data, checkpoint: Path, device) -> dict:
    model = load_arm(arm_name, checkpoint, device)
    gradients = initial_gradients(model, data, args, device)
    budget = budget_from_args(args)
    order = batch_order(len(data.train), budget.batch_size, budget.steps, seed)
    result = train(model, data, budget, order, device, label=f"{arm_name} seed {seed}", probe=lambda_state,
                   lambda_lr_scale=ARMS[arm_name].lambda_lr_scale)
    result["initial_lambda_gradients"] = gradients
    return result


# ---- report ------------------------------------------------------------------------------------------------------


def lambda_summary(probes: list[dict | None]) -> tuple[float, float, float, float, float]:
    """(λ_first start, end, λ_self start, end: means over receiving layers; largest |Δλ| of any layer)."""
    start, end = np.array(probes[0]["table"])[1:], np.array(probes[-1]["table"])[1:]
    return start[:, 0].mean(), end[:, 0].mean(), start[:, 1].mean(), end[:, 1].mean(), np.abs(end - start).max()


def write_report(store: RunStore, arms: list[str], seeds: list[int], out: Path) -> None:
    seeds = [s for s in seeds if all(f"{a}/seed{s}" in store for a in arms)]
    if "pretrain" not in store or not seeds:
        print("no continuation seed has finished every arm yet; nothing to report")
        return
    meta = store.meta
    base = {s: store[f"llama/seed{s}"] for s in seeds}
    final_tokens = base[seeds[0]]["curve"][-1][0]
    checkpoints = [final_tokens // 4, final_tokens // 2, final_tokens]
    rows, lambda_rows, gradient_rows = [], [], []
    for arm in arms:
        runs = {s: store[f"{arm}/seed{s}"] for s in seeds}
        finals = [runs[s]["final_val_loss"] for s in seeds]
        start = runs[seeds[0]]["curve"][0][1]
        row = [f"`{arm}`", ARMS[arm].description, f"{start:.4f}", spread(finals).format(".4f")]
        if arm == "llama":
            row += ["—"] * (len(checkpoints) + 1)
        else:
            for tokens in checkpoints:
                d = paired_difference([float(interpolate_curve(runs[s]["curve"], [tokens])[0]) for s in seeds],
                                      [float(interpolate_curve(base[s]["curve"], [tokens])[0]) for s in seeds])
                row.append(f"{d.mean:+.4f} ± {d.std:.4f}")
            d = paired_difference(finals, [base[s]["final_val_loss"] for s in seeds])
            row.append(f"[{d.low:+.4f}, {d.high:+.4f}], {d.negative}/{d.n} lower: {d.verdict()}")
        rows.append(row)
        if runs[seeds[0]]["probes"][0] is not None:
            summaries = np.array([lambda_summary(runs[s]["probes"]) for s in seeds])
            mean = summaries.mean(axis=0)
            ends = np.mean([np.array(runs[s]["probes"][-1]["table"])[1:] for s in seeds], axis=0)
            lambda_rows.append([f"`{arm}`", f"{mean[0]:.3f} → {mean[1]:.3f}", f"{mean[2]:.3f} → {mean[3]:.3f}",
                                f"{mean[4]:.3f}", ", ".join(f"{a:.2f}/{b:.2f}" for a, b in ends)])
            gradients = runs[seeds[0]]["initial_lambda_gradients"]
            gradient_rows.append([f"`{arm}`"] + [", ".join(f"{k.replace('lambda_', '')} {v:.2e}"
                                                           for k, v in gradients.items())])
    pretrain = store["pretrain"]
    lines = [
        "# Uptraining a converted Llama vs continuing the Llama (CPU scale)",
        f"Regenerate: `{meta['command']}`. {meta['environment']}",
        f"Model: {meta['size']}, context {store.config['seq_len']}. Data: {meta['data']}. The training blocks are "
        f"split at random: {1 - store.config['continue_fraction']:.0%} for pre-training, "
        f"{store.config['continue_fraction']:.0%} for the continuation (text the Llama never saw).",
        f"Pre-training (one Llama, seed {store.config['pretrain_seed']}): {pretrain['budget']}; final validation "
        f"loss {pretrain['final_val_loss']:.4f}. Continuation of every arm: {meta['budget']}; continuation seeds "
        f"{', '.join(map(str, seeds))} set the batch order, the same for every arm within a seed. Conversions by "
        "`resformer_hf.convert_llama_checkpoint` (preserve conversions verified to reproduce the Llama's logits).",
        "",
        markdown_table(["arm", "what", "val loss at the start", "final val loss (mean ± std)"]
                       + [f"Δ vs Llama at {t / 1e6:.2f}M tokens" for t in checkpoints]
                       + ["final Δ: 95% t-interval, seeds lower, verdict"], rows),
        "",
        "Δ is per continuation seed (arm minus the Llama continued on the same batches), mean ± std over seeds; "
        "negative is better for the arm. *At the start* is the validation loss of the converted checkpoint before "
        "any continuation step (preserve conversions equal the Llama's; the paper init changes the function).",
        "",
        "How the λ moved over the continuation (mean over seeds; λ averaged over the receiving layers 1..L−1):",
        "",
        markdown_table(["arm", "λ_first start → end", "λ_self start → end", "largest change of a λ",
                        "final λ_first/λ_self per layer 1..L−1"], lambda_rows),
        "",
        "Gradient each λ parameter gets on the first continuation batch at the converted starting point "
        "(max abs ∂loss/∂p; `*_offset` are the stored offsets from the initial values):",
        "",
        markdown_table(["arm", "max abs gradient per λ parameter"], gradient_rows),
        "",
        f"![uptraining]({NAME}.png)",
        "",
    ]
    (out / f"{NAME}.md").write_text("\n".join(lines))
    plot(store, arms, seeds, out)


def plot(store: RunStore, arms: list[str], seeds: list[int], out: Path) -> None:
    plt = pyplot()
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 4.6))
    grid = [t for t, _ in store[f"llama/seed{seeds[0]}"]["curve"]]
    tokens = np.array(grid) / 1e6
    base = np.array([interpolate_curve(store[f"llama/seed{s}"]["curve"], grid) for s in seeds])
    for index, arm in enumerate(arms):
        color = "black" if arm == "llama" else f"C{index}"
        runs = [store[f"{arm}/seed{s}"] for s in seeds]
        losses = np.array([interpolate_curve(r["curve"], grid) for r in runs])
        for axes, values in ((left, losses), (middle, losses - base)):
            mean = values.mean(axis=0)
            std = values.std(axis=0, ddof=1) if len(seeds) > 1 else np.zeros_like(mean)
            axes.plot(tokens, mean, color=color, label=arm)
            axes.fill_between(tokens, mean - std, mean + std, color=color, alpha=0.15, lw=0)
        if runs[0]["probes"][0] is not None:
            first = np.mean([[np.mean(np.array(p["table"])[1:, 0]) for p in r["probes"]] for r in runs], axis=0)
            right.plot(tokens, first, color=color, label=arm)
    final = base[:, -1].mean()
    left.set_ylim(final - 0.3, final + 1.0)
    left.set(xlabel="continuation tokens (M)", ylabel="validation loss", title="Validation loss (mean ± std)")
    middle.axhline(0, color="grey", lw=1)
    middle.set(xlabel="continuation tokens (M)", ylabel="val loss − continued Llama (same seed)",
               title="Paired difference to the continued Llama")
    middle.set_ylim(-0.15, 0.3)
    right.set(xlabel="continuation tokens (M)", ylabel="mean λ_first over layers 1..L−1", title="λ_first")
    for axes in (left, middle, right):
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out / f"{NAME}.png", dpi=120)
    plt.close(figure)


# ---- main ----------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(parser)
    add_study_args(parser, tokens=500_000, eval_every=25)
    parser.set_defaults(lr=1e-3)
    parser.add_argument("--pretrain-tokens", type=int, default=1_200_000, help="the Llama's pre-training tokens")
    parser.add_argument("--pretrain-lr", type=float, default=3e-3, help="the Llama's pre-training peak lr")
    parser.add_argument("--pretrain-seed", type=int, default=0, help="the Llama's init, order and data split")
    parser.add_argument("--continue-fraction", type=float, default=0.4,
                        help="share of the training blocks kept for the continuation (default 0.4)")
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=sorted(ARMS), metavar="ARM",
                        help=f"continuations to compare (default {' '.join(DEFAULT_ARMS)}; all: {' '.join(ARMS)})")
    parser.add_argument("--work-dir", default=None, help="checkpoints folder (default: under the temp directory)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    args = parser.parse_args(argv)
    if "llama" not in args.arms:
        parser.error("--arms must include 'llama': every difference is to the continued Llama")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per run would drown the training log
    seeds = seeds_from_args(args)
    store = open_study(args, NAME, "pretrain_tokens", "pretrain_lr", "pretrain_seed", "continue_fraction")
    if not args.report_only:
        device, data = prepare_training(store, args, "bench_uptrain.py", argv)
        pre, cont = split_blocks(data, args.continue_fraction, args.pretrain_seed)
        folder = work_dir(args)
        llama = pretrain_llama(store, args, pre, folder, device)
        for seed in seeds:
            for arm in args.arms:
                checkpoint = converted(arm, llama)
                store.run(f"{arm}/seed{seed}", run_arm, arm, seed, args, cont, checkpoint, device)
    write_report(store, args.arms, seeds, args.out)
    print(f"wrote {args.out / f'{NAME}.md'}")


if __name__ == "__main__":
    main()
