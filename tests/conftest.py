"""Fixtures and offline mode for the whole suite; shared helper functions live in `helpers.py`."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import resformer_hf  # noqa: E402,F401  (registers the Auto classes)
from resformer_hf import VALUE_RESIDUAL_VARIANTS  # noqa: E402


@pytest.fixture(params=VALUE_RESIDUAL_VARIANTS)
def variant(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
