"""Serving with vLLM's Transformers modeling backend (`trust_remote_code=True`): greedy tokens from vLLM equal
`generate()`'s, offline (`LLM`) and from the OpenAI-compatible server, with the plugin installed (its vLLM model,
`resformer_hf.integrations.vllm_plugin`, serves: an SVFormer stores its values once) and from a folder's remote code
alone (`model_impl="transformers"`).

vLLM pins its own transformers, so these tests run in their own virtualenv (`bash .ci/vllm-venv .venv/vllm`); elsewhere
they skip. Every vLLM engine runs in a fresh interpreter (`vllm_serving.py`); the reference tokens come from
`generate()` in this process, one prompt at a time (no padding), while vLLM gets the prompts as one batch and packs
them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed: the serving tests run in their own virtualenv (vLLM pins its own transformers); "
        "see .ci/vllm-venv and docs/serving.md",
        allow_module_level=True,
    )

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from resformer_hf import ResFormerConfig, convert_llama_checkpoint  # noqa: E402
from resformer_hf.examples.finetune import TEXT_CHARS, VOCAB_SIZE  # noqa: E402
from resformer_hf.hub import save_for_hub  # noqa: E402
from resformer_hf.remote_code.value_embeddings import NEEDS_INPUT_IDS  # noqa: E402
from resformer_hf.remote_code.variants import VARIANTS  # noqa: E402
from resformer_hf.text import sample_text, train_tokenizer  # noqa: E402

from helpers import TINY, model_with_random_lambdas  # noqa: E402
from vllm_serving import ENGINE_ARGS, engine_env, free_port, run_engine  # noqa: E402

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
#: Prompts of different lengths (2 to 174 tokens; the last is the first 240 characters of the bundled sample text), so
#: vLLM packs sequences of different lengths into one step.
PROMPT_TEXTS = ("It", "The quick brown fox", "Once upon a time there was a little girl who lived in a village near")
SERVED = ("learnable_plus", "svformer")
OTHER_VARIANTS = tuple(variant for variant in VARIANTS if variant not in SERVED)
#: Cross-layer attention alone and with SVFormer (folder name: config fields).
CLA = {"cla2": dict(value_residual="none", cross_layer_attention=2),
       "svformer_cla2": dict(value_residual="svformer", cross_layer_attention=2)}


def _shape(tokenizer) -> dict:
    """TINY's layer and head counts with head size 32 (vLLM's CPU attention has no kernel for TINY's 8)."""
    special = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("pad", "bos", "eos")}
    return {**TINY, **special, "vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 256,
            "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Folders as a user publishes them (plugin-written Hub folders with λ moved off init, a Llama, and a converted
    Llama), the prompts as token ids, and `generate()`'s greedy tokens for each folder."""
    root = tmp_path_factory.mktemp("serving")
    tokenizer = train_tokenizer([sample_text(TEXT_CHARS)], VOCAB_SIZE)
    texts = [*PROMPT_TEXTS, sample_text(TEXT_CHARS)[:240]]
    prompts = [tokenizer(t).input_ids for t in texts]
    assert len({len(p) for p in prompts}) == len(prompts) and min(map(len, prompts)) >= 1
    shape = _shape(tokenizer)
    folders = {}
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    folders["llama"] = root / "llama"
    llama.save_pretrained(folders["llama"])
    tokenizer.save_pretrained(folders["llama"])
    folders["converted_svformer"] = root / "converted_svformer"
    convert_llama_checkpoint(folders["llama"], folders["converted_svformer"], variant="svformer", init="paper",
                             progress=False)
    for index, variant in enumerate(VARIANTS):
        torch.manual_seed(1 + index)
        model = model_with_random_lambdas(ResFormerConfig(**shape, value_residual=variant))
        folders[variant] = save_for_hub(model, root / variant, tokenizer=tokenizer)
    for index, (name, fields) in enumerate(CLA.items()):
        torch.manual_seed(100 + index)
        model = model_with_random_lambdas(ResFormerConfig(**shape, **fields))
        folders[name] = save_for_hub(model, root / name, tokenizer=tokenizer)
    torch.manual_seed(200)  # value embeddings (issue 56): random tables and gates, so the tokens depend on them
    model = model_with_random_lambdas(ResFormerConfig(**shape, value_embeddings="alternating"))
    with torch.no_grad():
        for parameter in (p for name, p in model.named_parameters() if ".value_embedding" in name):
            parameter.normal_(0.0, 0.5)
    folders["value_embeddings"] = save_for_hub(model, root / "value_embeddings", tokenizer=tokenizer)
    references = {name: greedy(folder, prompts, tokenizer.pad_token_id) for name, folder in folders.items()}
    return dict(root=root, folders=folders, prompts=prompts, texts=texts, references=references, tokenizer=tokenizer)


