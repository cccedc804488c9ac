"""The paper's headline at CPU scale, with seeds: from-scratch pre-training of Llama vs ResFormer variants.

Within a seed every model gets the same initial seed, the same batches in the same order and the same token budget;
each seed draws another init and data order. Reports, per variant, mean ± std over seeds of the final validation loss
and of the paper's metric (fewer training tokens to reach Llama's final validation loss), the paired per-seed
difference to Llama with its t-interval (a difference *exceeds seed noise* when that interval excludes 0), and loss
curves with a ±1 std band.

    python benchmarks/bench_pretrain.py                       # default: 4 models × 3 seeds, ~45 min on 2 idle cores
    python benchmarks/bench_pretrain.py --seeds 0 1 2 3 4     # more seeds (finished runs are reused)
    python benchmarks/bench_pretrain.py --device cuda --hidden-size 512 --layers 8 --tokens 100000000
    python benchmarks/bench_pretrain.py --report-only         # redraw table/plot from results/pretrain.json

Every finished (variant, seed) run is saved at once; a rerun with the same flags skips it (`--fresh` retrains).
Writes `benchmarks/results/pretrain.{json,md,png}` and `pretrain_analysis.png`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from scipy import stats

from resformer_hf.analysis import attention_entropy, lambda_table, token_similarity

from common import BASELINE, RESULTS_DIR, add_device_args, markdown_table, pyplot
from run_store import RunStore
from study_cli import add_study_args, budget_from_args, open_study, prepare_training, seeds_from_args, size_from_args
from study_data import batch_order
from study_statistics import interpolate_curve, paired_difference, spread, tokens_to_reach
from study_training import non_embedding_parameters, seeded_model, train

DEFAULT_VARIANTS = [BASELINE, "identity", "learnable_plus", "svformer"]
NAME = "pretrain"


def run_one(variant: str, seed: int, args, data, device) -> dict:
    budget = budget_from_args(args)
    model = seeded_model(variant, size_from_args(args), data, args.seq_len, seed, device)
    order = batch_order(len(data.train), budget.batch_size, budget.steps, seed)
    result = train(model, data, budget, order, device, label=f"{variant} seed {seed}")
    probe = data.val[: args.analysis_sequences].to(device)
    result.update(
        attention_entropy=attention_entropy(model, probe).tolist(),
        token_similarity=token_similarity(model, probe).tolist(),
        lambdas=lambda_table(model).tolist(),
        parameters=sum(p.numel() for p in model.parameters()),
        non_embedding_parameters=non_embedding_parameters(model),
    )
    return result


# ---- report --------------------------------------------------------------------------------------------------------


def seed_table(store: RunStore, variants: list[str], seeds: list[int]) -> tuple[dict[str, dict], list[int]]:
    """Per variant: the per-seed results of the seeds where it and Llama both finished."""
    complete = [s for s in seeds if all(f"{v}/seed{s}" in store for v in variants)]
    return {v: {s: store[f"{v}/seed{s}"] for s in complete} for v in variants}, complete


def summarize(store: RunStore, variants: list[str], seeds: list[int]) -> dict:
    """Everything the table says, computed once (the README quotes the same numbers)."""
    runs, complete = seed_table(store, variants, seeds)
    summary = {"seeds": complete, "variants": {}}
    if not complete:  # nothing to summarise yet (an interrupted study)
        return summary
    base = runs[BASELINE]
    for variant in variants:
        finals = [runs[variant][s]["final_val_loss"] for s in complete]
        budgets = [base[s]["curve"][-1][0] for s in complete]
        reached = [tokens_to_reach(runs[variant][s]["curve"], base[s]["final_val_loss"]) for s in complete]
        fewer = [1 - r / b for r, b in zip(reached, budgets) if r is not None]
        entry = {
            "final": spread(finals),
            "fewer_tokens": spread(fewer) if fewer else None,
            "not_reached": sum(r is None for r in reached),
            "time_ratio": spread([runs[variant][s]["train_seconds"] / base[s]["train_seconds"] for s in complete]),
            "entropy": float(np.mean([np.mean(runs[variant][s]["attention_entropy"]) for s in complete])),
            "similarity": float(np.mean([runs[variant][s]["token_similarity"][-2] for s in complete])),
            "lambdas": np.mean([runs[variant][s]["lambdas"] for s in complete], axis=0).tolist(),
            "parameters": runs[variant][complete[0]]["non_embedding_parameters"],
        }
        if variant != BASELINE:
            entry["delta"] = paired_difference(finals, [base[s]["final_val_loss"] for s in complete])
            if len(fewer) == len(complete):
                entry["fewer_test"] = paired_difference(fewer, [0.0] * len(fewer))
        summary["variants"][variant] = entry
    return summary


def write_report(store: RunStore, variants: list[str], seeds: list[int], out: Path) -> None:
    if not any(k.startswith(f"{BASELINE}/") for k in store.runs):
        raise SystemExit(f"the report needs the {BASELINE!r} baseline among --variants")
    summary = summarize(store, variants, seeds)
    complete = summary["seeds"]
    if not complete:
        print("no seed has finished every variant yet; nothing to report")
        return
    rows = []
    for variant, e in summary["variants"].items():
        if variant == BASELINE:
            delta = verdict = fewer_test = "—"
            fewer = "—"
        else:
            d = e["delta"]
            delta = d.describe()
            verdict = f"{d.negative}/{d.n} seeds lower; {d.verdict()}"
            fewer = "not reached" if e["fewer_tokens"] is None else (
                f"{100 * e['fewer_tokens'].mean:.1f}% ± {100 * e['fewer_tokens'].std:.1f}%"
                + (f" ({e['not_reached']} seed(s) not reached)" if e["not_reached"] else ""))
            t = e.get("fewer_test")
            fewer_test = "—" if t is None else f"[{100 * t.low:+.1f}%, {100 * t.high:+.1f}%]"
        rows.append([f"`{variant}`", f"{e['parameters'] / 1e6:.3f}M", e["final"].format(".4f"), delta, verdict, fewer,
                     fewer_test, e["time_ratio"].format(".2f"), f"{e['entropy']:.3f}", f"{e['similarity']:.3f}"])
    per_seed = [[f"`{v}`"] + [f"{store[f'{v}/seed{s}']['final_val_loss']:.4f}" for s in complete] for v in variants]
    meta = store.meta
    lines = [
        "# Pre-training with seeds: Llama vs value-residual variants (CPU scale)",
        f"Regenerate: `{meta['command']}`. {meta['environment']}",
        f"Model: {meta['size']}, context {store.config['seq_len']}; {meta['budget']}. Data: {meta['data']}. "
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
    learned = [v for v in variants if v in ("learnable", "learnable_plus")]
    if learned:
        layers = len(summary["variants"][learned[0]]["lambdas"])
        lines += ["", "Learned (λ_first, λ_self) per layer after training, mean over seeds:", "", markdown_table(
            ["model"] + [str(i) for i in range(layers)],
            [[f"`{v}`"] + [f"{a:.2f}, {b:.2f}" for a, b in summary["variants"][v]["lambdas"]] for v in learned],
        )]
    lines += ["", f"![validation loss]({NAME}.png)", "", f"![analysis]({NAME}_analysis.png)", ""]
    (out / f"{NAME}.md").write_text("\n".join(lines))
    plot(store, variants, complete, out)


def plot(store: RunStore, variants: list[str], seeds: list[int], out: Path) -> None:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    grid = [t for t, _ in store[f"{BASELINE}/seed{seeds[0]}"]["curve"][1:]]
    base = np.array([interpolate_curve(store[f"{BASELINE}/seed{s}"]["curve"], grid) for s in seeds])
    lows = []
    for index, variant in enumerate(variants):
        losses = np.array([interpolate_curve(store[f"{variant}/seed{s}"]["curve"], grid) for s in seeds])
        color = "black" if variant == BASELINE else f"C{index}"
        tokens = np.array(grid) / 1e6
        for axes, values in ((left, losses), (right, losses - base)):
            mean, std = values.mean(axis=0), values.std(axis=0, ddof=1) if len(seeds) > 1 else 0 * values[0]
            axes.plot(tokens, mean, color=color, lw=2 if variant == BASELINE else 1.5, label=variant)
            axes.fill_between(tokens, mean - std, mean + std, color=color, alpha=0.15, lw=0)
        lows.append(losses.min())
    left.set_ylim(min(lows) - 0.05, min(lows) + 1.5)
    left.set(xlabel="training tokens (M)", ylabel="validation loss",
             title=f"Validation loss, mean ± std over {len(seeds)} seeds")
    right.axhline(0, color="grey", lw=1)
    right.set(xlabel="training tokens (M)", ylabel="val loss − same seed's Llama", title="Paired difference to Llama")
    for axes in (left, right):
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out / f"{NAME}.png", dpi=120)
    plt.close(figure)

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, variant in enumerate(variants):
        color = "black" if variant == BASELINE else f"C{index}"
        entropy = np.mean([store[f"{variant}/seed{s}"]["attention_entropy"] for s in seeds], axis=0)
        similarity = np.mean([store[f"{variant}/seed{s}"]["token_similarity"] for s in seeds], axis=0)
        left.plot(range(len(entropy)), entropy, marker="o", color=color, label=variant)
        right.plot(range(len(similarity)), similarity, marker="o", color=color, label=variant)
    left.set(xlabel="layer", ylabel="mean attention entropy (nats)", title="Attention entropy (mean over seeds)")
    right.set(xlabel="hidden state (0 = embeddings)", ylabel="mean pairwise cosine", title="Token similarity")
    for axes in (left, right):
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out / f"{NAME}_analysis.png", dpi=120)
    plt.close(figure)


# ---- main ----------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(parser)
    add_study_args(parser, tokens=1_200_000)
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="'llama' and value_residual variants")
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (multi-head attention)")
    parser.add_argument("--analysis-sequences", type=int, default=8, help="validation blocks for entropy/similarity")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if BASELINE not in args.variants:
        raise SystemExit(f"--variants must include the baseline {BASELINE!r}: every number is relative to it")
    seeds = seeds_from_args(args)
    store = open_study(args, NAME, "kv_heads")
    if not args.report_only:
        device, data = prepare_training(store, args, "bench_pretrain.py", argv)
        for seed in seeds:  # seed-major: an interrupted study still has whole seeds to report
            for variant in args.variants:
                store.run(f"{variant}/seed{seed}", run_one, variant, seed, args, data, device)
    write_report(store, args.variants, seeds, args.out)
    print(f"wrote {args.out / f'{NAME}.md'}")


if __name__ == "__main__":
    main()
