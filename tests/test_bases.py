"""The bases users start from (issue 67): Qwen 3, SmolLM3, OLMo 2, Gemma 3 and Mistral's window, with Llama 3.2's
shape as the control, each one tiny model built by transformers' own class (`bases.py`).

Converted with `--init preserve` each computes exactly what its source computes (the source model is the reference);
described from scratch by `ResFormerConfig` fields alone, with the source's weights and no value residual, it is the
source; and with λ off their initial values it runs every engine as a Llama-shaped ResFormer does: `generate()` with
dynamic, static and compiled caches against the uncached tokens (prompts longer than the windows), eager/sdpa/flex
attention, gradient checkpointing, continuous batching, the Trainer with PEFT's default LoRA targets, and SVFormer's
cache saving. What a base holds that ResFormer does not compute is refused by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from bases import BASES, CHAT_TEMPLATE, SCRATCH, SIZE, converted, save_source, source_model
from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, DynamicCache, GenerationConfig

from resformer_hf import ConversionError, ResFormerConfig, ResFormerForCausalLM, convert_llama_checkpoint
from resformer_hf.cache_accounting import cache_nbytes
from resformer_hf.cli.convert import main as convert_main
from resformer_hf.remote_code._compat import cache_of, with_cache
from resformer_hf.remote_code.variants import convertible_variants, output_preserving_variants

from helpers import assert_attention_backends_agree, assert_checkpointing_keeps_the_gradients, run_fresh_python

#: Longer than every window (6), left-padded in the second row.
PROMPT = torch.randint(3, 300, (2, 14), generator=torch.Generator().manual_seed(2))
MASK = torch.ones_like(PROMPT)
MASK[1, :3] = 0
GREEDY = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("bases")


def logits(model, ids=PROMPT, mask=MASK) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def moved_off_init(model):
    """`model` with every λ offset uniform in ±0.4, so the mix differs from the source's (engine tests)."""
    with torch.no_grad():
        for parameter in model.model.value_residual.parameters():
            parameter.uniform_(-0.4, 0.4, generator=torch.Generator().manual_seed(3))
    return model.eval()


# ---- conversion ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BASES)
def test_each_base_converts_exactly_with_its_tokenizer_and_generation_defaults(root, name):
    folder = converted(name, root)
    source = AutoModelForCausalLM.from_pretrained(root / name).eval()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert isinstance(model, ResFormerForCausalLM)
    for field, value in BASES[name][2].items():
        assert getattr(model.config, field) == value, field
    # the same transformers ops in the same order: bit-equal logits (a dropped norm or scale moves them by > 0.1),
    # in bfloat16 too (OLMo 2's RoPE in float32: with Llama's, 0.04 apart there)
    assert torch.equal(logits(model), logits(source)), (logits(model) - logits(source)).abs().max()
    assert torch.equal(model.generate(PROMPT[:1], **GREEDY), source.generate(PROMPT[:1], **GREEDY))
    low = logits(model.to(torch.bfloat16)).float(), logits(source.to(torch.bfloat16)).float()
    assert torch.equal(*low), (low[0] - low[1]).abs().max()
    assert AutoTokenizer.from_pretrained(folder).chat_template == CHAT_TEMPLATE
    defaults = json.loads((folder / "generation_config.json").read_text())
    assert (defaults["temperature"], defaults["top_p"]) == (0.7, 0.9)


@pytest.mark.slow
@pytest.mark.parametrize("name", BASES)
def test_every_variant_and_value_embeddings_convert_on_each_base(root, name):
    """Every variant the converter offers, preserving where it can (then exactly the source), else with the paper's
    initial values (finite, and different from the source), and value-embedding tables (at zero: the source)."""
    source = logits(AutoModelForCausalLM.from_pretrained(converted(name, root)).eval())
    preserving = output_preserving_variants()
    for variant in convertible_variants():
        init = "preserve" if variant in preserving else "paper"
        model = AutoModelForCausalLM.from_pretrained(converted(name, root, variant, init)).eval()
        assert model.config.value_residual == variant
        found = logits(model)
        if init == "preserve":
            assert torch.equal(found, source), (variant, (found - source).abs().max())
        else:
            assert torch.isfinite(found).all() and (found - source).abs().max() > 1e-3, variant
    tables = converted(name, root, "learnable_plus", value_embeddings="alternating")
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tables).eval()), source)


