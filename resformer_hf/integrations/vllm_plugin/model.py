"""The model vLLM serves for `architectures: ["ResFormerForCausalLM"]` once this plugin is installed.

It is vLLM's Transformers modeling backend (`TransformersForCausalLM`: the plugin's own modeling code, vLLM's paged
attention, weight loading and sampling), so every variant serves exactly as with `model_impl="transformers"`. Two
cache savings on top:

- cross-layer attention (`cross_layer_attention`): each consumer layer's vLLM `Attention` is built with vLLM's own
  cross-layer KV sharing (`kv_sharing_target_layer_name`, its producer's layer), so vLLM gives it no cache pages and
  binds it to its producer's; it writes nothing and attends over the producer's K and V. That is vLLM's generic
  mechanism (the model runner and every attention backend honour it), on its CPU and GPU builds alike.
- SVFormer on vLLM's CPU backend: the attention layers become `SharedValuesAttention` plus one value store: keys per
  storing layer, values once (see `attention.py`). Elsewhere a warning, and every storing layer keeps K and V.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.logger import init_logger
from vllm.model_executor.models.transformers import TransformersForCausalLM
from vllm.model_executor.models.transformers.base import VLLM_ATTN_ATTR
from vllm.model_executor.models.utils import maybe_prefix
from vllm.platforms import current_platform

from ...remote_code.cache_resformer import key_value_sources_of

logger = init_logger(__name__)

#: Name of the value store in vLLM's layer registry. vLLM orders KV caches by the one integer in a layer's name, so
#: the store is numbered after the last decoder layer.
VALUE_STORE_NAME = "model.value_store.{index}.attn"


def stores_values_once(config, cache_dtype: str) -> bool:
    """Whether this config is an SVFormer (every layer n >= 1 attends over layer 0's values) whose values vLLM can
    store once here: on vLLM's CPU backend, with an unquantized cache (a quantized one scales V per layer)."""
    sources = key_value_sources_of(config)
    if len(sources) < 2 or any(source.values != 0 for source in sources[1:]):
        return False
    if not current_platform.is_cpu() or cache_dtype != "auto":
        logger.warning_once(
            "SVFormer: values are stored once only on vLLM's CPU backend with kv_cache_dtype='auto' so far; here "
            "(%s, kv_cache_dtype=%r) every layer keeps its own K and V pages (same tokens, a Llama-size cache).",
            current_platform.device_name, cache_dtype)
        return False
    return True


def sharing_keys_values(attention_class: type, targets: dict[str, str]) -> Callable:
    """Builds `attention_class` as the Transformers backend does, with vLLM's `kv_sharing_target_layer_name` set for
    the layers named in `targets` (consumer layer name -> its producer's)."""
    def build(**kwargs):
        return attention_class(**kwargs, kv_sharing_target_layer_name=targets.get(kwargs.get("prefix")))

    return build


class ResFormerForCausalLM(TransformersForCausalLM):
    """vLLM's Transformers backend for ResFormer: cross-layer attention's consumers share their producer's KV cache,
    an SVFormer stores keys per layer and layer 0's values once."""

    _kv_sharing_targets: dict[str, str] = {}

    def _get_attn_cls(self):
        if stores_values_once(self.text_config, self.cache_config.cache_dtype):
            from .attention import SharedValuesAttention

            attention_class = SharedValuesAttention
        else:
            attention_class = super()._get_attn_cls()
        if not self._kv_sharing_targets:
            return attention_class
        return sharing_keys_values(attention_class, self._kv_sharing_targets)

    def _create_attention_instances(self, prefix: str = "") -> None:
        sources = [source.keys for source in key_value_sources_of(self.text_config)]
        names = {layer: maybe_prefix(prefix, f"{attention_prefix}.{VLLM_ATTN_ATTR}")
                 for layer, (attention_prefix, _) in self.attention_fusers.items()}
        self._kv_sharing_targets = {names[layer]: names[source] for layer, source in enumerate(sources)
                                    if source != layer and layer in names and source in names}
        super()._create_attention_instances(prefix)
        if not stores_values_once(self.text_config, self.cache_config.cache_dtype):
            return
        from .attention import SharedValuesAttention

        layers = [module for module in self.model.modules() if isinstance(module, SharedValuesAttention)]
        if len(layers) != self.text_config.num_hidden_layers:
            raise RuntimeError(
                f"SVFormer in vLLM: expected {self.text_config.num_hidden_layers} attention layers, found "
                f"{len(layers)} (pipeline parallelism is not supported with values stored once)")
        first = layers[0]
        name = VALUE_STORE_NAME.format(index=self.text_config.num_hidden_layers)
        if prefix:
            name = f"{prefix}.{name}"
        # Same heads, head size and cache dtype as every layer, so all pages share one spec and one block table
        self.value_store = SharedValuesAttention(
            num_heads=first.num_heads, head_size=first.head_size, scale=first.impl.scale,
            num_kv_heads=first.num_kv_heads, cache_config=self.cache_config, quant_config=self.quant_config,
            prefix=name,
        )
        for layer in layers:
            layer.value_store_name = name

