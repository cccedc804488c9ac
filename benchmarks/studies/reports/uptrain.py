"""The uptrain study's report: each arm's continuation against the continued source (paired per continuation seed),
how the λ moved, and the gradient every λ gets at the converted starting point."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from resformer_hf.conversion.bases import BASES

from benchmarks.common import BASELINE, markdown_table, pyplot
from benchmarks.studies.plan import PRETRAIN
from benchmarks.studies.reports.seeds import save
from benchmarks.studies.results import CellRuns, Results
from benchmarks.studies.seed_statistics import interpolate_curve, paired_difference, spread
from benchmarks.studies.uptrain import lambda_summary


def render(results: Results) -> Path | None:
    store, arms, source = results.only, results.arms, results.study.baseline
    name = BASES[store.config.get("source", BASELINE)].name  # the source's architecture, as the docs call it
    seeds = [s for s in results.seeds if all(f"{a}/seed{s}" in store for a in arms)]
    if PRETRAIN not in store or not seeds:
        print("no continuation seed has finished every arm yet; the report says what is missing")
        return results.write([
            f"# {results.study.name}: continuations of a pre-trained {name}, not trained yet", results.regenerate,
            "", f"No continuation seed has finished every arm ({', '.join(f'`{arm}`' for arm in arms)}) yet, of the "
            f"seeds {', '.join(map(str, results.seeds))}; run the command above to train what is missing (the "
            f"pre-trained {name} is shared through the run store).",
        ])
    meta = store.meta
    base = {s: store[f"{source}/seed{s}"] for s in seeds}
    final_tokens = base[seeds[0]]["curve"][-1][0]
    checkpoints = [final_tokens // 4, final_tokens // 2, final_tokens]
    rows, lambda_rows, gradient_rows = [], [], []
    for arm in arms:
        runs = {s: store[f"{arm}/seed{s}"] for s in seeds}
        finals = [runs[s]["final_val_loss"] for s in seeds]
        start = runs[seeds[0]]["curve"][0][1]
        row = [f"`{arm}`", results.study.arm(arm).description, f"{start:.4f}", spread(finals).format(".4f")]
        if arm == source:
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
            gradient_rows.append([f"`{arm}`", ", ".join(f"{k.replace('lambda_', '')} {v:.2e}"
                                                         for k, v in gradients.items()) or "— (no λ parameters)"])
    pretrain = store[PRETRAIN]
    lines = [
        f"# Uptraining a converted {name} vs continuing the {name} (CPU scale)",
        f"{results.regenerate} {results.environments()}",
        f"Model: {meta['size']}, context {store.config['seq_len']}"
        + "".join(f", {key} {value}" for key, value in store.config.get("source_fields", ()))
        + f". Data: {meta['data']}. The training blocks are split at random: "
        f"{1 - store.config['continue_fraction']:.0%} for pre-training, {store.config['continue_fraction']:.0%} for "
        f"the continuation (text the {name} never saw).",
        f"Pre-training (one {name}, transformers' own class, seed {store.config['pretrain_seed']}): "
        f"{pretrain['budget']}; final validation loss {pretrain['final_val_loss']:.4f}. Continuation of every arm: "
        f"{meta['budget']}; continuation seeds {', '.join(map(str, seeds))} set the batch order, the same for every "
        "arm within a seed. Conversions by `resformer_hf.convert_llama_checkpoint` (preserve conversions verified to "
        f"reproduce the {name}'s logits).",
        "",
        markdown_table(["arm", "what", "val loss at the start", "final val loss (mean ± std)"]
                       + [f"Δ vs {name} at {t / 1e6:.2f}M tokens" for t in checkpoints]
                       + ["final Δ: 95% t-interval, seeds lower, verdict"], rows),
        "",
        f"Δ is per continuation seed (arm minus the {name} continued on the same batches), mean ± std over seeds; "
        "negative is better for the arm. *At the start* is the validation loss of the converted checkpoint before "
        f"any continuation step (preserve conversions equal the {name}'s; the paper init changes the function).",
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
    ]
    path = results.write(lines, ("uptraining", ""))
    plot(store, arms, seeds, results.image(), source, name)
    return path


def plot(store: CellRuns, arms: list[str], seeds: list[int], path: Path, source: str, name: str) -> None:
    plt = pyplot()
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 4.6))
    grid = [t for t, _ in store[f"{source}/seed{seeds[0]}"]["curve"]]
    tokens = np.array(grid) / 1e6
    base = np.array([interpolate_curve(store[f"{source}/seed{s}"]["curve"], grid) for s in seeds])
    spread = [0.0]  # the paired differences' mean ± std, so the middle panel is scaled to them
    for index, arm in enumerate(arms):
        color = "black" if arm == source else f"C{index}"
        runs = [store[f"{arm}/seed{s}"] for s in seeds]
        losses = np.array([interpolate_curve(r["curve"], grid) for r in runs])
        for axes, values in ((left, losses), (middle, losses - base)):
            mean = values.mean(axis=0)
            std = values.std(axis=0, ddof=1) if len(seeds) > 1 else np.zeros_like(mean)
            axes.plot(tokens, mean, color=color, label=arm)
            axes.fill_between(tokens, mean - std, mean + std, color=color, alpha=0.15, lw=0)
            if axes is middle:
                spread += [float((mean - std).min()), float((mean + std).max())]
        if runs[0]["probes"][0] is not None:
            first = np.mean([[np.mean(np.array(p["table"])[1:, 0]) for p in r["probes"]] for r in runs], axis=0)
            right.plot(tokens, first, color=color, label=arm)
    final = base[:, -1].mean()
    left.set_ylim(final - 0.3, final + 1.0)
    left.set(xlabel="continuation tokens (M)", ylabel="validation loss", title="Validation loss (mean ± std)")
    middle.axhline(0, color="grey", lw=1)
    middle.set(xlabel="continuation tokens (M)", ylabel=f"val loss − continued {name} (same seed)",
               title=f"Paired difference to the continued {name}")
    low, high = min(spread), max(spread)  # a paper-init start (+0.09) shows whole; a 0.01 gain is not flattened
    margin = 0.1 * (high - low) or 0.01
    middle.set_ylim(max(low - margin, -0.15), min(high + margin, 0.3))
    right.set(xlabel="continuation tokens (M)", ylabel="mean λ_first over layers 1..L−1", title="λ_first")
    save(plt, figure, (left, middle, right), path)
