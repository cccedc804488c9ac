"""How transformers' loader, its distributed engines, vocabulary resizing and PEFT meet a ResFormer, in four parts.

- Loading a checkpoint refuses a value-projection layout of another variant and non-finite λ: transformers would drop
  unexpected v_proj weights or random-initialise missing ones, and for a ResFormer either means the checkpoint was
  trained as another variant, so the load stops and says which.
- Parallelism: the λ are replicated wherever the weights are sharded, so tensor parallel sums their gradient over the
  ranks (`value_residual_weights`; a gated model's value gates are split by kv head instead), FSDP2 mixed precision
  gathers them in float32, and pipeline parallel is refused, because V_0 cannot cross transformers' stages.
- `resize_token_embeddings` resizes each value-embedding table with `embed_tokens`; new rows start at zero.
- PEFT picks default `target_modules` by `config.model_type` from tables that only know built-in models; a ResFormer
  has Llama's module names, so it gets Llama's rows. Train the λ with LoRA by naming them in `modules_to_save`:
  `LoraConfig(task_type="CAUSAL_LM", modules_to_save=LAMBDA_MODULES)`. PEFT itself is imported inside `try`, which
  transformers' `check_imports` skips, so the shipped files never require PEFT.

Copied next to `config.json` for `trust_remote_code`: imports only torch, transformers and sibling files.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sys
from collections.abc import Iterator

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.utils import logging

from ._compat import ALL_PARALLEL_STYLES
from .architecture import HEAD, PROJECTION
from .configuration_resformer import ResFormerConfig
from .value_embeddings import VALUE_EMBEDDING_TP_PLAN, ValueEmbedding
from .variants import GATE, VARIANTS

# ---- loading a checkpoint -------------------------------------------------------------------------------------------


def check_value_projections(config: ResFormerConfig, missing_keys, unexpected_keys) -> None:
    """Refuse a checkpoint of the other value-projection layout instead of dropping or random-initialising v_proj.

    SVFormer layers n >= 1 have no `v_proj`; every other variant has one. A mismatch means the checkpoint was
    trained as a different variant than the config says.
    """
    # Cross-layer attention's consumers have no v_proj either (`check_key_value_projections` below).
    without = set(config.layers_without_value_projection) | set(config.layers_reading_shared_keys_values)
    extra = [layer for layer in _layers_with(unexpected_keys, "v_proj") if layer in without]
    if extra:
        raise ValueError(
            f"Variant mismatch: the model is value_residual={config.value_residual!r}, which has no v_proj in "
            f"layers {sorted(without)}, but the checkpoint has v_proj weights for layers {extra}, so it was "
            "trained as another variant. Load it with the value_residual its config.json names."
        )
    # Missing v_proj means "trained without them" only where the same layer's other projections did load: a
    # checkpoint that lacks everything (wrong prefix, another model) gets transformers' missing-keys report.
    loaded_layers = set(range(config.num_hidden_layers)) - set(_layers_with(missing_keys, "q_proj"))
    absent = [layer for layer in _layers_with(missing_keys, "v_proj") if layer in loaded_layers - without]
    if absent:
        reusing = [name for name, spec in VARIANTS.items() if spec.drops_value_projections]
        raise ValueError(
            f"Variant mismatch: the model is value_residual={config.value_residual!r}, but the checkpoint has no "
            f"v_proj weights for layers {absent} while their other projections are there, so it was trained "
            f"without them ({' or '.join(reusing)}). Load it with the value_residual its config.json names "
            "instead of random-initialising those projections."
        )


def check_value_gates(config: ResFormerConfig, unexpected_keys) -> None:
    """Refuse a checkpoint with value gates in layers that have none, instead of dropping them: it was trained as
    `gated` (missing gates are fine: they load as zeros, the documented start)."""
    extra = [layer for layer in _layers_with(unexpected_keys, "value_gate")
             if layer not in config.layers_with_value_gate]
    if extra:
        gated = [name for name, spec in VARIANTS.items() if spec.role == GATE]
        raise ValueError(
            f"Variant mismatch: the model is value_residual={config.value_residual!r}, but the checkpoint has value "
            f"gates (self_attn.value_gate) for layers {extra}, so it was trained as {' or '.join(gated)} (with those "
            "receiving layers). Load it with the value_residual and value_residual_layers its config.json names."
        )


def check_value_embedding_tables(config: ResFormerConfig, unexpected_keys) -> None:
    """Refuse a checkpoint with value-embedding tables in layers that have none, instead of dropping them (missing
    tables are fine: they load as zeros, the documented start)."""
    extra = [n for n in _layers_with(unexpected_keys, "value_embedding") if n not in config.value_embedding_layers]
    if extra:
        raise ValueError(f"value_embeddings mismatch: the checkpoint has value-embedding tables for layers {extra}, "
                         f"which value_embeddings={config.value_embeddings!r} does not give one; load it with the "
                         "value_embeddings its config.json names.")


def check_lambdas_are_finite(value_residual: nn.Module) -> None:
    """Refuse NaN/inf λ from a checkpoint, as the config refuses them: they would silently give NaN logits."""
    for name, parameter in value_residual.named_parameters():
        if parameter.device.type != "meta" and not torch.isfinite(parameter.detach()).all():
            raise ValueError(
                f"The checkpoint's model.value_residual.{name} holds NaN or infinite values, so the model would "
                "output NaN. Load a healthy save of the checkpoint instead."
            )


def check_key_value_projections(config: ResFormerConfig, missing_keys, unexpected_keys) -> None:
    """Refuse a checkpoint whose k_proj layout is another `cross_layer_attention`'s, instead of dropping its weights
    or random-initialising missing ones."""
    consumers = set(config.layers_reading_shared_keys_values)
    extra = [layer for layer in _layers_with(unexpected_keys, "k_proj") if layer in consumers]
    loaded_layers = set(range(config.num_hidden_layers)) - set(_layers_with(missing_keys, "q_proj"))
    absent = [layer for layer in _layers_with(missing_keys, "k_proj") if layer in loaded_layers - consumers]
    if extra or absent:
        found = f"has k_proj weights for layers {extra}" if extra else f"lacks k_proj weights for layers {absent}"
        raise ValueError(
            f"cross_layer_attention mismatch: the model has cross_layer_attention={config.cross_layer_attention} "
            f"(no k_proj in layers {sorted(consumers)}), but the checkpoint {found}. Load it with the "
            "cross_layer_attention its config.json names."
        )


def modules_kept_in_float32(config: ResFormerConfig) -> list[str]:
    """The modules `from_pretrained` keeps in float32 whatever the dtype: those of the model that decide how values
    mix (the learnable λ, DenseFormer's depth weights, `gated`'s value gates)."""
    spec = config.value_residual_spec
    kept = (("value_residual", spec.learnable), ("depth_weighted_average", spec.depth_weighted_average),
            ("value_gate", bool(config.layers_with_value_gate)))
    return [name for name, present in kept if present]


class CheckpointChecks:
    """`ResFormerPreTrainedModel`'s override of transformers' loading hook: the checks above, once weights load."""

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        """Refuse a checkpoint of another variant's v_proj layout or value gates, or with non-finite λ (`loading.py`).

        A private transformers hook: `PreTrainedModel._finalize_model_loading` calls it once the weights are loaded
        and missing ones initialised, which is when both checks can be made.
        """
        super()._adjust_missing_and_unexpected_keys(loading_info)
        check_key_value_projections(self.config, loading_info.missing_keys, loading_info.unexpected_keys)
        check_value_projections(self.config, loading_info.missing_keys, loading_info.unexpected_keys)
        check_value_gates(self.config, loading_info.unexpected_keys)
        check_value_embedding_tables(self.config, loading_info.unexpected_keys)  # value embeddings
        check_lambdas_are_finite(self.base_model.value_residual)


class LambdaScaleToVector(ConversionOps):
    """Checkpoint conversion: a λ_scale offset saved as a 0-dim scalar becomes the shape-[1] parameter, same value.

    A 1-D tensor passes unchanged, so saving (this op again, as its own reverse) writes the new layout. Sharded
    loading (FSDP2) hands a 0-dim tensor to the rank that owns its one slice; the others get an empty list.
    """

    @torch.no_grad()
    def convert(self, input_dict: dict, source_patterns: list[str], target_patterns: list[str], **kwargs) -> dict:
        (tensors,) = input_dict.values()
        tensors = tensors if isinstance(tensors, list) else [tensors]
        local = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0, dtype=torch.float32)
        return {target_patterns[0]: local}

    @property
    def reverse_op(self) -> ConversionOps:
        return self


#: Weight conversions `from_pretrained` applies to a ResFormer checkpoint (registered for the model type).
LAMBDA_CHECKPOINT_CONVERSIONS = [
    WeightConverter(
        "value_residual.lambda_scale_offset", "value_residual.lambda_scale_offset", [LambdaScaleToVector()]
    )
]


_PROJECTION_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(\w+)\.")


def _layers_with(keys, projection: str) -> list[int]:
    """Sorted layer indices that have a `self_attn.<projection>` entry among `keys`."""
    matches = (_PROJECTION_KEY.search(key) for key in keys)
    return sorted({int(match.group(1)) for match in matches if match and match.group(2) == projection})


# ---- parallelism ---------------------------------------------------------------------------------------------------

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
        if self.base_model is self and self.config.qk_norm == HEAD:  # one norm over each head: as Qwen 3's plan has it
            self._tp_plan.update(dict.fromkeys(("layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm"),
                                               "replicated_with_grad_allreduce"))

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
        if (getattr(distributed_config, "tp_size", None) or 1) > 1 and model.config.qk_norm == PROJECTION:
            raise ValueError("qk_norm='projection' (OLMo 2's norms over the whole q/k projection) does not split by "
                             "head, as tensor parallelism splits q and k; use FSDP2 (DistributedConfig(fsdp_size=N)).")
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


# ---- resizing the vocabulary ---------------------------------------------------------------------------------------


class VocabularyResizing:
    """`ResFormerPreTrainedModel`'s override of transformers' `_resize_token_embeddings` (which resizes only
    `embed_tokens` and `lm_head`): every value-embedding table takes `embed_tokens`' new row count, kept rows as they
    were and new rows at zero whatever `mean_resizing` says. A zero row adds nothing to a token's values, so a new
    token has no table until trained and the old tokens' outputs do not move."""

    def _resize_token_embeddings(self, new_num_tokens, pad_to_multiple_of=None, mean_resizing=True):
        embeddings = super()._resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        for table in [module for module in self.modules() if isinstance(module, ValueEmbedding)]:
            kept = table.num_embeddings  # transformers' resize: DeepSpeed ZeRO-3 gathers, the Parameter is kept
            self._get_resized_embeddings(table, embeddings.num_embeddings, mean_resizing=False)
            with torch.no_grad():
                table.weight[kept:].zero_()
        return embeddings


