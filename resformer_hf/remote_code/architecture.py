"""The base a ResFormer is built on: what sets transformers' Llama-like decoders apart from Llama, as config facts.

Each fact is a field of `ResFormerConfig`, read once by the layers that need it in their `__init__`; the modeling code
never compares base names. Where transformers has a field for a fact, it has that field's name and meaning
(`layer_types`, `sliding_window`, `query_pre_attn_scalar`); the defaults are Llama's.

| fact | Llama | Qwen 3 | SmolLM3 | OLMo 2 (3) | Gemma 3 | Mistral |
| --- | --- | --- | --- | --- | --- | --- |
| `qk_norm`: RMSNorm on queries and keys | – | `"head"` | – | `"projection"` | `"head"` | – |
| `block_norms`: where a block's norms sit | `"pre"` | `"pre"` | `"pre"` | `"post"` | `"sandwich"` | `"pre"` |
| `rms_norm_type`: transformers' RMSNorm | `"llama"` | `"llama"` | `"llama"` | `"olmo2"` | `"gemma3"` | `"llama"` |
| `rope_in_float32` | – | – | – | yes | – | – |
| `embedding_multiplier` | – | – | – | – | √hidden | – |
| `query_pre_attn_scalar` (scores × it^-1/2) | – | – | – | – | its own | – |
| sliding layers (`layer_types`, `sliding_window`) | – | optional | – | OLMo 3: 3 of 4 | 5 of 6 | all |
| `nope_layers`: layers without RoPE | – | – | every 4th | – | – | – |

A `rope_parameters` keyed by layer type (Gemma 3, OLMo 3: a RoPE base per type) gives each type its own rotary
embedding. Imports nothing: copied next to `config.json` for `trust_remote_code`.
"""

from __future__ import annotations

HEAD, PROJECTION = "head", "projection"  #: q/k norm over each head's dimensions, or over the whole projection
PRE, POST, SANDWICH = "pre", "post", "sandwich"  #: norms before each sublayer, on its output, or both
FULL, SLIDING = "full_attention", "sliding_attention"  #: transformers' layer types
CHOICES = {"qk_norm": (None, HEAD, PROJECTION), "block_norms": (PRE, POST, SANDWICH),
           "rms_norm_type": ("llama", "olmo2", "gemma3")}
#: The base's fields of `ResFormerConfig` (`check_architecture` checks them).
FIELDS = (*CHOICES, "rope_in_float32", "embedding_multiplier", "query_pre_attn_scalar", "layer_types",
          "sliding_window", "nope_layers")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and value == value


def check_architecture(config) -> None:
    """Raise a `ValueError` naming the field where the base's fields do not fit each other or the model's size."""
    for name, allowed in CHOICES.items():
        if getattr(config, name) not in allowed:
            raise ValueError(f"{name}={getattr(config, name)!r} is not one of {', '.join(map(repr, allowed))}.")
    if not isinstance(config.rope_in_float32, bool):
        raise ValueError(f"rope_in_float32={config.rope_in_float32!r} must be True or False.")
    for name in ("embedding_multiplier", "query_pre_attn_scalar"):
        value = getattr(config, name)
        if value is not None and not _positive(value):
            raise ValueError(f"{name}={value!r} must be a positive number (or None: Llama's 1 / head_dim).")
    layers = config.num_hidden_layers
    types = config.layer_types
    if types is not None and (not isinstance(types, (list, tuple)) or len(types) != layers
                              or any(kind not in (FULL, SLIDING) for kind in types)):
        raise ValueError(f"layer_types={types!r} must list {FULL!r} or {SLIDING!r} for each of the {layers} layers.")
    window = config.sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window={window!r} must be a positive integer (or None: no sliding window).")
    if window is None and types is not None and SLIDING in types:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is None; set the window.")
    nope = config.nope_layers or []
    if not isinstance(nope, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in nope):
        raise ValueError(f"nope_layers={config.nope_layers!r} must list layer indices in 0..{layers - 1}.")
    kinds = attention_types(config)
    missing = sorted(set(kinds) - set(config.rope_parameters)) if rope_by_layer_type(config) else []
    if missing:
        raise ValueError(f"rope_parameters is keyed by layer type but has no entry for {missing}; give each type one.")
    mixed = [layer for layer, source in enumerate(config.key_value_source_layers) if kinds[source] != kinds[layer]]
    if mixed:
        raise ValueError(f"cross_layer_attention={config.cross_layer_attention} groups layers of different "
                         f"layer_types (layers {mixed} would read a window of another size); group like layers.")


def attention_types(config) -> list[str]:
    """Each layer's type as transformers' caches read it: `layer_types`, else every layer sliding where a
    `sliding_window` is set (Mistral), else full."""
    if config.layer_types is not None:
        return list(config.layer_types)
    return [SLIDING if config.sliding_window is not None else FULL] * config.num_hidden_layers


def rope_by_layer_type(config) -> bool:
    """Whether `rope_parameters` holds one set of parameters per layer type (Gemma 3, OLMo 3)."""
    rope = config.rope_parameters
    return isinstance(rope, dict) and any(kind in rope for kind in (FULL, SLIDING))


__all__ = ["FIELDS", "FULL", "HEAD", "POST", "PRE", "PROJECTION", "SANDWICH", "SLIDING", "attention_types",
           "check_architecture", "rope_by_layer_type"]
