"""Value embeddings (`value_embeddings`, issue 56): a layer with a table attends over `V' + 2·σ(W x̂[:12])·E[token]`.

Checked against the independent reference (`tests/reference.py`) on every path the model computes values on
(with gradient, without, λ as tensors, float64), the attention backends, generate()'s caches, and a converted Llama:
tables at zero start at its exact outputs and get gradient from the first step.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from resformer_hf import ResFormerConfig, ResFormerForCausalLM
from resformer_hf.remote_code._compat import with_cache
from resformer_hf.remote_code.value_embeddings import gated_rows

from helpers import (
    TINY,
    assert_attention_backends_agree,
    assert_checkpointing_keeps_the_gradients,
    assert_compiled_training_keeps_the_gradients,
    llama_pair,
    model_with_random_lambdas,
    tiny_config,
)
from reference import reference_logits

#: (variant, value_embeddings): the layouts by name, a list with layer 0, and each variant family that combines
CASES = [("none", "alternating"), ("learnable_plus", "u_net"), ("learnable", [0, 3]), ("identity", [1]),
         ("sparse", "alternating"), ("constant", [2, 3])]


def model_with_tables(variant: str, layout, seed: int = 0, **overrides) -> ResFormerForCausalLM:
    """A tiny model (eval) with random λ, tables and gates, so that every term of V'' is exercised."""
    torch.manual_seed(seed)
    model = model_with_random_lambdas(tiny_config(variant, value_embeddings=layout, **overrides))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "value_embedding" in name:
                parameter.normal_(0.0, 0.5)
    return model


def state_of(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize(("variant", "layout"), CASES, ids=[f"{v}-{layout}" for v, layout in CASES])
def test_every_path_matches_the_reference(variant, layout):
    model = model_with_tables(variant, layout)
    input_ids = torch.randint(3, 128, (2, 11))
    with_gradient = model(input_ids).logits  # the training path: fused mix, autograd
    with torch.no_grad():
        prefill = model(input_ids).logits  # without gradient, each receiver scaling V_0 itself
        decode = model(input_ids[:, :4]).logits  # a few tokens: layer 0 scales V_0 for every receiver at once
    for name, logits, ids in (("gradient", with_gradient, input_ids), ("prefill", prefill, input_ids),
                              ("decode", decode, input_ids[:, :4])):
        expected = reference_logits(model.config, state_of(model), ids)
        assert (logits - expected).abs().max().item() <= 2e-5, name


def test_float64_matches_the_reference_to_rounding():
    model = model_with_tables("learnable_plus", "alternating").double()
    input_ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        delta = (model(input_ids).logits - reference_logits(model.config, state_of(model), input_ids)).abs().max()
    assert delta.item() <= 1e-12


def test_tables_change_the_output_and_only_their_layers_hold_them():
    model = model_with_tables("learnable_plus", "u_net", num_hidden_layers=8)
    assert model.config.value_embedding_layers == (1, 2, 5, 6, 7)
    holders = [n for n, layer in enumerate(model.model.layers) if hasattr(layer.self_attn, "value_embedding")]
    assert holders == [1, 2, 5, 6, 7]
    assert model.model.layers[1].self_attn.value_embedding.weight.shape == (128, 2 * 8)  # [vocab, H_kv·D]
    assert model.model.layers[1].self_attn.value_embedding_gate.weight.shape == (2, 12)  # [H_kv, channels]
    input_ids = torch.randint(3, 128, (1, 7))
    with torch.no_grad():
        before = model(input_ids).logits
        model.model.layers[6].self_attn.value_embedding.weight.zero_()
        assert (model(input_ids).logits - before).abs().max().item() > 1e-3


@pytest.mark.parametrize(("variant", "layout"), CASES[:3], ids=[f"{v}-{layout}" for v, layout in CASES[:3]])
def test_attention_backends_agree(variant, layout):
    model = model_with_tables(variant, layout, seed=1)
    assert_attention_backends_agree(model)


GREEDY = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize(("variant", "layout"), CASES[:3], ids=[f"{v}-{layout}" for v, layout in CASES[:3]])
def test_generate_with_dynamic_and_static_caches_gives_the_uncached_reference_tokens(variant, layout):
    model = model_with_tables(variant, layout, initializer_range=0.2)
    prompt = torch.randint(3, 128, (2, 6))
    dynamic = model.generate(prompt, **GREEDY)
    static = model.generate(prompt, cache_implementation="static", **GREEDY)
    uncached = model.generate(prompt, use_cache=False, **GREEDY)
    assert torch.equal(dynamic, uncached) and torch.equal(static, uncached)
    log_probs = torch.log_softmax(reference_logits(model.config, state_of(model), dynamic)[:, 5:-1].double(), -1)
    chosen = log_probs.gather(-1, dynamic[:, 6:, None])[..., 0]
    assert (log_probs.max(-1).values - chosen).max().item() <= 1e-4


def test_a_gate_swapped_for_another_linear_module_gives_the_same_outputs():
    """vLLM's Transformers backend replaces every `nn.Linear` with its own layer, which has no `in_features` (it
    failed on it); the gate's input width is the layer's own, read once from the config."""

    class ServingLinear(torch.nn.Module):  # what vLLM builds: a weight, input_size / output_size, no in_features
        def __init__(self, linear: torch.nn.Linear):
            super().__init__()
            self.weight, self.input_size, self.output_size = linear.weight, linear.in_features, linear.out_features

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight)

    model = model_with_tables("learnable_plus", "alternating")
    input_ids = torch.randint(3, 128, (2, 7))
    with torch.no_grad():
        expected = model(input_ids).logits
        for layer in model.model.layers:
            if layer.self_attn.has_value_embedding:
                layer.self_attn.value_embedding_gate = ServingLinear(layer.self_attn.value_embedding_gate)
        torch.testing.assert_close(model(input_ids).logits, expected, rtol=0, atol=0)


@pytest.mark.slow
def test_a_compiled_training_step_gives_the_eager_gradients():
    """The lookup's checkpoint traces into one graph (`fullgraph=True`, forward and backward), eager's gradients."""
    eager = assert_compiled_training_keeps_the_gradients(model_with_tables("learnable_plus", "alternating"))
    assert any(".value_embedding." in name for name in eager)


def test_the_cache_holds_values_with_the_table_in_them():
    """A decode step reads earlier tokens' V'' from the cache: a cache filled without the tables gives other logits."""
    model = model_with_tables("learnable_plus", "alternating")
    prompt = torch.randint(3, 128, (1, 8))
    with torch.no_grad():
        full = model(prompt).logits[:, -1]
        cache = model(prompt[:, :-1], use_cache=True).past_key_values
        stepped = model(prompt[:, -1:], **with_cache(cache), use_cache=True).logits[:, -1]
    assert (stepped - full).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_compiled_static_cache_generates_the_uncached_tokens():
    from transformers import CompileConfig

    model = model_with_tables("learnable_plus", "alternating", initializer_range=0.2)
    prompt = torch.randint(3, 128, (1, 6))
    compiled = model.generate(prompt, cache_implementation="static", compile_config=CompileConfig(fullgraph=True),
                              **GREEDY)
    assert torch.equal(compiled, model.generate(prompt, use_cache=False, **GREEDY))


