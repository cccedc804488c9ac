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

from .configuration_resformer import ResFormerConfig
from .modeling_resformer import (
    ResFormerForCausalLM,
    ResFormerForQuestionAnswering,
    ResFormerForSequenceClassification,
    ResFormerForTokenClassification,
    ResFormerModel,
)

_AUTO_MODELS = (
    (AutoModel, ResFormerModel),
    (AutoModelForCausalLM, ResFormerForCausalLM),
    (AutoModelForSequenceClassification, ResFormerForSequenceClassification),
    (AutoModelForTokenClassification, ResFormerForTokenClassification),
    (AutoModelForQuestionAnswering, ResFormerForQuestionAnswering),
)


def register_auto_classes() -> None:
    """Make `AutoConfig` / `AutoModel*` resolve model type "resformer"; safe to call more than once."""
    AutoConfig.register(ResFormerConfig.model_type, ResFormerConfig, exist_ok=True)
    for auto_class, model_class in _AUTO_MODELS:
        auto_class.register(ResFormerConfig, model_class, exist_ok=True)
