"""SVFormer's KV cache (keys for every layer, values once) and cross-layer attention's (K and V per layer group).

In SVFormer every layer n >= 1 attends over layer 0's values V_0 of the same tokens, so a cache that stores values per
layer holds L - 1 identical copies. Following transformers' cross-layer KV sharing (gemma4: a producer layer stores,
consumer layers reuse), layer 0 keeps a stock `DynamicLayer` / `StaticLayer` and every later layer gets a keys-only
layer whose `values` ARE layer 0's tensor. The caches stay the stock `DynamicCache` / `StaticCache` objects, so
`generate()`'s cache operations (beam reordering, `crop`, batch select/repeat, `torch.compile` on a static cache) work
unchanged. Cross-layer attention (CLA) goes one step further: a layer that attends over an earlier layer's K and V gets
a layer that stores nothing and reads both from its producer. This file is copied next to `config.json` for
`trust_remote_code`, so it imports only torch and transformers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticLayer
from transformers.models.llama.modeling_llama import rotate_half
from transformers.utils import is_torchdynamo_compiling

# ---- which layers' keys and values each layer attends over ----------------------------------------------------------
# The one fact every cache stores by (the dynamic and static caches, the plugin's paged cache, vLLM's): itself for
# both, unless cross-layer attention gives a layer its group's first layer's keys and values, or SVFormer layer 0's
# values.


class KeyValueSource(NamedTuple):
    """The layers whose cached keys and values one layer attends over."""

    keys: int
    values: int


def key_value_sources_of(config: Any) -> list[KeyValueSource]:
    """For each layer of `config`: from the two lists a ResFormer config has (older remote code's too), else (any
    other model) every layer its own. SVFormer's layers attend over V_0: every full-attention layer reads it from the
    first of them (layer 0 of a Llama), a windowed layer keeps its own window of it (those tokens only)."""
    sources = getattr(config, "key_value_source_layers", None)
    if sources is None:
        return [KeyValueSource(layer, layer) for layer in range(getattr(config, "num_hidden_layers", 0) or 0)]
    reads_first = set(getattr(config, "layers_without_value_projection", None) or ())
    types = getattr(config, "layer_types", None) or ["full_attention"] * len(sources)
    full = [layer for layer, kind in enumerate(types) if kind == "full_attention"]
    return [KeyValueSource(keys=source, values=full[0] if layer in reads_first and layer in full else source)
            for layer, source in enumerate(sources)]


# ---- cross-layer attention ------------------------------------------------------------------------------------------
# Cross-layer attention (CLA, Brandon et al., 2024), the KV-sharing baseline the paper compares SVFormer with: with
# `cross_layer_attention=g`, each group of g consecutive layers attends over the keys and values of its first layer
# (the producer), after RoPE and, with a cache, including every cached token. The other layers (consumers) have no
# `k_proj` / `v_proj` and no cache entries of their own (`SharedKeysValues*Layer` below). The producer hands its K and
# V to the next layer through the decoder loop, as positional tensors (reentrant checkpointing propagates them).


def shared_keys_values_queries(
    attention: nn.Module,
    hidden_states: torch.Tensor,
    shared_keys_values: tuple[torch.Tensor | None, torch.Tensor | None],
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """A consumer layer's own queries ([B, H_q, T, D]) as its attention makes them (the base's q norm, RoPE unless the
    layer has none), after checking that the producer's keys and values were handed to it."""
    if shared_keys_values[0] is None or shared_keys_values[1] is None:
        raise ValueError(
            f"Layer {attention.layer_idx} attends over an earlier layer's keys and values (cross_layer_attention), "
            "but none were handed to it: run the whole decoder stack, not this layer alone."
        )
    hidden_shape = (*hidden_states.shape[:-1], -1, attention.head_dim)
    query_states = attention.normed(attention.q_proj(hidden_states), attention.q_norm, hidden_shape)
    if attention.rotate is None:
        return query_states
    cos, sin = position_embeddings
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return ((query_states * cos) + (rotate_half(query_states) * sin)).to(query_states.dtype)  # as the attention


def share_key_value_projections(attention: nn.Module, config) -> None:
    """Set up `attention` for cross-layer attention: a consumer (`reads_shared_keys_values`) loses `k_proj` and
    `v_proj`; a layer whose next layer reads its K and V `hands_on_keys_values`."""
    sources, layer = config.key_value_source_layers, attention.layer_idx
    attention.reads_shared_keys_values = sources[layer] != layer
    attention.hands_on_keys_values = layer + 1 < len(sources) and sources[layer + 1] == sources[layer]
    if attention.reads_shared_keys_values:
        attention.k_proj = attention.v_proj = None



