"""The paired report (`tuned_seeds`, `gated`): per grid cell (corpus) and arm, the difference to the same seed's Llama
over every seed all arms finished, its 95% t-interval and whether it exceeds seed noise; then each seed's numbers with
the λ a learnable arm ended at, so a reader sees whether a wide spread between seeds goes with where the λ went, and
for a `gated` arm the mix its gates gave the validation tokens at the end of training, layer by layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from resformer_hf.remote_code.variants import VARIANTS

from benchmarks.common import BASELINE, markdown_table, pyplot
from benchmarks.studies.reports.seeds import complete_seeds, fewer_tokens, save, summarize
from benchmarks.studies.results import CellRuns, Results
from benchmarks.studies.runner import ANALYSIS_SEQUENCES
from benchmarks.studies.seed_statistics import paired_difference, spread


def learns_lambdas(variant: str) -> bool:
    return variant in VARIANTS and VARIANTS[variant].learns_mix


def seed_rows(cell: CellRuns, arm: str, seeds: list[int]) -> tuple[list[list[str]], str]:
    """One row per seed (final loss, Δ vs that seed's Llama, the λ per receiving layer at the end of training) and
    the correlation over seeds of Δ with the mean λ_first and λ_self ("" with fewer than 3 seeds)."""
    rows, deltas, firsts, selves = [], [], [], []
    for seed in seeds:
        run, base = cell[f"{arm}/seed{seed}"], cell[f"{BASELINE}/seed{seed}"]
        delta = run["final_val_loss"] - base["final_val_loss"]
        table = np.array(run["lambdas"])[1:]  # layer 0 has no λ
        deltas.append(delta)
        firsts.append(table[:, 0].mean())
        selves.append(table[:, 1].mean())
        rows.append([str(seed), f"{run['final_val_loss']:.4f}", f"{delta:+.4f}", f"{table[:, 0].mean():.2f}",
                     f"{table[:, 1].mean():.2f}", ", ".join(f"{a:.2f}/{b:.2f}" for a, b in table)])
    if len(seeds) < 3:
        return rows, ""
    correlations = [f"{name} {np.corrcoef(values, deltas)[0, 1]:+.2f}" for name, values in
                    (("λ_first", firsts), ("λ_self", selves)) if np.std(values) > 0 and np.std(deltas) > 0]
    if not correlations:
        return rows, ""
    return rows, "; correlation over seeds of Δ with the mean " + ", with the mean ".join(correlations)


def head_to_head_rows(summaries: dict, results: Results) -> dict[str, list[list[str]]]:
    """Per reference arm (the study's `references`, else the first non-Llama arm), every other non-Llama arm against
    it, paired by seed as against Llama; a pair already shown under an earlier reference is not repeated."""
    arms = [arm for arm in results.arms if arm != BASELINE]
    tables = {}
    for index, reference in enumerate(results.study.references or arms[:1]):
        earlier = set(results.study.references[:index])
        rows = []
        for cell, summary in summaries.items():
            seeds, runs = summary["seeds"], results.cells[cell]
            for arm in arms:
                if arm == reference or arm in earlier:
                    continue
                d = paired_difference([runs[f"{arm}/seed{s}"]["final_val_loss"] for s in seeds],
                                      [runs[f"{reference}/seed{s}"]["final_val_loss"] for s in seeds])
                rows.append([f"`{cell}`", f"`{arm}`", d.describe(), f"{d.negative}/{d.n} seeds lower; {d.verdict()}"])
        if rows:
            tables[reference] = rows
    return tables


def gate_rows(cell: CellRuns, arm: str, seeds: list[int]) -> list[list[str]]:
    """One row per gated layer: the mix on V_0 its gates gave the validation tokens at the end of training
    (`value_gate_statistics`), over the seeds; none when the arm's runs have no gates."""
    statistics = [cell[f"{arm}/seed{seed}"].get("value_gate_statistics") for seed in seeds]
    if not statistics or any(entry is None for entry in statistics):
        return []
    rows = []
    for layer in sorted(statistics[0], key=int):
        per_seed = [entry[layer] for entry in statistics]
        means = spread([entry["mean"] for entry in per_seed])
        rows.append([layer, f"{means.mean:.3f} ± {means.std:.3f}", f"{np.mean([e['std'] for e in per_seed]):.3f}",
                     f"{min(e['min'] for e in per_seed):.3f} – {max(e['max'] for e in per_seed):.3f}",
                     ", ".join(f"{entry['mean']:.3f}" for entry in per_seed)])
    return rows


def described_arms(study) -> list[str]:
    """The arms' descriptions, when the study gives them (with the parameters each adds); none otherwise."""
    described = [f"`{arm.name}`: {arm.description}" for arm in study.arms if getattr(arm, "description", "")]
    return ["", "Arms: " + "; ".join(described) + "."] if described else []


def render(results: Results) -> Path | None:
    study = results.study
    summaries = {cell: summarize(runs, results.arms, results.seeds) for cell, runs in results.cells.items()}
    summaries = {cell: summary for cell, summary in summaries.items() if summary["seeds"]}
    if not summaries:
        print("no corpus has a seed that finished every arm yet; the report says what is missing")
        return results.write([
            "# Each arm against Llama at the tuned settings, on every corpus (CPU scale): not trained yet",
            results.regenerate, "",
            f"No corpus has a seed that every arm ({', '.join(f'`{arm}`' for arm in results.arms)}) finished yet, "
            f"of the seeds {', '.join(map(str, results.seeds))}; run the command above to train what is missing "
            "(runs other studies stored at the same settings are reused).",
        ])
    rows = []
    for cell, summary in summaries.items():
        for arm, e in summary["variants"].items():
            if arm == BASELINE:
                rows.append([f"`{cell}`", f"`{arm}`", len(summary["seeds"]), e["final"].format(".4f"), "—", "—", "—"])
                continue
            d = e["delta"]
            rows.append([f"`{cell}`", f"`{arm}`", len(summary["seeds"]), e["final"].format(".4f"), d.describe(),
                         f"{d.negative}/{d.n} seeds lower; {d.verdict()}", fewer_tokens(e, "never reached it")])
    first = results.cells[next(iter(summaries))]
    config = first.config
    lines = [
        f"# Each arm against Llama over {max(len(s['seeds']) for s in summaries.values())} seeds at the tuned "
        "settings, on every corpus (CPU scale)",
        f"{results.regenerate} {results.environments()}",
        f"Model: {first.meta['size']}, context {config['seq_len']}; {first.meta['budget']}: the learning rate every "
        "arm's sweep found best (`lr_sweep.md`). Within a seed every arm starts from the same initial draw and sees "
        "the same batches. Data: " + "; ".join(f"`{cell}`: {results.cells[cell].meta.get('data', '?')}"
                                                  for cell in summaries) + ".",
        *described_arms(study),
        "",
        markdown_table(["corpus", "model", "seeds", "final val loss (mean ± std)",
                        "Δ vs Llama, paired (mean ± std [95% t-interval])", "seed noise check",
                        "fewer tokens to reach Llama's final loss"], rows),
        "",
        "Δ is per seed (arm minus that seed's Llama), then averaged; it *exceeds seed noise* when the 95% t-interval "
        "excludes 0. *Fewer tokens* is the paper's metric, `1 − tokens_to_reach(arm curve, Llama's final loss) / "
        "budget`, per seed.",
    ]
    for reference, head_to_head in head_to_head_rows(summaries, results).items():
        lines += ["", f"Head to head with `{reference}`, paired by seed the same way:", "",
                  markdown_table(["corpus", "model", f"Δ vs `{reference}`, paired (mean ± std [95% t-interval])",
                                  "seed noise check"], head_to_head)]
    for cell, summary in summaries.items():
        for arm in results.arms:
            if arm == BASELINE or not learns_lambdas(study.arm(arm).model):
                continue
            per_seed, correlation = seed_rows(results.cells[cell], arm, summary["seeds"])
            lines += ["", f"`{arm}` on `{cell}`, seed by seed: the λ it ended at (λ_first/λ_self of each receiving "
                      f"layer 1..L−1; mean over them in their own columns){correlation}:", "",
                      markdown_table(["seed", "final val loss", "Δ vs that seed's Llama", "mean λ_first",
                                      "mean λ_self", "λ_first/λ_self per layer"], per_seed)]
            gates = gate_rows(results.cells[cell], arm, summary["seeds"])
            if gates:
                tokens = ANALYSIS_SEQUENCES * results.cells[cell].config["seq_len"]
                lines += ["", f"`{arm}` on `{cell}`: the mix g on V_0 its gates gave the first {ANALYSIS_SEQUENCES} "
                          f"validation blocks ({tokens} tokens) at the end of training, per gated layer (the λ above "
                          "are the mix at the gates' biases alone):", "",
                          markdown_table(["layer", "mean g (mean ± std over seeds)",
                                          "spread over tokens and kv heads (std, mean over seeds)",
                                          "range (min – max, every seed)", "mean g per seed"], gates)]
    fixed = [arm for arm in results.arms if arm != BASELINE and not learns_lambdas(study.arm(arm).model)]
    if fixed:
        lines += ["", f"{', '.join(f'`{arm}`' for arm in fixed)}: fixed λ, nothing learned to show per seed."]
    missing = [f"`{cell}`" for cell, runs in results.cells.items()
               if len(complete_seeds(runs, results.arms, results.seeds)) < len(results.seeds)]
    if missing:
        lines += ["", f"**Incomplete**: {', '.join(missing)} do not have every arm at all {len(results.seeds)} seeds "
                  f"({', '.join(map(str, results.seeds))}) yet; the tables cover the seeds every arm finished. Rerun "
                  "the command to train the rest (finished runs are kept)."]
    path = results.write(lines, ("paired differences", ""))
    plot(summaries, results.arms, results.image())
    return path


def plot(summaries: dict, arms: list[str], path: Path) -> None:
    plt = pyplot()
    figure, panels = plt.subplots(1, len(summaries), figsize=(6 * len(summaries), 4.5), squeeze=False)
    others = [arm for arm in arms if arm != BASELINE]
    for axes, (cell, summary) in zip(panels[0], summaries.items()):
        for index, arm in enumerate(others):
            d = summary["variants"][arm]["delta"]
            spread = np.linspace(-0.15, 0.15, d.n) if d.n > 1 else np.zeros(1)
            axes.scatter(index + spread, d.differences, color=f"C{index + 1}", s=14, alpha=0.6)
            half = (d.high - d.low) / 2 if np.isfinite(d.high) else 0.0
            axes.errorbar([index + 0.3], [d.mean], yerr=[[half], [half]], marker="o", capsize=4, color=f"C{index + 1}")
        axes.axhline(0, color="black", lw=1)
        axes.set_xticks(range(len(others)), others)
        axes.set(ylabel="final val loss − same seed's Llama",
                 title=f"{cell}: each seed; mean, 95% t-interval ({len(summary['seeds'])} seeds)")
    save(plt, figure, panels[0], path, legend=False)
