"""Scaling out: FSDP2, DeepSpeed ZeRO, tensor and pipeline parallel, for every kind of value residual.

Each engine runs in 2 CPU processes (`torchrun --nproc_per_node 2`, gloo) through a worker in `tests/distributed/`
and must match one process on the same global batch: per-step losses, the λ gradients of the first step and the λ
after 3 AdamW steps within 1e-5, the λ table (`value_residual_lambdas()` on the sharded model) equal to the
unsharded model's. `learnable_plus` (the default, softmax λ with a shared λ_scale), `svformer` (no λ, V_0 reused) and
`dense` (a λ matrix over every earlier layer's values) cover the three ways values travel, and `gated` a mix computed
by a gate in every layer (sharded with its layer; by kv head, as v_proj, under tensor parallelism); a plain Llama of
the same shape is the control. The `learnable_plus` checkpoint is written in the old layout (0-dim λ_scale), so
sharded loading of old checkpoints is covered too. Mixed precision must keep the λ in float32; pipeline parallelism
must refuse. Under tensor parallelism `generate()` must give one process's greedy tokens on both ranks, each holding
its kv heads' half of every value-embedding table and gate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bases import converted
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.distributed import DistributedConfig
from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

import resformer_hf
from resformer_hf.remote_code.loading import PIPELINE_PARALLEL_UNSUPPORTED

from helpers import TINY, mixing_parameters, model_with_random_lambdas, save_with_scalar_lambda_scale, tiny_config

WORKERS = Path(__file__).parent / "distributed"
sys.path.insert(0, str(WORKERS))
from engine_common import BASE_MODELS, LEARNING_RATE, MODELS, Engine, greedy_tokens, train  # noqa: E402  (shared with the workers, which run as scripts)

TOLERANCE = 1e-5
RESFORMERS = [name for name in MODELS if name != "llama"]


# ---- single process: layout, old checkpoints, refusals ---------------------------------------------------------


def test_every_lambda_is_at_least_one_dimensional(variant):
    """FSDP2 (`fully_shard`) and DeepSpeed ZeRO refuse 0-dim parameters."""
    model = resformer_hf.ResFormerForCausalLM(tiny_config(variant))
    assert all(parameter.dim() >= 1 for parameter in model.parameters())


@pytest.fixture
def old_checkpoint(tmp_path):
    """A `learnable_plus` model saved the old way (0-dim λ_scale), and the folder."""
    model = model_with_random_lambdas(tiny_config("learnable_plus"))
    save_with_scalar_lambda_scale(model, tmp_path / "old")
    assert load_file(tmp_path / "old" / "model.safetensors")["model.value_residual.lambda_scale_offset"].dim() == 0
    return model, tmp_path / "old"


def test_old_checkpoints_with_a_scalar_lambda_scale_load_to_the_same_values(old_checkpoint, tmp_path):
    model, folder = old_checkpoint
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    expected = model.model.value_residual.lambda_scale_offset
    assert loaded.model.value_residual.lambda_scale_offset.shape == (1,)
    assert loaded.model.value_residual.lambda_scale_offset.item() == expected.item() != 0.0
    torch.testing.assert_close(loaded.value_residual_lambdas(), model.value_residual_lambdas(), rtol=0, atol=0)
    input_ids = torch.randint(3, 128, (2, 9))
    torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)

    loaded.save_pretrained(tmp_path / "resaved")  # written in the new layout
    resaved = load_file(tmp_path / "resaved" / "model.safetensors")
    assert resaved["model.value_residual.lambda_scale_offset"].shape == (1,)

    by_torch = resformer_hf.ResFormerForCausalLM(model.config)  # torch's load_state_dict (Trainer resume, PEFT)
    by_torch.load_state_dict(load_file(folder / "model.safetensors"))
    assert by_torch.model.value_residual.lambda_scale_offset.item() == expected.item()


@pytest.mark.parametrize("as_dict", [False, True])
def test_pipeline_parallel_is_refused_before_anything_is_built(old_checkpoint, as_dict):
    _, folder = old_checkpoint
    config = {"pp_size": 2} if as_dict else DistributedConfig(pp_size=2)
    with pytest.raises(ValueError) as error:
        AutoModelForCausalLM.from_pretrained(folder, distributed_config=config)
    assert str(error.value) == PIPELINE_PARALLEL_UNSUPPORTED
    assert "V_0" in str(error.value) and "tp_size" in str(error.value) and "fsdp_size" in str(error.value)


@pytest.mark.parametrize("stage", ["first", "later"])
def test_a_model_split_into_pipeline_stages_by_hand_refuses_to_run(stage):
    """`apply_pipeline_parallelism` puts placeholders where another stage's modules live; no AttributeError."""
    model = model_with_random_lambdas(tiny_config("learnable_plus"))
    if stage == "first":
        model.model.layers[3], model.model.norm = PipelineIdentityLayer(), PipelineIdentityLayer()
    else:
        model.model.layers[0], model.model.embed_tokens = PipelineIdentityLayer(), PipelineIdentityLayer()
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        model(torch.randint(3, 128, (2, 5)))


