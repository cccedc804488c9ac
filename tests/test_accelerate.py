"""accelerate: big-model loading split over CPU and disk, and data-parallel training of the Trainer example.

The split model must give the unsplit model's logits and generations, keep decoder layers whole
(`_no_split_modules`), and hand the cross-layer value tensor (`residual_values`) to each layer positionally, where
accelerate's hooks move it to the layer's execution device. The data-parallel run (2 processes, gloo on CPU) must
match a single process that sees the same global batch.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from resformer_hf.examples import finetune

from helpers import VOCAB_SIZE, build_model


def nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-layer model with trained-looking λ (non-zero offsets), saved as safetensors."""
    model = build_model(hidden_size=64, intermediate_size=128, num_hidden_layers=4).eval()
    with torch.no_grad():
        for parameter in model.model.value_residual.parameters():
            parameter.copy_(0.3 * torch.randn_like(parameter))
    folder = tmp_path_factory.mktemp("model")
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def split(saved, tmp_path_factory):
    model, folder = saved
    layer = nbytes(model.model.layers[0])
    budget = nbytes(model.model.embed_tokens) + 3 * layer  # room for some decoder layers, not all
    return AutoModelForCausalLM.from_pretrained(
        folder, device_map="auto", max_memory={"cpu": budget}, offload_folder=tmp_path_factory.mktemp("offload")
    ).eval()


def test_device_map_splits_between_cpu_and_disk_at_decoder_layer_boundaries(split):
    device_map = split.hf_device_map
    layer_devices = {name: device for name, device in device_map.items() if name.startswith("model.layers.")}
    assert all(re.fullmatch(r"model\.layers\.\d+", name) for name in layer_devices), device_map  # never inside one
    assert set(layer_devices.values()) == {"cpu", "disk"}, device_map
    for name, device in layer_devices.items():  # disk layers stay on the meta device until their hook loads them
        parameter_devices = {p.device.type for p in split.get_submodule(name).parameters()}
        assert parameter_devices == ({"meta"} if device == "disk" else {"cpu"}), (name, parameter_devices)


def test_split_model_reproduces_the_unsplit_logits_lambdas_and_generation(saved, split):
    model, _ = saved
    input_ids = torch.randint(3, VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(split(input_ids).logits, model(input_ids).logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(split.value_residual_lambdas(), model.value_residual_lambdas(), rtol=0, atol=0)
    assert (model.value_residual_lambdas()[1:, 1] - 0.5).abs().min() > 1e-4  # λ really loaded, not left at init
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(split.generate(input_ids, **settings), model.generate(input_ids, **settings))


def test_residual_values_reach_each_layer_positionally_through_the_hooks(split):
    """accelerate's AlignDevicesHook moves positional args (and kwargs outside `skip_keys`) to the layer's device."""
    received = {}
    for layer in split.model.layers:
        hook = layer._hf_hook

        def spy(module, *args, _hook=hook, _index=layer.layer_idx, **kwargs):
            moved_args, moved_kwargs = type(_hook).pre_forward(_hook, module, *args, **kwargs)
            received[_index] = (moved_args[1], _hook.execution_device)
            return moved_args, moved_kwargs

        hook.pre_forward = spy
    try:
        with torch.no_grad():
            split(torch.randint(3, VOCAB_SIZE, (2, 12)))
    finally:
        for layer in split.model.layers:
            del layer._hf_hook.pre_forward
    config = split.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert received[0][0] is None  # layer 0 creates V_0
    for index in range(1, config.num_hidden_layers):
        values, device = received[index]  # V_0 as this pass hands it on: a tensor, or a tuple of them (no grad)
        tensors = [t for t in torch.utils._pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]
        assert tensors
        # [B, H_kv, T, D] (with gradient), or flat [B·T, H_kv·D] as v_proj's GEMM wrote it (no-grad mix, issue 32)
        layouts = ((2, config.num_key_value_heads, 12, head_dim), (2 * 12, config.num_key_value_heads * head_dim))
        for tensor in tensors:
            assert tuple(tensor.shape[-4:]) in layouts or tuple(tensor.shape[-2:]) in layouts, tensor.shape
            assert tensor.device == torch.device(device)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_two_processes(output_dir) -> subprocess.CompletedProcess:
    """`resformer_hf.examples.finetune` under `accelerate launch`, 2 processes, on a fresh port."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
        "-m", "resformer_hf.examples.finetune",
        "--output-dir", str(output_dir), "--max-steps", "6", "--batch-size", "2",
    ]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)


#: How torchrun reports a worker that gloo's C++ aborted (`terminate called without an active exception`, SIGABRT):
#: seen once in CI's full suite, with other distributed tests on the same 2 cores, never when run alone (0 of 10, also
#: under a 3-process CPU load). A Python error in our code exits 1 and is never retried.
NATIVE_ABORT = re.compile(r"exitcode\s*:\s*-6\b")


def test_data_parallel_trainer_matches_a_single_process(tmp_path):
    """`accelerate launch` with 2 CPU processes (torchrun + gloo) vs one process with the same global batch of 4.

    accelerate 1.x's `--cpu --num_processes 2` starts ONE process (multi-CPU needs mpirun); `--multi_gpu` on a
    machine without GPUs starts two through torchrun, and the Trainer's `use_cpu=True` keeps them on CPU with gloo.
    A run whose worker gloo aborted natively is launched once more (with a warning), see `NATIVE_ABORT`.
    """
    result = launch_two_processes(tmp_path / "dp")
    if result.returncode != 0 and NATIVE_ABORT.search(result.stderr):
        warnings.warn(f"a gloo worker aborted natively; launched again. Its log: {result.stderr[-2000:]}",
                      stacklevel=1)
        result = launch_two_processes(tmp_path / "dp-again")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    output_dir = Path(result.args[result.args.index("--output-dir") + 1])
    parallel = json.loads((output_dir / "losses.json").read_text())

    finetune.main(["--output-dir", str(tmp_path / "single"), "--max-steps", "6", "--batch-size", "4"])
    single = json.loads((tmp_path / "single" / "losses.json").read_text())

    assert parallel["world_size"] == 2 and single["world_size"] == 1
    torch.testing.assert_close(torch.tensor(parallel["losses"]), torch.tensor(single["losses"]), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(parallel["lambdas"]), torch.tensor(single["lambdas"]), rtol=0, atol=1e-5)
    assert parallel["losses"][-1] < parallel["losses"][0]
