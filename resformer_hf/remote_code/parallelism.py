"""How a ResFormer runs under transformers' parallelism: tensor parallel, FSDP2 mixed precision, pipeline parallel.

The λ are replicated wherever the weights are sharded, so each engine needs one thing said about them: tensor parallel
sums their gradient over the ranks (`value_residual_weights`; a gated model's value gates are split by kv head
instead), FSDP2 mixed precision gathers them in float32, and pipeline parallel is refused, because V_0 cannot cross
transformers' stages. This file is copied next to `config.json` for `trust_remote_code`, so it imports only torch,
transformers and its sibling files.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn

from ._compat import ALL_PARALLEL_STYLES
from .value_embeddings import VALUE_EMBEDDING_TP_PLAN

try:  # transformers' pipeline stages put this placeholder where a layer lives on another stage
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer
except ImportError:
    PipelineIdentityLayer = ()
if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
    from transformers.distributed.tensor_parallel import TensorParallelLayer
else:  # no torch.distributed: no tensor parallelism, no sharded tensors
    DTensor, TensorParallelLayer = (), object

PIPELINE_PARALLEL_UNSUPPORTED = (
    "ResFormer does not support pipeline parallelism (pp_size > 1): every layer n >= 1 mixes in layer 0's values V_0 "
    "(value_residual='dense': every earlier layer's values), which travel from layer to layer next to the hidden "
    "states, but transformers' pipeline stages hand only the hidden states to the next stage, so later stages would "
    "never see V_0. Use tensor parallelism (DistributedConfig(tp_size=N)) and/or FSDP2 (DistributedConfig("
    "fsdp_size=N)) to spread the model over devices, or device_map='auto' to split its layers across the devices of "
    "one process."
)


def refuse_pipeline_parallel(distributed_config) -> None:
    """Raise `PIPELINE_PARALLEL_UNSUPPORTED` for a `DistributedConfig` (object or dict) with pp_size > 1."""
    if isinstance(distributed_config, dict):
        pp_size = distributed_config.get("pp_size")
    else:
        pp_size = getattr(distributed_config, "pp_size", None)
    if pp_size is not None and pp_size > 1:
        raise ValueError(PIPELINE_PARALLEL_UNSUPPORTED)


def is_pipeline_stage(model: nn.Module) -> bool:
    """Whether transformers' pipeline stages replaced some of the base model's layers with placeholders."""
    return isinstance(model.layers[0], PipelineIdentityLayer) or isinstance(model.norm, PipelineIdentityLayer)


class _SumGradientOverRanks(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the process group."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class ValueResidualTensorParallel(TensorParallelLayer):
    """Tensor-parallel style of the λ module (`"value_residual_weights"`): replicated λ, summed weight gradients.

    Every rank holds all λ, but mixes values only on its own kv heads, so its gradient of the mixing weights is its
    heads' share. The shares are summed over the ranks in backward, before they reach the λ: every rank then gets the
    complete λ gradient, and micro-batches accumulate correctly. (transformers' `replicated_with_grad_allreduce`
    all-reduces each parameter's accumulated `.grad` after every backward pass instead, which adds the earlier
    micro-batches' already-summed gradients again under gradient accumulation.)
    """

    def transform_output_post_forward(self, module, output, mesh):
        if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
            return output
        return _SumGradientOverRanks.apply(output, mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp"))


if ALL_PARALLEL_STYLES is not None:
    ALL_PARALLEL_STYLES.register("value_residual_weights", ValueResidualTensorParallel())


def gather_in_float32(value_residual: nn.Module) -> None:
    """Switch the FSDP2 group of the λ (their own group, `base_model_fsdp_plan`) to gather them in float32.

    transformers' `fsdp_mixed_precision` gives every group one bfloat16 policy, though the λ are meant to stay
    float32 (`_keep_in_fp32_modules_strict`), as the torch recipe `fully_shard(value_residual,
    mp_policy=MixedPrecisionPolicy())` keeps them. FSDP2 has no public setter for a group's policy, so this sets the
    private attributes torch 2.13's FSDP2 reads it from (`FSDPState._mp_policy`, `FSDPParamGroup.mp_policy`,
    `FSDPParam.mp_policy`); the group reads them at its first forward, which is after this.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    state = fully_shard.state(value_residual)
    group = state._fsdp_param_group if state is not None else None
    if group is None:  # fixed λ (no parameters), or an `fsdp_plan` that left the λ in their parent's group
        return
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    state._mp_policy = group.mp_policy = policy
    for parameter in group.fsdp_params:
        parameter.mp_policy = policy


