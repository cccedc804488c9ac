"""Training and quantization clients with the plugin installed, against the source Llama: TRL's `SFTTrainer` (full
fine-tuning and LoRA) and torchao int8 weight-only quantization through transformers' `TorchAoConfig`.

The output-preserving conversion computes the Llama's function, so under LoRA (its λ frozen at λ_first = 0) every
training step's loss must equal the Llama's; in full fine-tuning the first step's must.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from resformer_hf.text import sample_text

from helpers import step_losses

STEPS = 4


def sft(folder, output_dir, peft_config=None):
    """Fine-tune the checkpoint in `folder` with TRL's SFTTrainer on the bundled text; returns the trainer."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl", reason="TRL is in the `clients` extra")
    lines = [line for line in sample_text(20_000).splitlines() if len(line) > 40][:64]
    config = trl.SFTConfig(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        max_length=48, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = trl.SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder), args=config,
        train_dataset=datasets.Dataset.from_dict({"text": lines}),
        processing_class=AutoTokenizer.from_pretrained(folder), peft_config=peft_config,
    )
    trainer.train()
    return trainer


@pytest.mark.slow
def test_sft_full_fine_tuning_starts_at_the_llamas_loss_and_trains(client_folders, tmp_path):
    losses = {name: step_losses(sft(client_folders[name], tmp_path / name))
              for name in ("llama", "resformer_preserve", "svformer")}
    assert losses["resformer_preserve"][0] == pytest.approx(losses["llama"][0], rel=1e-5)
    for name, run in losses.items():
        assert len(run) == STEPS and run[-1] < run[0], (name, run)


@pytest.mark.slow
def test_sft_lora_trains_exactly_like_the_llama(client_folders, tmp_path):
    peft = pytest.importorskip("peft")
    trainers = {name: sft(client_folders[name], tmp_path / name, peft.LoraConfig(task_type="CAUSAL_LM"))
                for name in ("llama", "resformer_preserve")}
    adapted = {name: {n for n, module in trainer.model.named_modules() if hasattr(module, "lora_A")}
               for name, trainer in trainers.items()}
    assert adapted["resformer_preserve"] == adapted["llama"] and adapted["llama"]  # Llama's default targets
    losses = {name: step_losses(trainer) for name, trainer in trainers.items()}
    assert len(losses["llama"]) == STEPS and losses["resformer_preserve"] == pytest.approx(losses["llama"], rel=1e-4)
    for trainer in trainers.values():  # the adapters trained (LoRA's B starts at zero)
        assert all(p.abs().sum() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)


@pytest.mark.parametrize("name", ["llama", "resformer_preserve", "learnable_plus", "svformer"])
def test_torchao_int8_weight_only_quantizes_the_projections_and_keeps_the_lambdas(name, client_folders):
    torchao = pytest.importorskip("torchao", reason="torchao is in the `clients` extra")
    from transformers import TorchAoConfig

    folder = client_folders[name]
    config = TorchAoConfig(torchao.quantization.Int8WeightOnlyConfig())
    quantized = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config).eval()
    full = AutoModelForCausalLM.from_pretrained(folder).eval()
    attention = quantized.model.layers[1].self_attn
    assert type(attention.q_proj.weight).__name__ != "Parameter" and attention.q_proj.weight.dtype == torch.float32
    assert type(attention.q_proj.weight) is not torch.nn.Parameter
    if hasattr(quantized.model, "value_residual"):
        for (key, value), (_, reference) in zip(quantized.model.value_residual.state_dict().items(),
                                                full.model.value_residual.state_dict().items()):
            assert type(value) is torch.Tensor and torch.equal(value, reference), key  # λ stay plain float32

    input_ids = torch.randint(3, full.config.vocab_size, (2, 12))
    with torch.no_grad():
        got, expected = quantized(input_ids).logits, full(input_ids).logits
    assert (got - expected).abs().max() < 0.02 * expected.abs().max()
    if name == "resformer_preserve":  # the same weights quantized the same way: the Llama's int8 logits
        llama = AutoModelForCausalLM.from_pretrained(client_folders["llama"], quantization_config=config).eval()
        with torch.no_grad():
            torch.testing.assert_close(got, llama(input_ids).logits, rtol=0, atol=1e-6)
