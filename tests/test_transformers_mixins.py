"""transformers' own common model tests (`ModelTesterMixin`) run against ResFormer — the default variant, SVFormer,
dense, gated and the default variant with value embeddings — and, as the control, against HF's Llama with the same
tester, as transformers' tests/models/llama does.

The mixin comes from the transformers sdist (fetched once by pip, see `transformers_mixins.py`); when pip cannot
fetch it the module fails in CI and is skipped elsewhere (`pypi_cache.unavailable`). Each test class runs the whole
mixin (the others: the `VARIANT_TESTS` subset, each name checked to exist in the mixin); the mixin's own skips (no
GPU, no flash-attention, ...) and the one this file adds (`_Environment`) apply to ResFormer and to the Llama control
alike; value embeddings skip `test_inputs_embeds_matches_input_ids`, as a table needs token ids.
"""

from __future__ import annotations

import unittest

import pytest
import torch
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

from pypi_cache import FetchError, unavailable

pytest.importorskip("parameterized", reason="transformers' test mixins need `parameterized` (the `test` extra)")
try:
    from transformers_mixins import load_modeling_common

    common = load_modeling_common()
except FetchError as error:
    unavailable("transformers' test mixins come from its sdist on PyPI", error)

pytestmark = pytest.mark.slow


class ModelTester:
    """Tiny configs and inputs for the mixin, as transformers' `CausalLMModelTester` makes them for Llama."""

    def __init__(self, parent, config_class, variant=None, batch_size=2, seq_length=7, **fields):
        self.parent, self.config_class, self.variant, self.fields = parent, config_class, variant, fields
        self.batch_size, self.seq_length = batch_size, seq_length
        self.is_training, self.vocab_size, self.hidden_size = True, 99, 32
        self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads = 2, 4, 2  # mixin: <= 2
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
        return self.config_class(**fields, **self.fields)

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
    fields = {}

    def setUp(self):
        self.model_tester = ModelTester(self, ResFormerConfig, self.variant, **self.fields)

    def test_reverse_loading_mapping(self):
        # ResFormer's one checkpoint conversion (`LambdaScaleToVector`) reshapes an old 0-dim λ_scale offset to shape
        # [1] under the same key, so saving renames no key; the mixin's other checks (every conversion matches a saved
        # key, the saved keys load back) still run.
        super().test_reverse_loading_mapping(check_keys_were_modified=False)


class TestLearnablePlusCommon(_ResFormerCommonTests, unittest.TestCase):
    variant = "learnable_plus"


#: For the other variants, the mixin tests that exercise what a variant changes (weights present or absent, λ
#: initialisation and fp32 keeping, loading and saving, attention paths, training, offloading); the whole mixin
#: (~160 tests) runs for the default variant and the Llama control, which keeps CI time within budget.
VARIANT_TESTS = {
    "test_all_tensors_are_parameter_or_buffer", "test_attention_outputs", "test_base_model_prefix_loads_base_weights",
    "test_batching_equivalence", "test_can_be_initialized_on_meta", "test_can_init_all_missing_weights",
    "test_can_load_ignoring_mismatched_shapes", "test_causal_lm_loss_honors_shift_labels", "test_correct_missing_keys",
    "test_cpu_offload", "test_determinism", "test_disk_offload_safetensors",
    "test_eager_matches_sdpa_inference_09_fp32_pad_left", "test_eager_matches_sdpa_inference_13_fp32_pad_right",
    "test_from_pretrained_no_checkpoint", "test_hidden_states_output", "test_init_weights_can_init_buffers",
    "test_inputs_embeds_matches_input_ids", "test_keep_in_fp32_modules", "test_keep_in_fp32_modules_exist",
    "test_load_save_without_tied_weights", "test_load_with_mismatched_shapes", "test_model_outputs_equivalence",
    "test_model_weights_reload_no_missing_tied_weights", "test_peft_gradient_checkpointing_enable_disable",
    "test_resize_tokens_embeddings", "test_retain_grad_hidden_states_attentions", "test_save_load",
    "test_torch_save_load", "test_tp_plan_matches_params", "test_training", "test_training_gradient_checkpointing",
    "test_training_gradient_checkpointing_use_reentrant_true",
}


def test_every_variant_test_names_a_mixin_test():
    """A test renamed or dropped upstream would otherwise silently leave SVFormer and dense without it."""
    mixin_tests = {name for name in dir(common.ModelTesterMixin) if name.startswith("test_")}
    assert VARIANT_TESTS <= mixin_tests, sorted(VARIANT_TESTS - mixin_tests)


def _only_variant_tests(cls):
    """Leave only `VARIANT_TESTS` collectable on `cls` (unittest collects callables named test_*)."""
    for name in dir(cls):
        if name.startswith("test_") and callable(getattr(cls, name)) and name not in VARIANT_TESTS:
            setattr(cls, name, None)  # flags such as `test_missing_keys = True` stay as they are
    return cls


@_only_variant_tests
class TestSVFormerCommon(_ResFormerCommonTests, unittest.TestCase):
    variant = "svformer"


@_only_variant_tests
class TestDenseCommon(_ResFormerCommonTests, unittest.TestCase):
    variant = "dense"


@_only_variant_tests
class TestValueEmbeddingsCommon(_ResFormerCommonTests, unittest.TestCase):
    """The default variant with a value-embedding table in every other layer (layer 1 of 2)."""

    fields = {"value_embeddings": "alternating"}

    def test_inputs_embeds_matches_input_ids(self):
        self.skipTest("a table is looked up by token id, so inputs_embeds alone is refused (test_value_embeddings.py: "
                      "test_inputs_embeds_alone_is_refused_naming_input_ids)")


@_only_variant_tests
class TestGatedCommon(_ResFormerCommonTests, unittest.TestCase):
    variant = "gated"


class TestLlamaControlCommon(_Environment, common.ModelTesterMixin, unittest.TestCase):
    all_model_classes = LLAMA_CLASSES

    def setUp(self):
        self.model_tester = ModelTester(self, LlamaConfig)