def test_a_converted_llama_with_tables_starts_at_its_outputs_and_the_tables_learn_at_once():
    llama, model = llama_pair("learnable", value_embeddings="alternating")
    input_ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, llama(input_ids).logits)
    model.train()
    model(input_ids, labels=input_ids).loss.backward()
    for layer in model.config.value_embedding_layers:
        attention = model.model.layers[layer].self_attn
        assert attention.value_embedding.weight.grad.abs().sum() > 0, layer
        used = attention.value_embedding.weight.grad.abs().sum(-1) > 0
        assert set(used.nonzero().flatten().tolist()) <= set(input_ids.flatten().tolist())  # only the tokens seen
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.step()
    model.zero_grad()
    model(input_ids, labels=input_ids).loss.backward()  # with tables off zero, the gates get gradient too
    assert all(model.model.layers[n].self_attn.value_embedding_gate.weight.grad.abs().sum() > 0
               for n in model.config.value_embedding_layers)


def test_a_checkpoint_without_tables_loads_them_at_zero(tmp_path):
    torch.manual_seed(0)
    llama = LlamaForCausalLM(llama_pair()[0].config).eval()
    llama.save_pretrained(tmp_path)
    model = ResFormerForCausalLM.from_pretrained(tmp_path, value_residual="none", value_embeddings="u_net").eval()
    tables = {n: p for n, p in model.named_parameters() if "value_embedding" in n}
    assert len(tables) == 2 * len(model.config.value_embedding_layers)
    assert all(torch.count_nonzero(p) == 0 for p in tables.values())
    input_ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        assert (model(input_ids).logits - llama(input_ids).logits).abs().max().item() <= 1e-5


def test_a_checkpoint_with_tables_loaded_without_them_is_refused_not_stripped(tmp_path):
    model_with_tables("learnable_plus", "alternating").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"value-embedding tables for layers \[3\], which value_embeddings=\[1\]"):
        ResFormerForCausalLM.from_pretrained(tmp_path, value_embeddings=[1])