# ---- PEFT ----------------------------------------------------------------------------------------------------------

logger = logging.get_logger(__name__)
#: The modules holding every λ (and DenseFormer's depth weights, `gated`'s value gates, value embeddings' tables and
#: gates); pass as PEFT `modules_to_save` to train them alongside an adapter. A model without one of them simply has
#: nothing to save under that name.
LAMBDA_MODULES = ["value_residual", "depth_weighted_average", "value_gate", "value_embedding", "value_embedding_gate"]

_MODEL_TYPE = "resformer"
_TEMPLATE_MODEL_TYPE = "llama"


def register_peft_target_modules() -> bool:
    """Give "resformer" Llama's default target modules in every PEFT mapping that lists Llama.

    Returns False (and does nothing) when PEFT is not installed; safe to call more than once. Importing PEFT here
    costs ~0.1 s once transformers is loaded, so it is done eagerly rather than through an import hook.
    """
    if importlib.util.find_spec("peft") is None:
        return False
    try:
        from peft.utils import constants
    except ImportError as error:  # a broken optional install must not break `import resformer_hf`
        logger.warning(f"PEFT is installed but failed to import ({error}); pass `target_modules` to PEFT yourself.")
        return False

    for name in dir(constants):
        table = getattr(constants, name)
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and _TEMPLATE_MODEL_TYPE in table:
            default = table[_TEMPLATE_MODEL_TYPE]
            table.setdefault(_MODEL_TYPE, list(default) if isinstance(default, list) else default)
    return True