#: The value gates' tensor-parallel style: one mix per kv head, so split by kv head as v_proj is (each rank computes
#: its own heads' mixes). In the plan of gated models only: transformers' checks refuse entries that match nothing.
VALUE_GATE_TP_PLAN = {"layers.*.self_attn.value_gate": "colwise"}


class ParallelismHooks:
    """`ResFormerPreTrainedModel`'s overrides of transformers' parallelism hooks (`DistributedMixin`)."""

    def init_parallel_plans(self) -> None:
        """transformers' plans, and for a gated base model its value gates' (`VALUE_GATE_TP_PLAN`). A transformers
        hook (`DistributedMixin`, 5.19-5.24): `post_init` calls it; the causal LM collects its base model's plan."""
        super().init_parallel_plans()
        if self.base_model is self and self.config.layers_with_value_gate:
            self._tp_plan.update(VALUE_GATE_TP_PLAN)
        if self.base_model is self and self.config.value_embedding_layers:  # value embeddings: split by kv head
            self._tp_plan.update(VALUE_EMBEDDING_TP_PLAN)

    @classmethod
    def prepare_distribute_model(cls, distributed_config, device_map=None):
        """Refuse pipeline parallelism before anything is built (see `parallelism.PIPELINE_PARALLEL_UNSUPPORTED`).

        A transformers hook (`DistributedMixin`): `from_pretrained` calls it with `distributed_config` (a
        `DistributedConfig` or a dict) before it builds the device mesh and the model.
        """
        refuse_pipeline_parallel(distributed_config)
        return super().prepare_distribute_model(distributed_config, device_map=device_map)

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """transformers' parallelism, with the λ gathered in float32 under `fsdp_mixed_precision`
        (`parallelism.gather_in_float32`). A transformers hook (`DistributedMixin`): `from_pretrained` calls it once
        the model is built (on the meta device), before the weights are loaded."""
        model = super().maybe_distribute_model(model, distributed_config, mesh_manager)
        if mesh_manager is not None and distributed_config.dp_size > 1 and distributed_config.fsdp_mixed_precision:
            gather_in_float32(model.base_model.value_residual)
        return model


@contextlib.contextmanager
def gathered_parameters(module: nn.Module) -> Iterator[None]:
    """Within the block, `module`'s own parameters are whole on every rank, whichever engine sharded them (FSDP2
    DTensors swapped for their full tensors, ZeRO-3 partitions gathered). A collective: every rank must enter it.
    Read-only: changes are lost."""
    parameters = dict(module.named_parameters(recurse=False))
    partitioned = [parameter for parameter in parameters.values() if hasattr(parameter, "ds_id")]
    # A `ds_id` means DeepSpeed partitioned them, so it is imported; looked up, as remote code imports only torch
    # and transformers.
    gather = sys.modules["deepspeed"].zero.GatheredParameters(partitioned) if partitioned else contextlib.nullcontext()
    with gather:
        sharded = {name: parameter for name, parameter in parameters.items() if isinstance(parameter, DTensor)}
        module._parameters.update({name: nn.Parameter(p.detach().full_tensor(), False) for name, p in sharded.items()})
        try:
            yield
        finally:
            module._parameters.update(sharded)