def test_what_a_base_holds_that_resformer_does_not_compute_is_refused_by_name(root, tmp_path):
    folder = save_source("gemma3", tmp_path / "gemma3")
    config = json.loads((folder / "config.json").read_text())
    for field, value in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                         ("use_bidirectional_attention", True), ("embedding_dropout_schedule", [0.1])):
        (folder / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ConversionError, match=field):
            convert_llama_checkpoint(folder, tmp_path / f"out-{field}", progress=False)
        assert not (tmp_path / f"out-{field}").exists()
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    with pytest.raises(ConversionError, match="only its text model converts: model_type gemma3_text"):
        convert_llama_checkpoint(folder, tmp_path / "out-multimodal", progress=False)


#: Run in a fresh interpreter that cannot import resformer_hf: each folder (argv[1]: name -> folder) through its own
#: remote code; its logits on `PROMPT` (argv[2]), and the classes that computed them.
REMOTE_ALONE = """
import json, sys, torch
from transformers import AutoModelForCausalLM

folders, ids = json.loads(sys.argv[1]), torch.tensor(json.loads(sys.argv[2]))
report = {}
for name, folder in folders.items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        report[name] = {"logits": model(input_ids=ids).logits.tolist(), "class": type(model).__module__}
print("REPORT " + json.dumps(report))
"""


@pytest.mark.slow
def test_each_base_loads_from_its_folders_code_alone_after_refresh_code(root, tmp_path):
    """Each base's converted folder, its code made stale (a modeling file that raises) and refreshed with
    `resformer-convert --refresh-code`, loads in an interpreter without the plugin from the folder's remote code and
    computes the source's logits."""
    folders = {}
    for name in BASES:
        folders[name] = shutil.copytree(converted(name, root), tmp_path / name)
        (folders[name] / "modeling_resformer.py").write_text('raise RuntimeError("stale remote code")\n')
        assert convert_main(["--refresh-code", str(folders[name])]) == 0
    report = run_fresh_python(REMOTE_ALONE, tmp_path, json.dumps({n: str(f) for n, f in folders.items()}),
                              json.dumps(PROMPT.tolist()))
    for name in BASES:
        assert report[name]["class"].startswith("transformers_modules."), report[name]["class"]
        source = AutoModelForCausalLM.from_pretrained(root / name).eval()
        expected = source(input_ids=PROMPT).logits.detach()
        assert torch.equal(torch.tensor(report[name]["logits"]), expected), name


# ---- from scratch --------------------------------------------------------------------------------------------------


ROPE = dict(rope_type="default", rope_theta=10000.0)
S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize("overrides, field", [
    (dict(qk_norm="layer"), "qk_norm"), (dict(block_norms="post-pre"), "block_norms"),
    (dict(rms_norm_type="t5"), "rms_norm_type"), (dict(rope_in_float32="yes"), "rope_in_float32"),
    (dict(embedding_multiplier=0.0), "embedding_multiplier"),
    (dict(query_pre_attn_scalar=-1), "query_pre_attn_scalar"),
    (dict(layer_types=[S, F], sliding_window=6), "layer_types"), (dict(sliding_window=0), "sliding_window"),
    (dict(layer_types=[S, F, S, F]), "sliding_window"), (dict(nope_layers=[4]), "nope_layers"),
    (dict(layer_types=[S, F, S, F], sliding_window=6, rope_parameters={F: ROPE}), "rope_parameters"),
    (dict(layer_types=[S, F, S, F], sliding_window=6, cross_layer_attention=2), "group like layers"),
])
def test_a_base_field_that_does_not_fit_raises_value_error_naming_it(overrides, field):
    """`architecture.py: check_architecture`: each base field that does not fit the model is refused by name."""
    with pytest.raises(ValueError, match=field):
        ResFormerConfig(value_residual="none", **SIZE, **overrides)


@pytest.mark.parametrize("name", BASES)
def test_resformer_config_fields_alone_describe_each_base(name):
    """A ResFormer written out by hand with the base's fields (`bases.SCRATCH`) and no value residual, holding the
    source's weights, computes the source's logits; the same fields with the paper's best variant build, train a
    step and reload."""
    source = source_model(name)
    config = ResFormerConfig(**SIZE, **SCRATCH[name], value_residual="none", pad_token_id=0)
    model = ResFormerForCausalLM(config).eval()
    model.load_state_dict(source.state_dict(), strict=not config.tie_word_embeddings)
    assert torch.equal(logits(model), logits(source)), (logits(model) - logits(source)).abs().max()
    plus = ResFormerForCausalLM(ResFormerConfig(**SIZE, **SCRATCH[name], pad_token_id=0))
    loss = plus(input_ids=PROMPT, labels=PROMPT).loss
    loss.backward()
    assert torch.isfinite(loss) and plus.model.value_residual.lambda_logits.grad.abs().sum() > 0


