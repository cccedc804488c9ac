"""The stock `transformers.Trainer` fine-tunes a ResFormer unchanged.

One reference run (12 steps, weight decay, a checkpoint every 6 steps, constant learning rate) is the yardstick:
gradient accumulation and gradient checkpointing must reproduce its per-step losses, a run resumed from its step-6
checkpoint must continue to the same losses and weights, bf16 autocast must stay close to it. Weight decay must pull
the λ toward their initial values, never toward zero.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, default_data_collator

from helpers import build_model, example_data, step_losses, training_arguments

LR = 1e-2
STEPS = 12
SAVE_STEPS = 6


class LambdaRecorder(TrainerCallback):
    """Effective (λ_first, λ_self) of every layer after every optimiser step (index 0: before training)."""

    def __init__(self):
        self.by_step: list[torch.Tensor] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not self.by_step:
            self.by_step.append(model.value_residual_lambdas())

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.by_step.append(model.value_residual_lambdas())


@pytest.fixture(scope="module")
def data():
    return example_data()


def run(data, output_dir, model=None, resume_from_checkpoint=None, compute_loss_func=None, **arguments):
    """Train with the stock Trainer; returns (trainer, λ recorder)."""
    tokenizer, dataset = data
    recorder = LambdaRecorder()
    trainer = Trainer(
        model=model if model is not None else build_model(len(tokenizer)),
        args=training_arguments(output_dir, **{"learning_rate": LR, "weight_decay": 0.1, **arguments}),
        train_dataset=dataset,
        data_collator=default_data_collator,
        callbacks=[recorder],
        compute_loss_func=compute_loss_func,
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer, recorder


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("reference")
    trainer, recorder = run(data, output_dir, max_steps=STEPS, save_strategy="steps", save_steps=SAVE_STEPS)
    state = {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}
    return output_dir, step_losses(trainer), recorder.by_step, state


def test_loss_decreases_and_lambdas_move(reference):
    _, losses, lambdas, _ = reference
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses)
    assert losses[0] == pytest.approx(math.log(256), abs=0.4)  # untrained: about uniform over the vocabulary
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2
    moved = (lambdas[-1] - lambdas[0]).abs()
    assert moved[0].max() == 0  # layer 0 provides V_0 and has no λ
    assert moved[1:].min() > 1e-3, f"every receiving layer's λ_first and λ_self should train, moved {moved}"


def test_save_steps_write_loadable_safetensors_checkpoints(reference):
    output_dir, _, lambdas, _ = reference
    checkpoints = {p.name for p in output_dir.glob("checkpoint-*")}
    assert checkpoints == {f"checkpoint-{SAVE_STEPS}", f"checkpoint-{STEPS}"}
    folder = output_dir / f"checkpoint-{SAVE_STEPS}"
    assert (folder / "model.safetensors").is_file() and not list(folder.glob("pytorch_model*.bin"))
    assert json.loads((folder / "config.json").read_text())["model_type"] == "resformer"
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded).__name__ == "ResFormerForCausalLM"
    torch.testing.assert_close(loaded.value_residual_lambdas(), lambdas[SAVE_STEPS], rtol=0, atol=0)


def test_resume_from_checkpoint_continues_like_an_uninterrupted_run(data, reference, tmp_path):
    output_dir, losses, lambdas, state = reference
    other_init = build_model(len(data[0]), seed=1)  # only the checkpoint's weights can reproduce the reference
    trainer, recorder = run(data, tmp_path, model=other_init, max_steps=STEPS,
                            resume_from_checkpoint=str(output_dir / f"checkpoint-{SAVE_STEPS}"))
    assert len(recorder.by_step) == 1 + STEPS - SAVE_STEPS  # it ran only the remaining steps
    resumed = step_losses(trainer)
    assert len(resumed) == STEPS  # the first SAVE_STEPS come from the checkpoint's trainer_state.json
    torch.testing.assert_close(
        torch.tensor(resumed[SAVE_STEPS:]), torch.tensor(losses[SAVE_STEPS:]), rtol=0, atol=1e-6
    )
    torch.testing.assert_close(recorder.by_step[-1], lambdas[-1], rtol=0, atol=1e-6)
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=1e-6, msg=name)


def test_gradient_accumulation_matches_the_full_batch(data, reference, tmp_path):
    _, losses, lambdas, _ = reference
    trainer, recorder = run(data, tmp_path, max_steps=SAVE_STEPS, per_device_train_batch_size=2,
                            gradient_accumulation_steps=2)
    torch.testing.assert_close(torch.tensor(step_losses(trainer)), torch.tensor(losses[:SAVE_STEPS]), rtol=0,
                               atol=1e-5)
    torch.testing.assert_close(recorder.by_step[-1], lambdas[SAVE_STEPS], rtol=0, atol=1e-5)


def test_gradient_checkpointing_matches_the_plain_run(data, reference, tmp_path):
    _, losses, lambdas, _ = reference
    model = build_model(len(data[0]))
    calls = []
    model.model.layers[1].self_attn.register_forward_pre_hook(lambda module, args: calls.append(module.training))
    trainer, recorder = run(data, tmp_path, model=model, max_steps=SAVE_STEPS, activation_checkpointing=True)
    assert calls.count(True) == 2 * SAVE_STEPS  # forward + recomputation in backward: checkpointing really ran
    torch.testing.assert_close(torch.tensor(step_losses(trainer)), torch.tensor(losses[:SAVE_STEPS]), rtol=0,
                               atol=1e-5)
    # The λ get their gradients through the recomputed layers too.
    torch.testing.assert_close(recorder.by_step[-1], lambdas[SAVE_STEPS], rtol=0, atol=1e-5)


def test_bf16_autocast_on_cpu_trains_close_to_fp32(data, reference, tmp_path):
    _, losses, lambdas, _ = reference
    trainer, recorder = run(data, tmp_path, max_steps=SAVE_STEPS, bf16=True)
    bf16_losses = step_losses(trainer)
    assert bf16_losses != losses[:SAVE_STEPS], "bf16=True should change the arithmetic"
    torch.testing.assert_close(torch.tensor(bf16_losses), torch.tensor(losses[:SAVE_STEPS]), rtol=0, atol=0.05)
    assert sum(bf16_losses[-3:]) / 3 < sum(bf16_losses[:3]) / 3 - 0.1
    assert all(p.dtype == torch.float32 for p in trainer.model.model.value_residual.parameters())
    assert (recorder.by_step[-1] - recorder.by_step[0])[1:].abs().min() > 1e-3


# ---- weight decay and the λ -------------------------------------------------------------------------------------

DECAY_LR, DECAY, DECAY_STEPS = 0.1, 0.5, 4


def zero_gradient_loss(outputs, labels, num_items_in_batch=None):
    """A loss that depends on every parameter but has zero gradient: AdamW's update is then weight decay alone."""
    return outputs.logits.sum() * 0.0


