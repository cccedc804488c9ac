"""The parameter-efficiency study's report: validation loss against non-embedding parameters N for Llama and a
ResFormer variant at several sizes, fitted (`L = α − β·ln N`, the reported fit; a power law with an irreducible loss
for comparison) and solved for the N at which the ResFormer reaches the Llama fit's loss at the largest size."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from benchmarks.common import BASELINE, markdown_table, pyplot
from benchmarks.studies.results import CellRuns, Results
from benchmarks.studies.seed_statistics import (
    fit_log_linear,
    fit_power_law,
    paired_difference,
    parameter_saving,
    spread,
)


def run_key(variant: str, size_name: str, seed: int) -> str:
    return f"{variant}/{size_name}/seed{seed}"


def flatten(results: Results) -> CellRuns:
    """Every size's runs in one view, keyed `ARM/SIZE/seedN`, with the study's settings and measurement lines."""
    runs = {}
    for size, cell in results.cells.items():
        for key, run in cell.runs.items():
            arm, seed = key.rsplit("/seed", 1)
            runs[run_key(arm, size, int(seed))] = run
    first = next(iter(results.cells.values()))
    meta = next((cell.meta for cell in results.cells.values() if cell.runs), first.meta)
    return CellRuns(runs, first.config, meta)


# ---- analysis ------------------------------------------------------------------------------------------------------


def points(store: CellRuns, variant: str, sizes: list[str], seeds: list[int]) -> tuple[list[float], list[float]]:
    """(non-embedding parameters, final validation loss) of every finished run of `variant`."""
    found = [store[run_key(variant, z, s)] for z in sizes for s in seeds if run_key(variant, z, s) in store]
    return [r["non_embedding_parameters"] for r in found], [r["final_val_loss"] for r in found]


def analyse(store: CellRuns, variant: str, sizes: list[str], seeds: list[int]) -> dict:
    """Fits on all runs, per-seed fits (their spread is the seed noise of the saving) and per-size paired Δ."""
    complete_sizes = [z for z in sizes if all(run_key(v, z, s) in store for v in (BASELINE, variant) for s in seeds)]
    result = {"sizes": complete_sizes, "rows": [], "fits": {}, "per_seed_saving": {}}
    if len(complete_sizes) < 2:
        return result
    for z in complete_sizes:
        base = [store[run_key(BASELINE, z, s)]["final_val_loss"] for s in seeds]
        other = [store[run_key(variant, z, s)]["final_val_loss"] for s in seeds]
        result["rows"].append({
            "size": z,
            "llama_parameters": store[run_key(BASELINE, z, seeds[0])]["non_embedding_parameters"],
            "parameters": store[run_key(variant, z, seeds[0])]["non_embedding_parameters"],
            "llama": spread(base), "resformer": spread(other), "delta": paired_difference(other, base),
        })
    largest = max(store[run_key(BASELINE, complete_sizes[-1], s)]["non_embedding_parameters"] for s in seeds)
    result["largest"] = largest
    for name, fit in (("log-linear", fit_log_linear), ("power law", fit_power_law)):
        fits = {v: fit(*points(store, v, complete_sizes, seeds)) for v in (BASELINE, variant)}
        if any(f is None for f in fits.values()):
            continue
        result["fits"][name] = fits
        result["per_seed_saving"][name] = []
        for s in seeds:
            seed_fits = {v: fit(*points(store, v, complete_sizes, [s])) for v in (BASELINE, variant)}
            if all(f is not None for f in seed_fits.values()):
                result["per_seed_saving"][name].append(parameter_saving(seed_fits[BASELINE], seed_fits[variant],
                                                                        largest))
    return result


def residual_rms(fit, parameters: list[float], losses: list[float]) -> float:
    return float(np.sqrt(np.mean((fit.loss(parameters) - np.asarray(losses)) ** 2)))


def render(results: Results) -> Path | None:
    sizes, seeds = list(results.cells), results.seeds
    variant = next(arm for arm in results.arms if arm != BASELINE)
    store = flatten(results)
    a = analyse(store, variant, sizes, seeds)
    if len(a["sizes"]) < 2:
        print("fewer than two sizes have finished every run; nothing to report yet")
        return None
    meta = store.meta
    rows = [[f"{r['size']}", f"{r['llama_parameters'] / 1e6:.3f}M", f"{r['parameters'] / 1e6:.3f}M",
             r["llama"].format(".4f"), r["resformer"].format(".4f"),
             f"{r['delta'].mean:+.4f} ± {r['delta'].std:.4f}", f"{r['delta'].negative}/{r['delta'].n}"]
            for r in a["rows"]]
    fit_rows = []
    for name, fits in a["fits"].items():
        saving = parameter_saving(fits[BASELINE], fits[variant], a["largest"])
        per_seed = a["per_seed_saving"][name]
        finite = [x for x in per_seed if math.isfinite(x)]
        rms = [residual_rms(fits[v], *points(store, v, a["sizes"], seeds)) for v in (BASELINE, variant)]
        seed_text = ", ".join("—" if not math.isfinite(x) else f"{100 * x:.1f}%" for x in per_seed)
        if len(finite) > 1:
            seed_text += f" (mean {100 * spread(finite).mean:.1f}% ± {100 * spread(finite).std:.1f}%)"
        fit_rows.append([name, fits[BASELINE].describe(), fits[variant].describe(), f"{rms[0]:.4f} / {rms[1]:.4f}",
                         "—" if not math.isfinite(saving) else f"{100 * saving:.1f}%", seed_text])
    lines = [
        f"# Parameter efficiency: Llama vs `{variant}` at {len(a['sizes'])} sizes (CPU scale)",
        f"{results.regenerate} {results.environments()}",
        f"Sizes `HIDDENxLAYERS`, head size {store.config['head_dim']}, MLP 8/3 of hidden; context "
        f"{store.config['seq_len']}; {meta['budget']} for every model. Data: {meta['data']}. Seeds "
        f"{', '.join(map(str, seeds))} (init and batch order, the same for both models within a seed).",
        "",
        markdown_table(["size", "Llama non-embedding params", f"`{variant}` params", "Llama final val loss",
                        f"`{variant}` final val loss", "Δ paired (mean ± std)", "seeds lower"], rows),
        "",
        "Fits of final validation loss against non-embedding parameters N (every run one point):",
        "",
        markdown_table(["fit", "Llama", f"`{variant}`", "residual RMS (Llama / ResFormer)",
                        f"fewer parameters to match Llama's fitted loss at N = {a['largest'] / 1e6:.2f}M",
                        "same, fitted per seed"], fit_rows),
        "",
        "*Fewer parameters* is `1 − N_res / N_max`, N_res solving `fit_res(N) = fit_llama(N_max)`; the paper "
        "reports 16.11% at 82M–468M parameters. The log-linear fit is the reported one: over this range of N its two "
        "parameters are determined by the data, while the power law's offset c and exponent b trade off against each "
        "other (one residual degree of freedom in the size means); the per-seed column refits each seed alone, so its "
        "spread is the seed noise of the saving.",
    ]
    path = results.write(lines, ("loss vs parameters", ""))
    plot(store, variant, a, seeds, results.image())
    return path


def plot(store: CellRuns, variant: str, analysis: dict, seeds: list[int], path: Path) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.8))
    grid = np.geomspace(min(points(store, BASELINE, analysis["sizes"], seeds)[0]) * 0.8, analysis["largest"] * 1.15)
    for v in (BASELINE, variant):
        color = "black" if v == BASELINE else "C1"
        n, loss = points(store, v, analysis["sizes"], seeds)
        axes.scatter(n, loss, color=color, s=18, label=f"{v} runs", zorder=3)
        for name, style in (("log-linear", "-"), ("power law", ":")):
            if name in analysis["fits"]:
                axes.plot(grid, analysis["fits"][name][v].loss(grid), style, color=color, lw=1.3,
                          label=f"{v}: {name} fit")
    fit = analysis["fits"]["log-linear"]
    target = float(fit[BASELINE].loss(analysis["largest"]))
    matched = fit[variant].parameters_for(target)
    axes.axhline(target, color="grey", lw=0.8, ls="--")
    if math.isfinite(matched):
        axes.annotate("", xy=(matched, target), xytext=(analysis["largest"], target),
                      arrowprops=dict(arrowstyle="->", color="C1"))
        axes.set_title(f"{variant} matches Llama's loss at N = {analysis['largest'] / 1e6:.2f}M with "
                       f"{100 * (1 - matched / analysis['largest']):.1f}% fewer parameters", fontsize="medium")
    axes.set_xscale("log")
    axes.set(xlabel="non-embedding parameters N", ylabel="final validation loss")
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
