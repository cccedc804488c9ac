"""The paper's other baselines: DenseFormer (Pagliardini et al., 2024) and cross-layer attention (CLA, Brandon et al.,
2024), alone and combined with SVFormer.

References: the independent plain-torch forward of `tests/reference.py` (logits and gradients), HF Llama on the same
weights (a fresh DenseFormer is Llama), the same model without a cache (every generate() cache path), and byte
formulas for the caches (CLA2: half a Llama's; SVFormer × CLA2: (L/2 + 1)/(2L) of it).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM, StaticCache

from resformer_hf import ResFormerConfig, ResFormerForCausalLM, cache_nbytes
from resformer_hf.remote_code._compat import cache_of, with_cache
from resformer_hf.remote_code.cache_resformer import SharedKeysValuesDynamicLayer, share_cache_storage

from helpers import (
    TINY,
    assert_checkpointing_keeps_the_gradients,
    llama_config_like,
    model_with_random_lambdas,
    tiny_config,
)
from reference import reference_logits

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
#: Cross-layer attention with each variant it combines with (CLA3 leaves a last group of one layer at L = 4).
CLA = {
    "cla2": dict(value_residual="none", cross_layer_attention=2),
    "cla3": dict(value_residual="none", cross_layer_attention=3),
    "svformer_cla2": dict(value_residual="svformer", cross_layer_attention=2),
    "denseformer_cla2": dict(value_residual="denseformer", cross_layer_attention=2, denseformer_dilation=2),
}
DENSEFORMER = {f"denseformer_dilation{k}": dict(value_residual="denseformer", denseformer_dilation=k) for k in (1, 3)}


def model(fields: dict, **overrides) -> ResFormerForCausalLM:
    """A tiny model (larger init, so greedy choices are no near-ties) with random λ and depth-weight offsets."""
    torch.manual_seed(0)
    config = ResFormerConfig(**{**TINY, "initializer_range": 0.2, **fields, **overrides})
    return model_with_random_lambdas(config, bound=0.3)


def kv_bytes(batch: int, tokens: int, tensors: int, kv_heads: int = 2, head_dim: int = 8) -> int:
    return batch * kv_heads * tokens * head_dim * 4 * tensors


@pytest.mark.parametrize("case", [*CLA, *DENSEFORMER])
def test_logits_and_gradients_match_the_plain_reference(case):
    network = model({**CLA, **DENSEFORMER}[case]).train()
    input_ids = torch.randint(3, 128, (2, 11))
    state = {name: parameter for name, parameter in network.named_parameters()}
    state.update({name: buffer for name, buffer in network.named_buffers()})
    state["lm_head.weight"] = network.lm_head.weight
    expected = reference_logits(network.config, state, input_ids)
    actual = network(input_ids).logits
    assert (actual - expected).abs().max().item() <= 1e-5
    reference_grads = torch.autograd.grad(expected.square().mean(), list(network.parameters()), allow_unused=True)
    model_grads = torch.autograd.grad(actual.square().mean(), list(network.parameters()), allow_unused=True)
    for (name, _), ours, theirs in zip(network.named_parameters(), model_grads, reference_grads, strict=True):
        assert (ours is None) == (theirs is None), name
        if ours is not None:
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6, msg=name)


def test_the_depth_weights_and_the_shared_keys_really_act():
    """Guards the reference test: DenseFormer with moved weights is not Llama, and CLA's consumers have no k/v_proj."""
    dense = model(DENSEFORMER["denseformer_dilation1"])
    plain = ResFormerForCausalLM(tiny_config("none")).eval()
    plain.load_state_dict(dense.state_dict(), strict=False)
    input_ids = torch.randint(3, 128, (1, 9))
    assert (dense(input_ids).logits - plain(input_ids).logits).abs().max() > 1e-3
    layers = model(CLA["svformer_cla2"]).model.layers
    assert [(layer.self_attn.k_proj is None, layer.self_attn.v_proj is None) for layer in layers] == [
        (False, False), (True, True), (False, True), (True, True)
    ]


