"""The paper's other comparisons at this machine's scale: DenseFormer and NeuTRENO next to ResFormer, and SVFormer next
to the other ways of shrinking the KV cache (GQA, cross-layer attention, SVFormer × CLA).

Every arm trains on the context-length study's context-512 settings (its model, 1.2M tokens in 2048 tokens per AdamW
step, lr 3e-3 with warmup and cosine decay, weight decay 0.1), three seeds, with the same initial draw and batch order
across arms within a seed. Two comparisons, each paired by seed with Llama:

* quality at Llama's KV cache: `llama`, `learnable_plus`, `neutreno`, `denseformer` (final loss, Δ vs Llama with its
  t-interval, the paper's fewer-tokens-to-match metric);
* loss against KV-cache bytes: `svformer`, `gqa` (half the kv heads), `cla2` (cross-layer attention, pairs of
  layers share K and V) and `svformer_cla2` (both), with the bytes per token measured by `cache_nbytes`.

    nice -n 19 python benchmarks/bench_baselines.py --threads 1           # every missing run, seed-major
    nice -n 19 python benchmarks/bench_baselines.py --threads 1 --seeds 1  # one seed per process, side by side
    python benchmarks/bench_baselines.py --report-only                    # table and plot only

Finished runs are kept in `results/baselines/ctx512.json`, written after every run, so an interrupted study resumes.
The `llama`, `learnable_plus` and `svformer` runs that the context-length study trained with identical settings are
taken from `results/context_length/ctx512.json` instead of being trained again (`--no-reuse` retrains them).
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import numpy as np
import torch
from bench_lr_sweep import CONTEXT_STUDY_STORE, adopt_runs
from bench_pretrain import run_one
from bench_pretrain import summarize as pretrain_summary
from bench_svformer_gqa import cache_bytes_per_token as measured_cache_bytes

from common import BASELINE, RESULTS_DIR, add_device_args, build_model, markdown_table, pyplot
from run_store import RunStore
from study_cli import add_study_args, command_line, open_study, prepare_training, seeds_from_args, size_from_args

NAME = "baselines"
SCRIPT = "bench_baselines.py"
#: arm: (model: "llama" or a value_residual variant, kv heads as a fraction of the query heads, cross_layer_attention)
ARMS = {
    BASELINE: (BASELINE, 1, None),
    "learnable_plus": ("learnable_plus", 1, None),
    "neutreno": ("neutreno", 1, None),
    "denseformer": ("denseformer", 1, None),
    "svformer": ("svformer", 1, None),
    "gqa": (BASELINE, 1 / 2, None),
    "cla2": ("none", 1, 2),
    "svformer_cla2": ("svformer", 1, 2),
}
QUALITY_ARMS = [BASELINE, "learnable_plus", "neutreno", "denseformer"]
KV_ARMS = [BASELINE, "svformer", "gqa", "cla2", "svformer_cla2"]
#: Arms whose runs the context-length study already has at these settings.
ADOPTABLE = [BASELINE, "learnable_plus", "svformer"]
DESCRIPTIONS = {
    BASELINE: "Llama",
    "learnable_plus": "ResFormer (learnable-plus λ)",
    "neutreno": "NeuTRENO (λ = 0.4)",
    "denseformer": "DenseFormer (DWA after every block, dilation 1)",
    "svformer": "SVFormer (values of layer 0 only)",
    "gqa": "GQA (half the kv heads)",
    "cla2": "CLA2 (layer pairs share K and V)",
    "svformer_cla2": "SVFormer × CLA2",
}


def arm_args(args: argparse.Namespace, arm: str) -> tuple[str, argparse.Namespace]:
    """(model variant, the study's flags with this arm's kv heads and cross-layer attention)."""
    variant, kv_fraction, cla = ARMS[arm]
    one = copy.copy(args)
    one.kv_heads = None if kv_fraction == 1 else max(1, round(args.heads * kv_fraction))
    one.cross_layer_attention = cla
    return variant, one


def run_arm(arm: str, seed: int, args: argparse.Namespace, data, device) -> dict:
    """`bench_pretrain.run_one` for the arm's model, plus the exact KV-cache bytes per token of that model."""
    variant, one = arm_args(args, arm)
    result = run_one(variant, seed, one, data, device)
    result["cache_bytes_per_token"] = cache_bytes_per_token(arm, args)
    return result


