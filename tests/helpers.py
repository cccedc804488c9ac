"""Helpers shared by the tests: tiny configs and models, and the Trainer pieces of the fine-tuning example.

Imported by name (`from helpers import ...`); pytest puts `tests/` on `sys.path`. Fixtures live in `conftest.py`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, Trainer

from resformer_hf import ResFormerConfig, ResFormerForCausalLM
from resformer_hf.examples.finetune import BLOCK_SIZE, TEXT_CHARS, VOCAB_SIZE, build_model, training_arguments
from resformer_hf.text import block_dataset, sample_text, train_tokenizer

#: The size most tests use: 4 layers, GQA (4 query heads, 2 kv heads), small enough for exhaustive per-variant tests.
TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(variant: str = "learnable_plus", **overrides) -> ResFormerConfig:
    """A `TINY` ResFormer config of `variant`."""
    return ResFormerConfig(**{**TINY, "value_residual": variant, **overrides})


def model_with_random_lambdas(config: ResFormerConfig, bound: float = 0.4) -> ResFormerForCausalLM:
    """A tiny causal LM (eval mode) whose learnable λ offsets are uniform in ±bound, so trained-looking λ are
    exercised rather than the initial values."""
    model = ResFormerForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.model.value_residual.parameters():
            parameter.uniform_(-bound, bound)
    return model


def save_with_scalar_lambda_scale(model: PreTrainedModel, folder: str | Path) -> None:
    """Save `model` as checkpoints were written before λ became at least 1-D: `lambda_scale_offset` as a 0-dim
    tensor (one safetensors file)."""
    model.save_pretrained(folder)
    path = Path(folder) / "model.safetensors"
    tensors = load_file(path)
    key = "model.value_residual.lambda_scale_offset"
    tensors[key] = tensors[key].reshape(())
    save_file(tensors, path, metadata={"format": "pt"})


def example_data():
    """(tokenizer, block dataset) of the fine-tuning example: the same text, tokenizer and blocks it trains on."""
    text = sample_text(TEXT_CHARS)
    tokenizer = train_tokenizer([text], VOCAB_SIZE)
    return tokenizer, block_dataset(tokenizer, [text], BLOCK_SIZE)


def step_losses(trainer: Trainer) -> list[float]:
    """The training loss of every logged step, in order."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


__all__ = [
    "BLOCK_SIZE",
    "TINY",
    "VOCAB_SIZE",
    "build_model",
    "example_data",
    "model_with_random_lambdas",
    "save_with_scalar_lambda_scale",
    "step_losses",
    "tiny_config",
    "training_arguments",
]
