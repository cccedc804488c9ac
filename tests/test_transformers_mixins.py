"""transformers' own common model tests (`ModelTesterMixin`) run against ResFormer — the default variant, SVFormer and
dense — and, as the control, against HF's Llama with the same tester, as transformers' tests/models/llama does.

The mixin comes from the transformers sdist (fetched once by pip, see `transformers_mixins.py`); without network the
module is skipped. Each test class runs the whole mixin; tests skipped for a ResFormer are skipped for the Llama
control too (same tester, same environment: no GPU, no flash-attention, ...), except those listed in `SKIPS` with
the reason that names the limitation.
"""

from __future__ import annotations

import unittest

import pytest
import torch
from pypi_cache import FetchError
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
)

from resformer_hf import (
    ResFormerConfig,
    ResFormerForCausalLM,
    ResFormerForQuestionAnswering,
    ResFormerForSequenceClassification,
    ResFormerForTokenClassification,
    ResFormerModel,
)

pytest.importorskip("parameterized", reason="transformers' test mixins need `parameterized` (the `test` extra)")
try:
    from transformers_mixins import load_modeling_common

    common = load_modeling_common()
except FetchError as error:
    pytest.skip(f"transformers' test mixins come from its sdist on PyPI: {error}", allow_module_level=True)

pytestmark = pytest.mark.slow


class ModelTester:
    """Tiny configs and inputs for the mixin, as transformers' `CausalLMModelTester` makes them for Llama."""

    def __init__(self, parent, config_class, variant=None, batch_size=2, seq_length=7):
        self.parent, self.config_class, self.variant = parent, config_class, variant
        self.batch_size, self.seq_length = batch_size, seq_length
        self.is_training, self.vocab_size, self.hidden_size = True, 99, 32
        self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads = 3, 4, 2
        self.num_labels, self.num_choices = 3, 4

    def get_config(self):
        fields = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=37,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, max_position_embeddings=512, num_labels=self.num_labels,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
        if self.variant is not None:
            fields["value_residual"] = self.variant
        return self.config_class(**fields)

    def prepare_config_and_inputs_for_common(self):
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))  # left-aligned, ragged
        attention_mask[:, 0] = 1
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


RESFORMER_CLASSES = (ResFormerModel, ResFormerForCausalLM, ResFormerForSequenceClassification,
                     ResFormerForTokenClassification, ResFormerForQuestionAnswering)
LLAMA_CLASSES = (LlamaModel, LlamaForCausalLM, LlamaForSequenceClassification, LlamaForTokenClassification,
                 LlamaForQuestionAnswering)


class _Environment:
    """Skips shared by ResFormer and the Llama control, each naming what this environment lacks."""

    def test_generation_tester_mixin_inheritance(self):
        self.skipTest("GenerationTesterMixin (tests/generation/test_utils.py) is not in the transformers sdist")


class _ResFormerCommonTests(_Environment, common.ModelTesterMixin):
    variant = "learnable_plus"
    all_model_classes = RESFORMER_CLASSES

    def setUp(self):
        self.model_tester = ModelTester(self, ResFormerConfig, self.variant)


class TestLearnablePlusCommon(_ResFormerCommonTests, unittest.TestCase):
    variant = "learnable_plus"


class TestSVFormerCommon(_ResFormerCommonTests, unittest.TestCase):
    variant = "svformer"


class TestDenseCommon(_ResFormerCommonTests, unittest.TestCase):
    variant = "dense"


class TestLlamaControlCommon(_Environment, common.ModelTesterMixin, unittest.TestCase):
    all_model_classes = LLAMA_CLASSES

    def setUp(self):
        self.model_tester = ModelTester(self, LlamaConfig)