def greedy(folder: Path, prompts: list[list[int]], pad_token_id: int) -> list[list[int]]:
    """`generate()`'s greedy continuation of each prompt, alone (no padding), MAX_TOKENS tokens, not stopping at EOS
    (vLLM's `ignore_eos`)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = []
    for ids in prompts:
        output = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                pad_token_id=pad_token_id)
        tokens.append(output[0, len(ids):].tolist())
        assert len(tokens[-1]) == MAX_TOKENS
    return tokens


def engine_job(served: dict, names, *, import_plugin: bool) -> dict:
    runs = [dict(name=name, folder=str(served["folders"][name]), prompts=served["prompts"], max_tokens=MAX_TOKENS)
            for name in names]
    return dict(import_plugin=import_plugin, runs=runs)


def assert_same_tokens(served: dict, results: dict, names) -> None:
    """vLLM's tokens equal `generate()`'s, every prompt, every token; and vLLM fused every layer it serves as it fuses
    a Llama's (`assert_fused_like_llama`)."""
    for name in names:
        got, expected = results[name]["tokens"], served["references"][name]
        mismatches = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
        assert len(got) == len(expected) and not mismatches, (name, mismatches, got, expected)
        assert_fused_like_llama(name, results[name]["fusions"], served["folders"][name])


