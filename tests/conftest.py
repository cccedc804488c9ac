"""Fixtures and offline mode for the whole suite; shared helper functions live in `helpers.py`."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One torch thread per process (the processes the tests start inherit it): the models are tiny, where more threads only
# add synchronisation (greedy decoding 10x slower on a busy 2-core machine); `-n` runs test files side by side.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton kernels (`remote_code/mix_kernels.py`) run in Triton's interpreter, on CPU tensors: set before anything
# imports triton, whose library kernels (`tl.sum`) read it then. `TRITON_INTERPRET=0` tests them compiled on a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import resformer_hf  # noqa: E402,F401  (registers the Auto classes)
from resformer_hf import VALUE_RESIDUAL_VARIANTS  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(params=VALUE_RESIDUAL_VARIANTS)
def variant(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def client_folders(tmp_path_factory):
    """Checkpoint folders (weights + tokenizer) for the client-library tests; see `helpers.client_checkpoints`."""
    from helpers import client_checkpoints

    return client_checkpoints(tmp_path_factory.mktemp("clients"))
