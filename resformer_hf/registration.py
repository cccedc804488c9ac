"""Registration of model type "resformer" with transformers' Auto classes (run on `import resformer_hf`)."""

from __future__ import annotations

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .remote_code.configuration_resformer import ResFormerConfig
from .remote_code.modeling_resformer import (
    ResFormerForCausalLM,
    ResFormerForQuestionAnswering,
    ResFormerForSequenceClassification,
    ResFormerForTokenClassification,
    ResFormerModel,
    register_model_type_names,
)

_AUTO_MODELS = (
    (AutoModel, ResFormerModel),
    (AutoModelForCausalLM, ResFormerForCausalLM),
    (AutoModelForSequenceClassification, ResFormerForSequenceClassification),
    (AutoModelForTokenClassification, ResFormerForTokenClassification),
    (AutoModelForQuestionAnswering, ResFormerForQuestionAnswering),
)


def register_auto_classes() -> None:
    """Make `AutoConfig` / `AutoModel*` resolve model type "resformer", and list it in every transformers name table
    that lists "llama" (`MODEL_TYPE_NAME_TABLES`: the Trainer's label-smoothing shift, pipelines and model cards read
    them); safe to call more than once.

    Also marks the classes for `register_for_auto_class`, so `save_pretrained` / `push_to_hub` copy
    `configuration_resformer.py`, `modeling_resformer.py` and their sibling imports next to `config.json` and write
    an `auto_map`: the folder then loads without this package via `trust_remote_code=True`.
    """
    AutoConfig.register(ResFormerConfig.model_type, ResFormerConfig, exist_ok=True)
    ResFormerConfig.register_for_auto_class("AutoConfig")
    for auto_class, model_class in _AUTO_MODELS:
        auto_class.register(ResFormerConfig, model_class, exist_ok=True)
        model_class.register_for_auto_class(auto_class.__name__)
    register_model_type_names()


def full_auto_map() -> dict[str, str]:
    """`auto_map` naming every Auto class, so remote code loads a causal-LM folder as `AutoModel` (or a head) too;
    `register_for_auto_class` alone names only the saved class."""
    auto_map = {"AutoConfig": f"configuration_resformer.{ResFormerConfig.__name__}"}
    for auto_class, model_class in _AUTO_MODELS:
        auto_map[auto_class.__name__] = f"modeling_resformer.{model_class.__name__}"
    return auto_map
