"""Pages only for the keys and values a ResFormer really has, in transformers' paged cache (continuous batching:
`generate_batch`, `transformers serve --continuous-batching`, `resformer-serve --continuous-batching`).

The engine builds one `FullAttentionCacheAllocator` for all full-attention layers, looked up in the registry
`ATTN_TYPE_TO_ALLOCATOR` of `transformers/generation/continuous_batching/cache.py` (5.19 to 5.24, same code). Its
blocks hold, per layer, a keys page and a values page. `StoredKeysValuesAllocator` replaces it there and gives pages
only to the layers that produce keys or values:

- cross-layer attention (`cross_layer_attention=g`): a group's first layer (the producer) has pages, the other layers
  of the group (consumers, no `k_proj`/`v_proj`) read and write the producer's, writing the producer's K and V of the
  same tokens again (the same bytes): CLA2 keeps half a Llama's bytes per token;
- SVFormer (layers n >= 1 attend over V_0): every storing layer has a keys page and layer 0's values page is the only
  values page, which every layer reads and writes (what they write there is V_0 of the same tokens): (L + 1)/(2L), and
  with CLA2 (L/2 + 1)/(2L).

Any other config gets the stock layout. Consumers write the same bytes again because the engine's attention paths
differ (5.24 updates the cache in the model's attention, 5.19-5.23 and the flash block-table path inside the
attention function), and going through the cache update is what gives each of them the producer's K and V in the
form it reads (`cross_layer_kv`, `_compat.update_cache`).

The engine converts `num_blocks` to bytes with a Llama block's size, so one `num_blocks` (or one memory budget) holds
more tokens. Installed by `import resformer_hf`; remote code alone (no plugin) keeps the stock layout, consumers
included, with the same tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.continuous_batching import cache as paged_cache
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

from ..remote_code.cache_resformer import key_value_sources_of


def consumer_producers(config: Any, layer_indices: list[int]) -> dict[int, int]:
    """With cross-layer attention, each consumer among `layer_indices` and the producer (the first layer of its group)
    whose pages it reads and writes; none unless every consumer's producer is among them. The rest store their own."""
    sources = [source.keys for source in key_value_sources_of(config)]
    if not sources or any(sources[layer] not in layer_indices for layer in layer_indices):
        return {}
    return {layer: sources[layer] for layer in layer_indices if sources[layer] != layer}


def reads_first_layer_values(config: Any, layer_indices: list[int]) -> bool:
    """Whether every layer of `layer_indices` but layer 0 (which must be among them) attends over layer 0's values."""
    sources = key_value_sources_of(config)
    others = set(layer_indices) - {0}
    return bool(others) and 0 in layer_indices and all(sources[layer].values == 0 for layer in others)


class StoredKeysValuesAllocator(FullAttentionCacheAllocator):
    """The stock full-attention allocator with pages only for the layers that store keys and values (see the module
    docstring); the stock layout for every other model."""

    def __init__(self, index: int, config: Any, num_key_value_heads: int, cache_dtype: torch.dtype, page_size: int,
                 layer_indices: list[int], allow_block_sharing: bool) -> None:
        self.producers = consumer_producers(config, layer_indices)  #: consumer layer -> producer
        storing = [layer for layer in layer_indices if layer not in self.producers]
        super().__init__(index=index, config=config, num_key_value_heads=num_key_value_heads,
                         cache_dtype=cache_dtype, page_size=page_size, layer_indices=storing,
                         allow_block_sharing=allow_block_sharing)
        self.values_once = reads_first_layer_values(config, storing) and len(storing) > 1
        if not self.values_once:
            return
        # A block is len(storing) keys pages + 1 values page, each of `page_size` rows of [kv heads, head dim].
        half_pages = len(storing) + 1
        self.pages_per_block = half_pages
        self.bytes_per_page = self.bytes_per_page // 2
        self.bytes_per_block = self.bytes_per_page * half_pages
        self.block_physical_stride = half_pages * page_size

    def register_cache_tensor(self, bytes_per_sector: int, non_trash_bytes: int, cache_tensor: torch.Tensor,
                              pool: Any) -> None:
        if self.values_once:
            self._register_values_once(bytes_per_sector, non_trash_bytes, cache_tensor, pool)
        else:
            super().register_cache_tensor(bytes_per_sector, non_trash_bytes, cache_tensor, pool)
        for layer, producer in self.producers.items():
            self._kv_token_views[layer] = self._kv_token_views[producer]
            self._kv_page_views[layer] = self._kv_page_views[producer]

    def _register_values_once(self, bytes_per_sector: int, non_trash_bytes: int, cache_tensor: torch.Tensor,
                              pool: Any) -> None:
        self.bytes_per_sector = bytes_per_sector
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
        row_shape = (self.num_key_value_heads, self.head_dim)
        rows = (non_trash_bytes + 2 * bytes_per_sector) // (self.bytes_per_page // self.tokens_per_page)
        typed = cache_tensor.view(self.cache_dtype)[: rows * self.num_key_value_heads * self.head_dim]
        flattened_view = typed.view(rows, *row_shape)
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, flattened_view, pool)
        # Block layout: [L0 keys | L0 values | keys of the 2nd storing layer | of the 3rd | ...], each page_size rows.
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
    """Make continuous batching build `StoredKeysValuesAllocator` for full-attention layers (idempotent)."""
    registry = paged_cache.ATTN_TYPE_TO_ALLOCATOR
    full = next(key for key, allocator in registry.items() if issubclass(allocator, FullAttentionCacheAllocator)
                and "sliding" not in key)
    if registry[full] is FullAttentionCacheAllocator:
        registry[full] = StoredKeysValuesAllocator


__all__ = ["StoredKeysValuesAllocator", "install", "consumer_producers", "reads_first_layer_values"]
