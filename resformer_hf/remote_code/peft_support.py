"""PEFT defaults for model type "resformer": the same target modules as Llama, for every PEFT method.

PEFT picks default `target_modules` by `config.model_type` from its `TRANSFORMERS_MODELS_TO_*_TARGET_MODULES_MAPPING`
tables, which only know built-in transformers models; without an entry, `get_peft_model(model, LoraConfig())` raises
"Please specify `target_modules`". A ResFormer has Llama's module names, so it gets Llama's rows.

The λ of the value residual are a handful of scalars in one module, `value_residual` (DenseFormer's depth weights in
`depth_weighted_average`, a gated model's per-layer gates in each `self_attn.value_gate`, [H_kv, hidden] + [H_kv]);
train them together with LoRA by naming them in `modules_to_save` (they are then saved in, and reloaded from, the
adapter)::

    LoraConfig(task_type="CAUSAL_LM", modules_to_save=LAMBDA_MODULES)

The modeling file imports this module, so it is copied next to `config.json` with the other remote-code files and a
Hub folder loaded with `trust_remote_code=True` (no `resformer_hf` installed) gets the same defaults. It therefore
imports only the standard library and transformers; PEFT itself is imported inside `try`, which transformers'
`check_imports` skips, so the shipped files never require PEFT.
"""

from __future__ import annotations

import importlib.util

from transformers.utils import logging

logger = logging.get_logger(__name__)
#: The modules holding every λ (and DenseFormer's depth weights, `gated`'s value gates, value embeddings' tables and
#: gates); pass as PEFT
#: `modules_to_save` to train them alongside an adapter. A model without one of them simply has nothing to save under
#: that name.
LAMBDA_MODULES = ["value_residual", "depth_weighted_average", "value_gate", "value_embedding", "value_embedding_gate"]

_MODEL_TYPE = "resformer"
_TEMPLATE_MODEL_TYPE = "llama"


def register_peft_target_modules() -> bool:
    """Give "resformer" Llama's default target modules in every PEFT mapping that lists Llama.

    Returns False (and does nothing) when PEFT is not installed; safe to call more than once. Importing PEFT here
    costs ~0.1 s once transformers is loaded, so it is done eagerly rather than through an import hook.
    """
    if importlib.util.find_spec("peft") is None:
        return False
    try:
        from peft.utils import constants
    except ImportError as error:  # a broken optional install must not break `import resformer_hf`
        logger.warning(f"PEFT is installed but failed to import ({error}); pass `target_modules` to PEFT yourself.")
        return False

    for name in dir(constants):
        table = getattr(constants, name)
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and _TEMPLATE_MODEL_TYPE in table:
            default = table[_TEMPLATE_MODEL_TYPE]
            table.setdefault(_MODEL_TYPE, list(default) if isinstance(default, list) else default)
    return True


__all__ = ["LAMBDA_MODULES", "register_peft_target_modules"]
