"""From the source's `config.json` to a `ResFormerConfig`: options, field checks, and sizes bounded by the weights.

Variant facts come from the registry in `variants.py` at call time, so a variant added there converts without
touching this module; each base's facts come from `bases.py`. Everything a user can get wrong in `config.json`, and
everything it holds that ResFormer does not compute, becomes a `ConversionError` naming the field, and the sizes that
decide how much gets built are checked against the weight headers before anything is.
"""

from __future__ import annotations

import re

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..remote_code.configuration_resformer import (
    VARIANTS,
    ResFormerConfig,
    convertible_variants,
    output_preserving_variants,
)
from .bases import BASES, TEXT_MODEL_OF, neutral_value
from .report import ConversionError
from .safetensors_io import TensorInfo

INITS = ("preserve", "paper")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_MODEL_TYPES = tuple(BASES)
#: Source fields that say where a config came from, not what the model computes.
_PROVENANCE_FIELDS = ("model_type", "transformers_version", "architectures", "_name_or_path", "auto_map")

#: Size fields of a decoder's config.json: each must be a positive integer when given (True: null allowed too).
_SIZE_FIELDS = {
    "vocab_size": False,
    "hidden_size": False,
    "intermediate_size": False,
    "num_hidden_layers": False,
    "num_attention_heads": False,
    "max_position_embeddings": False,
    "num_key_value_heads": True,
    "head_dim": True,
}
_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.")
_EMBEDDINGS = "model.embed_tokens.weight"


