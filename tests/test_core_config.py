"""Every invalid ResFormerConfig raises a ValueError that names the field and what to do."""

from __future__ import annotations

import math

import pytest

import resformer_hf
from resformer_hf import VALUE_RESIDUAL_VARIANTS, ResFormerConfig

from helpers import TINY, tiny_config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"value_residual": "resformer"}, "value_residual='resformer' is not a known variant"),
        ({"value_residual_layers": [0, 2]}, "value_residual_layers has [0]"),
        ({"value_residual_layers": [1, 4]}, "value_residual_layers has [4]"),
        ({"value_residual_layers": [2, 2]}, "lists a layer twice"),
        ({"value_residual_layers": []}, "value_residual_layers is empty"),
        ({"value_residual": "constant", "value_residual_lambda_first": math.nan}, "value_residual_lambda_first=nan"),
        ({"value_residual": "learnable", "value_residual_lambda_self": math.inf}, "value_residual_lambda_self=inf"),
        ({"value_residual": "learnable_plus", "value_residual_lambda_scale": -math.inf}, "lambda_scale=-inf"),
        ({"value_residual": "neutreno", "neutreno_lambda": math.nan}, "neutreno_lambda=nan"),
        ({"value_residual": "svformer", "num_hidden_layers": 1}, "needs num_hidden_layers >= 2"),
        ({"value_residual": "identity", "value_residual_lambda_first": 0.3}, "value_residual_lambda_first is ignored"),
        (
            {"value_residual": "learnable_plus", "value_residual_lambda_first": 1.0},
            "is ignored by value_residual='learnable_plus'",
        ),
        ({"value_residual": "none", "value_residual_layers": [1]}, "value_residual_layers is ignored"),
        ({"value_residual": "svformer", "value_residual_layers": [1]}, "value_residual_layers is ignored"),
        ({"value_residual": "constant", "neutreno_lambda": 0.2}, "neutreno_lambda is ignored"),
        ({"value_residual": "learnable", "value_residual_lambda_scale": 3.0}, "lambda_scale is ignored"),
    ],
)
def test_invalid_configs_raise_value_error_naming_the_field(overrides, message):
    with pytest.raises(ValueError) as error:
        ResFormerConfig(**{**TINY, **overrides})
    assert message in str(error.value)


def test_unknown_variant_error_lists_the_allowed_values():
    with pytest.raises(ValueError) as error:
        tiny_config("Learnable-Plus")
    for variant in VALUE_RESIDUAL_VARIANTS:
        assert variant in str(error.value)


def test_ignored_field_error_says_which_variants_read_it():
    with pytest.raises(ValueError, match="choose a variant that reads it: learnable_plus"):
        tiny_config("dense", value_residual_lambda_scale=2.0)


def test_defaults_and_receivers():
    assert ResFormerConfig().value_residual == "learnable_plus"
    assert tiny_config("learnable").value_residual_receivers == [1, 2, 3]
    assert tiny_config("none").value_residual_receivers == []
    assert tiny_config("sparse", num_hidden_layers=8).value_residual_receivers == [5, 6, 7]  # ceil(3*8/8) = 3
    assert tiny_config("identity", value_residual_layers=[3, 1]).value_residual_receivers == [1, 3]
    assert tiny_config("learnable_plus").value_residual_lambda_scale_resolved == 4.0


def test_config_round_trips_through_json(tmp_path):
    config = tiny_config("dense", value_residual_layers=[2, 3], value_residual_lambda_first=0.25)
    config.save_pretrained(tmp_path)
    loaded = ResFormerConfig.from_pretrained(tmp_path)
    assert loaded.model_type == "resformer"
    assert (loaded.value_residual, loaded.value_residual_layers, loaded.value_residual_lambda_first) == (
        "dense",
        [2, 3],
        0.25,
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("value_residual_lambda_first", "0.5", "value_residual_lambda_first='0.5' must be a number"),
        ("value_residual_lambda_first", 10**400, "value_residual_lambda_first=1000"),
        ("value_residual_lambda_self", True, "value_residual_lambda_self=True must be a number"),
        ("value_residual_layers", 2, "value_residual_layers=2 must be a list"),
        ("value_residual", None, "value_residual=None is not a known variant"),
    ],
)
def test_wrong_types_and_overflow_raise_value_error_naming_the_field(field, value, message):
    with pytest.raises(ValueError) as error:
        ResFormerConfig(**{**TINY, "value_residual": "learnable", field: value})
    assert message in str(error.value)


def test_assignments_after_construction_are_checked():
    config = tiny_config("learnable")
    with pytest.raises(ValueError, match="value_residual='bogus' is not a known variant"):
        config.value_residual = "bogus"
    assert config.value_residual == "learnable"  # the bad value was not stored
    with pytest.raises(ValueError, match="neutreno_lambda=inf must be a finite number"):
        config.neutreno_lambda = math.inf
    # Fields that only conflict with each other are caught when a model is built from the config.
    config.value_residual = "identity"
    config.value_residual_lambda_first = 0.3
    with pytest.raises(ValueError, match="value_residual_lambda_first is ignored by value_residual='identity'"):
        resformer_hf.ResFormerModel(config)
    config.value_residual_lambda_first = None
    config.num_hidden_layers = 2
    config.value_residual_layers = [3]
    with pytest.raises(ValueError, match=r"value_residual_layers has \[3\]"):
        resformer_hf.ResFormerModel(config)


@pytest.mark.parametrize("variant, group, expected", [
    ("learnable_plus", None, [(0, 0), (1, 1), (2, 2), (3, 3)]),
    ("svformer", None, [(0, 0), (1, 0), (2, 0), (3, 0)]),
    ("none", 2, [(0, 0), (0, 0), (2, 2), (2, 2)]),
    ("svformer", 2, [(0, 0), (0, 0), (2, 0), (2, 0)]),
])
def test_key_value_sources_say_which_layers_cached_keys_and_values_each_layer_reads(variant, group, expected):
    """The one fact every cache stores by, for any config: a ResFormer's, one from older remote code (which has only
    the two lists it is made of), and a Llama's (every layer its own)."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from resformer_hf.remote_code.cache_resformer import key_value_sources_of

    config = tiny_config(variant, num_hidden_layers=4, cross_layer_attention=group)
    assert [tuple(source) for source in config.key_value_sources] == expected
    older = SimpleNamespace(key_value_source_layers=config.key_value_source_layers,
                            layers_without_value_projection=config.layers_without_value_projection)
    assert [tuple(source) for source in key_value_sources_of(older)] == expected
    llama = LlamaConfig(num_hidden_layers=4)
    assert [tuple(source) for source in key_value_sources_of(llama)] == [(layer, layer) for layer in range(4)]