@pytest.mark.parametrize("variant_name", ["learnable", "learnable_plus", "dense"])
def test_bfloat16_lambda_copies_give_float32_mixing_weights_from_rounded_offsets(variant_name):
    """What DeepSpeed bf16 does (it casts every parameter): the weights are still computed in float32, and only the
    small offsets are rounded, so the error is that of bf16 on the offsets, not on λ itself."""
    model = model_with_random_lambdas(tiny_config(variant_name))
    exact = model.model.value_residual()
    rounded = {name: p.detach().bfloat16().float() for name, p in model.model.value_residual.named_parameters()}
    model.model.value_residual.bfloat16()
    weights = model.model.value_residual()
    assert weights.dtype == torch.float32
    expected = model_with_random_lambdas(tiny_config(variant_name))
    with torch.no_grad():
        for name, parameter in expected.model.value_residual.named_parameters():
            parameter.copy_(rounded[name])
    torch.testing.assert_close(weights, expected.model.value_residual(), rtol=0, atol=0)
    bound = max(p.detach().abs().max().item() for p in rounded.values()) * 2**-8  # bf16 rounding of the offsets
    assert 0 < (weights - exact).abs().max().item() < 4 * bound


# ---- two processes -------------------------------------------------------------------------------------------


def write_data(folder: Path, bases: Path) -> Path:
    """Checkpoints (GQA, and `-mha` with as many kv heads as query heads) with λ away from their initial values, each
    base's (its source and conversions under `bases`), and the global batch. `learnable_plus` is saved in the old
    layout (0-dim λ_scale)."""
    for suffix, overrides in (("", {}), ("-mha", {"num_key_value_heads": TINY["num_attention_heads"]})):
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).save_pretrained(folder / f"llama{suffix}")
        for name in RESFORMERS:
            torch.manual_seed(0)
            tables = {"value_embeddings": [1, 3]} if name == "value_embeddings" else {}
            model = model_with_random_lambdas(tiny_config("learnable_plus" if tables else name, **tables, **overrides))
            with torch.no_grad():  # value embeddings: random tables and gates, so both get gradient at once
                for parameter in (p for n, p in model.named_parameters() if ".value_embedding" in n):
                    parameter.normal_(0.0, 0.5)
            save = save_with_scalar_lambda_scale if name == "learnable_plus" else type(model).save_pretrained
            save(model, folder / f"{name}{suffix}")
    for name in BASE_MODELS:  # each base converted (`bases.py`), λ moved off their initial values
        model = AutoModelForCausalLM.from_pretrained(converted(name.removeprefix("base-"), bases, "learnable_plus"))
        with torch.no_grad():
            for parameter in model.model.value_residual.parameters():
                parameter.uniform_(-0.4, 0.4, generator=torch.Generator().manual_seed(0))
        model.save_pretrained(folder / name)
    batch = torch.randint(3, TINY["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(1))
    (folder / "batch.json").write_text(json.dumps(batch.tolist()))
    return folder


def single_process_records(folder: Path) -> dict:
    """One process, whole batch: the training record of every checkpoint, its mixing weights and its logits."""
    batch = torch.tensor(json.loads((folder / "batch.json").read_text()))
    expected = {}
    for checkpoint in sorted(path for path in folder.iterdir() if path.is_dir()):
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
        value_residual = getattr(model.base_model, "value_residual", None)
        with torch.no_grad():
            extra = {"logits": model(input_ids=batch).logits.tolist(), "greedy": greedy_tokens(model.eval(), batch)}
            if value_residual is not None:
                extra["weights"] = value_residual().tolist()
        expected[checkpoint.name] = {**train(Engine(model), batch), **extra}
    return expected


def launch(worker: str, data: Path, out: Path, **environment) -> tuple[dict, str]:
    """Run a worker on 2 processes; its results by check, and an error text if it did not exit cleanly."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKERS / worker), str(data), str(out)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **environment}
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    failure = "" if result.returncode == 0 else result.stdout[-3000:] + result.stderr[-6000:]
    return (json.loads(out.read_text()) if out.exists() else {}), failure


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_data(tmp_path_factory.mktemp("distributed"), tmp_path_factory.mktemp("bases"))


@pytest.fixture(scope="module")
def reference(data) -> dict:
    return single_process_records(data)


@pytest.fixture(scope="module")
def torch_launch(data, tmp_path_factory) -> tuple[dict, str]:
    return launch("torch_engines.py", data, tmp_path_factory.mktemp("torch") / "results.json")


@pytest.fixture(scope="module")
def deepspeed_launch(data, tmp_path_factory) -> tuple[dict, str]:
    pytest.importorskip("deepspeed", reason="DeepSpeed is the optional extra `distributed`")
    return launch("deepspeed_engines.py", data, tmp_path_factory.mktemp("ds") / "results.json", DS_ACCELERATOR="cpu")


class Results(dict):
    def __missing__(self, check: str) -> dict:
        return {"error": f"{check} never ran: the worker stopped before it"}


@pytest.fixture(scope="module")
def torch_engines(torch_launch) -> Results:
    return Results(torch_launch[0])


@pytest.fixture(scope="module")
def deepspeed_engines(deepspeed_launch) -> Results:
    return Results(deepspeed_launch[0])


@pytest.mark.slow
@pytest.mark.parametrize("launched", ["torch_launch", "deepspeed_launch"])
def test_workers_exit_cleanly(launched, request):
    results, failure = request.getfixturevalue(launched)
    assert results and not failure, failure


def max_deltas(run: dict, expected: dict) -> dict[str, float]:
    """max |Δ| between a run's record and the reference's, for each quantity the run recorded."""
    assert "error" not in run, run.get("traceback", run["error"])
    deltas = {}
    for key in ("losses", "grads", "lambdas", "table_before", "table_after", "weights", "logits"):
        if key not in run:
            continue
        got, want = run[key], expected[key]
        if isinstance(want, dict):  # λ by parameter name
            assert sorted(got) == sorted(want), key
            got, want = ([x for name in sorted(values) for x in values[name]] for values in (got, want))
        if want is None:
            assert got is None, key
            continue
        got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
        assert got.shape == want.shape, key
        deltas[key] = (got - want).abs().max().item() if got.numel() else 0.0
    return deltas


def assert_matches(run: dict, expected: dict, name: str) -> None:
    deltas = max_deltas(run, expected)
    assert {"losses", "table_after"} <= deltas.keys() or {"losses", "lambdas"} <= deltas.keys(), deltas
    assert max(deltas.values()) <= TOLERANCE, (name, deltas)
    if "table_before" in deltas:
        assert deltas["table_before"] == 0.0, (name, deltas)  # sharding moves values, it never changes them
    if expected["lambdas"]:  # the λ really trained: the comparison is not between two untouched initial values
        assert (torch.tensor(expected["table_after"]) - torch.tensor(expected["table_before"])).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp2_torch", "fsdp2_transformers"])
@pytest.mark.parametrize("name", MODELS)
def test_fsdp2_matches_one_process(torch_engines, reference, engine, name):
    assert_matches(torch_engines[f"{engine}/{name}"], reference[name], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", BASE_MODELS)
def test_fsdp2_trains_each_base_as_one_process(torch_engines, reference, name):
    """Issue 67: FSDP2 (transformers' `DistributedConfig(fsdp_size=2)`) trains each base's converted model as one
    process does: Gemma 3's `1 + w` norms and windows, OLMo's post-norms and projection-wide q/k norms, ... Losses,
    gradients and logits to `TOLERANCE`. The trained λ to a tenth of one AdamW step (a λ that misses or doubles a step
    is a whole step off): OLMo normalises each sublayer's output, so λ_self's scale cancels and its gradients are
    ~1e-6, which AdamW's normalised steps turn into steps that the sharded sums' reordering (gradients 6e-8 apart)
    moves by up to 1.5e-4. A sharding error shows in the gradients."""
    deltas = max_deltas(torch_engines[f"fsdp2_transformers/{name}"], reference[name])
    assert {"losses", "grads", "table_after"} <= deltas.keys(), deltas
    assert max(deltas[key] for key in ("losses", "grads")) <= TOLERANCE, (name, deltas)
    assert max(deltas.values()) <= LEARNING_RATE / 10 and deltas["table_before"] == 0.0, (name, deltas)


@pytest.mark.slow
@pytest.mark.parametrize("check", ["tp_gqa", "tp_mha", "tp_accumulating"])
@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_matches_one_process_and_every_rank_agrees(torch_engines, reference, check, name):
    """GQA and MHA (`-mha` checkpoints), and gradient accumulation (two micro-batches, two backward passes a step)."""
    run = torch_engines[f"{check}/{name}"]
    assert_matches(run, reference[f"{name}-mha" if check == "tp_mha" else name], name)
    assert run["spread"] == 0.0  # λ gradients and values identical on both ranks (all-reduced, not per-head shares)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_generates_one_processs_greedy_tokens_and_splits_every_table_by_kv_head(
        torch_engines, reference, name):
    """`generate()` under tensor parallelism gives one process's greedy tokens on every rank; each rank holds its kv
    heads' columns of every value-embedding table and gate (half of each), none of them whole."""
    run = torch_engines[f"tp_generate/{name}"]
    assert "error" not in run, run.get("traceback", run["error"])
    assert run["tokens"] == reference[name]["greedy"] and run["ranks_differ"] == 0, (run["tokens"], reference[name])
    if name != "value_embeddings":
        return
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    vocab, kv_dim = TINY["vocab_size"], TINY["num_key_value_heads"] * head_dim
    prefix = "model.layers.{}.self_attn.value_embedding"
    expected = {}
    for layer in (1, 3):
        expected[f"{prefix.format(layer)}.weight"] = [[vocab, kv_dim // 2], [vocab, kv_dim]]
        expected[f"{prefix.format(layer)}_gate.weight"] = [[1, 12], [2, 12]]
    assert run["shares"] == expected and run["table_parameters"] == len(expected), run["shares"]


def test_the_tables_decide_the_greedy_tokens_tensor_parallel_is_compared_on(data, reference):
    """Zeroing the value_embeddings checkpoint's tables changes its greedy tokens: equal tokens under tensor
    parallelism mean the ranks' shares were looked up, not skipped."""
    model = AutoModelForCausalLM.from_pretrained(data / "value_embeddings").eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("value_embedding.weight"):
                parameter.zero_()
    assert greedy_tokens(model, torch.tensor(json.loads((data / "batch.json").read_text()))) != reference[
        "value_embeddings"]["greedy"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp2_torch_bf16", "fsdp2_transformers_bf16"])
@pytest.mark.parametrize("name", RESFORMERS)
def test_fsdp2_mixed_precision_mixes_with_float32_lambdas(torch_engines, reference, data, engine, name):
    run = torch_engines[f"{engine}/{name}"]
    if fixed_lambdas_reach_the_layers_exact(run, data / name):
        return
    assert run.get("dtype") == "torch.float32", run
    assert max_deltas(run, reference[name])["weights"] <= 1e-6  # bf16 would be off by ~1e-3


def fixed_lambdas_reach_the_layers_exact(run: dict, folder: Path) -> bool:
    """Whether the model's λ are fixed (svformer; `gated`'s initial mix, its gates the learnt part), having asserted
    that its layers got the config's Python floats, no table: nothing an engine could round."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    if list(model.model.value_residual.parameters()):
        return False
    assert "error" not in run, run.get("traceback")
    expected = model.model.value_residual.per_layer(torch.bfloat16, 16)
    assert run["weights"] is None and run["per_layer"] == [list(pair) for pair in expected], run
    assert {type(x) for pair in expected for x in pair} <= {float, type(None)}
    return True


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_pipeline_parallel_refuses_resformers_and_runs_the_llama_control(torch_engines, reference, name):
    run = torch_engines[f"pp/{name}"]
    if name == "llama":
        assert max_deltas(run, reference[name])["logits"] <= TOLERANCE
    else:
        assert run.get("error") == f"ValueError: {PIPELINE_PARALLEL_UNSUPPORTED}"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero2", "zero3", "trainer_zero3"])
@pytest.mark.parametrize("name", MODELS)
def test_deepspeed_zero_matches_one_process(deepspeed_engines, reference, engine, name):
    assert_matches(deepspeed_engines[f"{engine}/{name}"], reference[name], name)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", RESFORMERS)
def test_deepspeed_bf16_mixes_in_float32_from_rounded_offsets(deepspeed_engines, reference, data, stage, name):
    """DeepSpeed casts every parameter to bf16 (its `keep_in_fp32_modules` keeps only buffers), so the λ offsets
    arrive rounded; the mixing weights are still float32, computed from them, and fixed λ stay float32 buffers."""
    run = deepspeed_engines[f"zero{stage}_bf16/{name}"]
    assert "error" not in run, run.get("traceback")
    assert run["buffer_dtypes"] in ([], ["torch.float32"])
    if fixed_lambdas_reach_the_layers_exact(run, data / name):
        return
    assert run["dtype"] == "torch.float32"
    model = AutoModelForCausalLM.from_pretrained(data / name)
    with torch.no_grad():
        for parameter in [*model.model.value_residual.parameters(), *mixing_parameters(model).values()]:
            parameter.copy_(parameter.bfloat16().float())
        rounded = model.model.value_residual()
    torch.testing.assert_close(torch.tensor(run["weights"]), rounded, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(run["table_before"]), model.value_residual_lambdas(), rtol=0, atol=1e-6)