def decay_only_run(data, model, tmp_path):
    _, recorder = run(data, tmp_path, model=model, max_steps=DECAY_STEPS, learning_rate=DECAY_LR,
                      weight_decay=DECAY, compute_loss_func=zero_gradient_loss)
    return recorder.by_step


@pytest.mark.parametrize("variant", ["learnable_plus", "dense", "gated"])  # "learnable": the next test
def test_weight_decay_leaves_lambdas_at_their_initial_values(data, tmp_path, variant):
    model = build_model(len(data[0]), value_residual=variant)
    q_before = model.model.layers[1].self_attn.q_proj.weight.detach().clone()
    lambdas = decay_only_run(data, model, tmp_path)
    assert torch.equal(lambdas[-1], lambdas[0]), f"{variant}: λ moved from {lambdas[0]} to {lambdas[-1]}"
    # Decay did act on the ordinary weights in the same run.
    shrink = (1 - DECAY_LR * DECAY) ** DECAY_STEPS
    torch.testing.assert_close(model.model.layers[1].self_attn.q_proj.weight, q_before * shrink)


def test_weight_decay_pulls_trained_lambdas_toward_init_not_zero(data, tmp_path):
    model = build_model(len(data[0]), value_residual="learnable")
    value_residual = model.model.value_residual
    with torch.no_grad():
        value_residual.lambda_self_offset.fill_(-0.3)  # as if training had lowered λ_self from 0.5 to 0.2
    lambdas = decay_only_run(data, model, tmp_path)
    shrink = (1 - DECAY_LR * DECAY) ** DECAY_STEPS
    expected = 0.5 - 0.3 * shrink  # toward 0.5; decaying a plain λ would give 0.2 * shrink
    torch.testing.assert_close(lambdas[-1][1:, 1], torch.full((2,), expected), rtol=0, atol=1e-6)


def test_plain_parameterised_lambdas_would_have_decayed(data, tmp_path):
    """Control: the same run with the initial values folded into the parameters drags λ toward zero."""
    model = build_model(len(data[0]), value_residual="learnable_plus")
    value_residual = model.model.value_residual
    before = model.value_residual_lambdas()
    with torch.no_grad():
        value_residual.lambda_self_offset += value_residual.lambda_self_init
        value_residual.lambda_scale_offset += value_residual.lambda_scale_init
    value_residual.lambda_self_init = value_residual.lambda_scale_init = 0.0
    value_residual.initial.zero_()  # the initial values' table (λ_first's row is 0 for learnable_plus anyway)
    torch.testing.assert_close(model.value_residual_lambdas(), before, rtol=0, atol=0)  # the same model
    lambdas = decay_only_run(data, model, tmp_path)
    shrink = (1 - DECAY_LR * DECAY) ** DECAY_STEPS
    expected = before.clone()
    expected[1:] *= shrink  # λ_scale and λ_self shrink; the zero logits (uniform softmax) stay put
    torch.testing.assert_close(lambdas[-1], expected, rtol=0, atol=1e-5)
    assert (lambdas[-1] - before)[1:].abs().min() > 0.05
