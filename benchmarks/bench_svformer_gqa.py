"""SVFormer combined with GQA at equal KV-cache bytes: SVFormer+GQA vs a Llama with fewer kv heads (CPU scale).

SVFormer's layers n ≥ 1 attend over layer 0's values, so its cache holds keys for L layers and values once:
(L + 1)·h_kv head-vectors per token, against 2L·h_kv for a Llama. At L = 5 layers an SVFormer with 5 kv heads and
a Llama with 3 kv heads (of 15 query heads) hold exactly the same bytes (6·5 = 10·3). Both are trained from scratch on
the same tokens, seeds and data order, next to reference Llamas with more kv heads; cache bytes are measured with
`resformer_hf.cache_nbytes` on a real forward pass with `use_cache=True`.

    python benchmarks/bench_svformer_gqa.py                  # default: 4 models × 3 seeds, ~35 min on 2 idle cores
    python benchmarks/bench_svformer_gqa.py --device cuda --hidden-size 1920 --tokens 100000000   # head size 128

Arms are `VARIANT:KV_HEADS` (`--arms`); the first is the equal-cache Llama every difference is measured against.
Resumable like every study. Writes `benchmarks/results/svformer_gqa.{json,md,png}`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from resformer_hf import cache_nbytes
from resformer_hf._compat import cache_of

from common import BASELINE, RESULTS_DIR, add_device_args, markdown_table, pyplot
from run_store import RunStore
from study_cli import add_study_args, budget_from_args, open_study, prepare_training, seeds_from_args, size_from_args
from study_data import batch_order
from study_statistics import interpolate_curve, paired_difference, spread
from study_training import non_embedding_parameters, seeded_model, train

NAME = "svformer_gqa"
DEFAULT_ARMS = ["llama:3", "svformer:5", "llama:5", "llama:15"]


def parse_arm(text: str, heads: int) -> tuple[str, int]:
    variant, _, kv = text.partition(":")
    try:
        kv_heads = int(kv)
    except ValueError:
        raise SystemExit(f"--arms takes VARIANT:KV_HEADS items such as svformer:5, got {text!r}") from None
    if heads % kv_heads:
        raise SystemExit(f"arm {text}: {heads} query heads are not a multiple of {kv_heads} kv heads")
    return variant, kv_heads


@torch.no_grad()
def cache_bytes_per_token(model, block: torch.Tensor) -> float:
    """`cache_nbytes` of the cache a forward pass over one block builds, per token of the block."""
    past = cache_of(model(input_ids=block[None], use_cache=True))
    return cache_nbytes(past) / block.numel()


def run_one(arm: str, seed: int, args, data, device) -> dict:
    variant, kv_heads = parse_arm(arm, args.heads)
    budget = budget_from_args(args)
    model = seeded_model(variant, size_from_args(args, kv_heads=kv_heads), data, args.seq_len, seed, device)
    order = batch_order(len(data.train), budget.batch_size, budget.steps, seed)
    result = train(model, data, budget, order, device, label=f"{arm} seed {seed}")
    result["cache_bytes_per_token"] = cache_bytes_per_token(model, data.val[0].to(device))
    result["non_embedding_parameters"] = non_embedding_parameters(model)
    return result


def write_report(store: RunStore, arms: list[str], seeds: list[int], out: Path) -> None:
    seeds = [s for s in seeds if all(f"{a}/seed{s}" in store for a in arms)]
    if not seeds:
        print("no seed has finished every arm yet; nothing to report")
        return
    reference = arms[0]
    base = [store[f"{reference}/seed{s}"]["final_val_loss"] for s in seeds]
    mha = max(store[f"{a}/seed{seeds[0]}"]["cache_bytes_per_token"] for a in arms if a.startswith(f"{BASELINE}:"))
    rows = []
    for arm in arms:
        first = store[f"{arm}/seed{seeds[0]}"]
        finals = [store[f"{arm}/seed{s}"]["final_val_loss"] for s in seeds]
        variant, kv = parse_arm(arm, store.config["heads"])
        row = [f"`{variant}`", kv, f"{first['non_embedding_parameters'] / 1e6:.3f}M",
               f"{first['cache_bytes_per_token']:.0f}", f"{first['cache_bytes_per_token'] / mha:.3f}",
               spread(finals).format(".4f")]
        if arm == reference:
            row += ["—", "—"]
        else:
            d = paired_difference(finals, base)
            row += [d.describe(), f"{d.negative}/{d.n}: {d.verdict()}"]
        rows.append(row)
    meta = store.meta
    lines = [
        "# SVFormer + GQA vs Llama with fewer kv heads, at equal KV-cache bytes (CPU scale)",
        f"Regenerate: `{meta['command']}`. {meta['environment']}",
        f"Model: {meta['size']} (query heads; kv heads per row), context {store.config['seq_len']}; "
        f"{meta['budget']}. Data: {meta['data']}. Seeds {', '.join(map(str, seeds))} (init and batch order, the same "
        "for every model within a seed).",
        "",
        markdown_table(["model", "kv heads", "non-embedding params", "KV cache bytes per token (fp32, measured)",
                        "cache / Llama MHA", "final val loss (mean ± std)",
                        f"Δ vs `{reference}` paired (mean ± std [95% t-interval])", "seeds lower: verdict"], rows),
        "",
        "Cache bytes are `resformer_hf.cache_nbytes` of the cache a forward pass over one validation block builds "
        "(shared storage counted once), divided by its tokens; they scale linearly with context and batch.",
        "",
        f"![svformer gqa]({NAME}.png)",
        "",
    ]
    (out / f"{NAME}.md").write_text("\n".join(lines))
    plot(store, arms, seeds, out)


def plot(store: RunStore, arms: list[str], seeds: list[int], out: Path) -> None:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    grid = [t for t, _ in store[f"{arms[0]}/seed{seeds[0]}"]["curve"][1:]]
    for index, arm in enumerate(arms):
        runs = [store[f"{arm}/seed{s}"] for s in seeds]
        color = "black" if arm == arms[0] else f"C{index}"
        losses = np.array([interpolate_curve(r["curve"], grid) for r in runs])
        mean = losses.mean(axis=0)
        std = losses.std(axis=0, ddof=1) if len(seeds) > 1 else np.zeros_like(mean)
        left.plot(np.array(grid) / 1e6, mean, color=color, label=arm)
        left.fill_between(np.array(grid) / 1e6, mean - std, mean + std, color=color, alpha=0.15, lw=0)
        finals = [r["final_val_loss"] for r in runs]
        right.errorbar(runs[0]["cache_bytes_per_token"], np.mean(finals), yerr=np.std(finals, ddof=1)
                       if len(finals) > 1 else 0, fmt="o", color=color, capsize=4, label=arm)
    left.set_ylim(mean.min() - 0.1, mean.min() + 1.2)
    left.set(xlabel="training tokens (M)", ylabel="validation loss", title="Validation loss (mean ± std)")
    right.set_xscale("log")
    right.set(xlabel="KV cache bytes per token (fp32)", ylabel="final validation loss",
              title="Final loss vs KV cache (mean ± std over seeds)")
    for axes in (left, right):
        axes.grid(alpha=0.3, which="both")
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out / f"{NAME}.png", dpi=120)
    plt.close(figure)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(parser)
    add_study_args(parser, tokens=1_200_000, hidden=120, layers=5, heads=15)
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, metavar="VARIANT:KV",
                        help=f"models as VARIANT:KV_HEADS, the equal-cache Llama first "
                        f"(default {' '.join(DEFAULT_ARMS)})")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    args = parser.parse_args(argv)
    for arm in args.arms:
        parse_arm(arm, args.heads)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    seeds = seeds_from_args(args)
    store = open_study(args, NAME, "arms")
    if not args.report_only:
        device, data = prepare_training(store, args, "bench_svformer_gqa.py", argv)
        for seed in seeds:
            for arm in args.arms:
                store.run(f"{arm}/seed{seed}", run_one, arm, seed, args, data, device)
    write_report(store, args.arms, seeds, args.out)
    print(f"wrote {args.out / f'{NAME}.md'}")


if __name__ == "__main__":
    main()
