"""The learning-rate sweep's report (`lr_sweep`, and `second_corpus`, tuned on it): final loss per (arm, lr), each
arm at its best lr against Llama at Llama's best lr, and which runs were unstable. `best_learning_rates` also tells
the runner at which lr a study tuned on another trains each arm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import BASELINE, markdown_table, pyplot
from benchmarks.studies.reports.paired import described_arms
from benchmarks.studies.reports.seeds import save
from benchmarks.studies.results import Results
from benchmarks.studies.seed_statistics import PairedDifference, Spread, paired_difference, spread, tokens_to_reach

#: A validation evaluation this far (nats) above the best earlier one is a loss spike: under warmup + cosine decay a
#: healthy run's held-out loss only falls, and evaluation noise on 32k held-out tokens is ~0.005.
SPIKE_NATS = 0.05


@dataclass
class Instability:
    """What went wrong in one run, if anything."""

    diverged: bool = False  #: final loss not finite, or not below the loss at initialisation
    spikes: list[float] = field(default_factory=list)  #: training tokens (M) of each validation spike

    def __bool__(self) -> bool:
        return self.diverged or bool(self.spikes)

    def describe(self) -> str:
        if self.diverged:
            return "diverged"
        return "spike at " + ", ".join(f"{t:.2f}M" for t in self.spikes) + " tokens"


def instability(run: dict) -> Instability:
    """Divergence and validation-loss spikes (> `SPIKE_NATS` above the best earlier evaluation) of one run."""
    curve = run["curve"]
    losses = [loss for _, loss in curve]
    final = run["final_val_loss"]
    result = Instability(diverged=not math.isfinite(final) or final >= losses[0])
    best = losses[0]
    for tokens, loss in curve[1:]:
        if not math.isfinite(loss) or loss > best + SPIKE_NATS:
            result.spikes.append(tokens / 1e6)
        best = min(best, loss) if math.isfinite(loss) else best
    return result


@dataclass
class Cell:
    """One (arm, lr): its per-seed runs."""

    runs: dict[int, dict]

    @property
    def finals(self) -> dict[int, float]:
        return {seed: run["final_val_loss"] for seed, run in self.runs.items()}

    def final(self) -> Spread:
        return spread(list(self.finals.values()))


def cells(stores: dict[float, object], arms: list[str], seeds: list[int]) -> dict[str, dict[float, Cell]]:
    """Per arm and lr, the runs of the requested seeds that finished."""
    return {arm: {lr: Cell({s: store[f"{arm}/seed{s}"] for s in seeds if f"{arm}/seed{s}" in store})
                  for lr, store in stores.items()} for arm in arms}


def best_learning_rates(table: dict[str, dict[float, Cell]], seeds: list[int]) -> dict[str, float | None]:
    """Each arm's lr with the lowest mean final loss among the lrs where every seed finished (None: no such lr)."""
    best = {}
    for arm, by_lr in table.items():
        complete = {lr: cell.final().mean for lr, cell in by_lr.items() if set(cell.runs) >= set(seeds)}
        best[arm] = min(complete, key=complete.get) if complete else None
    return best


@dataclass
class TunedComparison:
    """An arm at its best lr against Llama at Llama's best lr, paired by seed."""

    lr: float
    delta: PairedDifference
    fewer_tokens: Spread | None  #: 1 − tokens to reach Llama's best final loss / budget, per seed
    not_reached: int


def tuned_comparison(table: dict[str, dict[float, Cell]], best: dict[str, float | None],
                     seeds: list[int]) -> dict[str, TunedComparison]:
    base_lr = best.get(BASELINE)
    if base_lr is None:
        return {}
    base = table[BASELINE][base_lr].runs
    result = {}
    for arm, lr in best.items():
        if arm == BASELINE or lr is None:
            continue
        runs = table[arm][lr].runs
        finals = [runs[s]["final_val_loss"] for s in seeds]
        targets = [base[s]["final_val_loss"] for s in seeds]
        reached = [tokens_to_reach(runs[s]["curve"], target) for s, target in zip(seeds, targets)]
        budgets = [base[s]["curve"][-1][0] for s in seeds]
        fewer = [1 - r / b for r, b in zip(reached, budgets) if r is not None]
        result[arm] = TunedComparison(lr, paired_difference(finals, targets), spread(fewer) if fewer else None,
                                      sum(r is None for r in reached))
    return result


