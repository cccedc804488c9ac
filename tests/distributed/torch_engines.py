"""Worker: torch-native engines on 2 CPU processes (`torchrun --nproc_per_node 2`, gloo).

FSDP2 through torch's `fully_shard` (one per decoder layer, then the root) and through transformers'
`from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))`; tensor parallelism through
`DistributedConfig(tp_plan="auto")` (GQA and MHA); FSDP2 mixed precision (which dtype the λ are mixed in); and
pipeline parallelism (`pp_size=2`). Usage: `torchrun --nproc_per_node 2 torch_engines.py DATA_DIR OUT.json`.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from common import MODELS, Engine, lambda_parameters, load_batch, train, write_results
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import resformer_hf  # noqa: F401  (registers the Auto classes)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


class DataParallel(Engine):
    """FSDP2: each rank trains on its half of the batch; gradients are averaged by the engine."""

    def __init__(self, model):
        super().__init__(model)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def local_batch(self, batch):
        return batch.chunk(self.world_size)[self.rank]

    def full(self, parameter):
        return full_tensor(parameter)

    def full_grad(self, parameter):
        return full_tensor(parameter.grad)

    def mean(self, value):
        value = value.clone()
        dist.all_reduce(value)
        return value.item() / self.world_size


class TensorParallel(Engine):
    """TP: every rank sees the whole batch. Reports rank 0's values and how far the other ranks are from them."""

    def __init__(self, model):
        super().__init__(model)
        self.spread = 0.0

    def _agreed(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = full_tensor(tensor).contiguous()
        copies = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, tensor)
        self.spread = max([self.spread] + [(copy - copies[0]).abs().max().item() for copy in copies if copy.numel()])
        return copies[0]

    def full(self, parameter):
        return self._agreed(parameter)

    def full_grad(self, parameter):
        return self._agreed(parameter.grad)


def shard_with_torch(model, mp_policy: MixedPrecisionPolicy | None = None):
    """The usual FSDP2 recipe: `fully_shard` each decoder layer, then the root."""
    kwargs = {"mesh": init_device_mesh("cpu", (dist.get_world_size(),))}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if mp_policy is not None and lambda_parameters(model):
        # The λ in their own group, gathered in float32 (README, "Scaling out").
        fully_shard(model.model.value_residual, mesh=kwargs["mesh"], mp_policy=MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def mixing_weights_seen_in_forward(model, batch) -> dict:
    """The value-mixing matrix the decoder layers received in one forward pass, and its dtype."""
    seen = {}
    hook = model.model.value_residual.register_forward_hook(lambda module, args, output: seen.update(weights=output))
    with torch.no_grad():
        model(input_ids=batch)
    hook.remove()
    weights = full_tensor(seen["weights"])
    return {"dtype": str(weights.dtype), "weights": weights.float().tolist()}


def attempt(results: dict, key: str, function) -> None:
    """Run one check; an exception is recorded (type and message) instead of stopping the other checks."""
    if not key.startswith(tuple(os.environ.get("CHECKS", "").split(","))):
        return
    try:
        results[key] = function()
    except Exception as error:  # noqa: BLE001  (the parent test asserts on what happened)
        results[key] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}


def main(data_dir: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    data = Path(data_dir)
    batch = load_batch(data)
    results: dict = {}
    load = AutoModelForCausalLM.from_pretrained
    for name in MODELS:
        path = data / name
        attempt(results, f"fsdp2_torch/{name}", lambda: train(DataParallel(shard_with_torch(load(path))), batch))
        attempt(
            results,
            f"fsdp2_transformers/{name}",
            lambda: train(DataParallel(load(path, distributed_config=DistributedConfig(fsdp_size=2))), batch),
        )
        for heads in ("gqa", "mha"):
            def tensor_parallel(heads=heads):
                engine = TensorParallel(load(data / f"{name}-{heads}" if heads == "mha" else path,
                                             distributed_config=DistributedConfig(tp_plan="auto")))
                return {**train(engine, batch), "spread": engine.spread}

            if heads == "gqa" or (data / f"{name}-mha").exists():
                attempt(results, f"tp_{heads}/{name}", tensor_parallel)
        attempt(results, f"pp/{name}", lambda: pipeline(path, batch))
        if name != "llama":
            bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            attempt(results, f"fsdp2_torch_bf16/{name}",
                    lambda: mixing_weights_seen_in_forward(shard_with_torch(load(path), bf16), batch))
            config = DistributedConfig(fsdp_size=2, fsdp_mixed_precision=True)
            attempt(results, f"fsdp2_transformers_bf16/{name}",
                    lambda: mixing_weights_seen_in_forward(load(path, distributed_config=config), batch))
    write_results(results, out)
    dist.barrier()
    dist.destroy_process_group()


def pipeline(path: Path, batch: torch.Tensor) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(pp_size=2))
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    return {"logits": logits.tolist()}


if __name__ == "__main__":
    main(*sys.argv[1:3])