# ---- the caches -----------------------------------------------------------------------------------------------------


class _ReadsProducerValues:
    """Mixin for a cache layer that stores keys only and reads its values from a producer layer.

    The method bodies below restate transformers 5.23's `DynamicLayer` / `StaticLayer` methods (cache_utils.py) for
    keys only; each says which one it follows, so a transformers upgrade knows what to re-check.

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

    def offload(self) -> None:  # follows DynamicLayer.offload, keys only
        if self.is_initialized:
            self.keys = self.keys.to("cpu", non_blocking=True)

    def prefetch(self) -> None:  # follows DynamicLayer.prefetch, keys only
        if self.is_initialized and self.keys.device != self.device:
            self.keys = self.keys.to(self.device, non_blocking=True)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # follows DynamicLayer.reorder_cache, keys only
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
        """Crop the keys by the installed release's own `DynamicLayer.crop`, run on a stand-in that holds them.

        The rules differ across releases (5.19 reads a positive value as the length to keep, later ones refuse it), and
        `Cache.crop` crops the producer (layer 0) first: applying the very same rules here means a crop the producer
        accepted never fails half-way through the cache, and one it refused never reaches this layer."""
        if not self.is_initialized:
            return
        stand_in = DynamicLayer()
        stand_in.keys = stand_in.values = self.keys
        stand_in.is_initialized = True
        DynamicLayer.crop(stand_in, tokens_to_remove)
        self.keys = stand_in.keys

    def batch_repeat_interleave(self, repeats: int) -> None:  # follows DynamicLayer.batch_repeat_interleave
        if self.get_seq_length() > 0:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:  # follows DynamicLayer.batch_select_indices
        if self.get_seq_length() > 0:
            self.keys = self.keys[indices, ...]


class SharedValuesStaticLayer(_ReadsProducerValues, StaticLayer):
    """A `StaticLayer` that preallocates keys only and returns the producer layer's static value buffer."""

    def __init__(self, values_from: StaticLayer, max_cache_len: int, **kwargs: Any):
        self.values_from = values_from
        super().__init__(max_cache_len=max_cache_len, **kwargs)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        # follows StaticLayer.lazy_initialization (buffer layout, mark_static_address for torch.compile), keys only
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim = key_states.shape[-1]
        self.v_head_dim = value_states.shape[-1] if value_states is not None else self.k_head_dim
        self.keys = torch.zeros(
            (self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not is_torchdynamo_compiling():
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.cumulative_length)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the keys in place; `value_states` was already written by the producer and is not stored again.

        Follows `StaticLayer.update` (cumulative_length bookkeeping, index_copy_ with the MPS fallback), keys only."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache_position = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        self.cumulative_length.add_(key_states.shape[-2])
        try:
            self.keys.index_copy_(2, cache_position, key_states)
        except NotImplementedError:  # e.g. MPS, as in `StaticLayer.update`
            self.keys[:, :, cache_position] = key_states
        return self.keys, self.values_from.values

    def reset(self) -> None:  # follows StaticLayer.reset, keys only
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


def share_first_layer_values(cache: Cache, sources: list[KeyValueSource] | None = None) -> Cache:
    """Make every SVFormer layer whose `sources` entry names another layer's values (the first full-attention layer;
    None: layer 0, for every layer) store keys only and read that layer's values, in an empty cache; returns `cache`.

    Only stock full-attention layers (`DynamicLayer`, `StaticLayer`) of a cache that holds no tokens yet and is not
    offloaded are replaced (offloading moves the producer's values to the CPU while later layers still need them); any
    other cache (and layer) is returned unchanged and stays correct, just without the saving.
    """
    layers = getattr(cache, "layers", None)
    if not layers or getattr(cache, "offloading", False) or cache.get_seq_length() > 0:
        return cache
    sources = sources or [KeyValueSource(index, 0) for index in range(len(layers))]
    for index, source in enumerate(sources[: len(layers)]):
        replacement = None if source.values == index else _shared_values_layer(layers[index], layers[source.values])
        if replacement is None:
            continue
        if layers[index].is_initialized:  # early-initialised (e.g. for chunked prefill): keep it so, keys only
            replacement.lazy_initialization(layers[index].keys, layers[index].values)
        layers[index] = replacement
    return cache


def new_dynamic_cache(config: Any) -> DynamicCache:
    """The `DynamicCache` a model with `config` uses by default: values stored once when layers reuse V_0
    (SVFormer), keys and values once per layer group with cross-layer attention."""
    return share_cache_storage(DynamicCache(config=config), config)


class _ReadsProducerKeysValues:
    """Mixin for the cache layer of a layer that attends over an earlier layer's keys and values (cross-layer
    attention): it stores nothing; its keys, values, length and state are the producer's.

    The model hands a consuming layer its producer's K and V directly and never updates this layer, so every cache
    operation (reorder, crop, select, reset, offload) is the producer's to do and a no-op here. Assignments that the
    base classes make on init (`None`, `False`, a fresh counter) are ignored.
    """

    keys_values_from: DynamicLayer | StaticLayer
    supports_early_init = False  # `Cache.early_initialization` must not allocate buffers for it

    def _from_producer(name: str):  # noqa: N805  (a property factory used in the class body)
        def read(self):
            return getattr(self.keys_values_from, name)

        def write(self, value) -> None:  # the base classes' initial assignments; anything else is a bug
            if value is not None and value is not False and name != "cumulative_length":
                raise AttributeError(f"{type(self).__name__} stores nothing; its {name} are the producer layer's.")

        return property(read, write)

    keys = _from_producer("keys")
    values = _from_producer("values")
    is_initialized = _from_producer("is_initialized")
    cumulative_length = _from_producer("cumulative_length")
    del _from_producer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        pass

    def update(self, key_states=None, value_states=None, *args: Any, **kwargs: Any):
        """Store nothing; the producer's keys and values (already updated by the producer in this forward pass)."""
        return self.keys_values_from.keys, self.keys_values_from.values

    def get_seq_length(self) -> int:
        return self.keys_values_from.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys_values_from.get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return self.keys_values_from.get_max_length()

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        pass

    def crop(self, tokens_to_remove: int) -> None:
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(keys_values_from={type(self.keys_values_from).__name__})"


class SharedKeysValuesDynamicLayer(_ReadsProducerKeysValues, DynamicLayer):
    """The dynamic cache layer of a cross-layer-attention consumer: nothing stored, the producer's K and V."""

    def __init__(self, keys_values_from: DynamicLayer, **kwargs: Any):
        self.keys_values_from = keys_values_from
        super().__init__(**kwargs)


class SharedKeysValuesStaticLayer(_ReadsProducerKeysValues, StaticLayer):
    """The static cache layer of a cross-layer-attention consumer: no buffer, no counter, the producer's."""

    def __init__(self, keys_values_from: StaticLayer, **kwargs: Any):
        self.keys_values_from = keys_values_from
        super().__init__(max_cache_len=keys_values_from.max_cache_len, **kwargs)


_DYNAMIC_PRODUCERS = (DynamicLayer, SharedValuesDynamicLayer)
_STATIC_PRODUCERS = (StaticLayer, SharedValuesStaticLayer)


def share_cross_layer_keys_values(cache: Cache, source_layers: list[int]) -> Cache:
    """Make every layer whose `source_layers` entry names an earlier layer (cross-layer attention) read that layer's
    cache; returns `cache`. Like `share_first_layer_values`, only stock full-attention layers of an empty, not
    offloaded cache are replaced; any other cache stays correct (the model never reads a consumer's cache layer)."""
    layers = getattr(cache, "layers", None)
    if not layers or getattr(cache, "offloading", False) or cache.get_seq_length() > 0:
        return cache
    for index, source in enumerate(source_layers[: len(layers)]):
        if source == index:
            continue
        producer, layer = layers[source], layers[index]
        if type(producer) in _DYNAMIC_PRODUCERS and isinstance(layer, DynamicLayer) and type(layer) in (
            *_DYNAMIC_PRODUCERS, SharedKeysValuesDynamicLayer
        ):
            layers[index] = SharedKeysValuesDynamicLayer(keys_values_from=producer)
        elif type(producer) in _STATIC_PRODUCERS and type(layer) in _STATIC_PRODUCERS and (
            layer.max_cache_len == producer.max_cache_len
        ):
            layers[index] = SharedKeysValuesStaticLayer(keys_values_from=producer)
    return cache


def share_cache_storage(cache: Cache, config: Any) -> Cache:
    """Store in `cache` only what a model with `config` needs: V_0 once (SVFormer), K and V once per layer group
    (cross-layer attention), or both; returns `cache`."""
    sources = key_value_sources_of(config)
    if any(source.values != source.keys for source in sources):  # SVFormer: V_0 once, its own keys
        share_first_layer_values(cache, sources)
    if any(source.keys != layer for layer, source in enumerate(sources)):
        share_cross_layer_keys_values(cache, [source.keys for source in sources])
    return cache


__all__ = [
    "SharedKeysValuesDynamicLayer",
    "SharedKeysValuesStaticLayer",
    "SharedValuesDynamicLayer",
    "SharedValuesStaticLayer",
    "new_dynamic_cache",
    "share_cache_storage",
    "share_cross_layer_keys_values",
    "share_first_layer_values",
]
