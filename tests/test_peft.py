"""PEFT on a ResFormer: Llama's default target modules, LoRA training, adapter save/reload, merge, and the λ.

References: an HF `LlamaForCausalLM` of the same size for the default target modules, the adapted model's own logits
for reload and merge, and the untouched base for what must not change.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, default_data_collator

from resformer_hf import LAMBDA_MODULES, ResFormerForCausalLM, register_peft_target_modules
from resformer_hf.remote_code.lambdas import ValueResidual

from helpers import build_model, example_data, llama_pair, run_fresh_python, step_losses, training_arguments


@pytest.fixture(scope="module")
def data():
    tokenizer, dataset = example_data()
    held_out = len(dataset) - 16  # the last blocks: never trained on; for logits and the held-out loss
    return tokenizer, dataset.select(range(held_out)), torch.tensor(dataset[held_out:]["input_ids"])


def adapted_module_names(model: torch.nn.Module, marker: str) -> set[str]:
    return {name for name, module in model.named_modules() if hasattr(module, marker)}


def llama_twin(model: ResFormerForCausalLM) -> LlamaForCausalLM:
    fields = {k: v for k, v in model.config.to_dict().items() if k in LlamaConfig().to_dict() and k != "model_type"}
    return LlamaForCausalLM(LlamaConfig(**fields))


def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def held_out_loss(model, input_ids: torch.Tensor) -> float:
    with torch.no_grad():
        return model(input_ids=input_ids, labels=input_ids).loss.item()


def train(model, data, output_dir, steps: int = 8) -> list[float]:
    trainer = Trainer(
        model=model,
        args=training_arguments(output_dir, max_steps=steps, learning_rate=2e-2),
        train_dataset=data[1],
        data_collator=default_data_collator,
    )
    trainer.train()
    return step_losses(trainer)


def test_every_peft_table_that_knows_llama_knows_resformer():
    from peft.utils import constants

    tables = {
        name: table for name, table in vars(constants).items()
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and "llama" in table
    }
    assert len(tables) > 10
    assert register_peft_target_modules()  # a second call (import already made one) changes nothing
    for name, table in tables.items():
        assert table["resformer"] == table["llama"], name


@pytest.mark.parametrize("variant", ["learnable_plus", "svformer"])
def test_lora_default_target_modules_are_llamas(variant):
    assert TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["resformer"] == ["q_proj", "v_proj"]
    model = build_model(value_residual=variant)
    reference = get_peft_model(llama_twin(model), LoraConfig(task_type="CAUSAL_LM"))
    expected = adapted_module_names(reference, "lora_A")
    if variant == "svformer":  # layers n >= 1 have no v_proj: they reuse layer 0's values
        expected = {name for name in expected if "v_proj" not in name or ".layers.0." in name}
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM"))
    assert adapted_module_names(peft_model, "lora_A") == expected
    assert len(expected) == (6 if variant == "learnable_plus" else 4)


# A fresh interpreter that cannot import `resformer_hf`: the folder's remote code alone must give PEFT its defaults.
REMOTE_LORA = """
import importlib.util, json, sys
import torch, transformers
from transformers.models.auto import modeling_auto

folders = json.loads(sys.argv[1])
report = {"adapted": {}, "plugin_importable": importlib.util.find_spec("resformer_hf") is not None}
for name, folder in folders.items():
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=name != "llama")
    report[f"{name}_module"] = type(model).__module__
    if name == "no_peft":
        report["peft_imported"] = "peft" in sys.modules
        continue
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM"))
    report["adapted"][name] = sorted(n for n, module in peft_model.named_modules() if hasattr(module, "lora_A"))
