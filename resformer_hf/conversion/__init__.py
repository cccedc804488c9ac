"""Upgrade a causal LM checkpoint of a supported base (`bases.py`: Llama, Mistral, Qwen 2 and 3, SmolLM3, OLMo 2
and 3, Gemma 3's text model) to a ResFormer checkpoint of the same architecture.

ResFormer keeps the base's parameter names, so conversion is a streamed copy of the weights plus the new λ tensors
(`model.value_residual.*`, stored as offsets from the config's initial values; see `value_residual.py`). The default
`init="preserve"` picks initial λ that make the converted model compute exactly what the source computed, so it can be
fine-tuned from where the source stands.

Never loses data: the source is only read, output goes to a staging directory beside DST that replaces DST in one
rename when complete, and every problem a user can cause is a `ConversionError` with a one-line message saying what
to do. Modules: `source` (SRC, config.json, shards), `config` (the ResFormer config), `plan` (tensor plan),
`writing` + `safetensors_io` (streamed output), `staging` (atomic commit), `verify`, and `convert` (the steps in
order). `safetensors_io` and `staging` are generic and import nothing from `resformer_hf`. Not copied for
`trust_remote_code`, so these modules may use safetensors, huggingface_hub and tqdm.
"""

from __future__ import annotations

from ..remote_code.configuration_resformer import (
    DEFAULT_CONVERSION_VARIANT,
    convertible_variants,
    output_preserving_variants,
)
from .config import DTYPES, INITS, SUPPORTED_MODEL_TYPES, build_resformer_config
from .convert import convert_llama_checkpoint
from .report import ConversionError, ConversionReport
from .source import COPIED_FILE_PATTERNS
from .verify import probe_input_ids

DEFAULT_VARIANT = DEFAULT_CONVERSION_VARIANT

#: Read from the variant registry each time they are looked up, so a variant registered later is included.
_REGISTRY_VIEWS = {
    "CONVERTIBLE_VARIANTS": convertible_variants,  # variants a Llama checkpoint fully determines
    "FUNCTION_PRESERVING_VARIANTS": output_preserving_variants,  # ... with λ that reproduce the source exactly
}


def __getattr__(name: str):
    if name in _REGISTRY_VIEWS:
        return _REGISTRY_VIEWS[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CONVERTIBLE_VARIANTS",
    "COPIED_FILE_PATTERNS",
    "DEFAULT_VARIANT",
    "DTYPES",
    "FUNCTION_PRESERVING_VARIANTS",
    "INITS",
    "SUPPORTED_MODEL_TYPES",
    "ConversionError",
    "ConversionReport",
    "build_resformer_config",
    "convert_llama_checkpoint",
    "probe_input_ids",
]
