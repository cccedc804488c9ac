"""Continuous batching (`model.generate_batch`, transformers' paged-attention engine) gives `generate()`'s greedy
tokens for every variant, λ moved off their initial values, prompts of mixed lengths in one batch; a Llama of the
same shape is the control. Runs on the oldest supported transformers too (README, "Run the tests").

The paged cache gives pages only to the layers that store keys or values (`integrations/paged_cache.py`): SVFormer's
values once, cross-layer attention's K and V once per group, both combined. Their tokens are checked with pages of 8
tokens too, so requests span many blocks, and their bytes per cached token exactly, against a Llama's.

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

from resformer_hf.integrations.paged_cache import StoredKeysValuesAllocator
from resformer_hf.remote_code.variants import VARIANTS

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
    """The reference: `generate()` on each prompt alone (no padding). Without the model's own EOS: `generate()` takes
    the model's value for an EOS the generation config leaves unset, continuous batching does not."""
    model.generation_config.eos_token_id = None
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
            if layer.self_attn.k_proj is not None:  # cross-layer attention's consumers have none
                layer.self_attn.k_proj.weight.mul_(4)
    return model


#: Cross-layer attention with each variant it combines with (CLA3 at L = 4: groups of 3 and 1 layers).
CLA = {
    "cla2": dict(value_residual="none", cross_layer_attention=2),
    "cla3": dict(value_residual="none", cross_layer_attention=3),
    "svformer_cla2": dict(value_residual="svformer", cross_layer_attention=2),
    "denseformer_cla2": dict(value_residual="denseformer", cross_layer_attention=2, denseformer_dilation=2),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_generate_batch_gives_generates_greedy_tokens(variant):
    torch.manual_seed(0)
    model = sharpened(randomised_model(variant))
    prompts = _prompts()
    expected = generate_one_by_one(model, prompts)
    assert generate_continuously(model, prompts) == expected


@pytest.mark.parametrize(("variant", "layout"), [("learnable_plus", "alternating"), ("none", [0, 2])])
def test_value_embeddings_in_pages_give_generates_greedy_tokens(variant, layout):
    """Value embeddings (issue 56): every layer pages V' + g·E[token]; tables and gates random, so they count."""
    torch.manual_seed(0)
    model = sharpened(randomised_model(variant, value_embeddings=layout))
    with torch.no_grad():
        for parameter in (p for name, p in model.named_parameters() if ".value_embedding" in name):
            parameter.normal_(0.0, 0.5)
    prompts = _prompts()
    expected = generate_one_by_one(model, prompts)
    assert generate_continuously(model, prompts) == expected


@pytest.mark.parametrize("case", CLA)
def test_cross_layer_attention_in_pages_of_its_producers_gives_generates_greedy_tokens(case):
    """Consumers read (and rewrite) their producer's pages, also with pages of 8 tokens (requests span blocks)."""
    fields = dict(CLA[case])
    torch.manual_seed(0)
    model = sharpened(randomised_model(fields.pop("value_residual"), **fields))
    prompts = _prompts()
    expected = generate_one_by_one(model, prompts)
    assert generate_continuously(model, prompts) == expected
    assert generate_continuously(model, prompts, page_size=8) == expected


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
    assert isinstance(sv_allocator, StoredKeysValuesAllocator) and sv_allocator.values_once
    assert not llama_allocator.values_once
    sv_bytes_per_token = sv_allocator.bytes_per_block / sv_allocator.tokens_per_page
    llama_bytes_per_token = llama_allocator.bytes_per_block / llama_allocator.tokens_per_page
    assert sv_bytes_per_token / llama_bytes_per_token == (layers + 1) / (2 * layers)
    token_ratio = sv_allocator.num_blocks / llama_allocator.num_blocks
    assert abs(token_ratio - 2 * layers / (layers + 1)) < 1 / llama_allocator.num_blocks + 1e-9
    values = {v.data_ptr() for _, v in sv_allocator._kv_token_views.values()}
    keys = {k.data_ptr() for k, _ in sv_allocator._kv_token_views.values()}
    assert len(values) == 1 and len(keys) == layers and not values & keys


def test_stock_allocator_gives_the_same_tokens_with_a_page_per_layer(monkeypatch):
    """Remote code without the plugin gets transformers' own allocator: consumers write their producer's K and V into
    pages of their own, and the tokens are the same."""
    from transformers.generation.continuous_batching import cache as paged_cache_module
    from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

    for key, allocator in dict(paged_cache_module.ATTN_TYPE_TO_ALLOCATOR).items():
        if allocator is StoredKeysValuesAllocator:
            monkeypatch.setitem(paged_cache_module.ATTN_TYPE_TO_ALLOCATOR, key, FullAttentionCacheAllocator)
    fields = dict(CLA["svformer_cla2"])
    torch.manual_seed(0)
    model = sharpened(randomised_model(fields.pop("value_residual"), **fields))
    (allocator,) = _paged_cache(model.config).cache_allocators.values()
    assert type(allocator) is FullAttentionCacheAllocator and allocator.pages_per_block == 4
    prompts = _prompts()
    assert generate_continuously(model, prompts) == generate_one_by_one(model, prompts)


#: (fields, layers, bytes per cached token with 2 kv heads × head dim 8 in float32, share of the Llama's 16·L·2·8/4)
PAGED_BYTES = {
    "cla2": (CLA["cla2"], 4, 256, 1 / 2),
    "cla3": (CLA["cla3"], 4, 256, 1 / 2),  # groups [0, 1, 2], [3]: two producers
    "svformer_cla2": (CLA["svformer_cla2"], 4, 192, 3 / 8),  # (L/2 + 1)/(2L)
    "cla2_8": (CLA["cla2"], 8, 512, 1 / 2),
    "svformer_cla2_8": (CLA["svformer_cla2"], 8, 320, 5 / 16),
    "svformer_8": (dict(value_residual="svformer"), 8, 576, 9 / 16),  # (L + 1)/(2L)
}


@pytest.mark.parametrize("case", PAGED_BYTES)
def test_paged_cache_gives_pages_only_to_layers_that_store_keys_or_values(case):
    """Exact bytes per cached token against a Llama of the same shape; one byte budget holds the inverse ratio of
    tokens; every consumer's pages are its producer's (the same storage)."""
    fields, layers, expected_bytes, share = PAGED_BYTES[case]
    config = tiny_config(**{**fields, "num_hidden_layers": layers})
    llama = llama_config_like(config)
    (allocator,), (llama_allocator,) = (list(_paged_cache(c).cache_allocators.values()) for c in (config, llama))
    bytes_per_token = allocator.bytes_per_block / allocator.tokens_per_page
    llama_bytes_per_token = llama_allocator.bytes_per_block / llama_allocator.tokens_per_page
    assert (bytes_per_token, llama_bytes_per_token) == (expected_bytes, layers * 2 * 2 * 8 * 4)
    assert bytes_per_token / llama_bytes_per_token == share
    assert abs(allocator.num_blocks / llama_allocator.num_blocks - 1 / share) < 1 / llama_allocator.num_blocks + 1e-9
    sources = config.key_value_source_layers
    views = allocator._kv_token_views
    assert sorted(views) == list(range(layers))
    for layer in range(layers):
        assert views[layer][0].data_ptr() == views[sources[layer]][0].data_ptr()
    assert len({keys.data_ptr() for keys, _ in views.values()}) == len(set(sources))


@pytest.mark.parametrize("case", ["cla2", "cla3", "svformer_cla2", "svformer_8"])
def test_block_table_pages_are_what_the_producer_wrote(case):
    """The block-table path (what flash paged attention reads, `get_cache_for_block_table`, on a GPU): every layer's
    page views show the keys and values its producer (for SVFormer's values: layer 0) wrote through the token path,
    at the page and row the block table gives."""
    fields, layers, _, _ = PAGED_BYTES[case]
    config = tiny_config(**{**fields, "num_hidden_layers": layers})
    (allocator,) = _paged_cache(config).cache_allocators.values()
    page, stride = allocator.tokens_per_page, allocator.block_physical_stride // allocator.tokens_per_page
    sources = config.key_value_source_layers
    values_from = {layer: 0 if allocator.values_once else sources[layer] for layer in range(layers)}
    # Tokens at two rows of block 0 and one of block 3 (the block table's entry for block b is b × stride).
    blocks_rows = [(0, 0), (0, page - 1), (3, 5)]
    write_index = torch.tensor([block * allocator.block_physical_stride + row for block, row in blocks_rows])
    written = {}
    generator = torch.Generator().manual_seed(0)
    first_values = torch.randn(len(blocks_rows), config.num_key_value_heads, config.head_dim, generator=generator)
    for producer in sorted(set(sources)):
        keys, values = (torch.randn(len(blocks_rows), config.num_key_value_heads, config.head_dim,
                                    generator=generator) for _ in range(2))
        values = first_values if allocator.values_once else values  # SVFormer's layers all write V_0
        allocator.update(keys, values, producer, torch.tensor([], dtype=torch.long), write_index)
        written[producer] = (keys, values)
    for layer in range(layers):
        k_pages, v_pages = allocator.get_cache_for_block_table(layer)
        for token, (block, row) in enumerate(blocks_rows):
            where = (layer, block, row)
            assert torch.equal(k_pages[block * stride, row], written[sources[layer]][0][token]), where
            assert torch.equal(v_pages[block * stride, row], written[values_from[layer]][1][token]), where
