"""The value-residual variants of Zhou et al. (ACL 2025) and their baselines, declared once.

`VARIANTS` is the one place where the paper's variants are declared: what each receiving layer does with the values
(its *role*), how its λ are parameterised, which config fields it reads, its defaults, whether a Llama checkpoint can
be converted to it, and the words a model card uses for it. `ResFormerConfig` turns that into per-layer facts in the
way Gemma's configs work out `layer_types`; the modeling, cache, conversion, card and quickstart code read those facts
and never compare variant names. Imports nothing: copied next to `config.json` for `trust_remote_code`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

# ---- the variant registry ----------------------------------------------------------------------------------------

#: Roles a layer can have. Layer 0, and layers that do not receive the residual, are "plain".
PLAIN = "plain"  # attends over its own values V_n
MIX = "mix"  # attends over λ_first·V_0 + λ_self·V_n
MIX_ALL = "mix_all"  # attends over Σ_j w_j·V_j, j = 0..n (the values of every earlier layer and its own)
REUSE = "reuse"  # has no v_proj; attends over V_0 itself
CORRECT = "correct"  # attends over V_n, then adds λ·(V_0 − V_n) to the attention output
GATE = "gate"  # attends over V_n + g·(V_0 − V_n), g = its gate's mix for each token and kv head

#: How learnable λ are parameterised (see `lambdas.ValueResidual`).
FIXED = "fixed"  # constants from the config
PAIR = "pair"  # one learnable (λ_first, λ_self) per receiving layer
SOFTMAX = "softmax"  # λ_first = λ_scale·softmax(logits) over receiving layers, learnable λ_self per layer
DENSE = "dense"  # one learnable weight per (receiving layer, earlier layer)
PER_TOKEN = "per_token"  # each receiving layer's gate (`value_gate`) computes the mix of every token from its input

LAMBDA_FIRST, LAMBDA_SELF = "value_residual_lambda_first", "value_residual_lambda_self"
LAMBDA_SCALE, NEUTRENO_LAMBDA, LAYERS = "value_residual_lambda_scale", "neutreno_lambda", "value_residual_layers"
DENSEFORMER_DILATION = "denseformer_dilation"
#: The optional value-residual fields of `ResFormerConfig`; each variant reads a subset.
OPTIONAL_FIELDS = (LAYERS, LAMBDA_FIRST, LAMBDA_SELF, LAMBDA_SCALE, NEUTRENO_LAMBDA, DENSEFORMER_DILATION)
#: Cross-layer attention (Brandon et al., 2024): orthogonal to the variant, read by every model that allows it.
CROSS_LAYER_ATTENTION = "cross_layer_attention"
_POSITIVE_INT_FIELDS = (DENSEFORMER_DILATION, CROSS_LAYER_ATTENTION)
_NUMBER_FIELDS = (LAMBDA_FIRST, LAMBDA_SELF, LAMBDA_SCALE, NEUTRENO_LAMBDA)


def every_later_layer(num_layers: int) -> list[int]:
    return list(range(1, num_layers))


def last_three_eighths(num_layers: int) -> list[int]:
    """The paper's sparse setting: the last ⌈3L/8⌉ layers (never layer 0)."""
    return list(range(max(1, num_layers - math.ceil(3 * num_layers / 8)), num_layers))


@dataclass(frozen=True)
class ValueResidualVariant:
    """Everything the package knows about one variant. Add a variant by adding one of these to `VARIANTS`."""

    name: str
    role: str  #: role of each receiving layer (PLAIN, MIX, MIX_ALL, REUSE, CORRECT or GATE)
    lambdas: str  #: λ parameterisation (FIXED, PAIR, SOFTMAX, DENSE or PER_TOKEN)
    reads: tuple[str, ...]  #: optional config fields it reads; giving it another one is an error
    lambda_first: float | None  #: default λ_first (fixed value, or initial value when learnable); None: derived
    lambda_self: float | None  #: default λ_self, likewise
    label: str  #: short name for model cards
    summary: str  #: one sentence for model cards
    table_note: str = ""  #: how a model card's λ table reads for this variant, when not obvious
    lambda_first_field: str = LAMBDA_FIRST  #: the config field that overrides `lambda_first`
    default_layers: Callable[[int], list[int]] = every_later_layer  #: receivers when `value_residual_layers` unset
    keeps_every_layers_values: bool = False  #: later layers read every earlier layer's values, not only V_0
    convertible: bool = False  #: a Llama checkpoint determines every weight, so `resformer-convert` can make it
    preserving_fields: dict[str, float] | None = None  #: config fields that reproduce the source model exactly
    why_not_preserving: str = ""  #: said when a conversion asks to preserve outputs and it cannot
    #: DenseFormer: after every block, a learned average of the embeddings and all block outputs so far
    depth_weighted_average: bool = False
    #: layers may attend over an earlier layer's K and V (`cross_layer_attention`); variants whose receiving layers
    #: mix their own values cannot, since a layer without k_proj/v_proj has no values of its own
    combines_with_cross_layer_attention: bool = False

    @property
    def learnable(self) -> bool:  # its λ are parameters of `model.value_residual`
        return self.lambdas in (PAIR, SOFTMAX, DENSE)

    @property
    def learns_mix(self) -> bool:  # learnable λ, or a learned gate per layer
        return self.lambdas != FIXED

    @property
    def drops_value_projections(self) -> bool:
        return self.role == REUSE

    @property
    def can_preserve_outputs(self) -> bool:
        return self.preserving_fields is not None


