"""The paper's analyses for any ResFormer or Llama checkpoint: attention entropy, token similarity, λ table.

Value Residual Learning claims that carrying layer 0's values upward keeps deep layers' attention less concentrated
and their token representations less alike (less over-smoothing). These functions measure exactly that, per layer,
so a user can compare a checkpoint with and without the value residual. Each returns plain numbers and has a
`plot_*` companion that draws a PNG; matplotlib is the optional `analysis` extra and is imported only when plotting.

Command line: `resformer-analyze MODEL_DIR [MODEL_DIR ...] --text FILE --out DIR` (see `main`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = [
    "attention_entropy",
    "token_similarity",
    "lambda_table",
    "plot_per_layer",
    "plot_attention_entropy",
    "plot_token_similarity",
    "plot_lambdas",
    "analyze_checkpoints",
    "main",
]


# ---- numbers ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _eager_attention(model: PreTrainedModel) -> Iterator[None]:
    """Temporarily switch to eager attention: only it materialises the probabilities that entropy needs."""
    previous = model.config._attn_implementation
    if previous != "eager":
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if previous != "eager":
            model.set_attn_implementation(previous)


def _valid_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}; pass the "
            "2-D padding mask the tokenizer returned."
        )
    return attention_mask.bool()


@torch.no_grad()
def attention_entropy(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean entropy (nats) of each layer's attention distributions, float32 CPU tensor [num_hidden_layers].

    For every head and every non-padding query token, `H = -Σ_k p_k log p_k` over the keys it attends to; the layer's
    number is the mean over heads and query tokens of the batch. Low entropy = concentrated attention (the paper's
    "attention sink" symptom). Runs the model with eager attention (switched back afterwards).
    """
    valid = _valid_mask(input_ids, attention_mask)
    with _eager_attention(model):
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True, use_cache=False)
    if not outputs.attentions or any(a is None for a in outputs.attentions):
        raise ValueError(f"{type(model).__name__} returned no attention probabilities; it cannot be analysed here.")
    weight = valid.float()  # [B, T] query tokens that count
    entropies = []
    for probabilities in outputs.attentions:  # [B, H, T, T]
        probabilities = probabilities.float()
        per_query = -torch.special.xlogy(probabilities, probabilities).sum(-1).mean(1)  # [B, T], mean over heads
        entropies.append((per_query * weight).sum() / weight.sum())
    return torch.stack(entropies).cpu()


