"""SVFormer's values stored once in transformers' paged cache (continuous batching: `generate_batch`,
`transformers serve --continuous-batching`).

The engine builds one `FullAttentionCacheAllocator` for all full-attention layers, looked up in the registry
`ATTN_TYPE_TO_ALLOCATOR` of `transformers/generation/continuous_batching/cache.py` (5.19 to 5.24, same code). Its
blocks hold, per layer, a keys page and a values page. `FirstLayerValuesAllocator` replaces it there: for a config
whose layers n >= 1 have no value projection (SVFormer) a block holds layer 0's keys and values pages and one keys
page per later layer, and every layer reads and writes layer 0's values page (layers n >= 1 attend over V_0 of the
same tokens, so what they write there is what layer 0 wrote). For every other config it is the stock allocator.

The engine converts `num_blocks` to bytes with a Llama block's size, so one `num_blocks` (or one memory budget) holds
2L/(L+1) times the tokens for SVFormer. Installed by `import resformer_hf`; remote code alone (no plugin) keeps the
stock layout.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.continuous_batching import cache as paged_cache
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator


def reads_first_layer_values(config: Any, layer_indices: list[int]) -> bool:
    """Whether every layer of `layer_indices` but layer 0 (which must be among them) attends over layer 0's values."""
    without = set(getattr(config, "layers_without_value_projection", None) or ())
    return bool(without) and 0 in layer_indices and set(layer_indices) - {0} <= without


class FirstLayerValuesAllocator(FullAttentionCacheAllocator):
    """The stock full-attention allocator; for SVFormer, keys per layer and values once (layer 0's) per block."""

    def __init__(self, index: int, config: Any, num_key_value_heads: int, cache_dtype: torch.dtype, page_size: int,
                 layer_indices: list[int], allow_block_sharing: bool) -> None:
        super().__init__(index=index, config=config, num_key_value_heads=num_key_value_heads,
                         cache_dtype=cache_dtype, page_size=page_size, layer_indices=layer_indices,
                         allow_block_sharing=allow_block_sharing)
        self.values_once = reads_first_layer_values(config, layer_indices)
        if not self.values_once:
            return
        # A block is len(layers) keys pages + 1 values page, each of `page_size` rows of [kv heads, head dim].
        half_pages = len(layer_indices) + 1
        self.pages_per_block = half_pages
        self.bytes_per_page = self.bytes_per_page // 2
        self.bytes_per_block = self.bytes_per_page * half_pages
        self.block_physical_stride = half_pages * page_size

    def register_cache_tensor(self, bytes_per_sector: int, non_trash_bytes: int, cache_tensor: torch.Tensor,
                              pool: Any) -> None:
        if not self.values_once:
            super().register_cache_tensor(bytes_per_sector, non_trash_bytes, cache_tensor, pool)
            return
        self.bytes_per_sector = bytes_per_sector
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
        row_shape = (self.num_key_value_heads, self.head_dim)
        rows = (non_trash_bytes + 2 * bytes_per_sector) // (self.bytes_per_page // self.tokens_per_page)
        typed = cache_tensor.view(self.cache_dtype)[: rows * self.num_key_value_heads * self.head_dim]
        flattened_view = typed.view(rows, *row_shape)
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, flattened_view, pool)
        # Block layout: [L0 keys | L0 values | L1 keys | L2 keys | ...], each page_size rows.
        page = self.tokens_per_page
        values_view = flattened_view[page:]
        self._kv_token_views = {}
        for position, layer_idx in enumerate(self.layer_indices):
            keys_page = 0 if position == 0 else position + 1
            self._kv_token_views[layer_idx] = (flattened_view[keys_page * page:], values_view)
        page_shape = (-1, page, *row_shape)
        self._kv_page_views = {}
        for layer_idx, (k_view, v_view) in self._kv_token_views.items():
            full_pages = min(k_view.shape[0], v_view.shape[0]) // page
            self._kv_page_views[layer_idx] = (k_view[: full_pages * page].view(*page_shape),
                                              v_view[: full_pages * page].view(*page_shape))


def install() -> None:
    """Make continuous batching build `FirstLayerValuesAllocator` for full-attention layers (idempotent)."""
    registry = paged_cache.ATTN_TYPE_TO_ALLOCATOR
    full = next(key for key, allocator in registry.items() if issubclass(allocator, FullAttentionCacheAllocator)
                and "sliding" not in key)
    if registry[full] is FullAttentionCacheAllocator:
        registry[full] = FirstLayerValuesAllocator


__all__ = ["FirstLayerValuesAllocator", "install", "reads_first_layer_values"]
