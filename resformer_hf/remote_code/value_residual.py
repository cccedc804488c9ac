"""The λ of the value residual: one module holds them all and turns them into one table per forward pass.

Which layers receive V_0 and how their λ are parameterised is the variant registry's (`VARIANTS` in
`configuration_resformer.py`); what a layer does with its row of the table is its value path's (`value_paths.py`).
Imports only torch and transformers (copied for `trust_remote_code`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps, WeightConverter  # 5.23's checkpoint-conversion API

from .configuration_resformer import CORRECT, DENSE, MIX_ALL, PAIR, PLAIN, REUSE, SOFTMAX, ResFormerConfig

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # builds without torch.distributed have no sharded tensors
    DTensor = ()


class LayerMix(NamedTuple):
    """One layer's λ in a pass without gradient: Python numbers where they read for free (`readable_as_numbers`), else
    tensors. For a receiver with λ as tensors, `lambda_first` is every receiver's λ_first as a [R, 1, 1, 1, 1] column
    (layer 0 scales V_0 for all of them at once) and `lambda_self` its own 0-dim λ_self; `dense` hands its [R, L]
    weights to layer 0 instead."""

    lambda_first: float | torch.Tensor
    lambda_self: float | torch.Tensor


def readable_as_numbers(module: nn.Module) -> bool:
    """Whether `module`'s parameters can be read as Python numbers for free: eager, on the CPU, not sharded."""
    if torch.compiler.is_compiling():
        return False
    return all(type(p) is nn.Parameter and p.device.type == "cpu" and not hasattr(p, "ds_id")
               for p in module._parameters.values())