def _mean_pairwise_cosine(states: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean cosine similarity over ordered pairs i != j of valid tokens, averaged over sequences ([B, T, D] input)."""
    units = torch.nn.functional.normalize(states.float(), dim=-1) * valid[..., None]
    count = valid.sum(-1).float()  # tokens per sequence
    total = units.sum(1)  # Σ_i u_i
    # Σ_{i != j} u_i·u_j = |Σ_i u_i|² − Σ_i |u_i|² = |Σ_i u_i|² − n (unit vectors).
    pair_sum = (total * total).sum(-1) - count
    usable = count >= 2
    if not usable.any():
        raise ValueError("token similarity needs at least 2 non-padding tokens in some sequence; pass longer text.")
    return (pair_sum[usable] / (count[usable] * (count[usable] - 1))).mean()


@torch.no_grad()
def token_similarity(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean pairwise cosine similarity of token representations, float32 CPU tensor [num_hidden_layers + 1].

    Entry 0 is the embeddings, entry n the output of layer n (the last one after the final norm, as transformers
    returns it). Values near 1 mean the tokens have collapsed onto one direction (over-smoothing).
    """
    valid = _valid_mask(input_ids, attention_mask)
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return torch.stack([_mean_pairwise_cosine(h, valid) for h in outputs.hidden_states]).cpu()


def lambda_table(model: PreTrainedModel) -> torch.Tensor:
    """Effective (λ_first, λ_self) per layer, float32 [num_hidden_layers, 2]; a plain Llama is (0, 1) everywhere."""
    base = getattr(model, "base_model", model)
    if hasattr(base, "value_residual"):
        return base.value_residual.lambda_table()
    table = torch.zeros(model.config.num_hidden_layers, 2)
    table[:, 1] = 1.0
    return table


# ---- plots -------------------------------------------------------------------------------------------------------


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


# ---- command line ------------------------------------------------------------------------------------------------


def _load(model_dir: str, device: str):
    from transformers import AutoModelForCausalLM

    import resformer_hf  # noqa: F401  (registers model type "resformer")

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    return model.to(device).eval()


def _token_batch(text: str, tokenizer, max_tokens: int, num_sequences: int) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 2:
        raise ValueError("the --text file tokenizes to fewer than 2 tokens; give it at least a sentence.")
    length = min(max_tokens, len(ids))
    count = max(1, min(num_sequences, len(ids) // length))
    return torch.tensor(ids[: count * length]).view(count, length)


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def analyze_checkpoints(
    model_dirs: Sequence[str],
    text: str,
    out_dir: str | os.PathLike,
    *,
    tokenizer_path: str | None = None,
    max_tokens: int = 256,
    num_sequences: int = 4,
    device: str = "cpu",
    plots: bool = True,
) -> Path:
    """Analyse each checkpoint on the same tokens; write `summary.md` (+ PNGs) into `out_dir` and return its path."""
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_source = tokenizer_path or model_dirs[0]
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"could not load a tokenizer from {tokenizer_source!r} ({error}); pass --tokenizer PATH pointing at one."
        ) from error
    from transformers import AutoConfig

    import resformer_hf  # noqa: F401  (registers model type "resformer")

    context = min(getattr(AutoConfig.from_pretrained(d), "max_position_embeddings", max_tokens) for d in model_dirs)
    if max_tokens > context:
        logger.warning(f"max_tokens={max_tokens} exceeds the models' context ({context}); using {context}.")
        max_tokens = context
    input_ids = _token_batch(text, tokenizer, max_tokens, num_sequences).to(device)

    entropies, similarities, lambdas, kinds = {}, {}, {}, {}
    names = _short_names(model_dirs)
    for name, model_dir in zip(names, model_dirs):
        model = _load(model_dir, device)
        entropies[name] = attention_entropy(model, input_ids)
        similarities[name] = token_similarity(model, input_ids)
        lambdas[name] = lambda_table(model)
        kinds[name] = getattr(model.config, "value_residual", "none (Llama)")
        del model

    sections = [
        "# Value-residual analysis",
        f"{input_ids.shape[0]} sequence(s) × {input_ids.shape[1]} tokens. Attention entropy in nats (mean over heads "
        "and query tokens; low = concentrated); token similarity = mean pairwise cosine of hidden states (entry 0 = "
        "embeddings; high = over-smoothed).",
        "## Models",
        _markdown_table(
            ["name", "checkpoint", "value_residual"], [[n, f"`{d}`", kinds[n]] for n, d in zip(names, model_dirs)]
        ),
        "## Attention entropy per layer",
        _per_layer_table(entropies, first_layer=0),
        "## Token similarity per layer",
        _per_layer_table(similarities, first_layer=0, first_label="emb"),
        "## λ (λ_first, λ_self) per layer",
        _per_layer_table(
            {n: [f"{a:.3f}, {b:.3f}" for a, b in t.tolist()] for n, t in lambdas.items()}, first_layer=0
        ),
    ]
    if plots:
        plot_attention_entropy(entropies, out_dir / "attention_entropy.png")
        plot_token_similarity(similarities, out_dir / "token_similarity.png")
        plot_lambdas(lambdas, out_dir / "lambdas.png")
        sections += ["## Plots", "![attention entropy](attention_entropy.png)",
                     "![token similarity](token_similarity.png)", "![lambdas](lambdas.png)"]
    summary = out_dir / "summary.md"
    summary.write_text("\n\n".join(sections) + "\n")
    return summary


def _short_names(model_dirs: Sequence[str]) -> list[str]:
    names = [Path(d).name or str(d) for d in model_dirs]
    return [f"{name}#{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


def _per_layer_table(series: Mapping[str, Sequence], first_layer: int, first_label: str | None = None) -> str:
    width = max(len(v) for v in series.values())
    header = ["model"] + [
        first_label if (first_label is not None and i == 0) else str(first_layer + i) for i in range(width)
    ]
    rows = []
    for name, values in series.items():
        cells = [v if isinstance(v, str) else f"{float(v):.3f}" for v in values]
        rows.append([name] + cells + [""] * (width - len(cells)))
    return _markdown_table(header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    """`resformer-analyze`: plots and a markdown summary of attention entropy, token similarity and λ."""
    parser = argparse.ArgumentParser(
        prog="resformer-analyze",
        description="Per-layer attention entropy, token similarity and λ of ResFormer / Llama checkpoints.",
    )
    parser.add_argument("model_dirs", nargs="+", metavar="MODEL_DIR", help="checkpoint(s) to analyse and compare")
    parser.add_argument("--text", required=True, help="UTF-8 text file the models read")
    parser.add_argument("--out", required=True, help="output folder for summary.md and the PNGs")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path (default: the first MODEL_DIR)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--num-sequences", type=int, default=4, help="sequences cut from the text (default 4)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--no-plots", action="store_true", help="write only summary.md (no matplotlib needed)")
    args = parser.parse_args(argv)
    if args.max_tokens < 2 or args.num_sequences < 1:
        parser.error("--max-tokens must be >= 2 and --num-sequences >= 1")
    text_path = Path(args.text)
    if not text_path.is_file():
        parser.error(f"--text {args.text!r} is not a file")
    summary = analyze_checkpoints(
        args.model_dirs,
        text_path.read_text(encoding="utf-8"),
        args.out,
        tokenizer_path=args.tokenizer,
        max_tokens=args.max_tokens,
        num_sequences=args.num_sequences,
        device=args.device,
        plots=not args.no_plots,
    )
    print(f"wrote {summary}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
