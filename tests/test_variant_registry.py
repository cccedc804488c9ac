"""The variant registry: variants are declared once, in `variants.VARIANTS`, and everything reads it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import resformer_hf
from resformer_hf.hub.model_card import build_model_card
from resformer_hf.remote_code import variants as registry

from helpers import model_with_random_lambdas, tiny_config

PACKAGE = Path(resformer_hf.__file__).parent


def _variant_rules(tree: ast.AST):
    """String constants naming a variant where code decides by name: compared, listed, or used as a table key."""
    seen = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            candidates = [node.left, *node.comparators]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            candidates = node.elts
        elif isinstance(node, ast.Dict):
            candidates = [key for key in node.keys if key is not None]
        else:
            continue
        for candidate in candidates:
            for item in ast.walk(candidate):
                if isinstance(item, ast.Constant) and item.value in registry.VARIANTS and id(item) not in seen:
                    seen.add(id(item))
                    yield item


def test_variant_names_appear_in_code_only_in_the_registry():
    """Outside the registry no code compares, lists or tabulates variant names: it reads the registry."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "variants.py":
            continue
        for item in _variant_rules(ast.parse(path.read_text(encoding="utf-8"))):
            offenders.append(f"{path.relative_to(PACKAGE)}:{item.lineno}: {item.value!r}")
    assert not offenders, offenders


def test_the_registry_guard_sees_the_old_style():
    old_style = 'if variant == "svformer" or variant in ("learnable", "dense"):\n    LABELS = {"none": "plain"}\n'
    assert sorted(item.value for item in _variant_rules(ast.parse(old_style))) == [
        "dense", "learnable", "none", "svformer"
    ]


def test_layer_roles_follow_the_registry(variant):
    config = tiny_config(variant)
    spec = registry.VARIANTS[variant]
    roles = config.value_residual_layer_roles
    assert roles[0] == registry.PLAIN
    assert [n for n, role in enumerate(roles) if role != registry.PLAIN] == config.value_residual_receivers
    assert set(roles[1:]) <= {spec.role, registry.PLAIN}
    has_v_proj = [layer.self_attn.v_proj is not None for layer in resformer_hf.ResFormerModel(config).layers]
    assert [n for n, present in enumerate(has_v_proj) if not present] == config.layers_without_value_projection


@pytest.fixture
def toy_variant(monkeypatch):
    """A new fixed variant declared by one registry entry and nothing else."""
    toy = registry.ValueResidualVariant(
        "toy", registry.MIX, registry.FIXED, (registry.LAYERS,), 0.25, 0.75, "Toy (quarter)",
        "Every receiving layer attends over `0.25·V_0 + 0.75·V_n`.",
    )
    monkeypatch.setitem(registry.VARIANTS, "toy", toy)
    return toy


def test_a_variant_is_added_by_one_registry_entry(toy_variant):
    toy = model_with_random_lambdas(tiny_config("toy", value_residual_layers=[1, 3]))
    same = model_with_random_lambdas(tiny_config("constant", value_residual_layers=[1, 3],
                                                 value_residual_lambda_first=0.25, value_residual_lambda_self=0.75))
    same.load_state_dict(toy.state_dict())
    input_ids = torch.randint(3, 128, (2, 9))
    torch.testing.assert_close(toy(input_ids).logits, same(input_ids).logits, rtol=0, atol=0)
    plain = model_with_random_lambdas(tiny_config("none"))
    plain.load_state_dict(toy.state_dict())
    assert (toy(input_ids).logits - plain(input_ids).logits).abs().max() > 1e-3  # the toy mix really acts
    assert toy.value_residual_lambdas()[[1, 3]].tolist() == [[0.25, 0.75], [0.25, 0.75]]
    card = build_model_card(toy.config).content
    assert "Toy (quarter)" in card and "0.25·V_0 + 0.75·V_n" in card


def test_registry_entries_are_complete_and_consistent():
    for name, spec in registry.VARIANTS.items():
        assert spec.name == name and spec.label and spec.summary.endswith(".")
        assert set(spec.reads) <= set(registry.OPTIONAL_FIELDS)
        if spec.can_preserve_outputs:
            assert spec.convertible and set(spec.preserving_fields) <= set(spec.reads)
            resformer_hf.ResFormerConfig(value_residual=name, **spec.preserving_fields)  # a valid config
        elif spec.convertible:
            assert spec.why_not_preserving
        assert dataclasses.replace(spec) == spec
    assert registry.DEFAULT_VARIANT in registry.VARIANTS
    assert registry.DEFAULT_CONVERSION_VARIANT in registry.output_preserving_variants()
