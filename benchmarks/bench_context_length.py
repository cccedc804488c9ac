"""Does the value residual's gain hold as context grows? Pre-training at several context lengths, with seeds.

Every context trains the same arms (Llama, `identity`, `learnable_plus`, `svformer`) on the same number of tokens
per optimizer step (`--tokens-per-step`, so the batch shrinks as the context grows and every run takes the same
number of AdamW steps), the same total tokens, the same learning rate and schedule. Within a seed every arm gets the
same initial weights and the same batch order. Reports per context and arm: final validation loss (mean ± std over
seeds), the paired difference to that context's Llama with its t-interval, and the paper's metric (fewer tokens to
reach Llama's final loss); a plot of both against context.

    nice -n 19 python benchmarks/bench_context_length.py --threads 1                  # every context, in turn
    nice -n 19 python benchmarks/bench_context_length.py --threads 1 --contexts 1024  # one context per process
    python benchmarks/bench_context_length.py --report-only                           # table and plot only

Each context keeps its finished runs in its own store (`results/context_length/ctx<N>.json`), written after every
run: an interrupted study resumes where it stopped, and processes given different `--contexts` can run side by side.
Context-128 runs that the pre-training study (`bench_pretrain.py`) already trained with identical settings are
taken from `results/pretrain.json` instead of being trained again (`--no-reuse` retrains them).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
from bench_pretrain import run_one, seed_table
from bench_pretrain import summarize as pretrain_summary
from scipy import stats

from common import BASELINE, RESULTS_DIR, add_device_args, markdown_table, pyplot
from run_store import RunStore, portable_config
from study_cli import add_study_args, command_line, open_study, prepare_training, seeds_from_args

ARMS = [BASELINE, "identity", "learnable_plus", "svformer"]
CONTEXTS = [128, 512, 1024]
NAME = "context_length"
SCRIPT = "bench_context_length.py"
#: What the paper says about SVFormer and sequence length (Zhou et al. 2025, section on SVFormer).
PAPER_SVFORMER = (
    "The paper reports that SVFormer's advantage over the vanilla Transformer depends on the training sequence "
    "length (it grows as sequences get longer) and on the learning rate."
)


def context_args(args: argparse.Namespace, context: int) -> argparse.Namespace:
    """The study's flags for one context: that sequence length, and the batch that keeps tokens per step fixed."""
    if args.tokens_per_step % context:
        raise SystemExit(f"--tokens-per-step {args.tokens_per_step} is not a multiple of context {context}.")
    one = copy.copy(args)
    one.seq_len, one.batch_size = context, args.tokens_per_step // context
    one.out = args.out / NAME
    return one


def open_context(args: argparse.Namespace, context: int) -> tuple[argparse.Namespace, RunStore]:
    one = context_args(args, context)
    store = open_study(one, f"ctx{context}", "kv_heads")
    return one, store


def adopt_pretrain_runs(store: RunStore, source: Path) -> list[str]:
    """Copy runs the pre-training study trained with exactly this store's settings (same config dict)."""
    if not source.is_file():
        return []
    saved = json.loads(source.read_text())
    if portable_config(saved.get("config") or {}) != store.config:
        return []
    adopted = [key for key in saved.get("runs", {}) if key not in store and key.split("/")[0] in ARMS]
    for key in adopted:
        store.runs[key] = dict(saved["runs"][key], adopted_from=source.name)
    described = {k: v for k, v in saved.get("meta", {}).items() if k in DESCRIPTION and k not in store.meta}
    if adopted or described:
        store.meta.setdefault("adopted", {}).update({key: source.name for key in adopted})
        store.meta.update(described)
        store.save()
    return adopted


#: What a store's meta says about how its runs were measured (copied along with adopted runs).
DESCRIPTION = ("size", "environment", "data", "budget")


def train_all(args: argparse.Namespace, argv, seeds: list[int]) -> None:
    """Train every missing (context, seed, arm), seed-major within a context, with a running ETA."""
    plan = []
    for context in args.contexts:
        one, store = open_context(args, context)
        if context == 128 and args.reuse:
            adopted = adopt_pretrain_runs(store, RESULTS_DIR / "pretrain.json")
            if adopted:
                print(f"context 128: {len(adopted)} runs taken from pretrain.json (identical settings)", flush=True)
        missing = [(seed, arm) for seed in seeds for arm in args.arms if f"{arm}/seed{seed}" not in store]
        if missing:
            plan.append((context, one, store, missing))
    total = sum(len(missing) for *_, missing in plan)
    done, cost_done, started = 0, 0.0, time.monotonic()
    for context, one, store, missing in plan:
        device, data = prepare_training(store, one, SCRIPT, argv)
        store.meta["command"] = command_line(SCRIPT, argv)
        for seed, arm in missing:
            store.run(f"{arm}/seed{seed}", run_one, arm, seed, one, data, device)
            done += 1
            cost_done += context  # a run's cost grows with its context; the ETA weighs remaining runs by it
            remaining = sum(c * len(m) for c, _, _, m in plan) - cost_done
            elapsed = time.monotonic() - started
            eta = elapsed / cost_done * remaining
            print(f"[{done}/{total} runs] elapsed {elapsed / 60:.0f} min, ETA {eta / 60:.0f} min", flush=True)


# ---- report --------------------------------------------------------------------------------------------------------


