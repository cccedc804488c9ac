"""The KV-cache saving each cache-sharing model should reach, one table for both serving benchmarks (HF continuous
batching, vLLM): its config fields, and its bytes per cached token over a same-size Llama's, as the formula the
reports print and as a function of the layer count L. Plain Python: `bench_vllm` imports it in vLLM's virtualenv too.
"""

from __future__ import annotations

KV_CACHE_SHARES = {
    "svformer": (dict(value_residual="svformer"), "(L+1)/(2L)", lambda layers: (layers + 1) / (2 * layers)),
    "cla2": (dict(value_residual="none", cross_layer_attention=2), "1/2", lambda layers: 0.5),
    "svformer_cla2": (dict(value_residual="svformer", cross_layer_attention=2), "(L/2+1)/(2L)",
                      lambda layers: (layers / 2 + 1) / (2 * layers)),
}