_FIXED_REASON = (
    "its λ are fixed, and the only exact setting (λ_first=0, λ_self=1) would switch the residual off for good"
)

VARIANTS: dict[str, ValueResidualVariant] = {
    spec.name: spec
    for spec in (
        ValueResidualVariant(
            "none", PLAIN, FIXED, (), 0.0, 1.0, "plain Llama (value residual off)",
            "The value residual is switched off: every layer attends over its own values, exactly like Llama.",
            default_layers=lambda num_layers: [], combines_with_cross_layer_attention=True, convertible=True,
            preserving_fields={},
        ),
        ValueResidualVariant(
            "identity", MIX, FIXED, (LAYERS,), 0.5, 0.5, "ResFormer (identity)",
            "Every receiving layer attends over the plain average `0.5·V_0 + 0.5·V_n`.",
            convertible=True, why_not_preserving=_FIXED_REASON,
        ),
        ValueResidualVariant(
            "constant", MIX, FIXED, (LAYERS, LAMBDA_FIRST, LAMBDA_SELF), 2.0, 1.0, "ResFormer (constant λ)",
            "Every receiving layer mixes in layer 0's values with one fixed pair of weights.",
            convertible=True, why_not_preserving=_FIXED_REASON,
        ),
        ValueResidualVariant(
            "learnable", MIX, PAIR, (LAYERS, LAMBDA_FIRST, LAMBDA_SELF), 0.5, 0.5, "ResFormer (learnable λ)",
            "Every receiving layer mixes in layer 0's values with its own learned pair of weights.",
            convertible=True, preserving_fields={LAMBDA_FIRST: 0.0, LAMBDA_SELF: 1.0},
        ),
        ValueResidualVariant(
            "learnable_plus", MIX, SOFTMAX, (LAYERS, LAMBDA_SELF, LAMBDA_SCALE), None, 0.5,
            "ResFormer (learnable-plus λ)",
            "Receiving layers mix in layer 0's values with `λ_first = λ_scale·softmax(logits)` over the layers and a "
            "learned `λ_self` per layer (the paper's best variant).",
            convertible=True, preserving_fields={LAMBDA_SCALE: 0.0, LAMBDA_SELF: 1.0},
        ),
        ValueResidualVariant(
            "sparse", MIX, FIXED, (LAYERS, LAMBDA_FIRST, LAMBDA_SELF), 5.0, 1.0, "ResFormer (sparse)",
            "Only a few late layers mix in layer 0's values, with a fixed pair of weights.",
            default_layers=last_three_eighths, convertible=True, why_not_preserving=_FIXED_REASON,
        ),
        ValueResidualVariant(
            "dense", MIX_ALL, DENSE, (LAYERS, LAMBDA_FIRST, LAMBDA_SELF), 0.5, 0.5, "ResFormer (dense)",
            "Every receiving layer mixes in the values of all earlier layers with learned weights.",
            table_note="`dense` also mixes in every earlier layer's values; the table shows only the weights on V_0 "
            "and V_n.",
            keeps_every_layers_values=True,
        ),
        ValueResidualVariant(
            "svformer", REUSE, FIXED, (), 1.0, 0.0, "SVFormer",
            "Layers after the first have no value projection: they all attend over layer 0's values, which roughly "
            "halves the KV cache.",
            table_note="SVFormer layers n ≥ 1 have no `v_proj` and attend over V_0 itself.",
            convertible=True,
            why_not_preserving="it drops v_proj of layers n >= 1, so no setting reproduces the source",
            combines_with_cross_layer_attention=True,
        ),
        ValueResidualVariant(
            "neutreno", CORRECT, FIXED, (LAYERS, NEUTRENO_LAMBDA), 0.4, 1.0, "NeuTRENO",
            "The NeuTRENO baseline: each receiving layer adds `λ·(V_0 − V_n)` to its attention output.",
            table_note="NeuTRENO adds `λ·(V_0 − V_n)` after attention; the table shows λ as λ_first and 1 − λ as "
            "λ_self.",
            lambda_first_field=NEUTRENO_LAMBDA,
        ),
        ValueResidualVariant(
            "denseformer", PLAIN, FIXED, (DENSEFORMER_DILATION,), 0.0, 1.0, "DenseFormer",
            "The DenseFormer baseline (Pagliardini et al., 2024): no value residual; after every block a learned "
            "depth-weighted average of the embeddings and all block outputs so far, started as the plain residual "
            "stream.",
            table_note="DenseFormer has no value residual; its depth weights are `model.depth_weighted_average`.",
            default_layers=lambda num_layers: [], depth_weighted_average=True, convertible=True,
            preserving_fields={}, combines_with_cross_layer_attention=True,
        ),
        ValueResidualVariant(
            "gated", GATE, PER_TOKEN, (LAYERS, LAMBDA_FIRST), 0.5, None, "ResFormer (gated)",
            "Every receiving layer attends over `V_n + g·(V_0 − V_n)`, with a mix `g` its learned gate computes for "
            "each token and kv head from the layer's input (as x-transformers and RWKV-7 mix).",
            table_note="`gated` mixes per token and kv head; the table shows the mix at its gates' biases "
            "(`g0 − 0.5 + σ(b_g)`, mean over kv heads); `value_gate_statistics` measures it on text.",
            convertible=True, preserving_fields={LAMBDA_FIRST: 0.0},
        ),
    )
}

