"""Model cards for ResFormer checkpoints, rendered with `huggingface_hub.ModelCard` from the bundled template.

The card states what a reader of the Hub page needs and cannot get from `config.json` at a glance: the variant, the λ
per layer (learned values matter most after conversion), how to load with and without the plugin, where the model
came from and how it was trained, and the paper to cite.
"""

from __future__ import annotations

import importlib.resources
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from huggingface_hub import ModelCard, ModelCardData

from ..remote_code.configuration_resformer import ResFormerConfig
from ..remote_code.lambdas import ValueResidual

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: Name of the template inside the package; `model_cards/resformer.md` in the repository is the same file.
TEMPLATE_NAME = "model_card_template.md"

_INIT_SUMMARIES = {
    "preserve": "λ start where the converted model computes exactly what the base model computed",
    "paper": "λ start at the paper's initial values, so outputs differ from the base model until fine-tuned",
}


class CardFacts(TypedDict, total=False):
    """Where a model came from and how it was trained, as `build_model_card` states it (its docstring says what each
    means). Named once here so that the functions that pass them on to the card take exactly these keywords."""

    base_model: str | None
    init: str | None
    datasets: str | Sequence[str] | None
    training: Mapping[str, Any] | None
    license: str | None
    model_id: str | None


def check_card_facts(facts: Mapping[str, Any]) -> None:
    """Raise the `TypeError` a misspelt keyword raises, before the caller writes any file rather than at the card."""
    unknown = sorted(set(facts) - set(CardFacts.__annotations__))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(unknown)}; the model card takes "
            f"{', '.join(CardFacts.__annotations__)}"
        )


def _template_path() -> Path:
    """The template shipped inside the package, so installed (non-editable) copies can render cards too."""
    return Path(str(importlib.resources.files(__package__).joinpath(TEMPLATE_NAME)))


def _lambda_table(config: ResFormerConfig, lambdas: Any) -> torch.Tensor:
    """The [L, 2] table to print: the given one, checked, or the config's initial/fixed values."""
    if lambdas is None:
        return ValueResidual(config).lambda_table()
    table = torch.as_tensor(lambdas, dtype=torch.float32).detach().cpu()
    expected = (config.num_hidden_layers, 2)
    if tuple(table.shape) != expected:
        raise ValueError(
            f"lambdas has shape {tuple(table.shape)}, expected {expected} (layers × (λ_first, λ_self)); pass "
            "model.value_residual_lambdas()."
        )
    if not torch.isfinite(table).all():
        raise ValueError("lambdas contains NaN or infinity; check the training run before publishing.")
    return table


def _lambda_note(config: ResFormerConfig, given: bool) -> str:
    spec = config.value_residual_spec
    if spec.learns_mix:
        note = (
            "The values below are the learned ones stored in this checkpoint."
            if given
            else "The values below are the initial values from the config; training changes them."
        )
    else:
        note = "The values below are fixed by the variant."
    return f"{note} {spec.table_note}".strip()


def _kv_sharing(config: ResFormerConfig) -> str | None:
    """The card's cross-layer-attention row, or None when every layer has its own K and V."""
    consumers = config.layers_reading_shared_keys_values
    if not consumers:
        return None
    return (f"groups of {config.cross_layer_attention} layers attend over their first layer's K and V; layers "
            f"{', '.join(map(str, consumers))} have no `k_proj`/`v_proj` and no cache entries")


def _value_embeddings(config: ResFormerConfig) -> str | None:
    """The card's value-embedding row (issue 56): the layers with a table and the parameters they add; None without."""
    layers = config.value_embedding_layers
    if not layers:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    table = config.vocab_size * config.num_key_value_heads * head_dim
    gate = config.num_key_value_heads * min(12, config.hidden_size)
    return (f"layers {', '.join(map(str, layers))} add `g·E[token]` to their values (`{config.value_embeddings}`): "
            f"{len(layers) * (table + gate):,} parameters ({len(layers)} tables of {config.vocab_size} × "
            f"{config.num_key_value_heads * head_dim} and their gates)")


