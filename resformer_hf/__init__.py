"""resformer-hf: Value Residual Learning (ResFormer, SVFormer) for Hugging Face transformers.

Importing the package registers model type ``"resformer"`` with transformers' Auto classes.
"""

from .cache_resformer import cache_nbytes
from .configuration_resformer import VALUE_RESIDUAL_VARIANTS, ResFormerConfig
from .modeling_resformer import (
    ResFormerForCausalLM,
    ResFormerForQuestionAnswering,
    ResFormerForSequenceClassification,
    ResFormerForTokenClassification,
    ResFormerModel,
    ResFormerPreTrainedModel,
)
from .registration import register_auto_classes

__version__ = "0.1.0"

register_auto_classes()

__all__ = [
    "VALUE_RESIDUAL_VARIANTS",
    "ResFormerConfig",
    "ResFormerPreTrainedModel",
    "ResFormerModel",
    "ResFormerForCausalLM",
    "ResFormerForSequenceClassification",
    "ResFormerForTokenClassification",
    "ResFormerForQuestionAnswering",
    "register_auto_classes",
    "cache_nbytes",
]
