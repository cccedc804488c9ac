"""Shared fixtures: tiny configs so the whole suite runs in minutes on 2 CPU cores, offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import resformer_hf  # noqa: E402,F401  (registers the Auto classes)
from resformer_hf import VALUE_RESIDUAL_VARIANTS, ResFormerConfig  # noqa: E402

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
    """A 4-layer GQA ResFormer config small enough for exhaustive per-variant tests."""
    return ResFormerConfig(**{**TINY, "value_residual": variant, **overrides})


def model_with_random_lambdas(config: ResFormerConfig, bound: float = 0.4):
    """A tiny causal LM (eval mode) whose learnable λ offsets are uniform in ±bound, so trained-looking λ are
    exercised rather than the initial values."""
    from resformer_hf import ResFormerForCausalLM

    model = ResFormerForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.model.value_residual.parameters():
            parameter.uniform_(-bound, bound)
    return model


@pytest.fixture(params=VALUE_RESIDUAL_VARIANTS)
def variant(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
