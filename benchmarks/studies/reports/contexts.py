"""The context-length study's report: per context and arm, final loss, the paired difference to that context's Llama
with its t-interval and the tokens saved to reach Llama's final loss; a plot of both against context."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from scipy import stats

from benchmarks.common import BASELINE, markdown_table, pyplot
from benchmarks.studies.reports.seeds import complete_seeds, fewer_tokens, save, summarize
from benchmarks.studies.results import Results

#: What the paper says about SVFormer and sequence length (Zhou et al. 2025, section on SVFormer).
PAPER_SVFORMER = (
    "The paper reports that SVFormer's advantage over the vanilla Transformer depends on the training sequence "
    "length (it grows as sequences get longer) and on the learning rate."
)


def summarize_contexts(results: Results) -> dict:
    """Per context with a seed every arm finished: those seeds, and per arm the seed summary."""
    summary = {}
    for context, cell in results.cells.items():
        if complete_seeds(cell, results.arms, results.seeds):
            per_context = summarize(cell, results.arms, results.seeds)
            summary[context] = {"seeds": per_context["seeds"], "arms": per_context["variants"], "meta": cell.meta,
                                "config": cell.config}
    return summary


def render(results: Results) -> Path | None:
    summary = summarize_contexts(results)
    if not summary:
        print("no context has a seed that finished every arm yet; nothing to report")
        return None
    rows = []
    for context, entry in summary.items():
        for arm, e in entry["arms"].items():
            if arm == BASELINE:
                delta, check, fewer = "—", "—", "—"
            else:
                d = e["delta"]
                delta, check = d.describe(), f"{d.negative}/{d.n} seeds lower; {d.verdict()}"
                fewer = fewer_tokens(e, "never reached it")
            rows.append([context, f"`{arm}`", len(entry["seeds"]), e["final"].format(".4f"), delta, check, fewer])
    first = next(iter(summary.values()))
    meta, config = first["meta"], first["config"]
    missing = [c for c in results.cells if c not in summary or len(summary[c]["seeds"]) < len(results.seeds)]
    lines = [
        "# Does the gain hold as context grows? Pre-training at several context lengths (CPU scale)",
        f"{results.regenerate} " + environments(summary),
        f"Model: {meta.get('size', '?')}. Every run: {config['tokens'] / 1e6:.2f}M training tokens in "
        f"{config['tokens_per_step']} tokens per AdamW step (batch {config['tokens_per_step']} / context), lr "
        f"{config['lr']:g} with 5% warmup and cosine decay to 10%, weight decay {config['weight_decay']:g}, the same "
        "for every arm and context. The learning rate is the pre-training study's (`pretrain.md`), kept unchanged "
        "rather than tuned per arm or context, so no arm is favoured by the choice. Data: "
        f"{meta.get('data', '?')}; validation blocks have the run's context. Within a seed every arm starts from the "
        "same initial draw and sees the same batches.",
        "",
        markdown_table(["context", "model", "seeds", "final val loss (mean ± std)",
                        "Δ vs Llama, paired (mean ± std [95% t-interval])", "seed noise check",
                        "fewer tokens to reach Llama's final loss"], rows),
        "",
        "Losses are comparable within a context only (a longer context predicts better from more history). Δ is "
        "per seed (arm minus that seed's Llama at the same context), then averaged; it *exceeds seed noise* when the "
        f"t-interval excludes 0 (3 seeds: ±{stats.t.ppf(0.975, 2):.2f}·std/√3). *Fewer tokens* is the paper's "
        "metric, `1 − tokens_to_reach(arm curve, Llama's final loss) / budget`, per seed.",
        "",
        f"SVFormer and context: {PAPER_SVFORMER} Here: " + svformer_trend(summary) + ".",
    ]
    if missing:
        lines += ["", f"**Incomplete**: context(s) {', '.join(map(str, missing))} do not have all "
                  f"{len(results.seeds)} seeds yet; rerun the command to finish them (finished runs are kept)."]
    path = results.write(lines, ("loss difference vs context", ""))
    plot(summary, results.arms, results.image())
    return path


def environments(summary: dict) -> str:
    """Where each context's runs were trained: a resumed study may span days and releases."""
    lines: dict[str, list[str]] = {}
    for context, entry in summary.items():
        lines.setdefault(entry["meta"].get("environment", "Measured somewhere unrecorded."), []).append(str(context))
    if len(lines) == 1:
        return next(iter(lines))
    return " ".join(f"Context {', '.join(contexts)}: {line}" for line, contexts in lines.items())


def svformer_trend(summary: dict) -> str:
    parts = []
    for context, entry in summary.items():
        e = entry["arms"].get("svformer")
        if e is not None:
            parts.append(f"context {context}: Δ {e['delta'].mean:+.3f} ({e['delta'].verdict()})")
    return "; ".join(parts) if parts else "no SVFormer runs yet"


def plot(summary: dict, arms: list[str], path: Path) -> None:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    contexts = list(summary)
    for index, arm in enumerate(a for a in arms if a != BASELINE):
        xs, means, halves, fewer, fewer_std = [], [], [], [], []
        for context in contexts:
            e = summary[context]["arms"].get(arm)
            if e is None:
                continue
            d = e["delta"]
            xs.append(context)
            means.append(d.mean)
            halves.append((d.high - d.low) / 2 if np.isfinite(d.high) else 0.0)
            fewer.append(100 * e["fewer_tokens"].mean if e["fewer_tokens"] else np.nan)
            fewer_std.append(100 * e["fewer_tokens"].std if e["fewer_tokens"] else 0.0)
        color = f"C{index + 1}"
        left.errorbar(xs, means, yerr=[halves, halves], marker="o", capsize=4, color=color, label=arm)
        right.errorbar(xs, fewer, yerr=fewer_std, marker="o", capsize=4, color=color, label=arm)
    left.axhline(0, color="black", lw=1, label="Llama")
    left.set(xscale="log", xlabel="context (tokens)", ylabel="final val loss − same seed's Llama",
             title="Paired difference to Llama (95% t-interval)")
    right.axhline(0, color="black", lw=1)
    right.set(xscale="log", xlabel="context (tokens)", ylabel="% fewer tokens to reach Llama's final loss",
              title="Tokens saved (mean ± std over seeds)")
    for axes in (left, right):
        axes.set_xticks(contexts, [str(c) for c in contexts])
    save(plt, figure, (left, right), path)
