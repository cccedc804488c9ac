"""RL fine-tuning with TRL's `GRPOTrainer` (generation through `generate()`), full and LoRA, against the source Llama.

The ResFormer is the Llama converted with `convert_llama_checkpoint` (default: `learnable`, `init="preserve"`), which
computes the Llama's function with each layer's λ pair free and getting gradient from the first step. So the first
GRPO step must sample the Llama's completions, score them through the same reward function to the same rewards, and
give every Llama weight the Llama's gradient, plus a non-zero gradient on the λ; the λ then move off their initial
values, and what the trainer saves reloads to the trained model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

import resformer_hf
from resformer_hf import convert_llama_checkpoint

STEPS = 3
PROMPTS = ["Once upon a time", "The little girl", "In the village", "She said"]


@pytest.fixture(scope="module")
def folders(client_folders, tmp_path_factory):
    """The clients' Llama and its `learnable` conversion (λ_first = 0, λ_self = 1: the Llama's outputs)."""
    converted = tmp_path_factory.mktemp("grpo") / "learnable"
    convert_llama_checkpoint(client_folders["llama"], converted, variant="learnable", progress=False)
    return {"llama": client_folders["llama"], "resformer": converted}


class Recorder(TrainerCallback):
    """The first optimizer step's gradients, by parameter name, as the trainer is about to apply them."""

    def __init__(self):
        self.first_step_gradients = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.first_step_gradients is None:
            self.first_step_gradients = {name: parameter.grad.detach().clone()
                                         for name, parameter in model.named_parameters() if parameter.grad is not None}


def vowel_share(completions, **kwargs) -> list[float]:
    """The reward: the share of vowels in each completion, varied enough across a group to give advantages."""
    vowel_share.seen.append(list(completions))
    return [sum(character in "aeiou" for character in text) / max(len(text), 1) for text in completions]


def grpo(folder, output_dir, peft_config=None):
    """`STEPS` GRPO steps on `folder`'s checkpoint (4 prompts, 4 sampled completions of 8 tokens each); returns the
    trainer, the completions the reward saw at each step, and the first step's gradients."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl", reason="TRL is in the `clients` extra")
    config = trl.GRPOConfig(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    recorder, vowel_share.seen = Recorder(), []
    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder), reward_funcs=vowel_share, args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS * STEPS}),
        processing_class=AutoTokenizer.from_pretrained(folder), peft_config=peft_config, callbacks=[recorder],
    )
    trainer.train()
    return trainer, vowel_share.seen, recorder.first_step_gradients


def lambdas(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The λ among `named` tensors, by their name in the base model (PEFT's prefix and the `modules_to_save` copy's
    infix dropped: under LoRA the copy is what trains; the frozen original is left out)."""
    found = {}
    for name, tensor in named.items():
        if "value_residual" in name and "original_module" not in name:
            found[name.removeprefix("base_model.model.").replace("modules_to_save.default.", "")] = tensor.detach()
    return found


def same_start_as_the_llama(runs: dict) -> None:
    """The first step: the Llama's completions and rewards, and the Llama's gradient on every shared weight."""
    (_, llama_seen, llama_gradients), (_, seen, gradients) = runs["llama"], runs["resformer"]
    rewards = {name: [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
               for name, (trainer, _, _) in runs.items()}
    assert len(rewards["llama"]) == STEPS and len(rewards["resformer"]) == STEPS, rewards
    assert seen[0] == llama_seen[0] and rewards["resformer"][0] == rewards["llama"][0], rewards
    assert llama_gradients.keys() <= gradients.keys()
    for name, gradient in llama_gradients.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=1e-4, atol=1e-7, msg=name)
    assert any(gradient.abs().max() > 0 for gradient in llama_gradients.values())  # the policy gradient is not 0


def trained_lambdas_reload(runs: dict, initial_folder, reload) -> None:
    """Every λ got gradient at the first step and moved off its initial value; `reload()` gives back every trained
    tensor (the trained model's own forward is wrapped by accelerate's autocast: GRPOConfig's default bf16=True)."""
    trainer, _, gradients = runs["resformer"]
    initial = lambdas(dict(AutoModelForCausalLM.from_pretrained(initial_folder).named_parameters()))
    trained = lambdas(dict(trainer.model.named_parameters()))
    assert initial.keys() == trained.keys() == lambdas(gradients).keys() and initial, (initial.keys(), trained.keys())
    for name, gradient in lambdas(gradients).items():
        assert gradient.abs().min() > 0, name  # every layer's pair
        assert (trained[name] - initial[name]).abs().min() > 1e-4, name
    reloaded, expected = reload(trainer).state_dict(), trainer.model.state_dict()
    assert reloaded.keys() == expected.keys() and lambdas(reloaded).keys() == trained.keys()
    assert [name for name in expected if not torch.equal(reloaded[name], expected[name])] == []


@pytest.mark.slow
def test_grpo_full_fine_tuning_starts_as_the_llama_trains_the_lambdas_and_reloads(folders, tmp_path):
    runs = {name: grpo(folder, tmp_path / name) for name, folder in folders.items()}
    same_start_as_the_llama(runs)

    def reload(trainer):
        trainer.save_model(tmp_path / "saved")
        return AutoModelForCausalLM.from_pretrained(tmp_path / "saved")

    trained_lambdas_reload(runs, folders["resformer"], reload)


@pytest.mark.slow
def test_grpo_lora_trains_the_lambdas_through_modules_to_save_and_the_adapter_reloads_them(folders, tmp_path):
    peft = pytest.importorskip("peft")
    configs = {"llama": peft.LoraConfig(task_type="CAUSAL_LM"),
               "resformer": peft.LoraConfig(task_type="CAUSAL_LM", modules_to_save=resformer_hf.LAMBDA_MODULES)}
    runs = {name: grpo(folder, tmp_path / name, configs[name]) for name, folder in folders.items()}
    same_start_as_the_llama(runs)

    def reload(trainer):
        trainer.save_model(tmp_path / "adapter")
        base = AutoModelForCausalLM.from_pretrained(folders["resformer"])
        return peft.PeftModel.from_pretrained(base, tmp_path / "adapter")

    trained_lambdas_reload(runs, folders["resformer"], reload)
