"""ResFormer configuration: a `LlamaConfig` plus the value-residual fields of Zhou et al. (ACL 2025).

`VARIANTS` is the one place where the paper's variants are declared: what each receiving layer does with the values
(its *role*), how its λ are parameterised, which config fields it reads, its defaults, whether a Llama checkpoint can
be converted to it, and the words a model card uses for it. The config turns that into per-layer facts
(`value_residual_layer_roles`, `value_residual_sources`, ...) in the way Gemma's configs work out `layer_types`; the
modeling, cache, conversion, card and quickstart code read those facts and never compare variant names.

Copied next to `config.json` for `trust_remote_code`: it imports only `transformers`, `huggingface_hub` (which
transformers requires) and sibling files, each by `from .name import` (the only form the remote-code loader copies).
"""

from __future__ import annotations

from ._compat import OLDEST_SUPPORTED  # noqa: F401  (first: refuses an unsupported transformers in one line)
from .cache_resformer import KeyValueSource, key_value_sources_of
from .value_embeddings import value_embedding_layers

# isort: split
import math
from collections.abc import Callable
from dataclasses import dataclass

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

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
            default_layers=lambda num_layers: [], combines_with_cross_layer_attention=True,
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


def _checked_field(name: str, value):
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


@strict
class ResFormerConfig(LlamaConfig):
    r"""
    Configuration of a ResFormer: every field of [`LlamaConfig`] plus the value residual.

    Attention layer `n >= 1` attends over `V'_n = λ_first[n]·V_0 + λ_self[n]·V_n`, where `V_0` is layer 0's value
    projection of the same tokens. Layer indices are 0-based; layer 0 is never changed.

    `"gated"`: layer n attends over `V_n + g·(V_0 − V_n)`, `g = g0 − 0.5 + σ(W_g h + b_g)` per token and kv head from
    its normalised input h, with `self_attn.value_gate` (W_g, b_g) zero at first: a fresh model starts as `"identity"`
    (`g0 = 0.5`), `g0 = 0` exactly as a model without residual, gates learning at once (why: `value_gate.ValueGate`).

    Args:
        value_residual (`str`, *optional*, defaults to `"learnable_plus"`):
            The paper's variant: `"none"` (plain Llama), `"identity"` (fixed 0.5/0.5), `"constant"` (fixed pair),
            `"learnable"` (per-layer learnable pair), `"learnable_plus"` (`λ_first = λ_scale·softmax(logits)` over the
            receiving layers, shared learnable `λ_scale`; the paper's best), `"gated"` (a learned mix per token and
            kv head, above), `"sparse"` (fixed pair on a few late layers), `"dense"` (learnable weights on the values
            of every earlier layer), `"svformer"` (layers n >= 1 have no `v_proj` and attend over `V_0`), `"neutreno"`
            (the baseline `A_n V_n + λ(V_0 - V_n)`) or `"denseformer"` (the DenseFormer baseline: no value residual,
            depth-weighted averages of block outputs).
        value_residual_layers (`list[int]`, *optional*):
            The layers that receive `V_0` (each in `1 .. num_hidden_layers - 1`). Defaults to every layer n >= 1, and
            for `"sparse"` to the last ⌈3L/8⌉ layers. Not read by `"none"` and `"svformer"`.
        value_residual_lambda_first (`float`, *optional*):
            λ_first: the fixed value for `"constant"` (default 2.0) and `"sparse"` (5.0); the initial value for
            `"learnable"` (0.5) and, as the weight on `V_0`, for `"dense"` (0.5); `"gated"`: its initial mix g0 (0.5).
        value_residual_lambda_self (`float`, *optional*):
            λ_self: fixed for `"constant"` (1.0) and `"sparse"` (1.0); initial for `"learnable"`, `"learnable_plus"`
            and `"dense"` (0.5).
        value_residual_lambda_scale (`float`, *optional*):
            Initial shared λ_scale of `"learnable_plus"`; defaults to `num_hidden_layers`.
        neutreno_lambda (`float`, *optional*):
            λ of the `"neutreno"` baseline (default 0.4).
        denseformer_dilation (`int`, *optional*):
            Dilation of the `"denseformer"` baseline: the average after block i reads only block outputs j with
            `(i - j) % dilation == 0` (default 1: every block output).
        cross_layer_attention (`int`, *optional*):
            Cross-layer attention (CLA, Brandon et al. 2024): each group of this many consecutive layers attends over
            the keys and values of its first layer, which alone has `k_proj`/`v_proj` and cache entries (2: CLA2,
            half a Llama's KV cache). None or 1: off. Combines with `"none"`, `"svformer"` and `"denseformer"`.
        value_embeddings (`list[int]` or `str`, *optional*):
            Layers with a table whose `g·VE[token]` joins their values (`value_embeddings.py`): layer indices,
            `"alternating"` (nanochat's) or `"u_net"` (modded-nanogpt's); None (default): no tables.

    ```python
    >>> import resformer_hf
    >>> from transformers import AutoModelForCausalLM
    >>> config = resformer_hf.ResFormerConfig(hidden_size=256, num_hidden_layers=4, value_residual="learnable_plus")
    >>> model = AutoModelForCausalLM.from_config(config)
    ```
    """

    model_type = "resformer"
    # λ replicated on every rank, their gradient summed over the ranks (parallelism.py; value gates: its plan hook).
    base_model_tp_plan = {**LlamaConfig.base_model_tp_plan, "value_residual": "value_residual_weights"}
    # The λ in their own FSDP2 group, so that mixed precision can gather them in float32 (see modeling_resformer.py).
    base_model_fsdp_plan = {**LlamaConfig.base_model_fsdp_plan, "value_residual": "free_full_weight"}
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "residual_values", "attention_mask"], ["hidden_states", "residual_values"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    value_residual: str = DEFAULT_VARIANT
    value_residual_layers: list[int] | None = None
    value_residual_lambda_first: float | int | None = None
    value_residual_lambda_self: float | int | None = None
    value_residual_lambda_scale: float | int | None = None
    neutreno_lambda: float | int | None = None
    denseformer_dilation: int | None = None
    cross_layer_attention: int | None = None
    value_embeddings: list[int] | str | None = None  # value embeddings: checked and resolved in value_embeddings.py
    value_embedding_layers = property(value_embedding_layers)  # sorted layers with a table; a ValueError if invalid

    def __setattr__(self, name: str, value) -> None:
        # Checked on every assignment, not only in __init__: `config.value_residual = "bogus"` fails here, by name.
        if name in ("value_residual", CROSS_LAYER_ATTENTION) or name in OPTIONAL_FIELDS:
            value = _checked_field(name, value)
        super().__setattr__(name, value)

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.check_value_residual()

    def check_value_residual(self) -> None:
        """Raise a `ValueError` naming the field if the value-residual fields do not fit together or the model shape.

        Runs on construction and again when a model is built, so fields assigned after construction are checked too.
        """
        for name in ("value_residual", CROSS_LAYER_ATTENTION, *OPTIONAL_FIELDS):
            _checked_field(name, getattr(self, name))
        spec = self.value_residual_spec
        for name in OPTIONAL_FIELDS:
            if getattr(self, name) is not None and name not in spec.reads:
                users = [v for v, other in VARIANTS.items() if name in other.reads]
                raise ValueError(
                    f"{name} is ignored by value_residual={spec.name!r}; leave it unset (None), or choose a variant "
                    f"that reads it: {', '.join(users)}."
                )
        if spec.role == REUSE and self.num_hidden_layers < 2:
            raise ValueError(
                f"value_residual={spec.name!r} needs num_hidden_layers >= 2 (got {self.num_hidden_layers}): layer 0 "
                "provides the values that the later layers reuse."
            )
        if (self.cross_layer_attention or 1) > 1 and not spec.combines_with_cross_layer_attention:
            users = [v for v, other in VARIANTS.items() if other.combines_with_cross_layer_attention]
            raise ValueError(
                f"cross_layer_attention={self.cross_layer_attention} does not combine with value_residual="
                f"{spec.name!r}: its layers mix their own values, and a layer that reads another layer's K and V has "
                f"none. Leave cross_layer_attention unset, or use one of: {', '.join(users)}."
            )
        if self.value_residual_layers is not None:
            layers = list(self.value_residual_layers)
            last = self.num_hidden_layers - 1
            bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= last]
            if bad:
                raise ValueError(
                    f"value_residual_layers has {bad}: each entry must be a layer index in 1..{last} "
                    "(0-based; layer 0 provides V_0 and is never mixed)."
                )
            if len(set(layers)) != len(layers):
                raise ValueError(f"value_residual_layers={layers} lists a layer twice; give each index once.")
            if not layers:
                raise ValueError(
                    "value_residual_layers is empty; name at least one layer, or use value_residual='none' for a "
                    "plain Llama."
                )
        self.value_embedding_layers  # noqa: B018  (value embeddings: raises a ValueError naming the field)

    # ---- per-layer facts (derived, never serialised) ----------------------------------------------------------------

    @property
    def value_residual_spec(self) -> ValueResidualVariant:
        """The registry entry of `value_residual`."""
        return VARIANTS[self.value_residual]

    @property
    def value_residual_receivers(self) -> list[int]:
        """Sorted 0-based indices of the layers that use layer 0's values (empty for `"none"`)."""
        if self.value_residual_spec.role == PLAIN:
            return []
        if self.value_residual_layers is not None:
            return sorted(self.value_residual_layers)
        return self.value_residual_spec.default_layers(self.num_hidden_layers)

    @property
    def value_residual_layer_roles(self) -> list[str]:
        """What each layer does with values: the variant's role for receivers, `"plain"` for every other layer."""
        receivers, role = set(self.value_residual_receivers), self.value_residual_spec.role
        return [role if layer in receivers else PLAIN for layer in range(self.num_hidden_layers)]

    @property
    def value_residual_sources(self) -> list[int]:
        """Layers whose raw values later layers read: none, layer 0, or (dense) every layer."""
        if not self.value_residual_receivers:
            return []
        if self.value_residual_spec.keeps_every_layers_values:
            return list(range(self.num_hidden_layers))
        return [0]

    @property
    def layers_with_value_gate(self) -> list[int]:
        """Layers whose mix a learned gate computes per token (`"gated"`): they hold `self_attn.value_gate`."""
        return [layer for layer, role in enumerate(self.value_residual_layer_roles) if role == GATE]

    @property
    def layers_without_value_projection(self) -> list[int]:
        """Layers that have no `v_proj` because they attend over layer 0's values (SVFormer)."""
        return [layer for layer, role in enumerate(self.value_residual_layer_roles) if role == REUSE]

    @property
    def key_value_source_layers(self) -> list[int]:
        """For each layer, the layer whose keys and values it attends over: itself, or with cross-layer attention
        the first layer of its group."""
        group = self.cross_layer_attention or 1
        return [layer - layer % group for layer in range(self.num_hidden_layers)]

    @property
    def layers_reading_shared_keys_values(self) -> list[int]:
        """Layers without `k_proj`/`v_proj` that attend over an earlier layer's keys and values (CLA)."""
        return [layer for layer, source in enumerate(self.key_value_source_layers) if source != layer]

    @property
    def key_value_sources(self) -> list[KeyValueSource]:
        """For each layer, the layers whose cached keys and values it attends over (`key_value_sources.py`)."""
        return key_value_sources_of(self)

    @property
    def denseformer_dilation_resolved(self) -> int:
        return self.denseformer_dilation or 1

    @property
    def value_residual_lambda_first_resolved(self) -> float | None:
        """λ_first in use: the configured value or the variant's documented default (None when derived)."""
        spec = self.value_residual_spec
        configured = getattr(self, spec.lambda_first_field)
        return float(configured) if configured is not None else spec.lambda_first

    @property
    def value_residual_lambda_self_resolved(self) -> float | None:
        """λ_self in use: configured, or the variant's default (`"gated"`: 1 − λ_first, its lerp's weight on V_n)."""
        if self.value_residual_spec.lambdas == PER_TOKEN:
            return 1.0 - self.value_residual_lambda_first_resolved
        configured = self.value_residual_lambda_self
        return float(configured) if configured is not None else self.value_residual_spec.lambda_self

    @property
    def value_residual_lambda_scale_resolved(self) -> float:
        """Initial λ_scale of a softmax parameterisation: the configured value or `num_hidden_layers`."""
        configured = self.value_residual_lambda_scale
        return float(configured) if configured is not None else float(self.num_hidden_layers)


__all__ = ["DEFAULT_CONVERSION_VARIANT", "DEFAULT_VARIANT", "VALUE_RESIDUAL_VARIANTS", "VARIANTS", "ResFormerConfig",
           "ValueResidualVariant", "convertible_variants", "output_preserving_variants"]
