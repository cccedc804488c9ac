"""The baselines study's report: its two comparisons, each paired by seed with Llama — quality at Llama's KV cache
(ResFormer, NeuTRENO, DenseFormer) and loss against KV-cache bytes (SVFormer, GQA, CLA2, SVFormer × CLA2), the bytes
measured by `cache_nbytes` on each arm's model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from benchmarks.common import BASELINE, build_model, markdown_table, pyplot
from benchmarks.studies.reports.seeds import fewer_tokens, save, summarize
from benchmarks.studies.results import Results
from benchmarks.studies.seed_statistics import paired_difference
from benchmarks.studies.spec import Arm, Settings
from benchmarks.studies.training import cache_bytes_per_token


def arm_cache_bytes(arm: Arm, settings: Settings, tokens: int = 16) -> float:
    """Bytes the arm's float32 KV cache holds per token, measured with `cache_nbytes` after a forward pass."""
    size = arm.size(settings)
    fields = dict(vocab_size=64, hidden_size=size.hidden_size, intermediate_size=size.intermediate,
                  num_hidden_layers=size.layers, num_attention_heads=size.heads,
                  num_key_value_heads=size.kv_heads or size.heads, max_position_embeddings=tokens)
    if size.cross_layer_attention:
        fields["cross_layer_attention"] = size.cross_layer_attention
    model = build_model(arm.model, **fields).eval()
    return cache_bytes_per_token(model, torch.randint(0, 64, (tokens,)))


def summarize_arms(results: Results) -> dict:
    """Per arm: the seed summary over the seeds where it and Llama both finished, and its cache bytes per token."""
    cell = results.only
    settings = cell.settings
    summary = {}
    for arm in results.arms:
        pair = [BASELINE] if arm == BASELINE else [BASELINE, arm]
        entry = summarize(cell, pair, results.seeds)
        if entry["seeds"]:
            summary[arm] = dict(entry["variants"][arm], seeds=entry["seeds"],
                                cache=arm_cache_bytes(results.study.arm(arm), settings))
    return summary


def delta_cells(entry: dict) -> list[str]:
    if "delta" not in entry:
        return ["—", "—"]
    d = entry["delta"]
    return [d.describe(), f"{d.negative}/{d.n} seeds lower; {d.verdict()}"]


def head_to_head(cell, arms: tuple[str, ...], seeds: list[int]) -> list[list[str]]:
    """The comparison's first arm after Llama (the paper's proposal) against each later one, paired by the seeds both
    finished: the paper's orderings, read beyond seed noise or not."""
    reference, *others = [arm for arm in arms if arm != BASELINE]
    rows = []
    for arm in others:
        both = [seed for seed in seeds if f"{arm}/seed{seed}" in cell and f"{reference}/seed{seed}" in cell]
        if len(both) < 2:
            continue
        d = paired_difference([cell[f"{arm}/seed{seed}"]["final_val_loss"] for seed in both],
                              [cell[f"{reference}/seed{seed}"]["final_val_loss"] for seed in both])
        rows.append([f"`{arm}` − `{reference}`", len(both), d.describe(), f"{d.negative}/{d.n} seeds lower; "
                     f"{d.verdict()}"])
    return rows


def head_to_head_lines(cell, arms: tuple[str, ...], seeds: list[int]) -> list[str]:
    rows = head_to_head(cell, arms, seeds)
    if not rows:
        return []
    return ["Head to head, paired by seed (a negative Δ: the later arm ends lower):", "",
            markdown_table(["Δ final val loss", "seeds", "mean ± std [95% t-interval]", "seed noise check"], rows), ""]


def render(results: Results) -> Path | None:
    summary, cell, study = summarize_arms(results), results.only, results.study
    if BASELINE not in summary:
        print("no Llama run has finished yet; nothing to report")
        return None
    quality_arms, kv_arms = (arms for _, arms in study.comparisons)
    describe = {arm.name: arm.description for arm in study.arms}
    llama_cache = summary[BASELINE]["cache"]
    quality = [[f"`{arm}`", describe[arm], len(e["seeds"]), e["final"].format(".4f"), *delta_cells(e),
                "—" if "delta" not in e else fewer_tokens(e, "never reached it")]
               for arm, e in summary.items() if arm in quality_arms]
    kv = [[f"`{arm}`", describe[arm], f"{e['cache']:,.0f}", f"{e['cache'] / llama_cache:.4f}", len(e["seeds"]),
           e["final"].format(".4f"), *delta_cells(e)] for arm, e in summary.items() if arm in kv_arms]
    missing = [key for key in (f"{arm}/seed{seed}" for arm in results.arms for seed in results.seeds)
               if key not in cell]
    meta, config = cell.meta, cell.config
    lines = [
        "# The paper's other comparisons: DenseFormer, NeuTRENO, GQA, CLA and SVFormer × CLA (CPU scale)",
        f"{results.regenerate} {meta.get('environment', 'Measured somewhere unrecorded.')}",
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
        *head_to_head_lines(cell, quality_arms, results.seeds),
        "## Loss vs KV-cache bytes: SVFormer vs GQA, CLA and SVFormer × CLA",
        "",
        markdown_table(["arm", "model", "KV cache bytes / token (fp32, measured)", "× Llama's", "seeds",
                        "final val loss (mean ± std)", "Δ vs Llama, paired (mean ± std [95% t-interval])",
                        "seed noise check"], kv),
        "",
        *head_to_head_lines(cell, kv_arms, results.seeds),
        "Cache bytes are `cache_nbytes` of each arm's model after a forward pass (every storage counted once); at "
        f"L = {config['layers']} layers SVFormer holds (L + 1)/(2L), GQA and CLA2 1/2 and SVFormer × CLA2 "
        "(L/2 + 1)/(2L) of Llama's cache. Δ *exceeds seed noise* when its t-interval excludes 0.",
    ]
    if missing:
        lines += ["", f"**Incomplete**: {len(missing)} run(s) not finished yet ({', '.join(missing)}); rerun the "
                  "command to finish them (finished runs are kept)."]
    path = results.write(lines, ("baselines", ""))
    plot(summary, kv_arms, llama_cache, results.image())
    return path


def plot(summary: dict, kv_arms: tuple[str, ...], llama_cache: float, path: Path) -> None:
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
    for arm in (a for a in kv_arms if a in summary):
        e = summary[arm]
        right.errorbar([e["cache"] / llama_cache], [e["final"].mean], yerr=[e["final"].std], marker="o", capsize=4,
                       color="black" if arm == BASELINE else f"C{others.index(arm) + 1}", label=arm)
    right.set(xlabel="KV-cache bytes per token, × Llama's", ylabel="final val loss (mean ± std)",
              title="Loss vs KV-cache size")
    right.legend(fontsize="small")
    save(plt, figure, (left, right), path, legend=False)
