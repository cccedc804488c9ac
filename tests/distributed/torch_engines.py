"""Worker: torch-native engines on 2 CPU processes (`torchrun --nproc_per_node 2`, gloo).

FSDP2 through torch's `fully_shard` (one per decoder layer, then the root) and through transformers'
`from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))`; tensor parallelism through
`DistributedConfig(tp_plan="auto")` (GQA, MHA, with gradient accumulation, and greedy generation); FSDP2 mixed
precision (which dtype the λ are mixed in); and pipeline parallelism (`pp_size=2`).
Usage: `torchrun --nproc_per_node 2 torch_engines.py DATA_DIR OUT.json`.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import resformer_hf  # noqa: F401  (registers the Auto classes)

from engine_common import (
    BASE_MODELS,
    DataParallel,
    Engine,
    check_every_model,
    greedy_tokens,
    lambdas_seen_in_forward,
    train,
)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


class FullyShardedDataParallel(DataParallel):
    """FSDP2: parameters and gradients are DTensor shards, gathered to read them."""

    def full(self, parameter):
        return full_tensor(parameter)

    def full_grad(self, parameter):
        return full_tensor(parameter.grad)


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


class TensorParallelAccumulating(TensorParallel):
    """TP with gradient accumulation: each step is two micro-batches (halves of the batch), one backward pass each."""

    def forward(self, input_ids):
        self.micro_batch_losses = [self.model(input_ids=half, labels=half).loss / 2 for half in input_ids.chunk(2)]
        return sum(loss.detach() for loss in self.micro_batch_losses)

    def backward(self, loss):
        for micro_batch_loss in self.micro_batch_losses:
            micro_batch_loss.backward()


def shard_with_torch(model, mp_policy: MixedPrecisionPolicy | None = None):
    """The usual FSDP2 recipe: `fully_shard` each decoder layer, then the root."""
    kwargs = {"mesh": init_device_mesh("cpu", (dist.get_world_size(),))}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if mp_policy is not None and list(model.model.value_residual.parameters()):
        # The λ in their own group, gathered in float32 (docs/scaling-out.md).
        fully_shard(model.model.value_residual, mesh=kwargs["mesh"], mp_policy=MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def mixing_weights_seen_in_forward(model, batch) -> dict:
    """The λ table the decoder layers received in one forward pass (with gradient, as a training step runs), its
    dtype, and each layer's pair."""
    table, per_layer = lambdas_seen_in_forward(model.model.value_residual, lambda: model(input_ids=batch))
    if table is None:  # fixed λ
        return {"dtype": None, "weights": None, "per_layer": per_layer}
    weights = full_tensor(table)
    return {"dtype": str(weights.dtype), "weights": weights.float().tolist(), "per_layer": per_layer}


def main(data_dir: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    checks = {
        "fsdp2_torch": fsdp2_torch,
        "fsdp2_transformers": fsdp2_transformers,
        "tp_gqa": partial(tensor_parallel, TensorParallel),
        "tp_mha": tensor_parallel_mha,
        "tp_accumulating": partial(tensor_parallel, TensorParallelAccumulating),
        "tp_generate": tensor_parallel_generate,
    }
    mixing_checks = {"fsdp2_torch_bf16": fsdp2_torch_bf16, "fsdp2_transformers_bf16": fsdp2_transformers_bf16}
    results = check_every_model(data_dir, out, checks, mixing_checks)
    check_every_model(data_dir, out, {"fsdp2_transformers": fsdp2_transformers}, results=results, models=BASE_MODELS)
    # Last: a pipeline split that fails on one stage leaves the other waiting for hidden states (until the timeout).
    check_every_model(data_dir, out, {"pp": pipeline}, results=results)
    dist.barrier()
    dist.destroy_process_group()


def fsdp2_torch(path: Path, batch: torch.Tensor) -> dict:
    return train(FullyShardedDataParallel(shard_with_torch(AutoModelForCausalLM.from_pretrained(path))), batch)


def fsdp2_transformers(path: Path, batch: torch.Tensor) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))
    return train(FullyShardedDataParallel(model), batch)


def fsdp2_torch_bf16(path: Path, batch: torch.Tensor) -> dict:
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return mixing_weights_seen_in_forward(shard_with_torch(AutoModelForCausalLM.from_pretrained(path), bf16), batch)


def fsdp2_transformers_bf16(path: Path, batch: torch.Tensor) -> dict:
    config = DistributedConfig(fsdp_size=2, fsdp_mixed_precision=True)
    return mixing_weights_seen_in_forward(AutoModelForCausalLM.from_pretrained(path, distributed_config=config), batch)


def tensor_parallel(engine_class: type[TensorParallel], path: Path, batch: torch.Tensor) -> dict:
    config = DistributedConfig(tp_plan="auto")
    engine = engine_class(AutoModelForCausalLM.from_pretrained(path, distributed_config=config))
    return {**train(engine, batch), "spread": engine.spread}


def tensor_parallel_mha(path: Path, batch: torch.Tensor) -> dict:
    """`tensor_parallel` on the model's multi-head-attention twin (`<name>-mha`, as many kv heads as heads)."""
    return tensor_parallel(TensorParallel, path.with_name(f"{path.name}-mha"), batch)


def tensor_parallel_generate(path: Path, batch: torch.Tensor) -> dict:
    """Greedy tokens under tensor parallelism (rank 0's, and how many tokens the other rank differs in), and the
    shape of the share of every value-embedding table and gate this rank holds, with the whole one's."""
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto")).eval()
    shares = {name: [list(parameter.to_local().shape), list(parameter.shape)] for name, parameter
              in model.named_parameters() if ".value_embedding" in name and isinstance(parameter, DTensor)}
    tokens = torch.tensor(greedy_tokens(model, batch))
    copies = [torch.empty_like(tokens) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, tokens)
    return {"tokens": tokens.tolist(), "ranks_differ": sum(int((c != tokens).sum()) for c in copies),
            "shares": shares, "table_parameters": sum(".value_embedding" in n for n, _ in model.named_parameters())}


def pipeline(path: Path, batch: torch.Tensor) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(pp_size=2))
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    return {"logits": logits.tolist()}


if __name__ == "__main__":
    main(*sys.argv[1:3])