def assert_fused_like_llama(name: str, fusions: list[dict], folder: Path) -> None:
    """Each decoder layer as vLLM served it: q, k and v as one `qkv_proj` GEMM (a layer without v_proj: q and k as
    one merged GEMM; a cross-layer-attention consumer has q alone), gate and up as one `gate_up_proj`, every norm
    vLLM's own, as for a Llama (`tests/vllm_serving.py: fusions`)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    without_values = set(config.get("layers_without_value_projection") or ())  # not serialised: derived below
    if config.get("value_residual") == "svformer":
        without_values = set(range(1, config["num_hidden_layers"]))
    group = config.get("cross_layer_attention") or 1
    for index, layer in enumerate(fusions):
        attention = layer["attention"]
        if index % group:  # a consumer: its q alone
            expected = ["o_proj", "q_proj"]
        elif index in without_values:
            expected = ["merged_proj_6_q_proj_6_k_proj", "o_proj"]
        else:
            expected = ["o_proj", "qkv_proj"]
        assert sorted(attention) == expected, (name, index, attention)
        assert layer["mlp"] == ["act_fn", "down_proj", "gate_up_proj"], (name, index, layer["mlp"])
        assert layer["norms"] and all(layer["norms"].values()), (name, index, layer["norms"])


def test_vllms_fusers_take_every_layer_as_they_take_a_llamas():
    """vLLM's Transformers backend fuses what its fusers can read in a module's forward (`get_fusers`, cached by
    class): every attention layer of every variant and option gets the QKV fusion a Llama's gets (a layer without
    v_proj, q and k merged), every MLP the gate/up fusion, every norm vLLM's RMSNorm. Asked directly of vLLM's own
    fuser on tiny models, no engine: it fails the moment the attention forward hides a projection from it."""
    from vllm.model_executor.models.transformers.fuser import get_fusers

    def fusers(model) -> dict[str, list[str]]:
        return {name: [type(fuser).__name__ for fuser in get_fusers(module)] for name, module in model.named_modules()
                if name.endswith(("self_attn", "mlp", "layernorm"))}

    shape = dict(TINY, hidden_size=64, head_dim=16)
    llama = fusers(LlamaForCausalLM(LlamaConfig(**shape)))
    assert {name: found[0] for name, found in llama.items()} == {
        name: "QKVFuser" if name.endswith("self_attn") else "GLUFuser" if name.endswith("mlp") else "RMSNormFuser"
        for name in llama}
    models = {**{variant: dict(value_residual=variant) for variant in VARIANTS}, **CLA,
              "value_embeddings": dict(value_residual="learnable_plus", value_embeddings="alternating")}
    for name, fields in models.items():
        found = fusers(model_with_random_lambdas(ResFormerConfig(**shape, **fields)))
        config = ResFormerConfig(**shape, **fields)
        for module, kinds in found.items():
            layer = int(module.split(".")[2])
            if module.endswith("self_attn") and layer in config.layers_reading_shared_keys_values:
                assert "QKVFuser" not in kinds, (name, module, kinds)  # q alone: nothing to fuse
            elif module.endswith("self_attn") and layer in config.layers_without_value_projection:
                assert kinds[0] == "MergedColumnParallelFuser", (name, module, kinds)
            else:
                assert kinds[0] == llama[module][0], (name, module, kinds)


def test_references_depend_on_lambda(served):
    """The λ the folders carry decide the tokens (so equal tokens mean vLLM loaded and used them): the same
    learnable_plus weights with λ back at their initial values generate differently."""
    folder = served["folders"]["learnable_plus"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in model.model.value_residual.parameters():
            parameter.zero_()
    reset = served["root"] / "learnable_plus_lambda_init"
    model.save_pretrained(reset)
    assert greedy(reset, served["prompts"], served["tokenizer"].pad_token_id) != served["references"]["learnable_plus"]


def test_offline_with_plugin(served, tmp_path):
    """With the plugin installed, vLLM's default `model_impl="auto"` serves ResFormer folders with the plugin's
    model (`resformer_hf.integrations.vllm_plugin`): learnable_plus, SVFormer and a converted Llama (SVFormer, paper
    λ) give `generate()`'s greedy tokens, and an SVFormer keeps (L+1)/(2L) of the Llama's KV cache bytes per token
    (keys per layer, layer 0's values once), so the same cache memory holds 2L/(L+1) times the tokens. The Llama
    (control) serves with the Transformers backend, as in the remote-code tests."""
    names = ("llama", *SERVED, "converted_svformer")
    job = engine_job(served, names, import_plugin=True)
    for run in job["runs"]:
        run["engine_args"] = dict(model_impl="transformers" if run["name"] == "llama" else "auto")
    results = run_engine(job, tmp_path, hide_plugin=False)
    assert_same_tokens(served, results, names)
    layers = TINY["num_hidden_layers"]
    for name in names:
        probe = results[name]["probe"]
        assert probe["plugin_importable"], probe
        if name != "llama":  # the plugin's vLLM model, running the plugin's modeling code
            assert probe["served_class"] == "resformer_hf.integrations.vllm_plugin.model.ResFormerForCausalLM", probe
            assert probe["model_class"] == "resformer_hf.remote_code.modeling_resformer.ResFormerModel", probe
        assert len(probe["attention_layers"]) == layers
        assert all(layer["num_kv_heads"] == TINY["num_key_value_heads"] and layer["head_size"] == 32
                   for layer in probe["attention_layers"]), probe
    # SVFormer layers n >= 1 have no v_proj in vLLM either (layer 0's is in its fused qkv_proj): they attend over
    # layer 0's values, kept in one store
    for name in ("svformer", "converted_svformer"):
        attention = results[name]["probe"]["attention_layers"]
        assert not any(layer["has_v_proj"] for layer in attention)
        assert ["qkv_proj" in layer["attention"] for layer in results[name]["fusions"]] == [True] + [False] * (
            layers - 1)
        assert {layer["attention_class"] for layer in attention} == {"SharedValuesAttention"}
        assert len({layer["value_store"] for layer in attention}) == 1
    assert {layer["attention_class"] for layer in results["learnable_plus"]["probe"]["attention_layers"]} == {
        "Attention"}
    # Cache bytes per token: K and V in every layer (float32) for the Llama and learnable_plus; for an SVFormer the
    # keys of every layer and layer 0's values once, (L+1)/(2L) of that (0.625 at L = 4). vLLM fills the memory it is
    # given with whole blocks, so the cache holds exactly floor(bytes / (block_size · bytes per token)) blocks.
    full = layers * 2 * TINY["num_key_value_heads"] * 32 * 4
    svformer = (layers + 1) * TINY["num_key_value_heads"] * 32 * 4
    assert svformer / full == (layers + 1) / (2 * layers)
    per_token = dict(llama=full, learnable_plus=full, svformer=svformer, converted_svformer=svformer)
    blocks = {name: results[name]["num_blocks"] for name in names}
    expected = {name: results[name]["kv_cache_bytes"] // (results[name]["block_size"] * per_token[name])
                for name in names}
    assert blocks == expected, (blocks, expected)
    tokens = {name: blocks[name] * results[name]["block_size"] for name in names}
    assert 2 * layers / (layers + 1) * 0.99 < tokens["svformer"] / tokens["llama"] <= 2 * layers / (layers + 1)


def test_offline_cross_layer_attention_with_plugin(served, tmp_path):
    """With the plugin, CLA2's consumer layers share their producer's KV cache through vLLM's own cross-layer KV
    sharing: half the Llama control's bytes per token, and with SVFormer the producers' keys plus one value store,
    (L/2 + 1)/(2L) of it; `generate()`'s greedy tokens in both."""
    names = ("llama", *CLA)
    job = engine_job(served, names, import_plugin=True)
    for run in job["runs"]:
        run["engine_args"] = dict(model_impl="transformers" if run["name"] == "llama" else "auto")
    results = run_engine(job, tmp_path, hide_plugin=False)
    assert_same_tokens(served, results, names)
    layers, kv_heads = TINY["num_hidden_layers"], TINY["num_key_value_heads"]
    for name in CLA:
        probe = results[name]["probe"]
        assert probe["served_class"] == "resformer_hf.integrations.vllm_plugin.model.ResFormerForCausalLM", probe
        attention = probe["attention_layers"]
        targets = [layer["kv_sharing_target"] for layer in attention]
        assert targets == [None, attention[0]["layer_name"], None, attention[2]["layer_name"]], targets
    assert {layer["attention_class"] for layer in results["svformer_cla2"]["probe"]["attention_layers"]} == {
        "SharedValuesAttention"}
    # Bytes per token (float32, head size 32): the Llama 2 · L pages, CLA2 L, SVFormer × CLA2 L/2 + 1 half-pages
    half_page = kv_heads * 32 * 4
    per_token = dict(llama=2 * layers * half_page, cla2=layers * half_page,
                     svformer_cla2=(layers // 2 + 1) * half_page)
    assert per_token == dict(llama=2048, cla2=1024, svformer_cla2=768)
    blocks = {name: results[name]["num_blocks"] for name in names}
    expected = {name: results[name]["kv_cache_bytes"] // (results[name]["block_size"] * per_token[name])
                for name in names}
    assert blocks == expected, (blocks, expected)
    tokens = {name: blocks[name] * results[name]["block_size"] for name in names}
    assert 0.99 * 2 < tokens["cla2"] / tokens["llama"] <= 2
    assert 0.99 * 2 * layers / (layers / 2 + 1) < tokens["svformer_cla2"] / tokens["llama"] <= 2 * layers / (
        layers / 2 + 1)


def test_offline_from_remote_code_alone(served, tmp_path):
    """learnable_plus, SVFormer, CLA2 and SVFormer × CLA2 serve with `generate()`'s greedy tokens when no process
    vLLM starts can import the plugin: the folder's remote code alone."""
    names = (*SERVED, *CLA)
    results = run_engine(engine_job(served, names, import_plugin=False), tmp_path, hide_plugin=True)
    assert_same_tokens(served, results, names)
    for name in names:
        probe = results[name]["probe"]
        assert not probe["plugin_importable"] and not probe["plugin_imported"], probe
        assert probe["model_class"].startswith("transformers_modules."), probe


@pytest.mark.parametrize("import_plugin", [True, False])
def test_offline_value_embeddings(served, tmp_path, import_plugin):
    """Value embeddings (learnable_plus with tables in layers 1 and 3): `generate()`'s greedy tokens with the
    plugin's vLLM model and from the folder's remote code alone; vLLM's cache pages hold V' + g·E[token] as the
    model's cache does, so its bytes per token are a Llama's. A request with prompt embeddings (no token ids for the
    tables) is refused by vLLM itself, which is started without `enable_prompt_embeds`, and the engine serves on."""
    job = engine_job(served, ("value_embeddings",), import_plugin=import_plugin)
    job["runs"][0]["prompt_embeds_request"] = True
    if import_plugin:  # as in test_offline_with_plugin; without it, as in test_offline_from_remote_code_alone
        job["runs"][0]["engine_args"] = dict(model_impl="auto")
    results = run_engine(job, tmp_path, hide_plugin=not import_plugin)
    assert_same_tokens(served, results, ("value_embeddings",))
    assert len(results["value_embeddings"]["probe"]["attention_layers"]) == TINY["num_hidden_layers"]
    assert results["value_embeddings"]["prompt_embeds_refusal"] == (
        "ValueError: You must set `--enable-prompt-embeds` to input `prompt_embeds`.")


@pytest.mark.parametrize("import_plugin", [True, False])
def test_value_embeddings_refuse_an_engine_with_prompt_embeddings_at_start(served, tmp_path, import_plugin):
    """With `enable_prompt_embeds` vLLM hands the model embeddings only, for every request, and the tables need the
    token ids: the engine is refused as it builds the model, with the error that says what to do, before any request
    (it used to start and die at its first one)."""
    job = engine_job(served, ("value_embeddings",), import_plugin=import_plugin)
    implementation = "auto" if import_plugin else "transformers"
    job["runs"][0]["engine_args"] = dict(enable_prompt_embeds=True, model_impl=implementation)
    with pytest.raises(RuntimeError, match="vLLM engine process failed"):
        run_engine(job, tmp_path, hide_plugin=not import_plugin)
    log = (tmp_path / "engine.log").read_text()
    assert f"ValueError: {NEEDS_INPUT_IDS}" in log, log[-3000:]
    assert "llm = LLM(" in log and "llm.generate(" not in log, log[-3000:]  # at engine start


def test_prompt_embeddings_engine_serves_a_resformer_without_tables(served, tmp_path):
    """The control: with `enable_prompt_embeds` every step reaches the model as embeddings, and learnable_plus (no
    tables; folder's remote code alone) still gives `generate()`'s greedy tokens."""
    job = engine_job(served, ("learnable_plus",), import_plugin=False)
    job["runs"][0]["engine_args"] = dict(enable_prompt_embeds=True)
    assert_same_tokens(served, run_engine(job, tmp_path, hide_plugin=True), ("learnable_plus",))


@pytest.mark.parametrize("import_plugin", [True, False])
def test_value_embeddings_under_tensor_parallel(served, tmp_path, monkeypatch, import_plugin):
    """Two CPU ranks (`tensor_parallel_size=2`): `generate()`'s greedy tokens, with the plugin's vLLM model and from
    the folder's remote code alone. vLLM swaps each table, vocabulary-sized, for its VocabParallelEmbedding: each rank
    holds half its rows (the vocabulary padded to a multiple of 64), a lookup is all-reduced to every kv head's
    columns, and the rank keeps its own head's, the one its `v_proj` and gate shards compute."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # vLLM's default: a NUMA node for each rank
    job = engine_job(served, ("value_embeddings",), import_plugin=import_plugin)
    job["in_process"] = False  # ranks are processes
    implementation = "auto" if import_plugin else "transformers"
    job["runs"][0]["engine_args"] = dict(tensor_parallel_size=2, model_impl=implementation)
    results = run_engine(job, tmp_path, hide_plugin=not import_plugin)
    assert_same_tokens(served, results, ("value_embeddings",))
    kv_heads, padded = TINY["num_key_value_heads"], -(-len(served["tokenizer"]) // 64) * 64
    expected = []
    for rank in (0, 1):
        share = {}
        for layer in (1, 3):  # "alternating" at 4 layers
            name = f"model.layers.{layer}.self_attn.value_embedding"
            share[name] = dict(weight=[padded // 2, kv_heads * 32], tp_rank=rank)
            share[f"{name}_gate"] = dict(heads=kv_heads // 2)
        expected.append(share)
    assert results["value_embeddings"]["shares"] == expected


def test_offline_every_other_variant(served, tmp_path):
    """identity, constant, learnable, sparse, dense and NeuTRENO: `generate()`'s greedy tokens too."""
    results = run_engine(engine_job(served, OTHER_VARIANTS, import_plugin=False), tmp_path, hide_plugin=True)
    assert_same_tokens(served, results, OTHER_VARIANTS)


def test_offline_every_base(tmp_path):
    """Each base of issue 67 (`bases.py`: Qwen 3, SmolLM3, OLMo 2, Gemma 3, Mistral's window, Llama 3.2's shape),
    converted to learnable_plus with λ off their initial values, serves from its remote code with `generate()`'s
    greedy tokens (prompts longer than the windows), and vLLM fuses each layer as it fuses a Llama's: q, k and v, the
    MLP, and every norm (q/k norms and Gemma's `1 + w` norms too)."""
    from bases import BASES, save_source

    from resformer_hf import convert_llama_checkpoint

    prompts = [torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(length)).tolist()
               for length in (3, 14, 27)]
    folders, references = {}, {}
    for name in BASES:
        # vLLM's CPU attention takes head sizes 32, 64, ...; its engines here are told 256 positions
        source = save_source(name, tmp_path / name, hidden_size=128, head_dim=32, max_position_embeddings=256)
        converted = tmp_path / f"{name}-learnable_plus"
        convert_llama_checkpoint(source, converted, variant="learnable_plus", progress=False)
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
        with torch.no_grad():
            for parameter in model.model.value_residual.parameters():
                parameter.uniform_(-0.4, 0.4, generator=torch.Generator().manual_seed(0))
        folders[name] = save_for_hub(model, tmp_path / f"{name}-served")
        references[name] = greedy(folders[name], prompts, pad_token_id=0)
    served = dict(folders=folders, prompts=prompts, references=references)
    job = engine_job(served, BASES, import_plugin=False)
    job["engine_args"] = dict(skip_tokenizer_init=True)  # token ids in and out
    results = run_engine(job, tmp_path / "engine", hide_plugin=True)
    assert_same_tokens(served, results, BASES)


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _stop(process: subprocess.Popen) -> None:
    """SIGINT (vLLM's clean shutdown), then SIGTERM, then SIGKILL, each with a bounded wait; the whole process
    group, so the engine core the server started goes too."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        if process.poll() is not None:
            break
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    try:  # leftovers of the group (the engine core) once the server itself has exited
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def served_token_ids(choice: dict) -> dict[str, list[int]]:
    """The completion's token ids by where the server put them: `token_ids`, and/or the logprobs tokens written
    as "token_id:N" (`return_tokens_as_token_ids`)."""
    found = {}
    if choice.get("token_ids") is not None:
        found["token_ids"] = list(choice["token_ids"])
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if tokens:
        assert all(token.startswith("token_id:") for token in tokens), tokens
        found["logprobs"] = [int(token.removeprefix("token_id:")) for token in tokens]
    return found


def test_served_token_ids_are_read_from_either_field():
    assert served_token_ids({"token_ids": [5, 6], "logprobs": {"tokens": ["token_id:5", "token_id:6"]}}) == {
        "token_ids": [5, 6], "logprobs": [5, 6]}
    assert served_token_ids({"token_ids": None, "logprobs": {"tokens": ["token_id:7"]}}) == {"logprobs": [7]}
    assert served_token_ids({"text": "x"}) == {}


def test_openai_server(served, tmp_path):
    """`vllm serve FOLDER --model-impl transformers --trust-remote-code` on 127.0.0.1 (plugin hidden) answers a
    completion request (temperature 0, 16 tokens) with `generate()`'s greedy text and tokens."""
    name = "svformer"
    folder = served["folders"][name]
    port = free_port()
    options = [
        "--host", "127.0.0.1", "--port", str(port),
        "--model-impl", "transformers", "--trust-remote-code", "--dtype", ENGINE_ARGS["dtype"], "--enforce-eager",
        "--max-model-len", str(ENGINE_ARGS["max_model_len"]),
        "--kv-cache-memory-bytes", str(ENGINE_ARGS["kv_cache_memory_bytes"]), "--seed", "0",
    ]
    try:
        importlib.metadata.version("vllm")
        command = [str(Path(sys.executable).with_name("vllm")), "serve", str(folder), *options]
    except importlib.metadata.PackageNotFoundError:
        # vllm-cpu: its `vllm` command dies at start asking for the version of a distribution named "vllm"
        # (importlib.metadata.PackageNotFoundError); the same server runs as a module (docs/serving.md)
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), *options]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=tmp_path, env=engine_env(tmp_path, hide_plugin=True),
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert process.poll() is None, f"vllm serve exited ({process.returncode}):\n{log_path.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"vllm serve not healthy in 600 s:\n{log_path.read_text()[-6000:]}"
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        prompt = served["prompts"][2]
        # Token ids two ways: `return_token_ids` (newer vLLM) and the logprobs tokens as "token_id:N" (older too)
        body = dict(model=str(folder), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                    return_token_ids=True, logprobs=0, return_tokens_as_token_ids=True)
        answer = _post(f"{base}/v1/completions", body, timeout=120)
    finally:
        _stop(process)
    assert process.poll() is not None
    expected = served["references"][name][2]
    choice = answer["choices"][0]
    assert choice["text"] == served["tokenizer"].decode(expected), (choice["text"], expected)
    returned = served_token_ids(choice)
    assert returned, f"the server returned no token ids (neither token_ids nor logprobs tokens): {choice}"
    for source, ids in returned.items():  # always compared: the text alone can hide a different tokenisation
        assert ids == expected, (source, ids, expected)
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