class ExactBuffers(nn.Module):
    """A module whose buffers `initial` and `mask` hold exact float32 constants (`initial_buffers`): they are made anew
    after every `_apply` (`.to()`, `.bfloat16()`, DeepSpeed's casts), which would otherwise round them (bf16 holds 0.4
    as 0.4004)."""

    def register_exact_buffers(self) -> None:
        """Make the buffers, non-persistent like Llama's rotary `inv_freq`, on the default device: where parameters are
        made too (`with torch.device("cuda")` puts both there; vLLM's build puts parameters on meta and buffers on the
        CPU). They follow `.to()` and device maps, and `_init_weights` rebuilds them after a meta build."""
        initial, mask = self.initial_buffers(torch.get_default_device())
        self.register_buffer("initial", initial, persistent=False)
        self.register_buffer("mask", mask, persistent=False)

    def exact_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers made anew where they are, by name: float32, or float64 in a model cast to it."""
        dtype = torch.promote_types(self.initial.dtype, torch.float32)
        fresh = zip(("initial", "mask"), self.initial_buffers(self.initial.device, dtype))
        return {name: buffer for name, buffer in fresh if buffer is not None}

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._buffers.update(self.exact_buffers())
        return self


class ValueResidual(ExactBuffers):
    """Every λ of the model (one module, not one per layer: a softmax couples the layers, and optimisers, PEFT's
    `modules_to_save=["value_residual"]` and model cards get one name to find).

    Learnable λ are stored as *offsets from the initial values in the config*: weight decay pulls them toward those
    values (never silently toward "no value residual"), and a checkpoint without them loads at exactly those values.
    Initial and fixed values live in non-persistent buffers made once, so a forward pass builds no tensor from Python
    data and copies nothing from the host.
    """

    def __init__(self, config: ResFormerConfig):
        super().__init__()
        config.check_value_residual()  # fields may have been assigned after the config was built
        self.parameterisation = config.value_residual_spec.lambdas
        self.receivers = config.value_residual_receivers
        self.roles = config.value_residual_layer_roles
        self.num_layers = config.num_hidden_layers
        self.lambda_first_init = config.value_residual_lambda_first_resolved
        self.lambda_self_init = config.value_residual_lambda_self_resolved
        self.lambda_scale_init = config.value_residual_lambda_scale_resolved
        n = len(self.receivers)
        if self.parameterisation == PAIR:
            self.lambda_first_offset = nn.Parameter(torch.zeros(n, dtype=torch.float32))
            self.lambda_self_offset = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        elif self.parameterisation == SOFTMAX:
            self.lambda_logits = nn.Parameter(torch.zeros(n, dtype=torch.float32))
            # Shape [1], not 0-dim: FSDP2 and DeepSpeed ZeRO refuse 0-dim parameters (old checkpoints are reshaped on
            # load, `LAMBDA_CHECKPOINT_CONVERSIONS`).
            self.lambda_scale_offset = nn.Parameter(torch.zeros(1, dtype=torch.float32))
            self.lambda_self_offset = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        elif self.parameterisation == DENSE:
            # Row r: offsets of receiver r's weights on the raw values V_0 .. V_{L-1}; columns after it unused.
            self.dense_weight_offset = nn.Parameter(torch.zeros(n, self.num_layers, dtype=torch.float32))
        self.register_exact_buffers()
        #: (the λ offsets read as numbers, the mixes built from them), reused while the offsets read the same
        self._numeric: tuple[tuple, tuple[LayerMix, ...]] | None = None

    def initial_buffers(self, device: torch.device, dtype: torch.dtype = torch.float32
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The table at zero offsets (fixed λ: the table itself), and dense's mask of the columns each row reads.

        Zeros made in float32 and then filled: DeepSpeed's `zero.Init` turns what `torch.tensor`/`full` create into
        its training dtype (bf16 holds 0.4 as 0.4004), but not what `fill_` writes into a float32 tensor.
        """
        n = len(self.receivers)
        if self.parameterisation != DENSE:
            initial = torch.zeros(2, n, device=device).to(dtype)
            initial[0] = 0.0 if self.parameterisation == SOFTMAX else (self.lambda_first_init or 0.0)
            initial[1] = self.lambda_self_init if self.lambda_self_init is not None else 1.0
            return initial, None
        initial = torch.zeros(n, self.num_layers, device=device).to(dtype)
        mask = torch.zeros(n, self.num_layers, device=device).to(dtype)
        for row, layer in enumerate(self.receivers):
            mask[row, : layer + 1] = 1.0
            initial[row, 0] = self.lambda_first_init
            initial[row, layer] = self.lambda_self_init
        return initial, mask

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Zero every offset (λ back to the initial values in the config) and rebuild the buffers in place."""
        for parameter in self.parameters(recurse=False):
            parameter.zero_()
        for name, fresh in self.exact_buffers().items():
            self._buffers[name].copy_(fresh)

    def forward(self, gradients: bool = True) -> torch.Tensor | tuple[LayerMix, ...]:
        """The λ table, float32: [2, R], the λ_first and the λ_self of the R receiving layers (contiguous rows, so each
        offset's gradient is a plain slice); `dense` [R, L], each receiver's weights on V_0 .. V_{L-1}. With
        `gradients=False` (a pass nothing will differentiate), one `LayerMix` per layer instead.

        Offsets are upcast before the initial values are added (type promotion with the float32 buffers): engines
        that hand the module bfloat16 copies of its parameters (DeepSpeed bf16) round only the small offsets.
        """
        if not gradients:
            return self.layer_mixes()
        if self.parameterisation == PAIR:
            return torch.stack((self.lambda_first_offset, self.lambda_self_offset)) + self.initial
        if self.parameterisation == SOFTMAX:
            dtype = self.initial.dtype  # float32 (float64 in a float64 model), whatever the offsets were cast to
            scale = self.lambda_scale_offset.to(dtype) + self.lambda_scale_init
            first = torch.softmax(self.lambda_logits.to(dtype), 0) * scale
            return torch.stack((first, self.lambda_self_offset.to(dtype))) + self.initial
        if self.parameterisation == DENSE:
            return (self.dense_weight_offset + self.initial) * self.mask
        return self.initial  # fixed λ (and `gated`'s initial mix): constants

    def rows(self, table: torch.Tensor, dtype: torch.dtype) -> tuple:
        """Each layer's (λ_first, λ_self) from `forward()`'s table in the values' dtype: 0-dim tensors, (its row of
        weights, None) for `dense`, (None, None) where a layer receives nothing or λ are fixed (their paths hold them
        as floats). All are views of one cast, so backward gathers their gradients in one op."""
        if not self._parameters:
            return ((None, None),) * self.num_layers
        table = table.to(dtype)
        if self.parameterisation == DENSE:
            rows = ((row, None) for row in table.unbind(0))
        else:  # flat: one unbind, whose backward is one stack
            flat = table.view(-1).unbind()
            rows = zip(flat[: table.shape[1]], flat[table.shape[1]:])
        return tuple(next(rows) if role != PLAIN else (None, None) for role in self.roles)

    def layer_mixes(self) -> tuple[LayerMix, ...]:
        """Every layer's `LayerMix` for a pass without gradient.

        Fixed λ are the config's numbers. Learnable ones are read into numbers where that is free, and kept while the
        parameters are not written to (every step of `generate()`): a mixing layer then folds them into v_proj's
        GEMM and the pass dispatches no op for λ. Elsewhere (GPU, compiled, sharded) they stay tensors: one table.
        """
        fixed = not self._parameters
        readable = fixed or (self.parameterisation != DENSE and readable_as_numbers(self))
        # Keyed by the values themselves: a write through `.data` bumps no version counter. Reading dispatches no op.
        versions = tuple(p.tolist() for p in self._parameters.values()) if readable else None
        if readable and self._numeric is not None and self._numeric[0] == versions:
            return self._numeric[1]
        if fixed:
            mixes = self._numeric_mixes([(self.lambda_first_init, self.lambda_self_init)] * len(self.receivers))
            if not torch.compiler.is_compiling():
                self._numeric = (versions, mixes)
            return mixes
        with torch.no_grad():
            table = self.forward()
        if readable:
            self._numeric = (versions, self._numeric_mixes(list(zip(*table.tolist()))))
            return self._numeric[1]
        if self.parameterisation == DENSE:  # layer 0 starts every receiver's running mix from the whole table
            return (LayerMix(table, 1.0),) * self.num_layers
        firsts, owns = table[0].view(-1, 1, 1, 1, 1), iter(table[1].unbind())
        return tuple(LayerMix(firsts, next(owns) if role != PLAIN else 1.0) for role in self.roles)

    def _numeric_mixes(self, pairs: list) -> tuple[LayerMix, ...]:
        pairs = iter(pairs)
        mixes = [LayerMix(*next(pairs)) if role != PLAIN else LayerMix(0.0, 1.0) for role in self.roles]
        if self.receivers and self.roles[self.receivers[0]] == CORRECT:  # NeuTRENO's layer 0 scales V_0 by λ once
            mixes[0] = LayerMix(mixes[self.receivers[0]].lambda_first, 1.0)
        return tuple(mixes)

    @torch.no_grad()
    def lambda_table(self) -> torch.Tensor:
        """Effective (λ_first, λ_self) of every layer, float32 [L, 2] on the CPU: plain layers (0, 1), SVFormer's
        (1, 0), NeuTRENO's (λ, 1 − λ) (the mix its correction `λ(V_0 − V_n)` makes of a token's own values), dense's
        weights on V_0 and on the layer's own values."""
        with gathered_parameters(self):
            table = self.forward().cpu()
        result = torch.tensor([[0.0, 1.0]]).repeat(self.num_layers, 1)
        for row, layer in enumerate(self.receivers):
            role = self.roles[layer]
            if role == REUSE:
                result[layer] = torch.tensor([1.0, 0.0])
            elif role == CORRECT:
                result[layer] = torch.stack((table[0, row], 1.0 - table[0, row]))
            elif role == MIX_ALL:
                result[layer] = torch.stack((table[row, 0], table[row, layer]))
            else:
                result[layer] = table[:, row]
        return result

    def extra_repr(self) -> str:
        return f"parameterisation={self.parameterisation!r}, receivers={self.receivers}"

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # torch's `load_state_dict` (Trainer resume, PEFT, DeepSpeed ZeRO-3 loading) of an old 0-dim λ_scale.
        key = f"{prefix}lambda_scale_offset"
        if key in state_dict and state_dict[key].dim() == 0:
            state_dict[key] = state_dict[key].reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class LambdaScaleToVector(ConversionOps):
    """Checkpoint conversion: a λ_scale offset saved as a 0-dim scalar becomes the shape-[1] parameter, same value.

    A 1-D tensor passes unchanged, so saving (the reverse, this op again) writes the new layout. Sharded loading
    (FSDP2 through `distributed_config`) treats a 0-dim tensor as one slice along the first dim and hands it to the
    rank that owns it; the others get an empty list and an empty local shard.
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


@contextlib.contextmanager
def gathered_parameters(module: nn.Module) -> Iterator[None]:
    """Within the block, `module`'s own parameters are whole on every rank, whichever engine sharded them (FSDP2
    DTensors are swapped for their full tensors, ZeRO-3 partitions gathered). A collective: every rank must enter it.
    Read-only: changes are lost."""
    parameters = dict(module.named_parameters(recurse=False))
    partitioned = [parameter for parameter in parameters.values() if hasattr(parameter, "ds_id")]
    # Parameters with a `ds_id` were partitioned by DeepSpeed, so it is imported; looked up, since remote code may
    # import only torch and transformers.
    gather = sys.modules["deepspeed"].zero.GatheredParameters(partitioned) if partitioned else contextlib.nullcontext()
    with gather:
        sharded = {name: parameter for name, parameter in parameters.items() if isinstance(parameter, DTensor)}
        module._parameters.update({name: nn.Parameter(p.detach().full_tensor(), False) for name, p in sharded.items()})
        try:
            yield
        finally:
            module._parameters.update(sharded)