def summarize(args: argparse.Namespace, seeds: list[int]) -> dict:
    """Per context: the seeds every arm finished, and per arm its final loss, paired Δ and tokens saved."""
    summary = {}
    for context in args.contexts:
        _, store = open_context(args, context)
        if context == 128 and args.reuse:
            adopt_pretrain_runs(store, RESULTS_DIR / "pretrain.json")
        if not seed_table(store, args.arms, seeds)[1]:  # no seed has finished every arm yet
            continue
        per_context = pretrain_summary(store, args.arms, seeds)  # the pre-training study's numbers, per context
        summary[context] = {"seeds": per_context["seeds"], "arms": per_context["variants"], "meta": store.meta,
                            "config": store.config}
    return summary


def write_report(args: argparse.Namespace, seeds: list[int]) -> Path | None:
    summary = summarize(args, seeds)
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
                delta = d.describe()
                check = f"{d.negative}/{d.n} seeds lower; {d.verdict()}"
                fewer = "not reached" if e["fewer_tokens"] is None else (
                    f"{100 * e['fewer_tokens'].mean:.1f}% ± {100 * e['fewer_tokens'].std:.1f}%"
                    + (f" ({e['not_reached']} seed(s) never reached it)" if e["not_reached"] else ""))
            rows.append([context, f"`{arm}`", len(entry["seeds"]), e["final"].format(".4f"), delta, check, fewer])
    first = next(iter(summary.values()))
    meta = first["meta"]
    adopted = sorted({c for c, e in summary.items() if e["meta"].get("adopted")})
    contexts_missing = [c for c in args.contexts if c not in summary or len(summary[c]["seeds"]) < len(seeds)]
    lines = [
        "# Does the gain hold as context grows? Pre-training at several context lengths (CPU scale)",
        f"Regenerate: `python benchmarks/{SCRIPT} --threads 1` (resumable; `--report-only` redraws). "
        + environments(summary),
        f"Model: {meta.get('size', '?')}. Every run: {first['config']['tokens'] / 1e6:.2f}M training tokens in "
        f"{args.tokens_per_step} tokens per AdamW step (batch {args.tokens_per_step} / context), lr "
        f"{first['config']['lr']:g} with 5% warmup and cosine decay to 10%, weight decay "
        f"{first['config']['weight_decay']:g}, the same for every arm and context. The learning rate is the "
        "pre-training study's (`pretrain.md`), kept unchanged rather than tuned per arm or context, so no arm is "
        f"favoured by the choice. Data: {meta.get('data', '?')}; validation blocks have the run's context. "
        "Within a seed every arm starts from the same initial draw and sees the same batches.",
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
    if adopted:
        lines += ["", f"Context {', '.join(map(str, adopted))}: runs with settings identical to the pre-training "
                  "study were taken from `pretrain.json`, not trained twice."]
    if contexts_missing:
        lines += ["", f"**Incomplete**: context(s) {', '.join(map(str, contexts_missing))} do not have all "
                  f"{len(seeds)} seeds yet; rerun the command to finish them (finished runs are kept)."]
    lines += ["", f"![loss difference vs context]({NAME}.png)", ""]
    path = args.out / f"{NAME}.md"
    path.write_text("\n".join(lines))
    plot(summary, args.out / f"{NAME}.png")
    return path


def environments(summary: dict) -> str:
    """Where each context's runs were last trained: a resumed study may span days and releases."""
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


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    contexts = list(summary)
    for index, arm in enumerate(a for a in ARMS if a != BASELINE):
        xs, means, lows, highs, fewer, fewer_std = [], [], [], [], [], []
        for context in contexts:
            e = summary[context]["arms"].get(arm)
            if e is None:
                continue
            d = e["delta"]
            xs.append(context)
            means.append(d.mean)
            half = (d.high - d.low) / 2 if np.isfinite(d.high) else 0.0
            lows.append(half)
            highs.append(half)
            fewer.append(100 * e["fewer_tokens"].mean if e["fewer_tokens"] else np.nan)
            fewer_std.append(100 * e["fewer_tokens"].std if e["fewer_tokens"] else 0.0)
        color = f"C{index + 1}"
        left.errorbar(xs, means, yerr=[lows, highs], marker="o", capsize=4, color=color, label=arm)
        right.errorbar(xs, fewer, yerr=fewer_std, marker="o", capsize=4, color=color, label=arm)
    left.axhline(0, color="black", lw=1, label="Llama")
    left.set(xscale="log", xlabel="context (tokens)", ylabel="final val loss − same seed's Llama",
             title="Paired difference to Llama (95% t-interval)")
    right.axhline(0, color="black", lw=1)
    right.set(xscale="log", xlabel="context (tokens)", ylabel="% fewer tokens to reach Llama's final loss",
              title="Tokens saved (mean ± std over seeds)")
    for axes in (left, right):
        axes.set_xticks(contexts, [str(c) for c in contexts])
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ---- main ----------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(parser)
    add_study_args(parser, tokens=1_200_000)
    parser.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS, help="context lengths to train at")
    parser.add_argument("--tokens-per-step", type=int, default=2048,
                        help="tokens per optimizer step at every context (batch = this / context; default 2048)")
    parser.add_argument("--arms", nargs="+", default=ARMS, help="'llama' and value_residual variants")
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (multi-head attention)")
    parser.add_argument("--analysis-sequences", type=int, default=8, help="validation blocks for entropy/similarity")
    parser.add_argument("--no-reuse", dest="reuse", action="store_false",
                        help="train context 128 even where pretrain.json has identical runs")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    args = parser.parse_args(argv)
    if BASELINE not in args.arms:
        parser.error(f"--arms must include the baseline {BASELINE!r}: every number is relative to it")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    seeds = seeds_from_args(args)
    if not args.report_only:
        train_all(args, argv, seeds)
    path = write_report(args, seeds)
    if path:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