def _format_fact(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(_format_fact(item) for item in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _as_list(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(item) for item in value]


def architecture(config: ResFormerConfig) -> str:
    """The architecture in words: Llama's, and what the base's facts change (`remote_code/architecture.py`)."""
    types = config.attention_types
    sliding = sum(kind != "full_attention" for kind in types)
    parts = [
        {"head": "RMSNorm on each head's queries and keys",
         "projection": "RMSNorm over the whole query and key projections"}.get(config.qk_norm),
        {"post": "norms on each sublayer's output (before the residual add) instead of its input",
         "sandwich": "norms before and after each sublayer"}.get(config.block_norms),
        "norms that scale by `1 + w`" if config.rms_norm_type == "gemma3" else None,
        "RoPE in float32" if config.rope_in_float32 else None,
        f"embeddings scaled by {config.embedding_multiplier:g}" if config.embedding_multiplier else None,
        f"attention scores scaled by {config.query_pre_attn_scalar:g}^-1/2" if config.query_pre_attn_scalar else None,
        f"{sliding} of {len(types)} layers attending over a {config.sliding_window}-token window" if sliding else None,
        f"no RoPE in layers {', '.join(map(str, config.nope_layers))}" if config.nope_layers else None,
    ]
    parts = [part for part in parts if part]
    return "Llama's architecture" + (f" with {', '.join(parts)}" if parts else "")


def build_model_card(
    config: ResFormerConfig,
    *,
    base_model: str | None = None,
    init: str | None = None,
    lambdas: Any = None,
    datasets: str | Sequence[str] | None = None,
    training: Mapping[str, Any] | None = None,
    license: str | None = None,
    model_id: str | None = None,
) -> ModelCard:
    """Render the card of a ResFormer checkpoint.

    Args:
        config: the model's `ResFormerConfig`.
        base_model: Hub id (or path) of the Llama checkpoint this one was converted from; goes into the metadata.
        init: the conversion's λ initialisation (e.g. `"preserve"`).
        lambdas: effective (λ_first, λ_self) per layer, `model.value_residual_lambdas()`; without it the table shows
            the config's initial (or fixed) values.
        datasets: Hub dataset ids used for training (metadata) or free-text names of other data (text only).
        training: training facts to list (steps, learning rate, final loss, ...), printed in the given order.
        license: SPDX-like Hub licence id (e.g. `"apache-2.0"`); left out of the metadata when unknown.
        model_id: the repo id (or path) readers load the model from; used in the code snippets and the title.
    """
    if not isinstance(config, ResFormerConfig):
        raise TypeError(
            f"config must be a ResFormerConfig, got {type(config).__name__}; pass model.config of a ResFormer model."
        )
    spec = config.value_residual_spec
    table = _lambda_table(config, lambdas)
    receivers = set(config.value_residual_receivers)
    dataset_list = _as_list(datasets)
    hub_datasets = [name for name in dataset_list if _looks_like_hub_id(name)]

    tags = ["resformer", "value-residual", "custom_code"]
    if spec.drops_value_projections:
        tags.append(spec.name)
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=tags,
        license=license,
        base_model=base_model if base_model and _looks_like_hub_id(base_model) else None,
        datasets=hub_datasets or None,
        model_name=model_id.rstrip("/").split("/")[-1] if model_id else None,
    )
    lambda_rows = [
        {
            "layer": layer,
            "receives": layer in receivers,
            "first": f"{table[layer, 0].item():.4f}",
            "self": f"{table[layer, 1].item():.4f}",
        }
        for layer in range(table.shape[0])
    ]
    if license:
        license_text = f"`{license}`"
    elif base_model:
        license_text = "not stated here; the base model's licence applies"
    else:
        license_text = "not stated"
    from .. import __version__  # late: the package imports this module's siblings first

    return ModelCard.from_template(
        card_data,
        template_path=str(_template_path()),
        title=model_id.rstrip("/").split("/")[-1] if model_id else f"{spec.label} language model",
        variant=spec.name,
        variant_label=spec.label,
        variant_summary=spec.summary,
        architecture=architecture(config),
        base_model=base_model,
        base_model_url=_base_model_url(base_model),
        init=init,
        init_summary=_INIT_SUMMARIES.get(init, "see `resformer_hf.conversion`"),
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        vocab_size=config.vocab_size,
        receivers=", ".join(str(layer) for layer in sorted(receivers)) or "–",
        kv_sharing=_kv_sharing(config),
        value_embeddings=_value_embeddings(config),
        license_text=license_text,
        model_id=model_id or "path/to/this/model",
        lambda_note=_lambda_note(config, lambdas is not None),
        lambda_rows=lambda_rows,
        dataset_list=dataset_list,
        training_rows=[(str(key), _format_fact(value)) for key, value in (training or {}).items()],
        training=bool(training),
        package_version=__version__,
    )


def write_model_card(
    save_directory: str | os.PathLike, config: ResFormerConfig, *, lambdas: Any = None, **facts: Unpack[CardFacts]
) -> Path:
    """Write the card as `README.md` into `save_directory` (created if missing); returns its path. The arguments are
    `build_model_card`'s."""
    card = build_model_card(config, lambdas=lambdas, **facts)
    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "README.md"
    card.save(path)
    return path


def _looks_like_hub_id(name: str) -> bool:
    """Hub ids are `name` or `owner/name` without spaces or path separators beyond one slash."""
    return bool(name) and " " not in name and name.count("/") <= 1 and not os.path.exists(name)


def _base_model_url(base_model: str | None) -> str | None:
    if base_model is None:
        return None
    return f"https://huggingface.co/{base_model}" if _looks_like_hub_id(base_model) else None


__all__ = ["CardFacts", "build_model_card", "check_card_facts", "write_model_card"]
