"""The pre-training study's report, and the per-arm seed summary the context-length and baseline reports share:
final loss over seeds, the paired difference to the same seed's Llama with its t-interval, the paper's
fewer-tokens-to-match metric, time ratio, attention entropy, token similarity and the learned λ."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from scipy import stats

from benchmarks.common import BASELINE, markdown_table, pyplot
from benchmarks.studies.results import CellRuns, Results
from benchmarks.studies.seed_statistics import interpolate_curve, paired_difference, spread, tokens_to_reach


def complete_seeds(cell: CellRuns, arms: list[str], seeds: list[int]) -> list[int]:
    """The seeds every arm finished."""
    return [s for s in seeds if all(f"{a}/seed{s}" in cell for a in arms)]


def summarize(cell: CellRuns, arms: list[str], seeds: list[int]) -> dict:
    """Everything a seed table says, computed once, over the seeds where every arm (and Llama) finished."""
    complete = complete_seeds(cell, arms, seeds)
    summary = {"seeds": complete, "variants": {}}
    if not complete:  # nothing to summarise yet (an interrupted study)
        return summary
    runs = {a: {s: cell[f"{a}/seed{s}"] for s in complete} for a in arms}
    base = runs[BASELINE]
    for arm in arms:
        finals = [runs[arm][s]["final_val_loss"] for s in complete]
        budgets = [base[s]["curve"][-1][0] for s in complete]
        reached = [tokens_to_reach(runs[arm][s]["curve"], base[s]["final_val_loss"]) for s in complete]
        fewer = [1 - r / b for r, b in zip(reached, budgets) if r is not None]
        entry = {
            "final": spread(finals),
            "fewer_tokens": spread(fewer) if fewer else None,
            "not_reached": sum(r is None for r in reached),
            "time_ratio": spread([runs[arm][s]["train_seconds"] / base[s]["train_seconds"] for s in complete]),
            "entropy": float(np.mean([np.mean(runs[arm][s]["attention_entropy"]) for s in complete])),
            "similarity": float(np.mean([runs[arm][s]["token_similarity"][-2] for s in complete])),
            "lambdas": np.mean([runs[arm][s]["lambdas"] for s in complete], axis=0).tolist(),
            "parameters": runs[arm][complete[0]]["non_embedding_parameters"],
        }
        if arm != BASELINE:
            entry["delta"] = paired_difference(finals, [base[s]["final_val_loss"] for s in complete])
            if len(fewer) == len(complete):
                entry["fewer_test"] = paired_difference(fewer, [0.0] * len(fewer))
        summary["variants"][arm] = entry
    return summary


def fewer_tokens(entry: dict, never: str = "not reached") -> str:
    """`mean% ± std%` of the tokens an arm saves to reach Llama's final loss (and how many seeds never did)."""
    if entry["fewer_tokens"] is None:
        return "not reached"
    note = f" ({entry['not_reached']} seed(s) {never})" if entry["not_reached"] else ""
    return f"{100 * entry['fewer_tokens'].mean:.1f}% ± {100 * entry['fewer_tokens'].std:.1f}%{note}"


