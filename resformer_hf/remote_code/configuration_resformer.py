"""ResFormer configuration: a `LlamaConfig` plus the value-residual fields of Zhou et al. (ACL 2025), and the facts of
the base it is built on.

The variants are declared once, in `variants.py`; the config turns them into per-layer facts
(`value_residual_layer_roles`, `value_residual_sources`, ...) in the way Gemma's configs work out `layer_types`. The
base's facts (Qwen 3's q/k norms, Gemma 3's four norms a block, sliding windows, ...) are fields too, checked in
`architecture.py`. The modeling, cache, conversion, card and quickstart code read those facts and never compare variant
or base names.

Copied next to `config.json` for `trust_remote_code`: it imports only `transformers`, `huggingface_hub` (which
transformers requires) and sibling files, each by `from .name import` (the only form the remote-code loader copies).
"""

from __future__ import annotations

from ._compat import OLDEST_SUPPORTED  # noqa: F401  (first: refuses an unsupported transformers in one line)
from .architecture import attention_types, check_architecture
from .cache_resformer import KeyValueSource, key_value_sources_of
from .value_embeddings import value_embedding_layers
from .variants import (  # the public names too: `configuration_resformer` was where they lived
    CROSS_LAYER_ATTENTION,
    DEFAULT_CONVERSION_VARIANT,
    DEFAULT_VARIANT,
    GATE,
    OPTIONAL_FIELDS,
    PER_TOKEN,
    PLAIN,
    REUSE,
    VALUE_RESIDUAL_VARIANTS,
    VARIANTS,
    ValueResidualVariant,
    checked_field,
    convertible_variants,
    output_preserving_variants,
)

# isort: split
from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig


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

        The base the model is built on (defaults: Llama's; `architecture.py` has each base's values):

        qk_norm (`str`, *optional*):
            RMSNorm on queries and keys before RoPE: `"head"` over each head (Qwen 3, Gemma 3), `"projection"` over the
            whole projection (OLMo 2); None: none.
        block_norms (`str`, *optional*, defaults to `"pre"`):
            `"pre"`: a norm before attention and before the MLP (Llama); `"post"`: one on each sublayer's output,
            before the residual add (OLMo 2); `"sandwich"`: both (Gemma 3).
        rms_norm_type (`str`, *optional*, defaults to `"llama"`):
            transformers' RMSNorm of that model: `"llama"`, `"olmo2"` (scaled in float32) or `"gemma3"` (`1 + w`).
        rope_in_float32 (`bool`, *optional*, defaults to `False`):
            RoPE rotates in float32 and casts back (OLMo 2 and 3); Llama's casts cos and sin to the queries' dtype.
        embedding_multiplier (`float`, *optional*):
            The embeddings are scaled by it, in the weights' dtype (Gemma 3: √hidden_size).
        query_pre_attn_scalar (`float`, *optional*):
            Attention scores are scaled by its inverse square root instead of head_dim's (Gemma 3).
        layer_types (`list[str]`, *optional*):
            `"full_attention"` or `"sliding_attention"` for each layer; None: every layer sliding if `sliding_window`
            is set (Mistral), else full. A `rope_parameters` keyed by these types gives each its own RoPE.
        sliding_window (`int`, *optional*):
            The window of the sliding layers.
        nope_layers (`list[int]`, *optional*):
            Layers without RoPE (SmolLM3's every 4th).

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
    # the base (architecture.py)
    qk_norm: str | None = None
    block_norms: str = "pre"
    rms_norm_type: str = "llama"
    rope_in_float32: bool = False
    embedding_multiplier: float | int | None = None
    query_pre_attn_scalar: float | int | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    nope_layers: list[int] | None = None

    def __setattr__(self, name: str, value) -> None:
        # Checked on every assignment, not only in __init__: `config.value_residual = "bogus"` fails here, by name.
        if name in ("value_residual", CROSS_LAYER_ATTENTION) or name in OPTIONAL_FIELDS:
            value = checked_field(name, value)
        super().__setattr__(name, value)

    def __post_init__(self, **kwargs):
        if self.layer_types is None:  # as transformers' configs with layer types fill it, which its helpers expect
            self.layer_types = attention_types(self)
        super().__post_init__(**kwargs)
        self.check_value_residual()

    def check_value_residual(self) -> None:
        """Raise a `ValueError` naming the field if the value-residual fields do not fit together or the model shape.

        Runs on construction and again when a model is built, so fields assigned after construction are checked too.
        """
        for name in ("value_residual", CROSS_LAYER_ATTENTION, *OPTIONAL_FIELDS):
            checked_field(name, getattr(self, name))
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
        check_architecture(self)

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
        """For each layer, the layers whose cached keys and values it attends over
        (`cache_resformer.key_value_sources_of`)."""
        return key_value_sources_of(self)

    @property
    def attention_types(self) -> list[str]:
        """Each layer's attention: `"full_attention"` or `"sliding_attention"` (`architecture.attention_types`)."""
        return attention_types(self)

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