def cache_bytes_per_token(arm: str, args: argparse.Namespace, tokens: int = 16) -> float:
    """Bytes the arm's float32 KV cache holds per token, measured with `cache_nbytes` after a forward pass."""
    variant, one = arm_args(args, arm)
    size = size_from_args(one)
    fields = dict(vocab_size=64, hidden_size=size.hidden_size, intermediate_size=size.intermediate,
                  num_hidden_layers=size.layers, num_attention_heads=size.heads,
                  num_key_value_heads=size.kv_heads or size.heads, max_position_embeddings=tokens)
    if size.cross_layer_attention:
        fields["cross_layer_attention"] = size.cross_layer_attention
    model = build_model(variant, **fields).eval()
    return measured_cache_bytes(model, torch.randint(0, 64, (tokens,)))


def open_store(args: argparse.Namespace) -> tuple[argparse.Namespace, RunStore]:
    one = copy.copy(args)
    one.out = args.out / NAME
    return one, open_study(one, f"ctx{args.seq_len}", "kv_heads")


def train_all(args: argparse.Namespace, argv, seeds: list[int]) -> None:
    """Train every missing (seed, arm), seed-major, so an interrupted study has whole seeds to report."""
    one, store = open_store(args)
    if args.reuse:
        adopted = adopt_runs(store, CONTEXT_STUDY_STORE, [a for a in args.arms if a in ADOPTABLE])
        if adopted:
            print(f"{len(adopted)} runs taken from {CONTEXT_STUDY_STORE.name} (identical settings)", flush=True)
    missing = [(seed, arm) for seed in seeds for arm in args.arms if f"{arm}/seed{seed}" not in store]
    if not missing:
        return
    device, data = prepare_training(store, one, SCRIPT, argv)
    store.meta["command"] = command_line(SCRIPT, argv)
    started = time.monotonic()
    for done, (seed, arm) in enumerate(missing, start=1):
        store.run(f"{arm}/seed{seed}", run_arm, arm, seed, one, data, device)
        elapsed = time.monotonic() - started
        print(f"[{done}/{len(missing)} runs] elapsed {elapsed / 60:.0f} min, "
              f"ETA {elapsed / done * (len(missing) - done) / 60:.0f} min", flush=True)


# ---- report --------------------------------------------------------------------------------------------------------


def summarize(args: argparse.Namespace, seeds: list[int]) -> tuple[dict, RunStore]:
    """Per arm: the pre-training study's numbers over the seeds where it and Llama both finished, and its cache."""
    _, store = open_store(args)
    if args.reuse:
        adopt_runs(store, CONTEXT_STUDY_STORE, [a for a in args.arms if a in ADOPTABLE])
    summary = {}
    for arm in args.arms:
        pair = [BASELINE] if arm == BASELINE else [BASELINE, arm]
        entry = pretrain_summary(store, pair, seeds)
        if entry["seeds"]:
            summary[arm] = dict(entry["variants"][arm], seeds=entry["seeds"],
                                cache=cache_bytes_per_token(arm, args))
    return summary, store


def delta_cells(entry: dict) -> list[str]:
    if "delta" not in entry:
        return ["—", "—"]
    d = entry["delta"]
    return [d.describe(), f"{d.negative}/{d.n} seeds lower; "
            f"{d.verdict()}"]


def fewer_cell(entry: dict) -> str:
    if "delta" not in entry:
        return "—"
    if entry["fewer_tokens"] is None:
        return "not reached"
    note = f" ({entry['not_reached']} seed(s) never reached it)" if entry["not_reached"] else ""
    return f"{100 * entry['fewer_tokens'].mean:.1f}% ± {100 * entry['fewer_tokens'].std:.1f}%{note}"