def render(results: Results) -> Path | None:
    cell, arms = results.only, results.arms
    if BASELINE not in arms:
        raise SystemExit(f"the report needs the {BASELINE!r} baseline among the arms")
    summary = summarize(cell, arms, results.seeds)
    complete = summary["seeds"]
    if not complete:
        print("no seed has finished every arm yet; nothing to report")
        return None
    rows = []
    for arm, e in summary["variants"].items():
        if arm == BASELINE:
            delta = verdict = fewer_test = fewer = "—"
        else:
            d = e["delta"]
            delta, verdict, fewer = d.describe(), f"{d.negative}/{d.n} seeds lower; {d.verdict()}", fewer_tokens(e)
            t = e.get("fewer_test")
            fewer_test = "—" if t is None else f"[{100 * t.low:+.1f}%, {100 * t.high:+.1f}%]"
        rows.append([f"`{arm}`", f"{e['parameters'] / 1e6:.3f}M", e["final"].format(".4f"), delta, verdict, fewer,
                     fewer_test, e["time_ratio"].format(".2f"), f"{e['entropy']:.3f}", f"{e['similarity']:.3f}"])
    per_seed = [[f"`{a}`"] + [f"{cell[f'{a}/seed{s}']['final_val_loss']:.4f}" for s in complete] for a in arms]
    meta = cell.meta
    lines = [
        "# Pre-training with seeds: Llama vs value-residual variants (CPU scale)",
        f"{results.regenerate} {meta['environment']}",
        f"Model: {meta['size']}, context {cell.config['seq_len']}; {meta['budget']}. Data: {meta['data']}. "
        f"Seeds {', '.join(map(str, complete))}: each seed sets the initial weights and the batch order, the same for "
        "every model within a seed.",
        "",
        markdown_table(
            ["model", "non-embedding params", "final val loss (mean ± std)",
             f"Δ vs Llama, paired (mean ± std [{int(100 * 0.95)}% t-interval])", "seed noise check",
             "fewer tokens to reach Llama's final loss", "its 95% t-interval", "train time ratio",
             "attention entropy", "token similarity (last layer)"],
            rows,
        ),
        "",
        "Δ is computed per seed (variant minus that seed's Llama) and then averaged; a difference *exceeds seed "
        f"noise* when its t-interval excludes 0 (with {len(complete)} seeds the interval is "
        f"±{stats.t.ppf(0.975, max(1, len(complete) - 1)):.2f}·std/√{len(complete)}, so only consistent differences "
        "pass). *Fewer tokens* is the paper's metric (20.3% at 82M–468M parameters): "
        "`1 − tokens_to_reach(variant curve, Llama's final loss) / budget`, per seed, interpolating linearly between "
        "evaluations. Train time ratios are wall-clock on a shared machine (noisy; `cost.md` has the real costs). "
        "Attention entropy (nats, mean over layers) and token similarity (mean pairwise cosine of the last hidden "
        "state) are averaged over seeds.",
        "",
        "Final validation loss per seed:",
        "",
        markdown_table(["model"] + [f"seed {s}" for s in complete], per_seed),
    ]
    learned = [a for a in arms if a in ("learnable", "learnable_plus")]
    if learned:
        layers = len(summary["variants"][learned[0]]["lambdas"])
        lines += ["", "Learned (λ_first, λ_self) per layer after training, mean over seeds:", "", markdown_table(
            ["model"] + [str(i) for i in range(layers)],
            [[f"`{a}`"] + [f"{x:.2f}, {y:.2f}" for x, y in summary["variants"][a]["lambdas"]] for a in learned],
        )]
    path = results.write(lines, ("validation loss", ""), ("analysis", "_analysis"))
    plot(cell, arms, complete, results.image(), results.image("_analysis"))
    return path


def band(axes, tokens, values, color, label: str, width: float = 1.5) -> None:
    """Mean over seeds (rows) with a ±1 std band."""
    mean = values.mean(axis=0)
    std = values.std(axis=0, ddof=1) if len(values) > 1 else np.zeros_like(mean)
    axes.plot(tokens, mean, color=color, lw=width, label=label)
    axes.fill_between(tokens, mean - std, mean + std, color=color, alpha=0.15, lw=0)


def plot(cell: CellRuns, arms: list[str], seeds: list[int], curves: Path, analysis: Path) -> None:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    grid = [t for t, _ in cell[f"{BASELINE}/seed{seeds[0]}"]["curve"][1:]]
    base = np.array([interpolate_curve(cell[f"{BASELINE}/seed{s}"]["curve"], grid) for s in seeds])
    lows = []
    for index, arm in enumerate(arms):
        losses = np.array([interpolate_curve(cell[f"{arm}/seed{s}"]["curve"], grid) for s in seeds])
        color = "black" if arm == BASELINE else f"C{index}"
        for axes, values in ((left, losses), (right, losses - base)):
            band(axes, np.array(grid) / 1e6, values, color, arm, 2 if arm == BASELINE else 1.5)
        lows.append(losses.min())
    left.set_ylim(min(lows) - 0.05, min(lows) + 1.5)
    left.set(xlabel="training tokens (M)", ylabel="validation loss",
             title=f"Validation loss, mean ± std over {len(seeds)} seeds")
    right.axhline(0, color="grey", lw=1)
    right.set(xlabel="training tokens (M)", ylabel="val loss − same seed's Llama", title="Paired difference to Llama")
    save(plt, figure, (left, right), curves)

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, arm in enumerate(arms):
        color = "black" if arm == BASELINE else f"C{index}"
        entropy = np.mean([cell[f"{arm}/seed{s}"]["attention_entropy"] for s in seeds], axis=0)
        similarity = np.mean([cell[f"{arm}/seed{s}"]["token_similarity"] for s in seeds], axis=0)
        left.plot(range(len(entropy)), entropy, marker="o", color=color, label=arm)
        right.plot(range(len(similarity)), similarity, marker="o", color=color, label=arm)
    left.set(xlabel="layer", ylabel="mean attention entropy (nats)", title="Attention entropy (mean over seeds)")
    right.set(xlabel="hidden state (0 = embeddings)", ylabel="mean pairwise cosine", title="Token similarity")
    save(plt, figure, (left, right), analysis)


def save(plt, figure, axes_list, path: Path, legend: bool = True) -> None:
    """Grid, legends, tight layout; written at 120 dpi and closed."""
    for axes in axes_list:
        axes.grid(alpha=0.3)
        if legend:
            axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
