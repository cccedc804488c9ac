"""SVFormer's KV cache: keys for every layer, values once.

In SVFormer every layer n >= 1 attends over layer 0's values V_0 of the same tokens, so a cache that stores values per
layer holds L - 1 identical copies. Following transformers' cross-layer KV sharing (gemma4: a producer layer stores,
consumer layers reuse), layer 0 keeps a stock `DynamicLayer` / `StaticLayer` and every later layer gets a keys-only
layer whose `values` ARE layer 0's tensor. The caches stay the stock `DynamicCache` / `StaticCache` objects, so
`generate()`'s cache operations (beam reordering, `crop`, batch select/repeat, `torch.compile` on a static cache) work
unchanged. This file is copied next to `config.json` for `trust_remote_code`, so it imports only torch and
transformers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticLayer
from transformers.utils import is_torchdynamo_compiling


class _ReadsProducerValues:
    """Mixin for a cache layer that stores keys only and reads its values from a producer layer.

    `values` is a read-only view of the producer's tensor (assigning `None`, which the base classes do on init and
    reset, is accepted and ignored), so the values exist once in memory and every operation on them (reorder, crop,
    select) is done once, by the producer.
    """

    values_from: DynamicLayer | StaticLayer

    @property
    def values(self) -> torch.Tensor | None:
        return self.values_from.values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError(
                f"{type(self).__name__} stores keys only; its values are the producer layer's and cannot be set here."
            )

    def offload(self) -> None:
        if self.is_initialized:
            self.keys = self.keys.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        if self.is_initialized and self.keys.device != self.device:
            self.keys = self.keys.to(self.device, non_blocking=True)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(values_from={type(self.values_from).__name__})"


class SharedValuesDynamicLayer(_ReadsProducerValues, DynamicLayer):
    """A `DynamicLayer` that grows its keys and returns the producer layer's (already updated) values."""

    def __init__(self, values_from: DynamicLayer, **kwargs: Any):
        self.values_from = values_from
        super().__init__(**kwargs)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.tensor([], dtype=self.dtype, device=self.device)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the keys; `value_states` (V_0 of the same tokens, already appended by the producer) is not stored."""
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        return self.keys, self.values_from.values

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.keys = self.keys[..., : -abs(tokens_to_remove), :]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self.keys = self.keys[indices, ...]


class SharedValuesStaticLayer(_ReadsProducerValues, StaticLayer):
    """A `StaticLayer` that preallocates keys only and returns the producer layer's static value buffer."""

    def __init__(self, values_from: StaticLayer, max_cache_len: int, **kwargs: Any):
        self.values_from = values_from
        super().__init__(max_cache_len=max_cache_len, **kwargs)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim = key_states.shape[-1]
        self.v_head_dim = value_states.shape[-1] if value_states is not None else self.k_head_dim
        self.keys = torch.zeros(
            (self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim), dtype=self.dtype, device=self.device
        )
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not is_torchdynamo_compiling():
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.cumulative_length)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the keys in place; `value_states` was already written by the producer and is not stored again."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache_position = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        self.cumulative_length.add_(key_states.shape[-2])
        try:
            self.keys.index_copy_(2, cache_position, key_states)
        except NotImplementedError:  # e.g. MPS, as in `StaticLayer.update`
            self.keys[:, :, cache_position] = key_states
        return self.keys, self.values_from.values

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
        self.cumulative_length.zero_()


def _shared_values_layer(layer: Any, producer: Any) -> Any:
    """The keys-only replacement of a stock full-attention layer, or None for layers with other semantics."""
    if type(layer) is DynamicLayer and type(producer) is DynamicLayer:
        return SharedValuesDynamicLayer(values_from=producer)
    if type(layer) is StaticLayer and type(producer) is StaticLayer and layer.max_cache_len == producer.max_cache_len:
        return SharedValuesStaticLayer(values_from=producer, max_cache_len=layer.max_cache_len)
    return None


def share_first_layer_values(cache: Cache) -> Cache:
    """Make layers n >= 1 of an empty SVFormer cache store keys only and read layer 0's values; returns `cache`.

    Only stock full-attention layers (`DynamicLayer`, `StaticLayer`) of a cache that holds no tokens yet and is not
    offloaded are replaced (offloading moves layer 0's values to the CPU while later layers still need them); any other
    cache is returned unchanged and stays correct, just without the saving.
    """
    layers = getattr(cache, "layers", None)
    if not layers or getattr(cache, "offloading", False) or cache.get_seq_length() > 0:
        return cache
    producer = layers[0]
    for index in range(1, len(layers)):
        replacement = _shared_values_layer(layers[index], producer)
        if replacement is None:
            continue
        if layers[index].is_initialized:  # early-initialised (e.g. for chunked prefill): keep it so, keys only
            replacement.lazy_initialization(layers[index].keys, layers[index].values)
        layers[index] = replacement
    return cache


def new_dynamic_cache(config: Any) -> DynamicCache:
    """The `DynamicCache` a model with `config` uses by default: values stored once when layers reuse V_0 (SVFormer)."""
    cache = DynamicCache(config=config)
    if getattr(config, "layers_without_value_projection", None):
        share_first_layer_values(cache)
    return cache


# ---- memory accounting ----------------------------------------------------------------------------------------------


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


def _cache_tensors(cache: Any) -> Iterator[torch.Tensor]:
    """Every tensor a cache holds: each layer's keys/values (also when they are properties) and other tensor state."""
    if isinstance(cache, (list, tuple)):  # legacy tuple-of-tuples caches
        yield from _tensors_in(cache)
        return
    sub_caches = [getattr(cache, name, None) for name in ("self_attention_cache", "cross_attention_cache")]
    if any(sub is not None for sub in sub_caches):  # EncoderDecoderCache
        for sub in sub_caches:
            if sub is not None:
                yield from _cache_tensors(sub)
        return
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"cache_nbytes expects a transformers Cache (e.g. `outputs.past_key_values`), got {type(cache).__name__}. "
            "Run the model with use_cache=True, or generate(..., return_dict_in_generate=True), and pass its "
            "`past_key_values`."
        )
    for layer in layers:
        yield from _tensors_in(getattr(layer, "keys", None))
        yield from _tensors_in(getattr(layer, "values", None))
        yield from _tensors_in(list(vars(layer).values()))


def cache_nbytes(past_key_values: Any) -> int:
    """Bytes of memory a KV cache really holds, counting storage shared between layers (or views) once.

    Works for any transformers cache (`DynamicCache`, `StaticCache`, encoder-decoder caches, Llama's as well as
    ResFormer's), so SVFormer's saving can be compared with a Llama of the same shape. Counts whole storages: a cropped
    dynamic cache still holds its pre-crop storage until the next update, and a static layer also holds its small
    position counter.
    """
    sizes: dict[tuple[str, int], int] = {}
    for tensor in _cache_tensors(past_key_values):
        try:
            storage = tensor.untyped_storage()
            key, size = (str(tensor.device), storage.data_ptr()), storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without one plain storage
            key, size = ("id", id(tensor)), tensor.numel() * tensor.element_size()
        if size and key[1] == 0:  # data_ptr 0 is shared by empty storages only; never merge real ones on it
            key = ("id", id(tensor))
        sizes[key] = max(sizes.get(key, 0), size)
    return sum(sizes.values())


__all__ = [
    "SharedValuesDynamicLayer",
    "SharedValuesStaticLayer",
    "cache_nbytes",
    "new_dynamic_cache",
    "share_first_layer_values",
]
