"""Cross-layer attention (CLA, Brandon et al., 2024): the KV-sharing baseline the paper compares SVFormer with.

With `cross_layer_attention=g`, each group of g consecutive layers attends over the keys and values of its first
layer (the producer), after RoPE and, with a cache, including every cached token. The other layers (consumers) have no
`k_proj` / `v_proj` and no cache entries of their own (`cache_resformer.SharedKeysValues*Layer`): CLA2 stores half a
Llama's KV cache, and combined with SVFormer (values once) (L/2 + 1)/(2L) of it. The producer hands its K and V to
the next layer through the decoder loop, as positional tensors so that reentrant gradient checkpointing propagates
their gradients. Imports only torch and transformers (copied for `trust_remote_code`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward, rotate_half


def attend_over_shared_keys_values(
    attention: nn.Module,
    hidden_states: torch.Tensor,
    shared_keys: torch.Tensor,
    shared_values: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A consumer layer's attention: its own queries (with RoPE, as Llama applies it) over the producer's keys and
    values, then its own `o_proj`. Returns (attention output, attention weights) like Llama's attention."""
    if shared_keys is None or shared_values is None:
        raise ValueError(
            f"Layer {attention.layer_idx} attends over an earlier layer's keys and values (cross_layer_attention), "
            "but none were handed to it: run the whole decoder stack, not this layer alone."
        )
    input_shape = hidden_states.shape[:-1]
    query_states = attention.q_proj(hidden_states).view(*input_shape, -1, attention.head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    query_states = (query_states * cos) + (rotate_half(query_states) * sin)
    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        attention.config._attn_implementation, eager_attention_forward
    )
    attn_output, attn_weights = attention_interface(
        attention,
        query_states,
        shared_keys,
        shared_values,
        attention_mask,
        dropout=0.0 if not attention.training else attention.attention_dropout,
        scaling=attention.scaling,
        **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return attention.o_proj(attn_output), attn_weights


def share_key_value_projections(attention: nn.Module, config) -> None:
    """Set up `attention` for cross-layer attention: a consumer (`reads_shared_keys_values`) loses `k_proj` and
    `v_proj`; a layer whose next layer reads its K and V `hands_on_keys_values`."""
    sources, layer = config.key_value_source_layers, attention.layer_idx
    attention.reads_shared_keys_values = sources[layer] != layer
    attention.hands_on_keys_values = layer + 1 < len(sources) and sources[layer + 1] == sources[layer]
    if attention.reads_shared_keys_values:
        attention.k_proj = attention.v_proj = None


__all__ = ["attend_over_shared_keys_values", "share_key_value_projections"]
