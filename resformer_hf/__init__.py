"""resformer-hf: Value Residual Learning (ResFormer, SVFormer) for Hugging Face transformers.

Importing the package registers model type ``"resformer"`` with transformers' Auto classes.
"""

from .cli import startup  # noqa: F401  (first, stdlib only: Ctrl-C while a command starts gives one line, exit 130)

# isort: split
from .cache_accounting import cache_nbytes
from .conversion import ConversionError, ConversionReport, convert_llama_checkpoint
from .integrations.paged_cache import install as install_paged_cache
from .registration import register_auto_classes
from .remote_code.configuration_resformer import VALUE_RESIDUAL_VARIANTS, ResFormerConfig
from .remote_code.loading import LAMBDA_MODULES, register_peft_target_modules
from .remote_code.modeling_resformer import (
    ResFormerForCausalLM,
    ResFormerForQuestionAnswering,
    ResFormerForSequenceClassification,
    ResFormerForTokenClassification,
    ResFormerModel,
    ResFormerPreTrainedModel,
)

__version__ = "0.1.0"

register_auto_classes()
register_peft_target_modules()  # PEFT's default target modules for "resformer", when PEFT is installed
install_paged_cache()  # SVFormer's values stored once in continuous batching's paged cache

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
    "convert_llama_checkpoint",
    "ConversionReport",
    "ConversionError",
    "LAMBDA_MODULES",
    "register_peft_target_modules",
]
