"""The training run every engine is compared on, shared by the distributed workers and the single-process reference.

The workers in this folder run under `torchrun --nproc_per_node 2` (gloo on CPU); `tests/test_distributed.py` writes
the checkpoints and the batch they read, runs the same steps in one process, and compares the JSON they write. An
engine plugs in through `Engine`: how it runs backward and the optimiser step, and how it reads a full (gathered)
parameter or gradient from its shards. Everything else is identical on both sides.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 3
LEARNING_RATE = 1e-2
#: Models every engine trains: the plain Llama control and the ResFormer variants the issue names, and `gated` (its
#: mix comes from a gate in each layer, sharded with the layer: by kv head under tensor parallelism), and
#: `value_embeddings` (learnable_plus with a table and gate in layers 1 and 3: sharded with their layer, and by kv
#: head under tensor parallelism).
MODELS = ("llama", "learnable_plus", "svformer", "dense", "gated", "value_embeddings")
#: The bases of issue 67 (`tests/bases.py`), each converted to learnable_plus with λ moved: trained under FSDP2 only.
BASE_MODELS = tuple(f"base-{name}" for name in ("llama3.2", "qwen3", "smollm3", "olmo2", "olmo3", "gemma3", "mistral"))


def lambda_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters that decide the mix, by name: the λ, and `gated`'s value gates (empty for a plain Llama or a
    fixed variant)."""
    module = getattr(model.base_model, "value_residual", None)
    found = dict(module.named_parameters()) if module is not None else {}
    return {**found, **{name: p for name, p in model.named_parameters()
                        if ".value_gate." in name or ".value_embedding" in name}}


def lambdas_seen_in_forward(value_residual: torch.nn.Module, forward: Callable[[], object]
                            ) -> tuple[torch.Tensor | None, list]:
    """What one forward pass handed the layers: the λ table where λ are learnable (None where they are fixed: no
    table is built), and each layer's (λ_first, λ_self) from `per_layer`, Python floats and None as they are and
    anything else by its type name, so a record shows whether fixed λ reached the layers exact."""
    seen = {}
    hook = value_residual.register_forward_hook(lambda module, args, output: seen.update(table=output))
    per_layer = value_residual.per_layer
    value_residual.per_layer = lambda *args: seen.setdefault("per_layer", per_layer(*args))
    try:
        forward()
    finally:
        hook.remove()
        del value_residual.per_layer
    pairs = [[x if x is None or isinstance(x, float) else type(x).__name__ for x in pair]
             for pair in seen["per_layer"]]
    return seen.get("table"), pairs


def lambda_table(model: torch.nn.Module) -> list | None:
    """`value_residual_lambdas()` as a list, None for a plain Llama."""
    return model.value_residual_lambdas().tolist() if hasattr(model, "value_residual_lambdas") else None


def greedy_tokens(model: torch.nn.Module, batch: torch.Tensor) -> list[list[int]]:
    """`generate()`'s greedy continuation (8 tokens, not stopping at EOS) of 2 rows of `batch` cut to 8 tokens."""
    with torch.no_grad():
        output = model.generate(batch[:2, :8], max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=model.config.pad_token_id)
    return output[:, 8:].tolist()


def load_batch(folder: str | Path) -> torch.Tensor:
    return torch.tensor(json.loads((Path(folder) / "batch.json").read_text()))


class Engine:
    """One process, no sharding: the reference. Workers override what their engine does differently."""

    world_size = 1
    rank = 0

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def full(self, parameter: torch.Tensor) -> torch.Tensor:
        return parameter.detach()

    def full_grad(self, parameter: torch.nn.Parameter) -> torch.Tensor:
        return parameter.grad.detach()

    def mean(self, value: torch.Tensor) -> float:
        return value.item()

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This process's share of the global batch (data-parallel engines split it by rank)."""
        return batch


class DataParallel(Engine):
    """Sharded data parallel (FSDP2, ZeRO): each rank trains on its share of the global batch and the engine averages
    the gradients; the reported loss is the mean over ranks, the global batch's loss."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        return batch.chunk(self.world_size)[self.rank]

    def mean(self, value: torch.Tensor) -> float:
        value = value.clone()
        dist.all_reduce(value)
        return value.item() / self.world_size


def train(engine: Engine, batch: torch.Tensor) -> dict:
    """`STEPS` AdamW steps on `batch`: per-step losses, λ gradients of the first step, λ and λ table after."""
    model = engine.model
    record = {"table_before": lambda_table(model), "losses": []}
    input_ids = engine.local_batch(batch)
    for index in range(STEPS):
        loss = engine.forward(input_ids)
        engine.backward(loss)
        if index == 0:
            record["grads"] = {
                name: engine.full_grad(parameter).float().flatten().tolist()
                for name, parameter in lambda_parameters(model).items()
            }
        engine.step()
        record["losses"].append(engine.mean(loss.detach().float()))
    record["lambdas"] = {
        name: engine.full(parameter).float().flatten().tolist() for name, parameter in lambda_parameters(model).items()
    }
    record["table_after"] = lambda_table(model)
    return record


def attempt(results: dict, key: str, function: Callable[[], dict], out: str | Path) -> None:
    """Run one check and record what it returned, or the exception (type, message, traceback) it raised, so that one
    failing check does not hide the others. Rank 0 rewrites `out` after every check: the JSON the parent test reads
    survives a later check that breaks the process group. `CHECKS=prefix,...` runs only the checks named so (when
    debugging a worker by hand)."""
    if not key.startswith(tuple(os.environ.get("CHECKS", "").split(","))):
        return
    try:
        results[key] = function()
    except Exception as error:  # noqa: BLE001  (the parent test asserts on what happened)
        results[key] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
    if int(os.environ.get("RANK", 0)) == 0:
        Path(out).write_text(json.dumps(results, indent=1))


#: A check a worker runs on one model: (the model's folder, the global batch) -> what the parent test compares.
Check = Callable[[Path, torch.Tensor], dict]


def check_every_model(
    data_dir: str | Path,
    out: str | Path,
    checks: Mapping[str, Check],
    mixing_checks: Mapping[str, Check] | None = None,
    results: dict | None = None,
    models: tuple[str, ...] = MODELS,
) -> dict:
    """`attempt` every check on every model of `models`, keyed `check/model`, model by model; `mixing_checks` (of
    the mixing weights) on every model but the plain Llama, which has none. Returns the results: `results` when
    given, so that a later call adds to what `out` already holds."""
    data = Path(data_dir)
    batch = load_batch(data)
    results = {} if results is None else results
    mixing_checks = mixing_checks or {}
    for name in models:
        mixing = mixing_checks if name != "llama" else {}
        for check, function in {**checks, **mixing}.items():
            attempt(results, f"{check}/{name}", partial(function, data / name, batch), out)
    return results
