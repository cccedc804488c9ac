"""How many bytes a KV cache really holds: `cache_nbytes`, for any transformers cache and any model.

Counts the storages behind every tensor a cache holds, each storage once (SVFormer's layers n >= 1 read layer 0's
value tensor, views share storage). Quantized caches (`cache_implementation="quantized"`, optimum-quanto or HQQ) hold
packed integers plus per-group scales and zero points, in tensor subclasses or (tensor, metadata) pairs, and a
full-precision residual window: a tensor subclass is counted through the plain tensors it is made of (PyTorch's
`__tensor_flatten__` protocol), never by its logical size, so a 4-bit cache counts about a quarter of a float32 one.

Not part of the remote code (the model never needs it), so it may grow with the caches it has to understand.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def _plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """`tensor` itself, or for a wrapper subclass (quanto's `QTensor`, torchao's tensors) the plain tensors inside."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        yield tensor
        return
    inner_names, _ = tensor.__tensor_flatten__()
    for name in inner_names:
        yield from _plain_tensors(getattr(tensor, name))


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield from _plain_tensors(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


def _cache_tensors(cache: Any) -> Iterator[torch.Tensor]:
    """Every tensor a cache holds: each layer's keys/values (also when they are properties) and other tensor state
    (quantized keys and values, their scales, position counters)."""
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

    Works for any transformers cache (`DynamicCache`, `StaticCache`, `QuantizedCache` with quanto or HQQ,
    encoder-decoder caches; Llama's as well as ResFormer's), so SVFormer's saving can be compared with a Llama of the
    same shape. Counts whole storages: a cropped dynamic cache still holds its pre-crop storage until the next update,
    and a static layer also holds its small position counter.
    """
    sizes: dict[tuple[str, int], int] = {}
    for tensor in _cache_tensors(past_key_values):
        try:
            storage = tensor.untyped_storage()
            key, size = (str(tensor.device), storage.data_ptr()), storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):  # tensors without one plain storage
            key, size = ("id", id(tensor)), tensor.numel() * tensor.element_size()
        if size and key[1] == 0:  # data_ptr 0 is shared by empty storages only; never merge real ones on it
            key = ("id", id(tensor))
        sizes[key] = max(sizes.get(key, 0), size)
    return sum(sizes.values())


__all__ = ["cache_nbytes"]