def test_save_load_round_trip_keeps_tables_in_the_model_dtype(tmp_path):
    model = model_with_tables("learnable_plus", "alternating")
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["value_embeddings"] == "alternating"  # as given
    loaded = ResFormerForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    table = loaded.model.layers[3].self_attn.value_embedding.weight
    assert table.dtype == torch.bfloat16 and loaded.model.value_residual.lambda_logits.dtype == torch.float32
    again = ResFormerForCausalLM.from_pretrained(tmp_path).eval()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_inputs_embeds_alone_is_refused_naming_input_ids():
    model = model_with_tables("learnable_plus", "alternating")
    embeds = model.model.embed_tokens(torch.randint(3, 128, (1, 5)))
    with pytest.raises(ValueError, match="Pass input_ids"):
        model(inputs_embeds=embeds)
    with pytest.raises(ValueError, match="value_embeddings"):
        model.generate(inputs_embeds=embeds, max_new_tokens=2, pad_token_id=0)
    plain = ResFormerForCausalLM(tiny_config("learnable_plus")).eval()  # without tables: still accepted
    plain(inputs_embeds=plain.model.embed_tokens(torch.randint(3, 128, (1, 5))))


@pytest.mark.parametrize("prompt_embeds, multimodal, attention", [
    (True, False, "vllm"), (False, True, "vllm"), (False, False, "vllm"), (True, False, "sdpa")])
def test_a_vllm_engine_that_hands_over_embeddings_only_is_refused_as_it_builds_the_model(
        monkeypatch, prompt_embeds, multimodal, attention):
    """vLLM drops input_ids whenever it passes inputs_embeds (prompt embeddings, multimodal front ends): the model
    refuses to be built in such an engine, read from vLLM's current config (a stand-in here; vLLM's own in
    tests/test_serving_vllm.py), so the engine fails at start, not at its first request; elsewhere nothing changes."""
    engine = SimpleNamespace(model_config=SimpleNamespace(enable_prompt_embeds=prompt_embeds,
                                                          is_multimodal_model=multimodal))
    monkeypatch.setitem(sys.modules, "vllm.config", SimpleNamespace(get_current_vllm_config_or_none=lambda: engine))
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "vllm", ALL_ATTENTION_FUNCTIONS["sdpa"])  # as vLLM
    for layout in ("alternating", None):
        config = tiny_config("learnable_plus", value_embeddings=layout)
        config._attn_implementation_internal = attention  # what vLLM's Transformers backend sets before building
        refused = layout is not None and attention == "vllm" and (prompt_embeds or multimodal)
        if refused:
            with pytest.raises(ValueError, match="vLLM: start the engine without enable_prompt_embeds"):
                ResFormerForCausalLM(config)
        else:
            ResFormerForCausalLM(config)


def test_a_rank_of_vllms_tensor_parallel_keeps_its_own_kv_heads_of_the_all_reduced_rows():
    """vLLM's tensor parallel swaps a table for its VocabParallelEmbedding, whose lookups return every kv head's
    columns (all-reduced over the vocabulary shards) while the gate, like v_proj, gives this rank's heads only."""
    table = torch.nn.Embedding(128, 2 * 8)  # 2 kv heads of 8
    token_ids, gate = torch.tensor([[5, 9, 7]]), torch.rand(1, 3, 1)  # one head a rank
    for rank in (0, 1):
        table.tp_rank = rank
        rows = gated_rows(table, gate, token_ids, torch.float32, 8)
        expected = gate.transpose(1, 2).unsqueeze(-1) * table(token_ids)[..., 8 * rank: 8 * (rank + 1)].unsqueeze(1)
        assert rows.shape == (1, 1, 3, 8)
        torch.testing.assert_close(rows, expected, rtol=0, atol=0)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant):
    plain = assert_checkpointing_keeps_the_gradients(model_with_tables("learnable_plus", [0, 2]), use_reentrant)
    assert any("value_embedding_gate" in n for n in plain)


def test_gradients_match_the_reference():
    model = model_with_tables("learnable_plus", "alternating").double().train()
    input_ids = torch.randint(3, 128, (2, 8))
    model(input_ids).logits.square().mean().backward()
    state = {name: tensor.detach().clone().requires_grad_() for name, tensor in model.state_dict().items()}
    reference_logits(model.config, state, input_ids).square().mean().backward()
    for name, parameter in model.named_parameters():
        if "value_embedding" in name:
            assert torch.allclose(parameter.grad, state[name].grad, atol=1e-12), name