# ---- every engine ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(root):
    """Each base converted to learnable_plus (preserve), its λ then moved off their initial values."""
    return {name: moved_off_init(AutoModelForCausalLM.from_pretrained(converted(name, root, "learnable_plus")))
            for name in BASES}


@pytest.mark.parametrize("name", BASES)
def test_each_base_generates_the_uncached_tokens_with_every_cache(models, name):
    model = models[name]
    uncached = model.generate(PROMPT[:1], use_cache=False, **GREEDY)
    assert torch.equal(model.generate(PROMPT[:1], **GREEDY), uncached)
    assert torch.equal(model.generate(PROMPT[:1], cache_implementation="static", **GREEDY), uncached)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_a_compiled_static_cache_generates_the_eager_tokens_through_windows(models, name):
    """A full-graph capture of the forward with windowed static cache layers (a recording backend, as
    `test_svformer_cache.py` does: dynamo's capture without inductor's CPU build time)."""
    import torch._dynamo
    from transformers import CompileConfig

    model, graphs = models[name], []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compile_config = CompileConfig(backend=recording_backend, fullgraph=True, mode=None)
    compile_config._compile_all_devices = True
    eager = model.generate(PROMPT[:1], cache_implementation="static", **GREEDY)
    torch._dynamo.reset()
    compiled = model.generate(PROMPT[:1], cache_implementation="static", compile_config=compile_config, **GREEDY)
    assert graphs, "generate() did not run the compiled forward"
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("name", BASES)
def test_each_base_agrees_across_attention_backends_and_checkpointing(models, name):
    model = models[name]
    assert_attention_backends_agree(model)
    model.set_attn_implementation("sdpa")
    assert_checkpointing_keeps_the_gradients(model, use_reentrant=True)
    model.eval()


@pytest.mark.parametrize("name", BASES)
def test_each_base_gives_generates_tokens_under_continuous_batching(models, name):
    model = models[name]
    prompts = [PROMPT[0].tolist(), PROMPT[1, 3:].tolist(), PROMPT[0, :9].tolist()]
    greedy = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = None
    expected = [model.generate(torch.tensor([p]), generation_config=greedy)[0, len(p):].tolist() for p in prompts]
    outputs = model.generate_batch(prompts, generation_config=greedy, continuous_batching_config=(
        ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64)))
    found = {int(key.rsplit("_", 1)[1]): list(output.generated_tokens) for key, output in outputs.items()}
    assert [found[index] for index in range(len(prompts))] == expected


@pytest.mark.parametrize("name", BASES)
def test_each_base_fine_tunes_with_peft_default_lora_targets(models, name):
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    from resformer_hf import LAMBDA_MODULES

    peft_model = get_peft_model(models[name], LoraConfig(task_type="CAUSAL_LM", modules_to_save=LAMBDA_MODULES))
    targeted = {module.rsplit(".", 1)[-1] for module, layer in peft_model.named_modules()
                if isinstance(layer, LoraLayer)}
    assert targeted == {"q_proj", "v_proj"}  # Llama's defaults, which PEFT gives model type "resformer"
    loss = peft_model(input_ids=PROMPT, labels=PROMPT).loss
    loss.backward()
    trained = [p for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for p in trained)
    peft_model.unload()


@pytest.mark.parametrize("name", BASES)
def test_svformer_keeps_values_once_in_each_bases_full_layers(root, name):
    """SVFormer converts on every base; its cache keeps V_0 once for all full-attention layers (where the base has
    more than one), against transformers' stock cache of the same model, which keeps it in each; a windowed layer keeps
    its own window of V_0 in both. The tokens are the same."""
    model = AutoModelForCausalLM.from_pretrained(converted(name, root, "svformer", "paper")).eval()
    ids, config = PROMPT[:1], model.config
    with torch.no_grad():
        shared = cache_of(model(input_ids=ids, use_cache=True))
        stock = DynamicCache(config=config)
        stock_logits = model(input_ids=ids, use_cache=True, **with_cache(stock)).logits
    assert torch.equal(stock_logits, logits(model, ids, torch.ones_like(ids)))
    full = [layer for layer, kind in enumerate(config.attention_types) if kind == "full_attention"]
    values = ids.shape[1] * config.head_dim * config.num_key_value_heads * 4  # float32 V of the prompt, one layer
    assert cache_nbytes(stock) - cache_nbytes(shared) == max(len(full) - 1, 0) * values, config.attention_types