def check_options(variant: str, init: str) -> None:
    """Refuse a variant the registry cannot make from a Llama, or an init it cannot honour."""
    convertible, preserving = convertible_variants(), output_preserving_variants()
    if variant not in convertible:
        raise ConversionError(
            f"variant {variant!r} cannot be made from a Llama checkpoint; use one of {', '.join(convertible)}."
        )
    if init not in INITS:
        raise ConversionError(f"init {init!r} is not known; use 'preserve' or 'paper'.")
    if init == "preserve" and variant not in preserving:
        raise ConversionError(
            f"variant {variant!r} cannot preserve the source's outputs ({VARIANTS[variant].why_not_preserving}); pass "
            "init='paper' (--init paper) to accept changed outputs that need fine-tuning, or use a variant that can "
            f"({', '.join(preserving)})."
        )


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The torch dtype for `--dtype` (None keeps each tensor's own)."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)} or leave it unset.")
    return DTYPES[name]


def check_source_config(source_config: dict) -> None:
    """Refuse what the ResFormer model does not implement, and field values of the wrong type, by field name."""
    model_type = source_config.get("model_type")
    if model_type == ResFormerConfig.model_type:
        raise ConversionError("SRC is already a ResFormer checkpoint; nothing to convert.")
    if model_type in TEXT_MODEL_OF:
        raise ConversionError(
            f"model_type {model_type!r} is a multimodal model; only its text model converts: model_type "
            f"{TEXT_MODEL_OF[model_type]}."
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(
            f"model_type {model_type!r} is not supported: the decoders that convert are "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    architectures = source_config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise ConversionError(
            f"config.json: architectures={architectures!r} must be a list of class names such as "
            "['LlamaForCausalLM']; fix config.json."
        )
    if any(not name.endswith("ForCausalLM") for name in architectures):
        raise ConversionError(
            f"architectures {architectures} is not a causal LM; only *ForCausalLM checkpoints convert."
        )
    quantization = source_config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else quantization
        raise ConversionError(
            f"quantized checkpoints are not supported (quantization_config: {method}); convert the unquantized "
            "weights."
        )
    for name, nullable in _SIZE_FIELDS.items():
        if name not in source_config or (nullable and source_config[name] is None):
            continue
        value = source_config[name]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConversionError(f"config.json: {name}={value!r} must be a positive integer; fix config.json.")


def check_sizes_against_weights(source_config: dict, inventory: dict[str, TensorInfo]) -> None:
    """The sizes that decide how much gets built must be what the weights hold, before anything is built."""
    layers = sorted({int(match.group(1)) for name in inventory if (match := _LAYER_TENSOR.match(name))})
    declared = source_config.get("num_hidden_layers")
    if declared is not None and (declared != len(layers) or layers != list(range(len(layers)))):
        held = f"{len(layers)} layer(s) ({layers[0]}..{layers[-1]})" if layers else "no layers"
        raise ConversionError(
            f"config.json says num_hidden_layers={declared} but the weights hold {held}; the config does not match "
            "the weights."
        )
    if _EMBEDDINGS in inventory and len(inventory[_EMBEDDINGS].shape) == 2:
        rows, width = inventory[_EMBEDDINGS].shape
        for name, held in (("vocab_size", rows), ("hidden_size", width)):
            if name in source_config and source_config[name] != held:
                raise ConversionError(
                    f"config.json says {name}={source_config[name]} but {_EMBEDDINGS} has shape {[rows, width]}; the "
                    "config does not match the weights."
                )


def lambda_fields(variant: str, init: str) -> dict:
    """Config fields that set the initial λ: the registry's exact-source point for `preserve`, else its defaults."""
    fields: dict = {"value_residual": variant}
    if init == "preserve":
        fields.update(VARIANTS[variant].preserving_fields)
    return fields


def build_resformer_config(
    source_config: dict, *, variant: str, init: str, dtype: torch.dtype | None = None, value_embeddings=None
) -> ResFormerConfig:
    """The ResFormer config for a source config (a `config.json` dict of one of `bases.BASES`), or a
    `ConversionError` that names the field or the feature the ResFormer model does not implement."""
    from transformers import AutoConfig

    check_source_config(source_config)
    model_type = source_config["model_type"]
    base = BASES[model_type]
    fields = {k: v for k, v in source_config.items() if k not in _PROVENANCE_FIELDS}
    try:
        parsed = AutoConfig.for_model(model_type, **fields)
    except Exception as error:  # transformers' strict dataclass checks raise several types; all mean "bad field"
        raise ConversionError(f"config.json does not parse as a {model_type} config: {error}") from error

    source = parsed.to_dict()
    rope = source.get("rope_parameters") or {}
    by_type = rope.values() if any(isinstance(value, dict) for value in rope.values()) else [rope]
    for parameters in by_type:
        rope_type = parameters.get("rope_type", "default") if isinstance(parameters, dict) else None
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise ConversionError(f"rope_parameters {rope} are not implemented by transformers' rotary embeddings.")
    kwargs = {k: v for k, v in source.items() if k not in _PROVENANCE_FIELDS and k not in base.consumed}
    for name, neutral in base.neutral.items():
        value = kwargs.pop(name, neutral)
        if not neutral_value(value, neutral):
            raise ConversionError(f"config.json: {name}={value!r} is not implemented by ResFormer (only {neutral!r}, "
                                  f"as {base.name} ships it); such a {model_type} checkpoint does not convert.")
    kwargs.update(base.architecture)
    kwargs.update(base.derive(source) if base.derive else {})
    unmodelled = sorted(set(kwargs) - set(ResFormerConfig().to_dict()))
    if unmodelled:
        raise ConversionError(f"config.json holds {', '.join(unmodelled)}, which ResFormer does not model; a "
                              f"{model_type} checkpoint with {'it' if len(unmodelled) == 1 else 'them'} does not "
                              "convert.")
    if base.qkv_bias_only:
        # q/k/v biases and no o_proj bias; Llama's flag adds all four, so o_proj gets an exact zero bias.
        kwargs["attention_bias"] = True
    if dtype is not None:
        kwargs["dtype"] = str(dtype).removeprefix("torch.")
    kwargs.update(lambda_fields(variant, init))
    if value_embeddings:  # value embeddings: tables at zero, so the outputs stay the source's
        kwargs["value_embeddings"] = value_embeddings
    try:
        config = ResFormerConfig(**kwargs)
    except Exception as error:  # ValueError naming the field, or a strict-dataclass type error
        raise ConversionError(f"the source config cannot become a ResFormer config: {error}") from error
    config.architectures = ["ResFormerForCausalLM"]
    return config


__all__ = [
    "DTYPES",
    "INITS",
    "SUPPORTED_MODEL_TYPES",
    "build_resformer_config",
    "check_options",
    "check_sizes_against_weights",
    "check_source_config",
    "lambda_fields",
    "resolve_dtype",
]
