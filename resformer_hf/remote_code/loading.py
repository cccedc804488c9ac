"""What loading a checkpoint must refuse: a value-projection layout of another variant, and non-finite λ.

transformers would drop unexpected v_proj weights or random-initialise missing ones; for a ResFormer either means the
checkpoint was trained as another variant, so the load stops and says which. This file is copied next to
`config.json` for `trust_remote_code`, so it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps, WeightConverter

from .configuration_resformer import GATE, VARIANTS, ResFormerConfig


def check_value_projections(config: ResFormerConfig, missing_keys, unexpected_keys) -> None:
    """Refuse a checkpoint of the other value-projection layout instead of dropping or random-initialising v_proj.

    SVFormer layers n >= 1 have no `v_proj`; every other variant has one. A mismatch means the checkpoint was
    trained as a different variant than the config says.
    """
    # Cross-layer attention's consumers have no v_proj either (`check_key_value_projections` below).
    without = set(config.layers_without_value_projection) | set(config.layers_reading_shared_keys_values)
    extra = [layer for layer in _layers_with(unexpected_keys, "v_proj") if layer in without]
    if extra:
        raise ValueError(
            f"Variant mismatch: the model is value_residual={config.value_residual!r}, which has no v_proj in "
            f"layers {sorted(without)}, but the checkpoint has v_proj weights for layers {extra}, so it was "
            "trained as another variant. Load it with the value_residual its config.json names."
        )
    # Missing v_proj means "trained without them" only where the same layer's other projections did load: a
    # checkpoint that lacks everything (wrong prefix, another model) gets transformers' missing-keys report.
    loaded_layers = set(range(config.num_hidden_layers)) - set(_layers_with(missing_keys, "q_proj"))
    absent = [layer for layer in _layers_with(missing_keys, "v_proj") if layer in loaded_layers - without]
    if absent:
        reusing = [name for name, spec in VARIANTS.items() if spec.drops_value_projections]
        raise ValueError(
            f"Variant mismatch: the model is value_residual={config.value_residual!r}, but the checkpoint has no "
            f"v_proj weights for layers {absent} while their other projections are there, so it was trained "
            f"without them ({' or '.join(reusing)}). Load it with the value_residual its config.json names "
            "instead of random-initialising those projections."
        )


def check_value_gates(config: ResFormerConfig, unexpected_keys) -> None:
    """Refuse a checkpoint with value gates in layers that have none, instead of dropping them: it was trained as
    `gated` (missing gates are fine: they load as zeros, the documented start)."""
    extra = [layer for layer in _layers_with(unexpected_keys, "value_gate")
             if layer not in config.layers_with_value_gate]
    if extra:
        gated = [name for name, spec in VARIANTS.items() if spec.role == GATE]
        raise ValueError(
            f"Variant mismatch: the model is value_residual={config.value_residual!r}, but the checkpoint has value "
            f"gates (self_attn.value_gate) for layers {extra}, so it was trained as {' or '.join(gated)} (with those "
            "receiving layers). Load it with the value_residual and value_residual_layers its config.json names."
        )


def check_value_embedding_tables(config: ResFormerConfig, unexpected_keys) -> None:
    """Refuse a checkpoint with value-embedding tables in layers that have none, instead of dropping them (missing
    tables are fine: they load as zeros, the documented start)."""
    extra = [n for n in _layers_with(unexpected_keys, "value_embedding") if n not in config.value_embedding_layers]
    if extra:
        raise ValueError(f"value_embeddings mismatch: the checkpoint has value-embedding tables for layers {extra}, "
                         f"which value_embeddings={config.value_embeddings!r} does not give one; load it with the "
                         "value_embeddings its config.json names.")


def check_lambdas_are_finite(value_residual: nn.Module) -> None:
    """Refuse NaN/inf λ from a checkpoint, as the config refuses them: they would silently give NaN logits."""
    for name, parameter in value_residual.named_parameters():
        if parameter.device.type != "meta" and not torch.isfinite(parameter.detach()).all():
            raise ValueError(
                f"The checkpoint's model.value_residual.{name} holds NaN or infinite values, so the model would "
                "output NaN. Load a healthy save of the checkpoint instead."
            )


def check_key_value_projections(config: ResFormerConfig, missing_keys, unexpected_keys) -> None:
    """Refuse a checkpoint whose k_proj layout is another `cross_layer_attention`'s, instead of dropping its weights
    or random-initialising missing ones."""
    consumers = set(config.layers_reading_shared_keys_values)
    extra = [layer for layer in _layers_with(unexpected_keys, "k_proj") if layer in consumers]
    loaded_layers = set(range(config.num_hidden_layers)) - set(_layers_with(missing_keys, "q_proj"))
    absent = [layer for layer in _layers_with(missing_keys, "k_proj") if layer in loaded_layers - consumers]
    if extra or absent:
        found = f"has k_proj weights for layers {extra}" if extra else f"lacks k_proj weights for layers {absent}"
        raise ValueError(
            f"cross_layer_attention mismatch: the model has cross_layer_attention={config.cross_layer_attention} "
            f"(no k_proj in layers {sorted(consumers)}), but the checkpoint {found}. Load it with the "
            "cross_layer_attention its config.json names."
        )


def modules_kept_in_float32(config: ResFormerConfig) -> list[str]:
    """The modules `from_pretrained` keeps in float32 whatever the dtype: those of the model that decide how values
    mix (the learnable λ, DenseFormer's depth weights, `gated`'s value gates)."""
    spec = config.value_residual_spec
    kept = (("value_residual", spec.learnable), ("depth_weighted_average", spec.depth_weighted_average),
            ("value_gate", bool(config.layers_with_value_gate)))
    return [name for name, present in kept if present]


class CheckpointChecks:
    """`ResFormerPreTrainedModel`'s override of transformers' loading hook: the checks above, once weights load."""

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        """Refuse a checkpoint of another variant's v_proj layout or value gates, or with non-finite λ (`loading.py`).

        A private transformers hook: `PreTrainedModel._finalize_model_loading` calls it once the weights are loaded
        and missing ones initialised, which is when both checks can be made.
        """
        super()._adjust_missing_and_unexpected_keys(loading_info)
        check_key_value_projections(self.config, loading_info.missing_keys, loading_info.unexpected_keys)
        check_value_projections(self.config, loading_info.missing_keys, loading_info.unexpected_keys)
        check_value_gates(self.config, loading_info.unexpected_keys)
        check_value_embedding_tables(self.config, loading_info.unexpected_keys)  # value embeddings
        check_lambdas_are_finite(self.base_model.value_residual)


class LambdaScaleToVector(ConversionOps):
    """Checkpoint conversion: a λ_scale offset saved as a 0-dim scalar becomes the shape-[1] parameter, same value.

    A 1-D tensor passes unchanged, so saving (this op again, as its own reverse) writes the new layout. Sharded
    loading (FSDP2) hands a 0-dim tensor to the rank that owns its one slice; the others get an empty list.
    """

    @torch.no_grad()
    def convert(self, input_dict: dict, source_patterns: list[str], target_patterns: list[str], **kwargs) -> dict:
        (tensors,) = input_dict.values()
        tensors = tensors if isinstance(tensors, list) else [tensors]
        local = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0, dtype=torch.float32)
        return {target_patterns[0]: local}

    @property
    def reverse_op(self) -> ConversionOps:
        return self


#: Weight conversions `from_pretrained` applies to a ResFormer checkpoint (registered for the model type).
LAMBDA_CHECKPOINT_CONVERSIONS = [
    WeightConverter(
        "value_residual.lambda_scale_offset", "value_residual.lambda_scale_offset", [LambdaScaleToVector()]
    )
]


_PROJECTION_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(\w+)\.")


def _layers_with(keys, projection: str) -> list[int]:
    """Sorted layer indices that have a `self_attn.<projection>` entry among `keys`."""
    matches = (_PROJECTION_KEY.search(key) for key in keys)
    return sorted({int(match.group(1)) for match in matches if match and match.group(2) == projection})