# ---- the config --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "layers", "num_layers"), [
    (None, (), 4), ([], (), 4), ([3, 0], (0, 3), 4), ("alternating", (1, 3), 4), ("alternating", (0, 2, 4), 5),
    ("u_net", (1, 2, 8, 9, 10), 11), ("u_net", (1, 2, 3), 4), ("alternating", (0, 2, 4, 6, 8, 10), 11),
])
def test_layouts_resolve_to_layers(value, layers, num_layers):
    assert tiny_config("none", value_embeddings=value, num_hidden_layers=num_layers).value_embedding_layers == layers


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(value_embeddings=[4]), r"value_embeddings has \[4\]: each entry must be a layer index in 0\.\.3"),
    (dict(value_embeddings=[-1]), r"layer index in 0\.\.3"),
    (dict(value_embeddings=[1, 1]), "value_embeddings=.* lists a layer twice"),
    (dict(value_embeddings="unet"), "value_embeddings='unet' is not a layout; use one of alternating, u_net"),
    (dict(value_embeddings="u_net", num_hidden_layers=1), "gives no layer"),
    (dict(value_embeddings=[True]), "layer index"),
    (dict(value_embeddings="alternating", value_residual="svformer"),
     "does not combine with value_residual='svformer'.*none, identity, constant, learnable, learnable_plus, sparse"),
    (dict(value_embeddings=[1], value_residual="dense"), "value_embeddings does not combine"),
    (dict(value_embeddings=[1], value_residual="neutreno"), "value_embeddings does not combine"),
    (dict(value_embeddings=[1], value_residual="gated"), "value_embeddings does not combine"),
    (dict(value_embeddings=[1], value_residual="denseformer"), "value_embeddings does not combine"),
    (dict(value_embeddings=[1], value_residual="none", cross_layer_attention=2),
     r"value_embeddings gives tables to layers \[1\].*cross_layer_attention"),
])
def test_invalid_value_embeddings_raise_value_error_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**{"value_residual": "learnable_plus", **overrides})


def test_an_assignment_after_construction_is_checked_when_the_model_is_built():
    config = tiny_config("learnable_plus")
    config.value_embeddings = [9]
    with pytest.raises(ValueError, match="value_embeddings"):
        ResFormerForCausalLM(config)


def test_a_table_keeps_only_its_gate_for_backward():
    """Exact byte accounting: beyond the same model without tables, a layer with a table saves its gate σ(W x̂)
    [B, T, H_kv] and nothing V-sized (the looked-up rows would be; backward looks them up again)."""
    from test_core_model import saved_activation_bytes

    input_ids = torch.randint(3, 128, (2, 32))
    saved = {}
    for layout in (None, "alternating"):
        torch.manual_seed(0)
        model = model_with_random_lambdas(tiny_config("learnable_plus", value_embeddings=layout)).train()
        saved[layout] = saved_activation_bytes(model, input_ids)
    gate_bytes = 2 * 32 * TINY["num_key_value_heads"] * 4
    assert saved["alternating"] - saved[None] == len(model.config.value_embedding_layers) * gate_bytes, saved


def test_cross_layer_attention_producers_may_have_tables():
    config = ResFormerConfig(**TINY, value_residual="none", cross_layer_attention=2, value_embeddings=[0, 2])
    model = model_with_tables("none", [0, 2], cross_layer_attention=2)
    assert config.value_embedding_layers == (0, 2)
    input_ids = torch.randint(3, 128, (2, 7))
    with torch.no_grad():
        expected = reference_logits(model.config, state_of(model), input_ids)
        assert (model(input_ids).logits - expected).abs().max().item() <= 2e-5


#: Kernels (aten ops, views excluded) a layer with a table adds, measured and held so they cannot grow: a decode step
#: the lookup, the gate's GEMM (and the reshape of its 3-D input), its sigmoid, the gated rows' product and the add;
#: a bf16 training step those, the lookup and product again in backward (the rows are not kept), their backward (the
#: table's dense gradient, the gate's), and autocast's casts of the gate and rows.
TABLE_KERNELS = {"decode": 6, "training": 26}


@pytest.mark.parametrize("kind", ["decode", "training"])
def test_a_layer_with_a_table_adds_a_fixed_number_of_kernels_and_one_without_adds_none(kind):
    from test_kernel_budgets import SHAPE, decode_kernels, training_kernels

    count = decode_kernels if kind == "decode" else training_kernels
    extra = {}
    for depth in (8, 12):
        totals = []
        for layout in (None, [], "alternating"):
            torch.manual_seed(0)
            config = tiny_config("learnable_plus", **SHAPE, num_hidden_layers=depth, value_embeddings=layout)
            totals.append(sum(count(model_with_random_lambdas(config)).values()))
        assert totals[0] == totals[1]  # no tables: not one op more
        extra[depth] = totals[2] - totals[0]
    per_layer = (extra[12] - extra[8]) / 2  # alternating: 6 tables at 12 layers, 4 at 8
    assert per_layer <= TABLE_KERNELS[kind] and extra[8] - 4 * per_layer <= 0, (per_layer, extra)
