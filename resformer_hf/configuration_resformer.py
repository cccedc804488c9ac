"""ResFormer configuration: a `LlamaConfig` plus the value-residual fields of Zhou et al. (ACL 2025).

This file is copied next to `config.json` for `trust_remote_code` loading, so it imports only `transformers`
(and `huggingface_hub`, which transformers itself requires).
"""

from __future__ import annotations

import math

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

#: The paper's variants, as accepted by `ResFormerConfig(value_residual=...)`.
VALUE_RESIDUAL_VARIANTS = (
    "none",
    "identity",
    "constant",
    "learnable",
    "learnable_plus",
    "sparse",
    "dense",
    "svformer",
    "neutreno",
)

#: Which optional λ fields each variant reads; giving a field to a variant that ignores it is an error.
_FIELDS_READ_BY_VARIANT = {
    "none": (),
    "identity": ("value_residual_layers",),
    "constant": ("value_residual_layers", "value_residual_lambda_first", "value_residual_lambda_self"),
    "learnable": ("value_residual_layers", "value_residual_lambda_first", "value_residual_lambda_self"),
    "learnable_plus": ("value_residual_layers", "value_residual_lambda_self", "value_residual_lambda_scale"),
    "sparse": ("value_residual_layers", "value_residual_lambda_first", "value_residual_lambda_self"),
    "dense": ("value_residual_layers", "value_residual_lambda_first", "value_residual_lambda_self"),
    "svformer": (),
    "neutreno": ("value_residual_layers", "neutreno_lambda"),
}
_OPTIONAL_FIELDS = (
    "value_residual_layers",
    "value_residual_lambda_first",
    "value_residual_lambda_self",
    "value_residual_lambda_scale",
    "neutreno_lambda",
)

#: Documented defaults of (λ_first, λ_self): fixed values for fixed variants, initial values for learnable ones.
DEFAULT_LAMBDAS = {
    "none": (0.0, 1.0),
    "identity": (0.5, 0.5),
    "constant": (2.0, 1.0),
    "learnable": (0.5, 0.5),
    "learnable_plus": (None, 0.5),  # λ_first = λ_scale · softmax(logits), λ_scale starts at num_hidden_layers
    "sparse": (5.0, 1.0),
    "dense": (0.5, 0.5),
    "svformer": (1.0, 0.0),
    "neutreno": (None, None),
}
DEFAULT_NEUTRENO_LAMBDA = 0.4


