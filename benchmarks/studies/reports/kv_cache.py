"""The SVFormer + GQA study's report: each arm's measured KV-cache bytes per token, final loss and paired difference
to the first arm (the Llama whose cache equals SVFormer's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.common import BASELINE, markdown_table, pyplot
from benchmarks.studies.results import CellRuns, Results
from benchmarks.studies.seed_statistics import interpolate_curve, paired_difference, spread


def render(results: Results) -> Path | None:
    store, arms = results.only, results.arms
    seeds = [s for s in results.seeds if all(f"{a}/seed{s}" in store for a in arms)]
    if not seeds:
        print("no seed has finished every arm yet; nothing to report")
        return None
    settings = store.settings
    reference = arms[0]
    base = [store[f"{reference}/seed{s}"]["final_val_loss"] for s in seeds]
    mha = max(store[f"{a}/seed{seeds[0]}"]["cache_bytes_per_token"] for a in arms
              if results.study.arm(a).model == BASELINE)
    rows = []
    for arm in arms:
        first = store[f"{arm}/seed{seeds[0]}"]
        finals = [store[f"{arm}/seed{s}"]["final_val_loss"] for s in seeds]
        declared = results.study.arm(arm)
        row = [f"`{declared.model}`", declared.size(settings).kv_heads or settings.heads,
               f"{first['non_embedding_parameters'] / 1e6:.3f}M",
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
        f"{results.regenerate} {meta['environment']}",
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
    ]
    path = results.write(lines, ("svformer gqa", ""))
    plot(store, arms, seeds, results.image())
    return path


def plot(store: CellRuns, arms: list[str], seeds: list[int], path: Path) -> None:
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
    figure.savefig(path, dpi=120)
    plt.close(figure)
