"""vLLM plugin (entry point `vllm.general_plugins`): vLLM serves ResFormer checkpoints with `model.py`'s model, which
stores an SVFormer's values once. Importing this package imports nothing from vLLM; `register()` runs in every
process vLLM starts, when the plugin is installed next to vLLM."""

from __future__ import annotations

ARCHITECTURE = "ResFormerForCausalLM"


def register() -> None:
    """Register the plugin's Auto classes with transformers and its model with vLLM (lazily, by name)."""
    from vllm import ModelRegistry

    import resformer_hf  # noqa: F401  (registers model type "resformer" with transformers' Auto classes)

    ModelRegistry.register_model(ARCHITECTURE, f"{__name__}.model:ResFormerForCausalLM")