@pytest.mark.parametrize("dilation", [1, 3])
def test_a_fresh_denseformer_is_llama_exactly(dilation):
    config = tiny_config("denseformer", denseformer_dilation=dilation, initializer_range=0.2)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(llama_config_like(config)).eval()
    dense = ResFormerForCausalLM(config).eval()
    missing, unexpected = dense.load_state_dict(llama.state_dict(), strict=False)
    assert missing == ["model.depth_weighted_average.weight_offset"] and not unexpected
    prompt = torch.randint(3, 128, (2, 9))
    assert torch.equal(dense(prompt).logits, llama(prompt).logits)
    assert torch.equal(dense.generate(prompt, max_new_tokens=8, **GREEDY), llama.generate(prompt, max_new_tokens=8,
                                                                                          **GREEDY))


@pytest.mark.parametrize("case", CLA)
def test_reentrant_gradient_checkpointing_keeps_the_shared_key_gradients(case):
    plain = assert_checkpointing_keeps_the_gradients(model(CLA[case]), use_reentrant=True)
    assert "model.layers.0.self_attn.k_proj.weight" in plain


#: generate() cache paths, each compared with the same decoding strategy run without a cache.
CACHE_PATHS = {
    "greedy": dict(max_new_tokens=12),
    "beam search": dict(num_beams=3, num_return_sequences=2, max_new_tokens=8),
    "assisted (prompt lookup)": dict(prompt_lookup_num_tokens=3, max_new_tokens=12),
    "static cache": dict(cache_implementation="static", max_new_tokens=12),
    "static, chunked prefill": dict(cache_implementation="static", prefill_chunk_size=3, max_new_tokens=12),
}


@pytest.mark.parametrize("path", CACHE_PATHS)
@pytest.mark.parametrize("case", ["cla2", "svformer_cla2", "denseformer_cla2"])
def test_every_cache_path_generates_the_uncached_tokens(case, path):
    network = model(CLA[case])
    prompt = torch.tensor([[5, 9, 17, 5, 9, 17, 5, 9], [3, 4, 5, 6, 7, 8, 9, 10]])
    settings = dict(CACHE_PATHS[path], **GREEDY)
    uncached = {k: v for k, v in settings.items() if k not in ("cache_implementation", "prefill_chunk_size")}
    uncached.pop("prompt_lookup_num_tokens", None)  # assisted decoding needs a cache; its reference is greedy
    if "prompt_lookup_num_tokens" in settings:
        prompt = prompt[:1]
    assert torch.equal(network.generate(prompt, **settings), network.generate(prompt, use_cache=False, **uncached))


def test_left_padded_batch_equals_each_sample_alone():
    network = model(CLA["svformer_cla2"])
    short, long = torch.randint(3, 128, (1, 4)), torch.randint(3, 128, (1, 7))
    batch = torch.zeros(2, 7, dtype=torch.long)
    batch[0, 3:], batch[1] = short[0], long[0]
    mask = (torch.arange(7) >= torch.tensor([[3], [0]])).long()
    together = network.generate(batch, attention_mask=mask, max_new_tokens=10, **GREEDY)
    assert torch.equal(together[0, 3:], network.generate(short, max_new_tokens=10, **GREEDY)[0])
    assert torch.equal(together[1], network.generate(long, max_new_tokens=10, **GREEDY)[0])