def render(results: Results) -> Path | None:
    stores, seeds, name = dict(sorted(results.cells.items())), results.seeds, results.study.name
    tuned_from = results.study.tuned_from
    table = cells(stores, results.arms, seeds)
    if not table[BASELINE] or not any(cell.runs for cell in table[BASELINE].values()):
        print("no Llama run has finished yet; nothing to report")
        return None
    best = best_learning_rates(table, seeds)
    tuned = tuned_comparison(table, best, seeds)
    lrs = sorted(stores)
    rows, unstable = [], []
    for arm, by_lr in table.items():
        row = [f"`{arm}`"]
        for lr in lrs:
            cell = by_lr[lr]
            if not cell.runs:
                row.append("—")
                continue
            count = len(cell.runs)
            text = cell.final().format(".4f") + ("" if count == len(seeds) else f" ({count} seed{'s' * (count != 1)})")
            row.append(f"**{text}**" if best[arm] == lr else text)
            for seed, run in sorted(cell.runs.items()):
                problem = instability(run)
                if problem:
                    unstable.append(f"`{arm}` lr {lr:g} seed {seed}: {problem.describe()}")
        row.append("—" if best[arm] is None else f"{best[arm]:g}")
        rows.append(row)
    tuned_rows = []
    for arm, t in tuned.items():
        d = t.delta
        fewer = "not reached" if t.fewer_tokens is None else (
            f"{100 * t.fewer_tokens.mean:.1f}% ± {100 * t.fewer_tokens.std:.1f}%"
            + (f" ({t.not_reached} seed(s) never reached it)" if t.not_reached else ""))
        tuned_rows.append([f"`{arm}`", f"{t.lr:g}", d.describe(),
                           f"{d.negative}/{d.n} seeds lower; {d.verdict()}", fewer])
    meta = next((store.meta for store in stores.values() if store.runs), next(iter(stores.values())).meta)
    config = next(iter(stores.values())).config
    # A study tuned on another trains one lr per arm: once that cell is complete, the arm's partial cells at other
    # lrs are other studies' runs on this corpus, shown but never trained by this one.
    partial = [(arm, lr, cell) for arm, by_lr in table.items() for lr, cell in by_lr.items()
               if len(cell.runs) < len(seeds)]
    missing = [f"`{arm}` lr {lr:g}" for arm, lr, cell in partial
               if not tuned_from or cell.runs and best[arm] is None]
    borrowed = [f"`{arm}` lr {lr:g}" for arm, lr, cell in partial
                if tuned_from and cell.runs and best[arm] is not None]
    if tuned_from:
        origin = (f"Each arm trains only at its best learning rate in `{tuned_from}.md` (the same model, budget "
                  "and schedule on the first corpus), so the comparison below is tuned Llama against tuned arms.")
    else:
        origin = (f"These are the context-length study's settings (`context_length.md`, context {config['seq_len']}), "
                  "whose 3e-3 runs are reused here.")
    lines = [
        f"# Is the gain real after tuning? Each arm at its own best learning rate ({name})",
        f"{results.regenerate} {results.environments()}",
        f"Model: {meta.get('size', '?')}, context {config['seq_len']}, {config['tokens'] / 1e6:.2f}M training tokens "
        f"per run in {config['seq_len'] * config['batch_size']} tokens per AdamW step, 5% warmup and cosine decay to "
        f"10% of the peak learning rate, weight decay {config['weight_decay']:g}. {origin} Data: "
        f"{meta.get('data', '?')}. Within a seed every arm starts from the same initial draw and sees the same "
        "batches, at every learning rate.",
        *described_arms(results.study),
        "",
        "Final validation loss (mean ± std over seeds; **bold**: the arm's best learning rate, the lowest mean among "
        "the learning rates where every seed finished):",
        "",
        markdown_table(["model"] + [f"lr {lr:g}" for lr in lrs] + ["best lr"], rows),
        "",
        "Each arm at its best learning rate against Llama at **Llama's** best learning rate, paired by seed:",
        "",
        markdown_table(["model", "its best lr", "Δ final loss vs tuned Llama (mean ± std [95% t-interval])",
                        "seed noise check", "fewer tokens to reach tuned Llama's final loss"], tuned_rows)
        if tuned_rows else "(no arm has every seed at any learning rate yet)",
        "",
        "Δ is per seed (arm minus that seed's Llama), then averaged; it *exceeds seed noise* when the t-interval "
        "excludes 0. *Fewer tokens* is the paper's metric, `1 − tokens_to_reach(arm curve, tuned Llama's final loss) "
        f"/ budget`, per seed. Unstable runs (a validation loss more than {SPIKE_NATS} nats above the best earlier "
        "evaluation, or a final loss not below the initial one): "
        + ("; ".join(unstable) if unstable else "none") + ".",
    ]
    if missing:
        lines += ["", f"**Incomplete**: {', '.join(missing)} do not have all {len(seeds)} seeds yet; rerun the "
                  "command to finish them (finished runs are kept). Best learning rates are chosen among complete "
                  "cells only."]
    if borrowed:
        lines += ["", f"{', '.join(borrowed)}: runs of other studies on this corpus, shown for reference; this study "
                  "trains each arm only at its best learning rate, where every seed has finished."]
    path = results.write(lines, ("final loss vs learning rate", ""))
    plot(table, best, results.image())
    return path


def plot(table: dict[str, dict[float, Cell]], best: dict[str, float | None], path: Path) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for index, (arm, by_lr) in enumerate(table.items()):
        lrs = [lr for lr, cell in sorted(by_lr.items()) if cell.runs]
        means = [by_lr[lr].final().mean for lr in lrs]
        stds = [by_lr[lr].final().std for lr in lrs]
        color = "black" if arm == BASELINE else f"C{index}"
        axes.errorbar(lrs, means, yerr=stds, marker="o", capsize=4, color=color, label=arm)
        if best[arm] is not None:
            axes.plot([best[arm]], [by_lr[best[arm]].final().mean], marker="*", markersize=14, color=color)
    axes.set(xscale="log", xlabel="peak learning rate", ylabel="final validation loss (mean ± std over seeds)",
             title="Final loss vs learning rate (★ = each arm's best)")
    all_lrs = sorted({lr for by_lr in table.values() for lr in by_lr})
    axes.set_xticks(all_lrs, [f"{lr:g}" for lr in all_lrs])
    axes.minorticks_off()
    save(plt, figure, [axes], path)
