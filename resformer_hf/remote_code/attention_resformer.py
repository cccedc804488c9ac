"""ResFormer's attention: Llama's, whose values depend on the layer's role in the value residual.

What a layer does with values is read once, in `ResFormerAttention.__init__`, as Gemma3n reads `is_kv_shared_layer`;
the formulas and the λ are `value_residual.py`'s and `lambdas.py`'s. The forward keeps Llama's q, k and v projections
as three calls on the layer's input, so vLLM's Transformers backend fuses them into one GEMM as it does a Llama's.
Copied next to `config.json` for `trust_remote_code`, so it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, eager_attention_forward
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from ._compat import is_paged_cache, update_cache
from .architecture import HEAD, PROJECTION
from .base_blocks import attach_base_attention
from .cache_resformer import share_key_value_projections, shared_keys_values_queries
from .configuration_resformer import ResFormerConfig
from .depth_weighted_average import dense_values
from .value_embeddings import add_value_embedding, attach_value_embedding
from .value_residual import ResidualValues, ValueGate, corrected_output, gated_values, hand_on, mixed_values
from .variants import CORRECT, GATE, MIX, MIX_ALL, PLAIN, REUSE


class ResFormerAttention(LlamaAttention):
    """Llama's attention, whose values depend on the layer's role in the value residual, read once here as Gemma3n
    reads `is_kv_shared_layer`: what it receives (`value_role`) and whether later layers read its values."""

    def __init__(self, config: ResFormerConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        receivers = config.value_residual_receivers
        self.value_role = config.value_residual_layer_roles[layer_idx]  #: PLAIN, MIX, REUSE, GATE, CORRECT, MIX_ALL
        #: whether later layers read its values (layer 0; `dense`: every layer before the last receiver)
        self.hands_on_values = layer_idx in config.value_residual_sources and layer_idx < max(receivers, default=0)
        self.receiver_row = receivers.index(layer_idx) if self.value_role != PLAIN else None
        self.value_buffer_rows = max(receivers, default=0)  # `dense`: one row per layer up to the last receiver
        self.keeps_every_layers_values = config.value_residual_spec.keeps_every_layers_values
        #: Llama's values: a plain layer that hands nothing on skips `values` (a call a layer in a decode step)
        self.attends_own_values = self.value_role == PLAIN and not self.hands_on_values
        if self.value_role == REUSE:  # SVFormer
            self.v_proj = None
        if self.value_role == GATE:
            self.value_gate = ValueGate(config.hidden_size, config.num_key_value_heads)
            self.value_gate_channels = self.value_gate.in_features  # read once: vLLM swaps the gate for its linear
            self.gate_shift = config.value_residual_lambda_first_resolved - 0.5  # g0 − σ(0)
        share_key_value_projections(self, config)  # cross-layer attention: consumers lose k_proj and v_proj
        attach_value_embedding(self, config, layer_idx)  # value embeddings: this layer's table and gate, if it has one
        attach_base_attention(self, config, layer_idx)  # the base: q/k norms, RoPE or none, a window, a score scale

    def forward(
        self, hidden_states: torch.Tensor, residual_values: ResidualValues | None, lambda_first, lambda_self,
        position_embeddings: tuple | None = None, attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None, shared_keys_values: tuple = (None, None), value_embedding_ids=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None, ResidualValues | None, tuple]:
        """Returns (attention output, attention weights, what later layers read of the values, the (K, V) the next
        layer attends over with cross-layer attention)."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        # Llama's projections, named apart from what is computed from them below: vLLM's fuser makes them one GEMM
        # only where it can see that nothing between them changes what they read
        queries = self.q_proj(hidden_states)
        keys = self.k_proj(hidden_states)
        own_values = None  # SVFormer's layers n >= 1 have no v_proj: they attend over V_0
        if self.value_role != REUSE:
            own_values = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        # main diff with Llama: the values this layer attends over, and what it hands on (`value_residual.py`)
        value_states = own_values  # Llama's, where the layer neither reads nor hands on a value residual
        if not self.attends_own_values:
            value_states, residual_values = self.values(own_values, hidden_states, residual_values, lambda_first,
                                                        lambda_self)
        if self.has_value_embedding:
            value_states = add_value_embedding(self, value_states, hidden_states, value_embedding_ids)

        if self.qk_norm is None:  # Llama's
            query_states = queries.view(hidden_shape).transpose(1, 2)
            key_states = keys.view(hidden_shape).transpose(1, 2)
        else:
            query_states = self.normed(queries, self.q_norm, hidden_shape)
            key_states = self.normed(keys, self.k_norm, hidden_shape)
        if self.rotate is not None:  # SmolLM3's NoPE layers have none
            cos, sin = position_embeddings
            query_states, key_states = self.rotate(query_states, key_states, cos, sin)

        # With cross-layer attention, the next layer attends over these K and V: in the paged cache the tokens' own,
        # which it updates the pages with as this layer does; elsewhere the cached ones this update returns. Other
        # layers hand on none: the tokens' own K and V, kept, would outlive the cache's copies.
        next_keys_values = (key_states, value_states) if self.hands_on_keys_values else (None, None)
        if cache is not None:
            key_states, value_states = update_cache(cache, key_states, value_states, self.layer_idx, kwargs)
            if self.hands_on_keys_values and not is_paged_cache(cache):
                next_keys_values = (key_states, value_states)

        implementation = self.config._attn_implementation
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
            sliding_window=self.sliding_window, **kwargs,
        )
        # Attention returns [B, T, H_q, D] here, [T, H_q·D] in vLLM.
        if self.value_role == CORRECT:  # main diff with Llama: NeuTRENO's o_proj(A_n V_n + λ(V_0 − V_n))
            attn_output = corrected_output(attn_output.reshape(*input_shape, -1, self.head_dim), residual_values,
                                           own_values, self.o_proj, lambda_first, self.num_key_value_groups)
        else:
            attn_output = self.o_proj(attn_output.reshape(*input_shape, -1).contiguous())
        return attn_output, attn_weights, residual_values, next_keys_values

    def normed(self, projected: torch.Tensor, norm: nn.Module | None, hidden_shape: tuple) -> torch.Tensor:
        """Queries or keys [B, H, T, D] from their projection [B, T, H·D], through the base's q/k norm if it has one:
        over the whole projection (OLMo 2) or over each head (Qwen 3, Gemma 3)."""
        if self.qk_norm == PROJECTION:
            projected = norm(projected)
        states = projected.view(hidden_shape)
        if self.qk_norm == HEAD:
            states = norm(states)
        return states.transpose(1, 2)

    def values(self, own: torch.Tensor | None, hidden_states: torch.Tensor, residual_values: ResidualValues | None,
               lambda_first, lambda_self) -> tuple[torch.Tensor, ResidualValues | None]:
        """(the values [B, H_kv, T, D] this layer attends over, what it hands on to later layers), by its role, from
        its own values V_n = v_proj(h) (None without v_proj). v_proj is read only to train a mix (vLLM's fuser
        replaces it)."""
        if self.value_role == REUSE:
            return residual_values, residual_values
        if self.value_role == MIX:
            v_proj = self.v_proj if torch.is_grad_enabled() else None
            return mixed_values(own, residual_values, lambda_first, lambda_self, self.receiver_row, v_proj,
                                hidden_states), residual_values
        if self.value_role == GATE:
            v_proj = self.v_proj if torch.is_grad_enabled() else None
            return gated_values(own, residual_values, self.value_gate, hidden_states, self.gate_shift,
                                self.value_gate_channels, v_proj), residual_values
        if self.keeps_every_layers_values and (self.hands_on_values or self.value_role == MIX_ALL):  # `dense`
            return dense_values(own, residual_values, lambda_first, self.layer_idx, self.value_buffer_rows,
                                mix=self.value_role == MIX_ALL, append=self.hands_on_values)
        if self.hands_on_values:  # layer 0: V_0, or λ_first·V_0 scaled once for every receiver (`hand_on`)
            return own, hand_on(own, lambda_first)
        return own, residual_values  # NeuTRENO: attends over V_n, corrects its output


