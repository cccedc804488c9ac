"""Writing the planned output shards: one tensor in memory at a time, cast as planned, and never silently wrong.

A cast that turns finite source values into infinities (e.g. bf16 weights beyond float16's range) is refused, and
with `check_finite` every tensor holding NaN or infinity is reported, so verification can fail on it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from tqdm.auto import tqdm

from .plan import Plan, ShardPlan
from .report import ConversionError
from .safetensors_io import TensorInfo, open_weights, write_file
from .source import SAFE_WEIGHTS_INDEX_NAME


@dataclass
class WriteResult:
    total_bytes: int = 0
    non_finite: list[str] = field(default_factory=list)  # tensors holding NaN or infinity (when checked)


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype`; refuses a cast that overflows finite values to infinity."""
    cast = tensor.to(dtype).contiguous()
    if cast.dtype != tensor.dtype and cast.is_floating_point() and not torch.isfinite(cast).all():
        overflowed = torch.isinf(cast) & torch.isfinite(tensor)
        if overflowed.any():
            largest = float(tensor[overflowed].abs().max())
            name_of = str(dtype).removeprefix("torch.")
            raise ConversionError(
                f"{name} holds {largest:.4g}, beyond what {name_of} can represent (largest "
                f"{torch.finfo(dtype).max:.4g}); keep the source dtype (leave --dtype unset) or pass --dtype "
                "bfloat16 or float32."
            )
    return cast


@contextmanager
def _shard_reader(shard_plan: ShardPlan, *, allow_pickle: bool) -> Iterator[Callable[[str], torch.Tensor]]:
    """`read(output name)` for one shard. A safetensors source is opened once per tensor, so the pages it maps are
    released as soon as the tensor is written; a pickle (allowed by the caller) is loaded once per shard."""
    pickled = shard_plan.source.suffix == ".bin"
    with open_weights(shard_plan.source, allow_pickle=allow_pickle) if pickled else nullcontext() as loaded:

        def read(name: str) -> torch.Tensor:
            plan = shard_plan.tensors[name]
            if plan.source is None:
                return torch.zeros(plan.shape, dtype=plan.dtype)
            if loaded is not None:
                tensor = loaded.get_tensor(plan.source)
            else:
                with open_weights(shard_plan.source) as view:
                    try:
                        tensor = view.get_tensor(plan.source)
                    except SafetensorError as error:
                        raise ConversionError(f"{shard_plan.source.name}: tensor {plan.source} cannot be read "
                                              f"({error}); the file is corrupted.") from error
            if tuple(tensor.shape) != plan.shape:
                raise ConversionError(f"{shard_plan.source.name}: tensor {plan.source} changed shape while "
                                      "converting; is another program writing SRC?")
            return _cast(name, tensor, plan.dtype)

        yield read


def write_weights(plan: Plan, staging: Path, *, allow_pickle: bool, check_finite: bool, progress: bool) -> WriteResult:
    """Write the output shards one at a time into `staging`, with the index when sharded."""
    result = WriteResult()
    weight_map: dict[str, str] = {}
    total_parameters = 0
    bar = tqdm(total=sum(shard.source.stat().st_size for shard in plan.shards), unit="B", unit_scale=True,
               unit_divisor=1024, desc="resformer-convert", disable=not progress)
    try:
        for number, shard_plan in enumerate(plan.shards, start=1):
            bar.set_postfix_str(f"shard {number}/{len(plan.shards)}")
            layout = {name: TensorInfo(t.shape, t.dtype, shard_plan.source) for name, t in shard_plan.tensors.items()}
            with _shard_reader(shard_plan, allow_pickle=allow_pickle) as read:

                def read_checked(name: str) -> torch.Tensor:
                    tensor = read(name)
                    if check_finite and tensor.is_floating_point() and not torch.isfinite(tensor).all():
                        result.non_finite.append(name)
                    return tensor

                write_file(staging / shard_plan.output_name, layout, read_checked)
            for name, tensor in shard_plan.tensors.items():
                weight_map[name] = shard_plan.output_name
                result.total_bytes += tensor.nbytes
                total_parameters += math.prod(tensor.shape)
            bar.update(shard_plan.source.stat().st_size)
    finally:
        bar.close()
    if len(plan.shards) > 1:
        index = {
            "metadata": {"total_size": result.total_bytes, "total_parameters": total_parameters},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (staging / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return result


__all__ = ["WriteResult", "write_weights"]
