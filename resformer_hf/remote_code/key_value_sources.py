"""Which layers' cached keys and values each layer attends over: the one fact every cache stores by (the dynamic and
static caches, the plugin's paged cache, vLLM's). Itself for both, unless cross-layer attention gives a layer its
group's first layer's keys and values, or SVFormer layer 0's values. Imports nothing but the standard library (copied
for `trust_remote_code`)."""

from __future__ import annotations

from typing import Any, NamedTuple


class KeyValueSource(NamedTuple):
    """The layers whose cached keys and values one layer attends over."""

    keys: int
    values: int


def key_value_sources_of(config: Any) -> list[KeyValueSource]:
    """For each layer of `config`: from the two lists a ResFormer config has (older remote code's too), else (any
    other model) every layer its own."""
    sources = getattr(config, "key_value_source_layers", None)
    if sources is None:
        return [KeyValueSource(layer, layer) for layer in range(getattr(config, "num_hidden_layers", 0) or 0)]
    reads_first = set(getattr(config, "layers_without_value_projection", None) or ())
    return [KeyValueSource(keys=source, values=0 if layer in reads_first else source)
            for layer, source in enumerate(sources)]