#: (fields, K/V tensors per token the cache stores at L = 8, that share of a Llama's cache).
RATIOS = {
    "cla2": (dict(value_residual="none", cross_layer_attention=2), 8, 0.5),
    "svformer": (dict(value_residual="svformer"), 9, 9 / 16),
    "svformer_cla2": (dict(value_residual="svformer", cross_layer_attention=2), 5, 0.3125),  # (L/2 + 1)/(2L)
}


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("case", RATIOS)
def test_cache_bytes_are_exact_and_the_ratio_to_llama_holds_on_top_of_gqa(case, kv_heads):
    fields, tensors, ratio = RATIOS[case]
    network = model(fields, num_hidden_layers=8, num_key_value_heads=kv_heads)
    llama = LlamaForCausalLM(llama_config_like(network.config)).eval()
    prompt = torch.randint(3, 128, (2, 7))
    out = network(prompt, use_cache=True)
    cache = cache_of(out)
    assert cache_nbytes(cache) == kv_bytes(2, 7, tensors, kv_heads)
    tokens = prompt
    for _ in range(4):  # decode: bytes follow the formula, logits the uncached model's
        tokens = torch.cat([tokens, out.logits[:, -1:].argmax(-1)], dim=1)
        out = network(tokens[:, -1:], **with_cache(cache), use_cache=True)
    assert cache_nbytes(cache) == kv_bytes(2, 11, tensors, kv_heads)
    assert (out.logits[:, -1] - network(tokens).logits[:, -1]).abs().max() < 1e-5
    llama_bytes = cache_nbytes(cache_of(llama(tokens, use_cache=True)))
    assert llama_bytes == kv_bytes(2, 11, 16, kv_heads)
    assert cache_nbytes(cache) / llama_bytes == ratio

    generated = network.generate(prompt, max_new_tokens=6, cache_implementation="static",
                                 return_dict_in_generate=True, **GREEDY)
    static = cache_of(generated)
    capacity = static.get_max_length()
    counters = 8 * len(set(network.config.key_value_source_layers))  # one int64 position counter per storing layer
    assert cache_nbytes(static) == kv_bytes(2, capacity, tensors, kv_heads) + counters
    assert torch.equal(generated.sequences, network.generate(prompt, max_new_tokens=6, use_cache=False, **GREEDY))


def test_cache_operations_act_once_through_the_producers():
    """crop (assisted decoding), batch repeat/select (group searches), reset: consumers follow their producers."""
    network = model(CLA["svformer_cla2"])
    tokens = torch.randint(3, 128, (2, 10))
    cache = cache_of(network(tokens, use_cache=True))
    assert [type(layer).__name__ for layer in cache.layers] == [
        "DynamicLayer", "SharedKeysValuesDynamicLayer", "SharedValuesDynamicLayer", "SharedKeysValuesDynamicLayer"
    ]
    cache.crop(-4)
    assert all(layer.keys.shape[-2] == 6 and layer.get_seq_length() == 6 for layer in cache.layers)
    logits = network(tokens[:, 6:], **with_cache(cache), use_cache=True).logits
    assert (logits - network(tokens).logits[:, 6:]).abs().max() < 1e-5

    cache.batch_repeat_interleave(2)
    assert cache_nbytes(cache) == kv_bytes(4, 10, 3)
    keep = torch.tensor([3, 0])
    cache.batch_select_indices(keep)
    assert cache.layers[3].keys is cache.layers[2].keys and cache.layers[1].values is cache.layers[0].values
    last = torch.randint(3, 128, (2, 1))
    step = network(last, **with_cache(cache), use_cache=True).logits[:, -1]
    full = torch.cat([tokens.repeat_interleave(2, dim=0)[keep], last], dim=1)
    assert (step - network(full).logits[:, -1]).abs().max() < 1e-5


def test_a_cache_the_caller_builds_is_used_as_given_and_static_sharing_survives_early_initialisation():
    network = model(CLA["cla2"])
    prompt = torch.randint(3, 128, (1, 6))
    uncached = network.generate(prompt, max_new_tokens=8, use_cache=False, **GREEDY)
    stock = DynamicCache(config=network.config)
    assert torch.equal(network.generate(prompt, max_new_tokens=8, **with_cache(stock), **GREEDY), uncached)
    assert cache_nbytes(stock) == kv_bytes(1, 13, 4)  # consumers never write a cache: half, even in a stock one

    static = share_cache_storage(StaticCache(config=network.config, max_cache_len=16), network.config)
    static.early_initialization(1, 2, 8, torch.float32, torch.device("cpu"))
    assert cache_nbytes(static) == kv_bytes(1, 16, 4) + 8 * 2
    assert isinstance(share_cache_storage(DynamicCache(config=network.config), network.config).layers[1],
                      SharedKeysValuesDynamicLayer)


