"""Cross-layer attention (CLA, Brandon et al., 2024): the KV-sharing baseline the paper compares SVFormer with.

With `cross_layer_attention=g`, each group of g consecutive layers attends over the keys and values of its first
layer (the producer), after RoPE and, with a cache, including every cached token. The other layers (consumers) have no
`k_proj` / `v_proj` and no cache entries of their own (`cache_resformer.SharedKeysValues*Layer`): CLA2 stores half a
Llama's KV cache, and combined with SVFormer (values once) (L/2 + 1)/(2L) of it. The producer hands its K and V to
the next layer through the decoder loop, as positional tensors so that reentrant gradient checkpointing propagates
their gradients. Imports only torch and transformers (copied for `trust_remote_code`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half


def shared_keys_values_queries(
    attention: nn.Module,
    hidden_states: torch.Tensor,
    shared_keys_values: tuple[torch.Tensor | None, torch.Tensor | None],
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """A consumer layer's own queries with RoPE as Llama applies it ([B, H_q, T, D]), after checking that the
    producer's keys and values were handed to it."""
    if shared_keys_values[0] is None or shared_keys_values[1] is None:
        raise ValueError(
            f"Layer {attention.layer_idx} attends over an earlier layer's keys and values (cross_layer_attention), "
            "but none were handed to it: run the whole decoder stack, not this layer alone."
        )
    input_shape = hidden_states.shape[:-1]
    query_states = attention.q_proj(hidden_states).view(*input_shape, -1, attention.head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (query_states * cos) + (rotate_half(query_states) * sin)


def share_key_value_projections(attention: nn.Module, config) -> None:
    """Set up `attention` for cross-layer attention: a consumer (`reads_shared_keys_values`) loses `k_proj` and
    `v_proj`; a layer whose next layer reads its K and V `hands_on_keys_values`."""
    sources, layer = config.key_value_source_layers, attention.layer_idx
    attention.reads_shared_keys_values = sources[layer] != layer
    attention.hands_on_keys_values = layer + 1 < len(sources) and sources[layer + 1] == sources[layer]
    if attention.reads_shared_keys_values:
        attention.k_proj = attention.v_proj = None


__all__ = ["share_key_value_projections", "shared_keys_values_queries"]
