"""Continuous batching (`model.generate_batch`, transformers' paged-attention engine) gives `generate()`'s greedy
tokens for every variant, λ moved off their initial values, prompts of mixed lengths in one batch; a Llama of the
same shape is the control. Runs on the oldest supported transformers too (README, "Run the tests").

SVFormer's values are stored once in the paged cache (`resformer_hf.paged_cache`): its tokens are checked with
pages of 8 tokens too, so requests span many blocks, and the cache of one size holds 2L/(L+1) times a Llama's tokens.

The paged cache is sized explicitly: on CPU, 5.19 otherwise sizes it from the machine's memory (and was killed for
memory). On 5.19-5.23 the engine hands its paged cache to the attention function under the name that is the layer's
cache argument on 5.24 (`_compat.update_cache` hands it back); the 5.19 run of this file is what catches that.
"""

from __future__ import annotations

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaForCausalLM
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.distributed import DistributedHelper

from resformer_hf.configuration_resformer import VARIANTS
from resformer_hf.paged_cache import FirstLayerValuesAllocator

from helpers import llama_config_like, randomised_model, tiny_config

PROMPT_LENGTHS = (3, 17, 41, 9, 26)
NEW_TOKENS = 6
#: 16 blocks of the default block size: thousands of tokens for these prompts, a few MB for the tiny model.
CB_CONFIG = dict(num_blocks=16, max_batch_tokens=64)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]


def _greedy() -> GenerationConfig:
    # No EOS: every request generates exactly NEW_TOKENS tokens, so no comparison is cut short.
    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)


def generate_one_by_one(model, prompts: list[list[int]]) -> list[list[int]]:
    """The reference: `generate()` on each prompt alone (no padding)."""
    return [model.generate(torch.tensor([p]), generation_config=_greedy())[0, len(p):].tolist() for p in prompts]


def generate_continuously(model, prompts: list[list[int]], **cb_config) -> list[list[int]]:
    """All prompts in one `generate_batch` call, in prompt order."""
    outputs = model.generate_batch(prompts, generation_config=_greedy(),
                                   continuous_batching_config=ContinuousBatchingConfig(**{**CB_CONFIG, **cb_config}))
    by_index = {int(request_id.rsplit("_", 1)[1]): output for request_id, output in outputs.items()}
    assert sorted(by_index) == list(range(len(prompts))), list(outputs)
    return [list(by_index[index].generated_tokens) for index in range(len(prompts))]


def sharpened(model):
    """`model` with its query and key projections scaled ×4 (scores ×16): a tiny random model's attention is nearly
    uniform, so greedy tokens barely depend on which keys and values a cache returns; sharpened, they do (a paged
    cache that hands a layer another layer's keys changes the tokens)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_generate_batch_gives_generates_greedy_tokens(variant):
    torch.manual_seed(0)
    model = sharpened(randomised_model(variant))
    prompts = _prompts()
    expected = generate_one_by_one(model, prompts)
    assert generate_continuously(model, prompts) == expected


def test_llama_control_and_the_variants_differ():
    """The Llama control batches the same way, and its tokens are not the ResFormer's: the comparison above would
    see a continuous-batching path that dropped the value residual."""
    torch.manual_seed(0)
    resformer = sharpened(randomised_model("svformer"))
    llama = sharpened(LlamaForCausalLM(llama_config_like(tiny_config("svformer"))).eval())
    prompts = _prompts()
    expected = generate_one_by_one(llama, prompts)
    assert generate_continuously(llama, prompts) == expected
    assert expected != generate_one_by_one(resformer, prompts)


def test_svformer_with_small_pages_spanning_many_blocks():
    torch.manual_seed(0)
    model = sharpened(randomised_model("svformer"))
    prompts = _prompts()
    assert generate_continuously(model, prompts, page_size=8) == generate_one_by_one(model, prompts)


def _paged_cache(config) -> PagedAttentionCache:
    """The paged cache continuous batching builds for `config` (the engine's own constructor call)."""
    cb_config = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=64, max_memory_percent=0.5, page_size=16)
    return PagedAttentionCache(config, cb_config, "cpu", DistributedHelper(None, None), dtype=torch.float32)


def test_svformer_paged_cache_holds_its_values_once():
    """One byte budget (num_blocks counts a Llama's blocks) holds 2L/(L+1) times the tokens; keys per layer,
    one values page per block that every layer reads."""
    svformer, llama = tiny_config("svformer"), llama_config_like(tiny_config("svformer"))
    layers = svformer.num_hidden_layers
    (sv_allocator,), (llama_allocator,) = (list(_paged_cache(c).cache_allocators.values()) for c in (svformer, llama))
    assert isinstance(sv_allocator, FirstLayerValuesAllocator) and sv_allocator.values_once
    assert not llama_allocator.values_once
    sv_bytes_per_token = sv_allocator.bytes_per_block / sv_allocator.tokens_per_page
    llama_bytes_per_token = llama_allocator.bytes_per_block / llama_allocator.tokens_per_page
    assert sv_bytes_per_token / llama_bytes_per_token == (layers + 1) / (2 * layers)
    token_ratio = sv_allocator.num_blocks / llama_allocator.num_blocks
    assert abs(token_ratio - 2 * layers / (layers + 1)) < 1 / llama_allocator.num_blocks + 1e-9
    values = {v.data_ptr() for _, v in sv_allocator._kv_token_views.values()}
    keys = {k.data_ptr() for k, _ in sv_allocator._kv_token_views.values()}
    assert len(values) == 1 and len(keys) == layers and not values & keys