@strict
class ResFormerConfig(LlamaConfig):
    r"""
    Configuration of a ResFormer: every field of [`LlamaConfig`] plus the value residual.

    Attention layer `n >= 1` attends over `V'_n = λ_first[n]·V_0 + λ_self[n]·V_n`, where `V_0` is layer 0's value
    projection of the same tokens. Layer indices are 0-based; layer 0 is never changed.

    Args:
        value_residual (`str`, *optional*, defaults to `"learnable_plus"`):
            The paper's variant: `"none"` (plain Llama), `"identity"` (fixed 0.5/0.5), `"constant"` (fixed pair),
            `"learnable"` (per-layer learnable pair), `"learnable_plus"` (`λ_first = λ_scale·softmax(logits)` over the
            receiving layers, shared learnable `λ_scale`; the paper's best), `"sparse"` (fixed pair on a few late
            layers), `"dense"` (learnable weights on the values of every earlier layer), `"svformer"` (layers n >= 1
            have no `v_proj` and attend over `V_0`) or `"neutreno"` (the baseline `A_n V_n + λ(V_0 - V_n)`).
        value_residual_layers (`list[int]`, *optional*):
            The layers that receive `V_0` (each in `1 .. num_hidden_layers - 1`). Defaults to every layer n >= 1, and
            for `"sparse"` to the last ⌈3L/8⌉ layers. Not read by `"none"` and `"svformer"`.
        value_residual_lambda_first (`float`, *optional*):
            λ_first: the fixed value for `"constant"` (default 2.0) and `"sparse"` (5.0); the initial value for
            `"learnable"` (0.5) and, as the weight on `V_0`, for `"dense"` (0.5).
        value_residual_lambda_self (`float`, *optional*):
            λ_self: fixed for `"constant"` (1.0) and `"sparse"` (1.0); initial for `"learnable"`, `"learnable_plus"`
            and `"dense"` (0.5).
        value_residual_lambda_scale (`float`, *optional*):
            Initial shared λ_scale of `"learnable_plus"`; defaults to `num_hidden_layers`.
        neutreno_lambda (`float`, *optional*):
            λ of the `"neutreno"` baseline (default 0.4).

    ```python
    >>> import resformer_hf
    >>> from transformers import AutoModelForCausalLM
    >>> config = resformer_hf.ResFormerConfig(hidden_size=256, num_hidden_layers=4, value_residual="learnable_plus")
    >>> model = AutoModelForCausalLM.from_config(config)
    ```
    """

    model_type = "resformer"
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "residual_values", "attention_mask"], ["hidden_states", "residual_values"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    value_residual: str = "learnable_plus"
    value_residual_layers: list[int] | None = None
    value_residual_lambda_first: float | int | None = None
    value_residual_lambda_self: float | int | None = None
    value_residual_lambda_scale: float | int | None = None
    neutreno_lambda: float | int | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._validate_value_residual()

    def _validate_value_residual(self) -> None:
        variant = self.value_residual
        if variant not in VALUE_RESIDUAL_VARIANTS:
            raise ValueError(
                f"value_residual={variant!r} is not a known variant; use one of {', '.join(VALUE_RESIDUAL_VARIANTS)}."
            )
        read = _FIELDS_READ_BY_VARIANT[variant]
        for name in _OPTIONAL_FIELDS:
            if getattr(self, name) is not None and name not in read:
                users = [v for v, fields in _FIELDS_READ_BY_VARIANT.items() if name in fields]
                raise ValueError(
                    f"{name} is ignored by value_residual={variant!r}; leave it unset (None), or choose a variant that "
                    f"reads it: {', '.join(users)}."
                )
        for name in ("value_residual_lambda_first", "value_residual_lambda_self", "value_residual_lambda_scale",
                     "neutreno_lambda"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number.")
        if variant == "svformer" and self.num_hidden_layers < 2:
            raise ValueError(
                f"value_residual='svformer' needs num_hidden_layers >= 2 (got {self.num_hidden_layers}): layer 0 "
                "provides the values that the later layers reuse."
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

    # ---- resolved values (derived, never serialised) -------------------------------------------------------------

    @property
    def value_residual_receivers(self) -> list[int]:
        """Sorted 0-based indices of the layers that mix in layer 0's values (empty for `"none"`)."""
        n_layers = self.num_hidden_layers
        if self.value_residual == "none":
            return []
        if self.value_residual_layers is not None:
            return sorted(self.value_residual_layers)
        if self.value_residual == "sparse":
            count = math.ceil(3 * n_layers / 8)
            return list(range(max(1, n_layers - count), n_layers))
        return list(range(1, n_layers))

    @property
    def value_residual_lambda_first_resolved(self) -> float | None:
        """λ_first in use: the configured value or the variant's documented default."""
        if self.value_residual_lambda_first is not None:
            return float(self.value_residual_lambda_first)
        return DEFAULT_LAMBDAS[self.value_residual][0]

    @property
    def value_residual_lambda_self_resolved(self) -> float | None:
        """λ_self in use: the configured value or the variant's documented default."""
        if self.value_residual_lambda_self is not None:
            return float(self.value_residual_lambda_self)
        return DEFAULT_LAMBDAS[self.value_residual][1]

    @property
    def value_residual_lambda_scale_resolved(self) -> float:
        """Initial λ_scale of `"learnable_plus"`: the configured value or `num_hidden_layers`."""
        if self.value_residual_lambda_scale is not None:
            return float(self.value_residual_lambda_scale)
        return float(self.num_hidden_layers)

    @property
    def neutreno_lambda_resolved(self) -> float:
        """λ of the NeuTRENO baseline: the configured value or 0.4."""
        return DEFAULT_NEUTRENO_LAMBDA if self.neutreno_lambda is None else float(self.neutreno_lambda)


__all__ = ["ResFormerConfig", "VALUE_RESIDUAL_VARIANTS"]