def write_report(args: argparse.Namespace, seeds: list[int]) -> Path | None:
    summary, store = summarize(args, seeds)
    if BASELINE not in summary:
        print("no Llama run has finished yet; nothing to report")
        return None
    llama_cache = summary[BASELINE]["cache"]
    quality = [[f"`{arm}`", DESCRIPTIONS[arm], len(e["seeds"]), e["final"].format(".4f"), *delta_cells(e),
                fewer_cell(e)] for arm, e in summary.items() if arm in QUALITY_ARMS]
    kv = [[f"`{arm}`", DESCRIPTIONS[arm], f"{e['cache']:,.0f}", f"{e['cache'] / llama_cache:.4f}", len(e["seeds"]),
           e["final"].format(".4f"), *delta_cells(e)] for arm, e in summary.items() if arm in KV_ARMS]
    missing = [f"{arm}/seed{seed}" for arm in args.arms for seed in seeds if f"{arm}/seed{seed}" not in store]
    meta, config = store.meta, store.config
    lines = [
        "# The paper's other comparisons: DenseFormer, NeuTRENO, GQA, CLA and SVFormer × CLA (CPU scale)",
        f"Regenerate: `python benchmarks/{SCRIPT} --threads 1` (resumable; `--report-only` redraws). "
        f"{meta.get('environment', 'Measured somewhere unrecorded.')}",
        f"Model: {meta.get('size', '?')}; every run {config['tokens'] / 1e6:.2f}M training tokens, context "
        f"{config['seq_len']}, batch {config['batch_size']}, lr {config['lr']:g} with 5% warmup and cosine decay to "
        f"10%, weight decay {config['weight_decay']:g}: the context-length study's context-{config['seq_len']} "
        f"settings, identical for every arm. Data: {meta.get('data', '?')}. Within a seed every arm starts from the "
        "same initial draw and sees the same batches; Δ is paired by seed (arm minus that seed's Llama).",
        "",
        "## Quality at Llama's cache: ResFormer vs the paper's baselines",
        "",
        markdown_table(["arm", "model", "seeds", "final val loss (mean ± std)",
                        "Δ vs Llama, paired (mean ± std [95% t-interval])", "seed noise check",
                        "fewer tokens to reach Llama's final loss"], quality),
        "",
        "## Loss vs KV-cache bytes: SVFormer vs GQA, CLA and SVFormer × CLA",
        "",
        markdown_table(["arm", "model", "KV cache bytes / token (fp32, measured)", "× Llama's", "seeds",
                        "final val loss (mean ± std)", "Δ vs Llama, paired (mean ± std [95% t-interval])",
                        "seed noise check"], kv),
        "",
        "Cache bytes are `cache_nbytes` of each arm's model after a forward pass (every storage counted once); at "
        f"L = {size_from_args(args).layers} layers SVFormer holds (L + 1)/(2L), GQA and CLA2 1/2 and SVFormer × CLA2 "
        "(L/2 + 1)/(2L) of Llama's cache. Δ *exceeds seed noise* when its t-interval excludes 0.",
    ]
    adopted = sorted(meta.get("adopted", {}))
    if adopted:
        lines += ["", f"Runs taken from the context-length study (identical settings): {', '.join(adopted)}."]
    if missing:
        lines += ["", f"**Incomplete**: {len(missing)} run(s) not finished yet ({', '.join(missing)}); rerun the "
                  "command to finish them (finished runs are kept)."]
    lines += ["", f"![baselines]({NAME}.png)", ""]
    path = args.out / f"{NAME}.md"
    path.write_text("\n".join(lines))
    plot(summary, llama_cache, args.out / f"{NAME}.png")
    return path


def plot(summary: dict, llama_cache: float, path: Path) -> None:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    others = [arm for arm in summary if arm != BASELINE]
    for row, arm in enumerate(others):
        d = summary[arm]["delta"]
        half = (d.high - d.low) / 2 if np.isfinite(d.high) else 0.0
        left.errorbar([d.mean], [row], xerr=[[half], [half]], marker="o", capsize=4, color=f"C{row + 1}")
    left.axvline(0, color="black", lw=1)
    left.set_yticks(range(len(others)), [f"{arm} ({len(summary[arm]['seeds'])} seeds)" for arm in others])
    left.set(xlabel="final val loss − same seed's Llama", title="Paired difference to Llama (95% t-interval)")
    for arm in (a for a in KV_ARMS if a in summary):
        e = summary[arm]
        right.errorbar([e["cache"] / llama_cache], [e["final"].mean], yerr=[e["final"].std], marker="o", capsize=4,
                       color="black" if arm == BASELINE else f"C{others.index(arm) + 1}", label=arm)
    right.set(xlabel="KV-cache bytes per token, × Llama's", ylabel="final val loss (mean ± std)",
              title="Loss vs KV-cache size")
    right.legend(fontsize="small")
    for axes in (left, right):
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ---- main ----------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(parser)
    add_study_args(parser, tokens=1_200_000)
    parser.set_defaults(seq_len=512, batch_size=4)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="arms to train and report")
    parser.add_argument("--kv-heads", type=int, default=None, help=argparse.SUPPRESS)  # the store's settings key
    parser.add_argument("--analysis-sequences", type=int, default=8, help="validation blocks for entropy/similarity")
    parser.add_argument("--no-reuse", dest="reuse", action="store_false",
                        help="train llama/learnable_plus/svformer even where the context-length study has them")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    args = parser.parse_args(argv)
    if BASELINE not in args.arms:
        parser.error(f"--arms must include the baseline {BASELINE!r}: every number is relative to it")
    if args.heads % 2:
        parser.error(f"--heads {args.heads}: the gqa arm halves the kv heads, so give an even number")
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
