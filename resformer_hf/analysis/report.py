"""A comparison report: the same tokens through each checkpoint, as `summary.md` with tables and (optionally) PNGs.

Inputs a user can get wrong (the text file, the tokenizer, a folder that is not a causal LM, a tokenizer whose ids
do not fit a model's vocabulary) are `AnalysisError`s with a one-line message.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from transformers.utils import logging

from ..errors import UserInputError
from .metrics import attention_entropy, lambda_table, token_similarity
from .plots import plot_attention_entropy, plot_lambdas, plot_token_similarity

logger = logging.get_logger(__name__)


class AnalysisError(UserInputError):
    """A problem with the analysis' inputs; the message says what to pass instead."""


def read_text_file(path: str | os.PathLike, label: str = "--text") -> str:
    """The UTF-8 text of `path`, refusing missing, unreadable, binary and empty files by name."""
    path = Path(path)
    if not path.is_file():
        raise AnalysisError(f"{label} {path} is not a file; pass a UTF-8 text file.")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise AnalysisError(f"{label} {path} cannot be read ({error.strerror or error}).") from None
    except UnicodeDecodeError:
        raise AnalysisError(f"{label} {path} is not UTF-8 text (a binary file?); pass a plain text file.") from None
    if "\x00" in text:
        raise AnalysisError(f"{label} {path} holds NUL bytes, so it is not text; pass a plain text file.")
    if not text.strip():
        raise AnalysisError(f"{label} {path} is empty; give it at least a few sentences.")
    return text


def _load_tokenizer(source: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as error:  # missing files, unknown class, bad JSON: all "no usable tokenizer here"
        raise AnalysisError(
            f"could not load a tokenizer from {source!r} ({type(error).__name__}: {error}); pass --tokenizer PATH "
            "pointing at one."
        ) from error


def _load_config(model_dir: str):
    from transformers import AutoConfig

    import resformer_hf  # noqa: F401  (registers model type "resformer")

    try:
        return AutoConfig.from_pretrained(model_dir)
    except Exception as error:  # not a folder, no config.json, a field of the wrong type, ...
        message = f"{model_dir} is not a loadable model folder ({type(error).__name__}: {error})."
        raise AnalysisError(message) from error


def _load_model(model_dir: str, device: str):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    except Exception as error:  # no weights, wrong architecture, invalid config values
        raise AnalysisError(f"{model_dir} does not load as a causal LM ({type(error).__name__}: {error}).") from error
    return model.to(device).eval()


def _token_batch(text: str, tokenizer, max_tokens: int, num_sequences: int) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 2:
        raise AnalysisError("the text tokenizes to fewer than 2 tokens; give it at least a sentence.")
    length = min(max_tokens, len(ids))
    count = max(1, min(num_sequences, len(ids) // length))
    return torch.tensor(ids[: count * length]).view(count, length)


def _check_vocabulary(input_ids: torch.Tensor, configs: Mapping[str, object], tokenizer_source: str) -> None:
    largest = int(input_ids.max())
    for model_dir, config in configs.items():
        vocab_size = getattr(config, "vocab_size", None)
        if vocab_size is not None and largest >= vocab_size:
            raise AnalysisError(
                f"the tokenizer from {tokenizer_source} produces token id {largest}, but {model_dir} has only "
                f"vocab_size={vocab_size}; pass that model's own tokenizer with --tokenizer."
            )


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


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
    if not os.fspath(out_dir).strip():
        raise AnalysisError("the output folder is empty (an unset shell variable?); pass a folder path.")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise AnalysisError(f"the output folder {out_dir} is a file; pass a folder path.")
    if plots and importlib.util.find_spec("matplotlib") is None:
        raise AnalysisError("plots need matplotlib: pip install matplotlib (the `analysis` extra) or pass --no-plots.")
    tokenizer_source = tokenizer_path or model_dirs[0]
    tokenizer = _load_tokenizer(tokenizer_source)
    configs = {model_dir: _load_config(model_dir) for model_dir in model_dirs}
    context = min(getattr(config, "max_position_embeddings", max_tokens) for config in configs.values())
    input_ids = _token_batch(text, tokenizer, min(max_tokens, context), num_sequences)
    _check_vocabulary(input_ids, configs, tokenizer_source)
    if max_tokens > context:  # said once the inputs are known to be usable
        logger.warning(f"max_tokens={max_tokens} exceeds the models' context ({context}); using {context}.")
    input_ids = input_ids.to(device)

    entropies, similarities, lambdas, kinds = {}, {}, {}, {}
    names = _short_names(model_dirs)
    for name, model_dir in zip(names, model_dirs):
        model = _load_model(model_dir, device)
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
    out_dir.mkdir(parents=True, exist_ok=True)
    if plots:
        plot_attention_entropy(entropies, out_dir / "attention_entropy.png")
        plot_token_similarity(similarities, out_dir / "token_similarity.png")
        plot_lambdas(lambdas, out_dir / "lambdas.png")
        sections += ["## Plots", "![attention entropy](attention_entropy.png)",
                     "![token similarity](token_similarity.png)", "![lambdas](lambdas.png)"]
    summary = out_dir / "summary.md"
    summary.write_text("\n\n".join(sections) + "\n")
    return summary


__all__ = ["AnalysisError", "analyze_checkpoints", "read_text_file"]
