"""PNG plots of the per-layer numbers (`metrics`); matplotlib is the optional `analysis` extra, imported only here."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


def _pyplot():
    try:
        import matplotlib
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Plotting needs matplotlib: `pip install resformer-hf[analysis]` (the numbers work without it)."
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_per_layer(
    series: Mapping[str, Sequence[float] | torch.Tensor],
    path: str | os.PathLike,
    *,
    ylabel: str,
    title: str,
    first_layer: int = 0,
) -> Path:
    """One line per named series against layer index; writes a PNG and returns its path."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, values in series.items():
        values = [float(v) for v in values]
        axes.plot(range(first_layer, first_layer + len(values)), values, marker="o", label=name)
    axes.set_xlabel("layer")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    return _save_figure(plt, figure, path)


def _save_figure(plt: Any, figure: Any, path: str | os.PathLike) -> Path:
    """Write `figure` as a PNG at `path` (parent folders created) and free it."""
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def plot_attention_entropy(series: Mapping[str, Sequence[float] | torch.Tensor], path: str | os.PathLike) -> Path:
    """PNG of `attention_entropy` results, one line per model."""
    return plot_per_layer(series, path, ylabel="mean attention entropy (nats)", title="Attention entropy per layer")


def plot_token_similarity(series: Mapping[str, Sequence[float] | torch.Tensor], path: str | os.PathLike) -> Path:
    """PNG of `token_similarity` results (index 0 = embeddings), one line per model."""
    return plot_per_layer(series, path, ylabel="mean pairwise cosine", title="Token similarity per layer")


def plot_lambdas(tables: Mapping[str, torch.Tensor], path: str | os.PathLike) -> Path:
    """PNG of `lambda_table` results: solid λ_first, dashed λ_self, one colour per model."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for index, (name, table) in enumerate(tables.items()):
        colour = f"C{index}"
        layers = range(len(table))
        axes.plot(layers, [float(v) for v in table[:, 0]], marker="o", color=colour, label=f"{name} λ_first")
        axes.plot(layers, [float(v) for v in table[:, 1]], marker="x", ls="--", color=colour, label=f"{name} λ_self")
    axes.set_xlabel("layer")
    axes.set_ylabel("weight")
    axes.set_title("Value-residual λ per layer")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return _save_figure(plt, figure, path)


__all__ = ["plot_attention_entropy", "plot_lambdas", "plot_per_layer", "plot_token_similarity"]