class ResFormerSharedKeysValuesAttention(ResFormerAttention):
    """A cross-layer-attention consumer (`cross_layer_attention`): no `k_proj` / `v_proj`; its queries attend over the
    keys and values of the first layer of its group, which the decoder loop hands to it.

    Its forward calls the attention interface itself, as Llama's does: vLLM's Transformers backend finds a model's
    attention layers by reading that call in each attention class's `forward` source (and tracing it with torch.fx).
    """

    def forward(self, hidden_states, residual_values, lambda_first, lambda_self, position_embeddings=None,
                attention_mask=None, cache=None, shared_keys_values=(None, None),
                value_embedding_ids=None, **kwargs: Unpack[TransformersKwargs]):  # value embeddings: never here
        input_shape = hidden_states.shape[:-1]
        query_states = shared_keys_values_queries(self, hidden_states, shared_keys_values, position_embeddings)
        # Indexed, not unpacked: under torch.fx tracing (vLLM) the pair is one traced value.
        key_states, value_states = shared_keys_values[0], shared_keys_values[1]
        if is_paged_cache(cache):  # the producer's K and V of these tokens, through its pages (see `paged_cache.py`)
            key_states, value_states = update_cache(cache, key_states, value_states, self.layer_idx, kwargs)
        implementation = self.config._attn_implementation
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
            sliding_window=self.sliding_window, **kwargs,
        )
        attn_output = self.o_proj(attn_output.reshape(*input_shape, -1).contiguous())
        return attn_output, attn_weights, residual_values, shared_keys_values


__all__ = ["ResFormerAttention", "ResFormerSharedKeysValuesAttention"]
