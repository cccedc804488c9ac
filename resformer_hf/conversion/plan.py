"""The tensor plan: every source tensor checked against the ResFormer model, and where each output tensor goes.

The target model is built on the meta device (no memory), and its state dict is the contract the output must meet.
The plan is made from the weight headers alone, so nothing is written before the whole source has been checked.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..remote_code.configuration_resformer import ResFormerConfig
from .bases import BASES
from .report import ConversionError, short_list
from .safetensors_io import TensorInfo
from .source import output_shard_name

_ROTARY_BUFFER = re.compile(r"\.rotary_emb\.inv_freq$")
_V_PROJ = re.compile(r"^model\.layers\.(\d+)\.self_attn\.v_proj\.")
_O_PROJ_BIAS = re.compile(r"^model\.layers\.(\d+)\.self_attn\.o_proj\.bias$")
#: Mixing weights stored as offsets from their initial values (zero: the config's start), float32: every λ, and
#: DenseFormer's depth weights (zero: the plain residual stream)
_OFFSET_PREFIXES = ("model.value_residual.", "model.depth_weighted_average.")


@dataclass
class TensorPlan:
    """One output tensor: where it comes from (None: zeros the converter adds), its shape and stored dtype."""

    source: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class ShardPlan:
    source: Path
    output_name: str
    tensors: dict[str, TensorPlan]  # output name -> plan, in source order


@dataclass
class Plan:
    shards: list[ShardPlan]
    added: list[str]
    dropped: list[str]

    @property
    def num_tensors(self) -> int:
        return sum(len(shard.tensors) for shard in self.shards)


def meta_model(config: ResFormerConfig):
    """The target model on the meta device; a config that cannot build a model is the user's `config.json`."""
    from ..remote_code.modeling_resformer import ResFormerForCausalLM

    try:
        with torch.device("meta"):
            return ResFormerForCausalLM(config)
    except Exception as error:  # e.g. an unknown hidden_act or inconsistent head sizes
        message = f"config.json describes a model that cannot be built ({error}); fix config.json."
        raise ConversionError(message) from error


def expected_state(model) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor `model.save_pretrained` would write."""
    state = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _is_value_gate(model, name: str) -> bool:
    """Whether `name` is a tensor of a gated layer's value gate (`value_gate.ValueGate`)."""
    from ..remote_code.value_residual import ValueGate

    return isinstance(model.get_submodule(name.rpartition(".")[0]), ValueGate)


def plan_conversion(
    shards: list[Path], inventory: dict[str, TensorInfo], model, model_type: str, dtype: torch.dtype | None
) -> Plan:
    """Check every source tensor's name and shape against the model and decide where each output tensor goes."""
    config = model.config
    expected = expected_state(model)
    plans = {path: ShardPlan(path, output_shard_name(path, len(shards)), {}) for path in shards}
    dropped = []
    for name, info in inventory.items():
        match = _V_PROJ.match(name)
        if _ROTARY_BUFFER.search(name) or (config.tie_word_embeddings and name == "lm_head.weight"):
            dropped.append(name)  # recomputed from the config / tied to the embeddings on load
        elif match and int(match.group(1)) in config.layers_without_value_projection:
            dropped.append(name)  # these layers attend over layer 0's values
        elif name not in expected:
            raise ConversionError(
                f"{info.path.name} has tensor {name}, which a {model_type} checkpoint converted to ResFormer cannot "
                "hold; the checkpoint does not match its config.json's architecture."
            )
        elif info.shape != expected[name][0]:
            raise ConversionError(
                f"{name} has shape {list(info.shape)} but config.json implies {list(expected[name][0])}; the weights "
                "do not match the config."
            )
        else:
            cast = dtype is not None and info.dtype.is_floating_point
            plans[info.path].tensors[name] = TensorPlan(name, info.shape, dtype if cast else info.dtype)

    ordered = list(plans.values())
    added = []
    missing = [name for name in expected if name not in inventory]
    for name in missing:
        if name.startswith(_OFFSET_PREFIXES) or _is_value_gate(model, name):
            # λ and depth-weight offsets and value gates are zero: the config holds the initial values (the mix g0
            # for every token, DenseFormer's plain residual stream)
            target = ordered[-1]
        elif ".self_attn.value_embedding" in name:  # value embeddings: zero tables and gates, in the weights' dtype
            target = ordered[-1]
            expected[name] = (expected[name][0], dtype or inventory["model.embed_tokens.weight"].dtype)
        elif BASES[model_type].qkv_bias_only and _O_PROJ_BIAS.match(name):
            weight = name.removesuffix("bias") + "weight"
            target = next(plan for plan in ordered if weight in plan.tensors)
            expected[name] = (expected[name][0], target.tensors[weight].dtype)
        else:
            raise ConversionError(
                f"the checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {short_list(missing)}; it is "
                "incomplete or does not match config.json."
            )
        shape, expected_dtype = expected[name]  # λ, gates: float32, as the model keeps them (_keep_in_fp32_modules)
        target.tensors[name] = TensorPlan(None, shape, expected_dtype)
        added.append(name)
    return Plan(ordered, added, dropped)


__all__ = ["Plan", "ShardPlan", "TensorPlan", "expected_state", "meta_model", "plan_conversion"]
