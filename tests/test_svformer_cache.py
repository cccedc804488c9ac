"""SVFormer's cache stores values once: exact byte counts vs the formula and vs Llama, and every cache operation that
generate() uses gives what a model without the trick gives."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig, DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache
from transformers.cache_utils import DynamicLayer

from resformer_hf import ResFormerConfig, ResFormerForCausalLM, cache_nbytes
from resformer_hf.remote_code._compat import cache_of, with_cache
from resformer_hf.remote_code.cache_resformer import share_first_layer_values

from helpers import TINY

LAYERS, HEADS, HEAD_DIM, FLOAT32 = 4, 4, 8, 4
SHAPES = {"mha": dict(num_key_value_heads=4), "gqa": dict(num_key_value_heads=2)}
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def config(variant: str = "svformer", **overrides) -> ResFormerConfig:
    return ResFormerConfig(**{**TINY, "initializer_range": 0.2, "value_residual": variant, **overrides})


def svformer(**overrides) -> ResFormerForCausalLM:
    torch.manual_seed(0)
    return ResFormerForCausalLM(config(**overrides)).eval()


def llama_like(model: ResFormerForCausalLM) -> LlamaForCausalLM:
    """A Llama of the same shape: the baseline whose cache stores K and V for every layer."""
    fields = {k: getattr(model.config, k) for k in TINY}
    return LlamaForCausalLM(LlamaConfig(**fields)).eval()


def kv_bytes(batch: int, kv_heads: int, tokens: int, tensors_per_token: int) -> int:
    """Bytes of `tensors_per_token` float32 [batch, kv_heads, tokens, head_dim] tensors."""
    return batch * kv_heads * tokens * HEAD_DIM * FLOAT32 * tensors_per_token


def assert_values_shared(cache) -> None:
    producer = cache.layers[0].values
    assert all(layer.values is producer for layer in cache.layers[1:])


def decode(model, cache, tokens: torch.Tensor, logits: torch.Tensor, steps: int):
    """Greedy-decode `steps` tokens one at a time through `cache`; returns (sequence, last step's logits)."""
    for _ in range(steps):
        next_token = logits[:, -1:].argmax(-1)
        tokens = torch.cat([tokens, next_token], dim=1)
        logits = model(next_token, **with_cache(cache), use_cache=True).logits
    return tokens, logits[:, -1]


@pytest.mark.parametrize("shape", SHAPES)
def test_dynamic_cache_bytes_follow_the_formula_and_decoding_matches_uncached(shape):
    model = svformer(**SHAPES[shape])
    kv_heads = model.config.num_key_value_heads
    prompt = torch.randint(3, 128, (2, 7))

    out = model(prompt, use_cache=True)
    cache = cache_of(out)
    assert cache_nbytes(cache) == kv_bytes(2, kv_heads, 7, LAYERS + 1)
    assert_values_shared(cache)

    tokens, step_logits = decode(model, cache, prompt, out.logits, steps=5)
    assert cache_nbytes(cache) == kv_bytes(2, kv_heads, 12, LAYERS + 1)
    assert_values_shared(cache)
    uncached = model(tokens, use_cache=False).logits[:, -1]
    assert (step_logits - uncached).abs().max() < 1e-5

    llama = llama_like(model)
    llama_cache = cache_of(llama(tokens, use_cache=True))
    assert cache_nbytes(llama_cache) == kv_bytes(2, kv_heads, 12, 2 * LAYERS)
    assert cache_nbytes(cache) / cache_nbytes(llama_cache) == (LAYERS + 1) / (2 * LAYERS)


def test_the_readme_ratio_at_eight_layers_is_0_5625():
    """The README's number, not only the formula at the suite's 4 layers: 9 tensors per token instead of 16."""
    model = svformer(num_hidden_layers=8)
    prompt = torch.randint(3, 128, (1, 5))
    ours, theirs = (cache_nbytes(cache_of(m.generate(prompt, max_new_tokens=3, return_dict_in_generate=True,
                                                     **GREEDY))) for m in (model, llama_like(model)))
    assert ours == kv_bytes(1, 2, 7, 9) and theirs == kv_bytes(1, 2, 7, 16)
    assert ours / theirs == 0.5625


@pytest.mark.parametrize("shape", SHAPES)
def test_generate_default_and_static_caches_store_values_once_and_match_uncached(shape):
    model = svformer(**SHAPES[shape])
    kv_heads = model.config.num_key_value_heads
    prompt = torch.randint(3, 128, (2, 6))
    uncached = model.generate(prompt, max_new_tokens=10, use_cache=False, **GREEDY)

    dynamic = model.generate(prompt, max_new_tokens=10, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(dynamic.sequences, uncached)
    # The cache holds every token but the last one generated.
    assert cache_nbytes(cache_of(dynamic)) == kv_bytes(2, kv_heads, 15, LAYERS + 1)
    assert_values_shared(cache_of(dynamic))

    static = model.generate(prompt, max_new_tokens=10, cache_implementation="static", return_dict_in_generate=True,
                            **GREEDY)
    assert torch.equal(static.sequences, uncached)
    capacity = cache_of(static).get_max_length()
    assert capacity >= 15
    counters = 8 * LAYERS  # one int64 position counter per static layer
    assert cache_nbytes(cache_of(static)) == kv_bytes(2, kv_heads, capacity, LAYERS + 1) + counters
    assert_values_shared(cache_of(static))

    # Chunked prefill early-initialises the static cache before the first forward; the saving must survive that.
    chunked = model.generate(prompt, max_new_tokens=10, cache_implementation="static", prefill_chunk_size=4,
                             return_dict_in_generate=True, **GREEDY)
    assert torch.equal(chunked.sequences, uncached)
    assert cache_nbytes(cache_of(chunked)) == cache_nbytes(cache_of(static))

    # A cache the caller builds is used as given: the stock layout, same tokens.
    standard = DynamicCache(config=model.config)
    given = model.generate(prompt, max_new_tokens=10, **with_cache(standard), return_dict_in_generate=True,
                           **GREEDY)
    assert torch.equal(given.sequences, uncached)
    assert cache_nbytes(standard) == kv_bytes(2, kv_heads, 15, 2 * LAYERS)


def test_static_cache_bytes_after_prefill_and_decode_against_llama():
    model = svformer()
    llama = llama_like(model)
    prompt = torch.randint(3, 128, (1, 5))
    cache = share_first_layer_values(StaticCache(config=model.config, max_cache_len=16))
    llama_cache = StaticCache(config=llama.config, max_cache_len=16)
    counters = 8 * LAYERS

    model(prompt, **with_cache(cache), use_cache=True)
    llama(prompt, **with_cache(llama_cache), use_cache=True)
    assert cache_nbytes(cache) == kv_bytes(1, 2, 16, LAYERS + 1) + counters
    assert cache_nbytes(llama_cache) == kv_bytes(1, 2, 16, 2 * LAYERS) + counters

    tokens = prompt
    for _ in range(4):
        next_token = torch.randint(3, 128, (1, 1))
        tokens = torch.cat([tokens, next_token], dim=1)
        step = model(next_token, **with_cache(cache), use_cache=True).logits[:, -1]
        llama(next_token, **with_cache(llama_cache), use_cache=True)
    assert int(cache.get_seq_length()) == 9
    assert cache_nbytes(cache) == kv_bytes(1, 2, 16, LAYERS + 1) + counters
    assert cache_nbytes(llama_cache) == kv_bytes(1, 2, 16, 2 * LAYERS) + counters
    assert (step - model(tokens).logits[:, -1]).abs().max() < 1e-5


def equivalent_model_without_the_trick(model: ResFormerForCausalLM) -> ResFormerForCausalLM:
    """`constant` with λ_first = 1, λ_self = 0 attends over exactly V_0 (V_n·0 + V_0·1) but keeps a v_proj in every
    layer, so its values go through the standard cache, one copy per layer."""
    reference = ResFormerForCausalLM(
        config("constant", value_residual_lambda_first=1.0, value_residual_lambda_self=0.0,
               num_key_value_heads=model.config.num_key_value_heads)
    ).eval()
    missing, unexpected = reference.load_state_dict(model.state_dict(), strict=False)
    assert sorted(missing) == [f"model.layers.{n}.self_attn.v_proj.weight" for n in range(1, LAYERS)]
    assert not unexpected
    return reference


def test_beam_search_equals_the_model_without_the_cache_trick():
    model = svformer()
    reference = equivalent_model_without_the_trick(model)
    prompt = torch.randint(3, 128, (2, 5))
    assert torch.equal(model(prompt).logits, reference(prompt).logits)

    kwargs = dict(num_beams=3, num_return_sequences=3, max_new_tokens=8, return_dict_in_generate=True,
                  output_scores=True, **GREEDY)
    ours, theirs = model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert (ours.sequences_scores - theirs.sequences_scores).abs().max() < 1e-5
    # Beam search reordered both caches; ours still shares one value tensor and is (L+1)/(2L) of the reference's.
    assert_values_shared(cache_of(ours))
    ratio = cache_nbytes(cache_of(ours)) / cache_nbytes(cache_of(theirs))
    assert ratio == (LAYERS + 1) / (2 * LAYERS)


def test_crop_then_decode_matches_uncached_and_assisted_decoding_matches_greedy():
    model = svformer()
    tokens = torch.randint(3, 128, (2, 10))
    cache = cache_of(model(tokens, use_cache=True))
    cache.crop(-4)  # what assisted decoding does after rejecting draft tokens
    assert cache.get_seq_length() == 6 and all(layer.keys.shape[-2] == 6 for layer in cache.layers)
    assert_values_shared(cache)
    assert cache.layers[0].values.shape[-2] == 6
    logits = model(tokens[:, 6:], **with_cache(cache), use_cache=True).logits
    assert (logits - model(tokens).logits[:, 6:]).abs().max() < 1e-5

    torch.manual_seed(1)
    assistant = ResFormerForCausalLM(config()).eval()  # a different model: most of its drafts get rejected
    prompt = tokens[:1, :6]
    assisted = model.generate(prompt, assistant_model=assistant, max_new_tokens=12, **GREEDY)
    assert torch.equal(assisted, model.generate(prompt, max_new_tokens=12, **GREEDY))


def test_batch_repeat_and_select_keep_values_shared_and_correct():
    model = svformer()
    tokens = torch.randint(3, 128, (2, 6))
    next_tokens = torch.randint(3, 128, (4, 1))
    cache = cache_of(model(tokens, use_cache=True))

    cache.batch_repeat_interleave(2)  # what contrastive / group searches do to expand the batch
    repeated = tokens.repeat_interleave(2, dim=0)
    assert cache_nbytes(cache) == kv_bytes(4, 2, 6, LAYERS + 1)
    logits = model(next_tokens, **with_cache(cache), use_cache=True).logits[:, -1]
    full = torch.cat([repeated, next_tokens], dim=1)
    assert (logits - model(full).logits[:, -1]).abs().max() < 1e-5

    keep = torch.tensor([3, 0])
    cache.batch_select_indices(keep)
    assert_values_shared(cache)
    assert cache_nbytes(cache) == kv_bytes(2, 2, 7, LAYERS + 1)
    last = torch.randint(3, 128, (2, 1))
    logits = model(last, **with_cache(cache), use_cache=True).logits[:, -1]
    assert (logits - model(torch.cat([full[keep], last], dim=1)).logits[:, -1]).abs().max() < 1e-5


def test_compiled_static_generate_produces_the_eager_tokens():
    model = svformer()
    prompt = torch.randint(3, 128, (2, 6))
    eager = model.generate(prompt, max_new_tokens=8, cache_implementation="static", **GREEDY)
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    # A recording backend checks dynamo's full-graph capture of our cache layers without inductor's CPU build time.
    compile_config = CompileConfig(backend=counting_backend, fullgraph=True, mode=None)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    compiled = model.generate(prompt, max_new_tokens=8, cache_implementation="static", compile_config=compile_config,
                              **GREEDY)
    assert graphs, "generate() did not run the compiled forward"
    assert torch.equal(compiled, eager)


def test_other_variants_keep_the_standard_cache():
    torch.manual_seed(0)
    model = ResFormerForCausalLM(config("learnable_plus")).eval()
    out = model.generate(torch.randint(3, 128, (1, 4)), max_new_tokens=3, return_dict_in_generate=True, **GREEDY)
    assert all(type(layer) is DynamicLayer for layer in cache_of(out).layers)
    assert cache_nbytes(cache_of(out)) == kv_bytes(1, 2, 6, 2 * LAYERS)


def test_cache_nbytes_rejects_what_is_not_a_cache():
    with pytest.raises(TypeError, match="expects a transformers Cache"):
        cache_nbytes(torch.zeros(3))


@pytest.mark.parametrize(("saved", "loaded"), [("learnable_plus", "svformer"), ("svformer", "learnable_plus")])
def test_loading_a_checkpoint_of_the_other_v_proj_layout_names_the_mismatch(tmp_path, saved, loaded):
    ResFormerForCausalLM(config(saved)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"Variant mismatch: .*layers \[1, 2, 3\]"):
        ResFormerForCausalLM.from_pretrained(tmp_path, value_residual=loaded)
    assert ResFormerForCausalLM.from_pretrained(tmp_path).config.value_residual == saved


@pytest.mark.parametrize("crop", [5, 8, 12, 0, -3, -8])
def test_crop_is_all_or_nothing_with_the_rules_of_a_llama_cache(crop):
    """`crop`'s rules differ across releases (5.19 keeps the first n tokens for a positive n, later releases refuse
    it); whatever they are, the SVFormer cache ends like a Llama's: cropped everywhere, or refused with nothing cut."""
    model = svformer()
    tokens = torch.randint(3, 128, (2, 8))
    ours = cache_of(model(tokens, use_cache=True))
    theirs = cache_of(llama_like(model)(tokens, use_cache=True))
    outcomes = []
    for cache in (ours, theirs):
        try:
            cache.crop(crop)
            outcomes.append(None)
        except (ValueError, RuntimeError) as error:
            outcomes.append(type(error))
    assert outcomes[0] == outcomes[1]
    length = theirs.get_seq_length()
    assert all(layer.keys.shape[-2] == length for layer in ours.layers)
    assert_values_shared(ours)
    assert ours.layers[0].values.shape[-2] == length and ours.get_seq_length() == length
    if 0 < length < 8:  # the kept tokens still decode like the uncached model
        logits = model(tokens[:, length:], **with_cache(ours), use_cache=True).logits
        assert (logits - model(tokens).logits[:, length:]).abs().max() < 1e-5