#: The paper's variants, as accepted by `ResFormerConfig(value_residual=...)`.
VALUE_RESIDUAL_VARIANTS = tuple(VARIANTS)
#: `ResFormerConfig`'s default: the paper's best variant, and the best in this project's pre-training benchmark.
DEFAULT_VARIANT = "learnable_plus"
#: `resformer-convert`'s default: a per-layer pair started at (λ_first, λ_self) = (0, 1) reproduces the source and
#: gets gradient on both λ at once (a softmax started at λ_scale = 0 gives its logits no gradient until λ_scale moves).
DEFAULT_CONVERSION_VARIANT = "learnable"


def convertible_variants() -> tuple[str, ...]:
    """Variants `resformer-convert` can make from a Llama checkpoint."""
    return tuple(name for name, spec in VARIANTS.items() if spec.convertible)


def output_preserving_variants() -> tuple[str, ...]:
    """Convertible variants with an initial λ setting that reproduces the source model exactly."""
    return tuple(name for name, spec in VARIANTS.items() if spec.convertible and spec.can_preserve_outputs)


# ---- field checks -------------------------------------------------------------------------------------------------


def checked_field(name: str, value):
    """The value of one value-residual field, or a `ValueError` naming it (on construction and on assignment)."""
    if name == "value_residual":
        if not isinstance(value, str) or value not in VARIANTS:
            raise ValueError(f"value_residual={value!r} is not a known variant; use one of {', '.join(VARIANTS)}.")
    elif name in _POSITIVE_INT_FIELDS and value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer (or None for the default, 1).")
    elif name in _NUMBER_FIELDS and value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}={value!r} must be a number (or None for the variant's default).")
        try:
            finite = math.isfinite(float(value))
        except OverflowError:
            finite = False
        if not finite:
            raise ValueError(f"{name}={value!r} must be a finite number.")
    elif name == LAYERS and value is not None:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{LAYERS}={value!r} must be a list of layer indices (or None for the default).")
        value = list(value)
    return value


__all__ = ["CORRECT", "CROSS_LAYER_ATTENTION", "DEFAULT_CONVERSION_VARIANT", "DEFAULT_VARIANT", "DENSE", "FIXED",
           "GATE", "MIX", "MIX_ALL", "OPTIONAL_FIELDS", "PAIR", "PER_TOKEN", "PLAIN", "REUSE", "SOFTMAX",
           "VALUE_RESIDUAL_VARIANTS", "VARIANTS", "ValueResidualVariant", "checked_field", "convertible_variants",
           "output_preserving_variants"]
