"""Quantized KV caches (`cache_implementation="quantized"`, optimum-quanto and HQQ) under ResFormer and SVFormer, with
a plain Llama of the same weights as the control, and `cache_nbytes` counting what such a cache really holds.

Reference for the bytes: the quantizer's documented layout, worked out by hand — `nbits` per element packed into
bytes, a float32 scale and zero point per group of `q_group_size` elements, and the last tokens (fewer than
`residual_length`) kept in full precision — never the cache's own attributes.
"""

from __future__ import annotations

import pytest
import torch

from resformer_hf import ResFormerForCausalLM, cache_nbytes
from resformer_hf.remote_code._compat import cache_of, with_cache

from helpers import llama_pair, tiny_config

PROMPT, NEW_TOKENS, GROUP, RESIDUAL = 40, 8, 64, 16
BACKEND_MODULES = {"quanto": "optimum.quanto", "hqq": "hqq"}


def quantized_generate(model, input_ids, backend: str, nbits: int):
    config = {"backend": backend, "nbits": nbits, "q_group_size": GROUP, "residual_length": RESIDUAL}
    return model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="quantized",
                          cache_config=config, return_dict_in_generate=True)


def expected_bytes(config, batch: int, nbits: int) -> int:
    """Keys and values of every layer: the prompt quantized at prefill, the decoded tokens (fewer than
    `residual_length`, so never re-quantized) in float32."""
    heads, head_dim = config.num_key_value_heads, config.head_dim
    quantized = batch * heads * PROMPT * head_dim
    packed = quantized * nbits // 8 + 2 * (quantized // GROUP) * 4  # data + float32 scale and zero point per group
    residual = batch * heads * (NEW_TOKENS - 1) * head_dim * 4
    return 2 * config.num_hidden_layers * (packed + residual)


@pytest.mark.parametrize("nbits", [2, 4])
@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_quantized_cache_generates_like_llama_and_counts_its_packed_bytes(backend, nbits):
    pytest.importorskip(BACKEND_MODULES[backend], reason=f"the {backend} backend is in the `clients` extra")
    llama, resformer = llama_pair("learnable_plus")
    input_ids = torch.randint(3, 128, (2, PROMPT))
    theirs = quantized_generate(llama, input_ids, backend, nbits)
    ours = quantized_generate(resformer, input_ids, backend, nbits)
    assert torch.equal(ours.sequences, theirs.sequences)
    expected = expected_bytes(resformer.config, 2, nbits)
    assert cache_nbytes(cache_of(theirs)) == cache_nbytes(cache_of(ours)) == expected

    full = resformer.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
    assert cache_nbytes(cache_of(full)) > 2.5 * expected  # float32 for every token


#: |logits after a 4-bit prefill − exact logits| of these tiny models: measured 0.003-0.012 (quanto and hqq, SVFormer
#: and dense); a prefill cache of another prompt moves them by 0.06-0.11, so 0.02 tells the two apart.
QUANTIZED_LOGITS_ATOL = 0.02


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_svformer_dense_and_gated_run_with_a_quantized_cache(backend):
    """A quantized cache stores values per layer (no sharing for SVFormer) and holds the packed size; decoding on a
    4-bit prefill stays within the measured 4-bit error of the uncached logits, and a wrong prefill does not."""
    pytest.importorskip(BACKEND_MODULES[backend], reason=f"the {backend} backend is in the `clients` extra")
    input_ids = torch.randint(3, 128, (1, PROMPT))
    other_prompt = torch.randint(3, 128, (1, PROMPT))
    for variant in ("svformer", "dense", "gated"):
        model = ResFormerForCausalLM(tiny_config(variant)).eval()
        out = quantized_generate(model, input_ids, backend, 4)
        assert out.sequences.shape == (1, PROMPT + NEW_TOKENS)
        assert cache_nbytes(cache_of(out)) == expected_bytes(model.config, 1, 4)
        continuation = out.sequences[:, PROMPT:-1]
        with torch.no_grad():
            exact = model(out.sequences[:, :-1]).logits[:, PROMPT:]
            cached = model(continuation, **with_cache(quantized_prefill(model, input_ids, backend))).logits
            wrong = model(continuation, **with_cache(quantized_prefill(model, other_prompt, backend))).logits
        assert (cached - exact).abs().max().item() <= QUANTIZED_LOGITS_ATOL, (variant, (cached - exact).abs().max())
        assert (wrong - exact).abs().max().item() > 2 * QUANTIZED_LOGITS_ATOL, (variant, (wrong - exact).abs().max())


def quantized_prefill(model, input_ids, backend):
    from transformers import QuantizedCache

    cache = QuantizedCache(backend=backend, config=model.config, nbits=4, q_group_size=GROUP,
                           residual_length=RESIDUAL)
    with torch.no_grad():
        model(input_ids, **with_cache(cache), use_cache=True)
    return cache