@pytest.mark.parametrize("case", ["svformer_cla2", "denseformer_cla2"])
def test_save_and_load_round_trip_is_bit_exact_and_a_wrong_layout_is_named(tmp_path, case):
    network = model(CLA[case])
    network.save_pretrained(tmp_path)
    loaded = ResFormerForCausalLM.from_pretrained(tmp_path).eval()
    input_ids = torch.randint(3, 128, (2, 9))
    assert torch.equal(loaded(input_ids).logits, network(input_ids).logits)
    for other in (None, 4):
        with pytest.raises(ValueError, match=r"cross_layer_attention mismatch: .*config\.json"):
            ResFormerForCausalLM.from_pretrained(tmp_path, cross_layer_attention=other)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(value_residual="learnable_plus", cross_layer_attention=2), "cross_layer_attention=2 does not combine"),
        (dict(value_residual="none", cross_layer_attention=0), "cross_layer_attention=0 must be a positive integer"),
        (dict(value_residual="none", cross_layer_attention=True), "cross_layer_attention=True must be a positive"),
        (dict(value_residual="denseformer", denseformer_dilation=0), "denseformer_dilation=0 must be a positive"),
        (dict(value_residual="svformer", denseformer_dilation=2), "denseformer_dilation is ignored by"),
    ],
)
def test_invalid_fields_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        ResFormerConfig(**{**TINY, **fields})


@pytest.mark.slow
def test_trainer_and_lora_train_the_depth_weights_with_cross_layer_attention(tmp_path):
    """The stock Trainer lowers the loss and moves DenseFormer's depth weights; with LoRA, `LAMBDA_MODULES` trains them
    in the adapter, which saves and reloads them."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, default_data_collator

    from resformer_hf import LAMBDA_MODULES

    from helpers import build_model, example_data, step_losses, training_arguments

    tokenizer, dataset = example_data()
    fields = dict(value_residual="denseformer", cross_layer_attention=2, num_hidden_layers=4)
    model = build_model(len(tokenizer), **fields)
    before = model.model.depth_weighted_average().detach().clone()
    trainer = Trainer(model=model, args=training_arguments(tmp_path / "full", max_steps=8, learning_rate=1e-2),
                      train_dataset=dataset, data_collator=default_data_collator)
    trainer.train()
    losses = step_losses(trainer)
    assert losses[-1] < losses[0] - 0.1
    assert (model.model.depth_weighted_average() - before).abs().max() > 1e-3

    base = build_model(len(tokenizer), **fields)
    base.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=4, modules_to_save=LAMBDA_MODULES))
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in name}
    assert trainable == {"base_model.model.model.depth_weighted_average.modules_to_save.default.weight_offset"}
    Trainer(model=peft_model, args=training_arguments(tmp_path / "lora", max_steps=4, learning_rate=1e-2),
            train_dataset=dataset, data_collator=default_data_collator).train()
    probe = torch.tensor(dataset[-4:]["input_ids"])
    with torch.no_grad():
        adapted = peft_model(input_ids=probe).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=probe).logits, adapted, rtol=0, atol=1e-6)


def test_the_model_card_names_the_baseline_and_the_shared_layers():
    from resformer_hf.hub.model_card import build_model_card

    card = build_model_card(tiny_config("denseformer", cross_layer_attention=2)).content
    assert "**DenseFormer**" in card and "depth-weighted average" in card
    assert "| cross-layer attention (CLA) | groups of 2 layers" in card and "layers 1, 3 have no `k_proj`" in card
    assert "cross-layer attention" not in build_model_card(tiny_config("denseformer")).content


@pytest.mark.slow
@pytest.mark.parametrize("case", ["svformer_cla2", "denseformer_cla2"])
def test_compiled_static_generate_captures_one_graph_with_the_eager_tokens(case):
    from transformers import CompileConfig

    network = model(CLA[case])
    prompt = torch.randint(3, 128, (2, 6))
    eager = network.generate(prompt, max_new_tokens=8, cache_implementation="static", **GREEDY)
    graphs = []

    def counting_backend(graph_module, example_inputs):  # dynamo's full-graph capture, without inductor's build
        graphs.append(graph_module)
        return graph_module.forward

    compile_config = CompileConfig(backend=counting_backend, fullgraph=True, mode=None)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    compiled = network.generate(prompt, max_new_tokens=8, cache_implementation="static",
                                compile_config=compile_config, **GREEDY)
    assert graphs and torch.equal(compiled, eager)
