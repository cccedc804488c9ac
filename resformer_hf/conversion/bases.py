"""The bases `resformer-convert` takes, by the source's `model_type`: the ResFormer facts each one's config stands for.

A base's source config is parsed by transformers' own config class; its fields either are `ResFormerConfig` fields
of the same name and meaning (sizes, RoPE, `layer_types`, `sliding_window`, `query_pre_attn_scalar`, ...), or stand
for one of the base's facts (`remote_code/architecture.py`) and are consumed here, or are refused by name unless they
hold the value that changes nothing (Gemma 3's logit soft-capping, say). Anything else a source config holds is
refused by name too (`config.build_resformer_config`): nothing the model would not compute is dropped silently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Base:
    """How one source `model_type` becomes a ResFormer config."""

    name: str  #: what the docs and errors call it
    architecture: dict = field(default_factory=dict)  #: fixed ResFormer facts (`qk_norm`, `block_norms`, ...)
    derive: Callable[[dict], dict] | None = None  #: facts computed from the parsed source config
    consumed: tuple[str, ...] = ()  #: source fields that `architecture` / `derive` stand for
    neutral: dict = field(default_factory=dict)  #: fields ResFormer does not model: allowed only at these values
    qkv_bias_only: bool = False  #: q/k/v have biases and o_proj none (Qwen 2): o_proj gets an exact zero bias


def _gemma3(source: dict) -> dict:
    """Gemma 3 scales its embeddings by √hidden_size and names its activation `hidden_activation`."""
    return {"embedding_multiplier": source["hidden_size"] ** 0.5, "hidden_act": source["hidden_activation"]}


def _smollm3(source: dict) -> dict:
    """SmolLM3's `no_rope_layers` marks with 1 the layers that *use* RoPE."""
    return {"nope_layers": [layer for layer, uses in enumerate(source["no_rope_layers"]) if not uses]}


_QWEN_WINDOW = ("use_sliding_window", "max_window_layers")  # what `layer_types` and `sliding_window` hold already
_OLMO = dict(qk_norm="projection", block_norms="post", rms_norm_type="olmo2", rope_in_float32=True)
BASES = {
    "llama": Base("Llama"),
    "mistral": Base("Mistral"),
    "qwen2": Base("Qwen 2", consumed=_QWEN_WINDOW, qkv_bias_only=True),
    "qwen3": Base("Qwen 3", dict(qk_norm="head"), consumed=_QWEN_WINDOW),
    "smollm3": Base("SmolLM3", derive=_smollm3, consumed=("no_rope_layers", "no_rope_layer_interval",
                                                           "use_sliding_window")),
    "olmo2": Base("OLMo 2", _OLMO),
    "olmo3": Base("OLMo 3", _OLMO),
    "gemma3_text": Base(
        "Gemma 3", dict(qk_norm="head", block_norms="sandwich", rms_norm_type="gemma3"), derive=_gemma3,
        consumed=("hidden_activation", "_sliding_window_pattern"),
        neutral=dict(final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False),
    ),
}
#: Multimodal configs whose text model converts on its own, and what to tell the user.
TEXT_MODEL_OF = {"gemma3": "gemma3_text (Gemma3ForCausalLM: the 270M and 1B checkpoints, or a text model saved alone)"}


def base_names() -> str:
    """The bases in words, for help texts: "Llama, Mistral, ... or Gemma 3"."""
    names = list(dict.fromkeys(base.name for base in BASES.values()))
    return f"{', '.join(names[:-1])} or {names[-1]}"


def neutral_value(value, neutral) -> bool:
    """Whether a field holds the value that changes nothing (None and False mean the same for a switch)."""
    return value == neutral or (neutral is False and value is None)


__all__ = ["BASES", "TEXT_MODEL_OF", "Base", "base_names", "neutral_value"]