report["causal_lm_names"] = sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
print("REPORT " + json.dumps(report))
"""


@pytest.mark.slow
def test_remote_code_gets_llamas_lora_defaults_without_the_plugin_and_never_requires_peft(tmp_path):
    llama, resformer = llama_pair("learnable_plus")
    llama.save_pretrained(tmp_path / "llama")
    resformer.save_pretrained(tmp_path / "resformer")
    folders = {"llama": str(tmp_path / "llama"), "resformer": str(tmp_path / "resformer")}
    report = run_fresh_python(REMOTE_LORA, tmp_path, json.dumps(folders))
    assert report["plugin_importable"] is False
    assert report["resformer_module"].startswith("transformers_modules.")
    assert report["adapted"]["resformer"] == report["adapted"]["llama"]
    assert len(report["adapted"]["llama"]) == 2 * llama.config.num_hidden_layers  # q_proj and v_proj
    assert "ResFormerForCausalLM" in report["causal_lm_names"]  # the Trainer shifts labels for it (label smoothing)

    # PEFT is imported inside `try` only: with PEFT missing too, the remote code still loads.
    report = run_fresh_python(REMOTE_LORA, tmp_path, json.dumps({"no_peft": folders["resformer"]}),
                              blocked=("resformer_hf", "peft"))
    assert report["no_peft_module"].startswith("transformers_modules.") and not report["peft_imported"]


def test_other_peft_methods_get_llamas_defaults_too():
    model = build_model()
    reference = get_peft_model(llama_twin(model), IA3Config(task_type="CAUSAL_LM"))
    peft_model = get_peft_model(model, IA3Config(task_type="CAUSAL_LM"))
    expected = adapted_module_names(reference, "ia3_l")
    assert adapted_module_names(peft_model, "ia3_l") == expected and len(expected) == 9


def test_lora_trains_saves_reloads_and_merges(data, tmp_path):
    model = build_model(len(data[0]))
    model.save_pretrained(tmp_path / "base")
    probe = data[2]
    base_logits = logits(model, probe)
    base_loss = held_out_loss(model, probe)
    lambdas_before = model.value_residual_lambdas()

    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8))
    train(peft_model, data, tmp_path / "run")
    assert held_out_loss(peft_model, probe) < base_loss - 1e-3  # small: LoRA on q/v of a random tiny model
    adapted = logits(peft_model, probe)
    assert (adapted - base_logits).abs().max() > 1e-3, "training should have moved the adapter off its zero init"
    with peft_model.disable_adapter():  # base weights frozen; LoRA's wrapped v_proj takes the plain (unfused) mix,
        torch.testing.assert_close(logits(peft_model, probe), base_logits, rtol=0, atol=1e-6)  # so rounding differs
    torch.testing.assert_close(peft_model.value_residual_lambdas(), lambdas_before, rtol=0, atol=0)

    peft_model.save_pretrained(tmp_path / "adapter")
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files and not any(f.endswith(".bin") for f in files)

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(logits(reloaded, probe), adapted, rtol=0, atol=1e-6)
    merged = reloaded.merge_and_unload()
    assert isinstance(merged, ResFormerForCausalLM) and not adapted_module_names(merged, "lora_A")
    torch.testing.assert_close(logits(merged, probe), adapted, rtol=0, atol=1e-5)


def test_lambdas_train_with_lora_and_travel_with_the_adapter(data, tmp_path):
    model = build_model(len(data[0]))
    model.save_pretrained(tmp_path / "base")
    probe = data[2]
    lambdas_before = model.value_residual_lambdas()

    config = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, modules_to_save=LAMBDA_MODULES)
    peft_model = get_peft_model(model, config)
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in name}
    assert trainable and all(".value_residual.modules_to_save.default." in name for name in trainable)
    train(peft_model, data, tmp_path / "run")
    trained_lambdas = peft_model.value_residual_lambdas()
    assert (trained_lambdas - lambdas_before)[1:].abs().min() > 1e-3, "the λ should train with the adapter"
    original = peft_model.base_model.model.model.value_residual.original_module
    assert isinstance(original, ValueResidual) and torch.equal(original.lambda_table(), lambdas_before)
    adapted = logits(peft_model, probe)

    peft_model.save_pretrained(tmp_path / "adapter")
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as saved:
        lambda_keys = {key for key in saved.keys() if "value_residual" in key}
    assert lambda_keys == {
        f"base_model.model.model.value_residual.{name}"
        for name in ("lambda_logits", "lambda_scale_offset", "lambda_self_offset")
    }

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(reloaded.value_residual_lambdas(), trained_lambdas, rtol=0, atol=0)
    torch.testing.assert_close(logits(reloaded, probe), adapted, rtol=0, atol=1e-6)

    merged = reloaded.merge_and_unload()
    assert isinstance(merged.model.value_residual, ValueResidual)
    merged.save_pretrained(tmp_path / "merged")
    standalone = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(standalone.value_residual_lambdas(), trained_lambdas, rtol=0, atol=0)
    torch.testing.assert_close(logits(standalone, probe), adapted, rtol=0, atol=1e-5)


def test_value_gates_train_with_lora_and_travel_with_the_adapter(data, tmp_path):
    """`gated`: `LAMBDA_MODULES` makes every layer's value gate trainable beside LoRA; the trained gates are saved in
    the adapter, reload to the same logits, and merge into a standalone model with real `ValueGate`s."""
    from resformer_hf.remote_code.value_residual import ValueGate

    model = build_model(len(data[0]), value_residual="gated")
    model.save_pretrained(tmp_path / "base")
    probe = data[2]
    table_before = model.value_residual_lambdas()

    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                                  modules_to_save=LAMBDA_MODULES))
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in name}
    gated_layers = model.config.layers_with_value_gate
    assert trainable == {f"base_model.model.model.layers.{layer}.self_attn.value_gate.modules_to_save.default.{part}"
                         for layer in gated_layers for part in ("weight", "bias")}
    train(peft_model, data, tmp_path / "run")
    trained_table = peft_model.value_residual_lambdas()
    assert (trained_table - table_before)[gated_layers].abs().min() > 1e-4, "the gates should train with the adapter"
    original = peft_model.base_model.model.model.layers[1].self_attn.value_gate.original_module
    assert isinstance(original, ValueGate) and not original.weight.any()  # the base stays at its zero start
    adapted = logits(peft_model, probe)

    peft_model.save_pretrained(tmp_path / "adapter")
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as saved:
        gate_keys = {key for key in saved.keys() if "value_gate" in key}
    assert gate_keys == {f"base_model.model.model.layers.{layer}.self_attn.value_gate.{part}"
                         for layer in gated_layers for part in ("weight", "bias")}

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(reloaded.value_residual_lambdas(), trained_table, rtol=0, atol=0)
    torch.testing.assert_close(logits(reloaded, probe), adapted, rtol=0, atol=1e-6)

    merged = reloaded.merge_and_unload()
    assert type(merged.model.layers[1].self_attn.value_gate) is ValueGate
    merged.save_pretrained(tmp_path / "merged")
    standalone = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(standalone.value_residual_lambdas(), trained_table, rtol=0, atol=0)
    torch.testing.assert_close(logits(standalone, probe), adapted, rtol=0, atol=1e-5)


def test_value_embeddings_train_with_lora_on_the_default_targets_and_travel_with_the_adapter(data, tmp_path):
    """Value embeddings (issue 56): LoRA on Llama's default targets, `LAMBDA_MODULES` trains each layer's table and
    gate beside it (both start at zero: the tables get gradient at once, the gates once the tables moved); the
    adapter holds them, reloads to the same logits and merges into a standalone model with real tables."""
    from resformer_hf.remote_code.value_embeddings import ValueEmbedding

    model = build_model(len(data[0]), value_embeddings="alternating")
    model.save_pretrained(tmp_path / "base")
    probe, layers = data[2], model.config.value_embedding_layers
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                                  modules_to_save=LAMBDA_MODULES))
    assert adapted_module_names(peft_model, "lora_A") == adapted_module_names(
        get_peft_model(llama_twin(model), LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8)), "lora_A")
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in name}
    tables = {f"base_model.model.model.layers.{layer}.self_attn.{module}.modules_to_save.default.weight"
              for layer in layers for module in ("value_embedding", "value_embedding_gate")}
    assert tables <= trainable
    train(peft_model, data, tmp_path / "run")
    attention = peft_model.base_model.model.model.layers[layers[-1]].self_attn
    assert attention.value_embedding.modules_to_save["default"].weight.abs().max() > 1e-4
    assert attention.value_embedding_gate.modules_to_save["default"].weight.abs().max() > 0
    assert not attention.value_embedding.original_module.weight.any()  # the base keeps its zero tables
    adapted = logits(peft_model, probe)

    peft_model.save_pretrained(tmp_path / "adapter")
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as saved:
        assert sum(".value_embedding" in key for key in saved.keys()) == 2 * len(layers)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(logits(reloaded, probe), adapted, rtol=0, atol=1e-6)
    merged = reloaded.merge_and_unload()
    assert type(merged.model.layers[layers[-1]].self_attn.value_embedding) is ValueEmbedding
    torch.testing.assert_close(logits(merged, probe), adapted, rtol=0, atol=1e-5)
