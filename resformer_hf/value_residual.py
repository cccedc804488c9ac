"""The λ of the value residual: every learnable or fixed mixing weight of a ResFormer, resolved once per forward pass.

Value Residual Learning (Zhou et al., ACL 2025, arXiv 2410.17897) is declared in the variant registry (`VARIANTS` in
`configuration_resformer.py`), parameterised here, and applied by each layer's value path (`value_paths.py`): with a
gradient through `fused_mixing.py`, which keeps training memory at Llama's, without one on v_proj's output with the
per-layer `LayerMix` this module resolves (`no_grad_mixing.py`). The modeling file only wires them into Llama's
attention. Imports only torch and transformers (copied for `trust_remote_code`).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps, WeightConverter  # 5.23's checkpoint-conversion API

from .configuration_resformer import CORRECT, DENSE, FIXED, PAIR, PER_TOKEN, PLAIN, REUSE, SOFTMAX, ResFormerConfig
from .no_grad_mixing import LayerMix, readable_as_numbers

#: Parameterisations whose λ are constants from the config: fixed λ, and `"gated"`'s initial mix (its gates live in
#: the layers, `value_gate.ValueGate`).
CONSTANT = (FIXED, PER_TOKEN)

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # builds without torch.distributed have no sharded tensors
    DTensor = ()


class ValueResidual(nn.Module):
    """Holds every λ of the model and turns them into per-layer mixing weights.

    One module for the whole model (not one per layer) because a softmax parameterisation couples the layers through
    a softmax and one shared λ_scale; it also gives optimisers, PEFT `modules_to_save=["value_residual"]` and model
    cards a single name to find. What it holds follows the variant's registry entry (`VARIANTS` in the configuration
    module): no parameters for fixed λ, a pair per receiving layer, softmax logits + scale, or a dense matrix.

    Learnable λ are stored as *offsets from their configured initial values* (the initial values live in the config).
    Weight decay therefore pulls λ toward their initial values rather than toward zero, which would silently switch
    the value residual off, and a checkpoint that lacks them (zero offsets) gets exactly the documented initial values.
    Initial and fixed values come from the config, never from the checkpoint.
    """

    def __init__(self, config: ResFormerConfig):
        super().__init__()
        config.check_value_residual()  # fields may have been assigned after the config was built
        self.parameterisation = config.value_residual_spec.lambdas
        self.num_layers = config.num_hidden_layers
        self.receivers = config.value_residual_receivers
        self.roles = config.value_residual_layer_roles
        self.lambda_first_init = config.value_residual_lambda_first_resolved
        self.lambda_self_init = config.value_residual_lambda_self_resolved
        self.lambda_scale_init = config.value_residual_lambda_scale_resolved
        self.role = config.value_residual_spec.role
        n = len(self.receivers)
        if self.parameterisation == PAIR:
            self.lambda_first_offset = nn.Parameter(torch.zeros(n, dtype=torch.float32))
            self.lambda_self_offset = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        elif self.parameterisation == SOFTMAX:
            self.lambda_logits = nn.Parameter(torch.zeros(n, dtype=torch.float32))
            # Shape [1], not a 0-dim scalar: FSDP2 and DeepSpeed ZeRO refuse 0-dim parameters. Checkpoints that saved
            # it as a scalar still load (`LAMBDA_CHECKPOINT_CONVERSIONS`, `_load_from_state_dict`).
            self.lambda_scale_offset = nn.Parameter(torch.zeros(1, dtype=torch.float32))
            self.lambda_self_offset = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        elif self.parameterisation == DENSE:
            # Row r: offsets of receiving layer receivers[r] on the raw values V_0 .. V_{L-1}; columns > layer unused.
            self.dense_weight_offset = nn.Parameter(torch.zeros(n, self.num_layers, dtype=torch.float32))
        # Fixed λ give a constant matrix: build it once instead of ~10 tiny ops per forward, which cost several % of a
        # small model's prefill. A non-persistent buffer follows `.to(device)` / device maps like Llama's rotary
        # `inv_freq`; like it, `_init_weights` rebuilds it when transformers loads on the meta device.
        fixed = self.mixing_weights(torch.device("cpu")) if self.parameterisation in CONSTANT else None
        self.register_buffer("fixed_weights", fixed, persistent=False)
        #: (λ offsets read as numbers, the mixes built from them): `layer_mixes` reuses them while the offsets match.
        self._numeric_mixes: tuple[dict[str, list], tuple[LayerMix, ...]] | None = None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Zero every offset (λ back to the initial values in the config) and rebuild the fixed matrix in place."""
        for parameter in self.parameters(recurse=False):
            parameter.zero_()
        if self.fixed_weights is not None:
            self.fixed_weights.copy_(self.mixing_weights(self.fixed_weights.device))

    def _receiver_pairs(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(λ_first, λ_self) of each receiving layer, as differentiable float32 tensors of shape [len(receivers)].

        Offsets are upcast before the initial values are added: engines that hand the module bfloat16 copies of its
        parameters (DeepSpeed bf16) then round only the small offsets, never λ itself (bf16 holds 32.3 as 32.25).
        """
        if self.parameterisation == PAIR:
            first, own = self.lambda_first_offset.float(), self.lambda_self_offset.float()
            return first + self.lambda_first_init, own + self.lambda_self_init
        if self.parameterisation == SOFTMAX:
            scale = self.lambda_scale_offset.float() + self.lambda_scale_init
            first = scale * torch.softmax(self.lambda_logits.float(), dim=0)
            return first, self.lambda_self_offset.float() + self.lambda_self_init
        n = len(self.receivers)  # float32 like `like`, not the default dtype: bf16 would round 0.4 to 0.4004
        return like.new_full((n,), self.lambda_first_init), like.new_full((n,), self.lambda_self_init)

    def _device(self) -> torch.device:
        parameter = next(self.parameters(), None)
        return parameter.device if parameter is not None else torch.device("cpu")

    def forward(self, inference: bool = False) -> torch.Tensor | tuple[LayerMix, ...]:
        """Mixing weights `W` [L, L], float32: a mixing layer n attends over `Σ_{j<n} W[n, j]·V_j + W[n, n]·V_n`.

        Only rows of receiving layers are meaningful, and outside a dense parameterisation only columns 0 and n are
        non-zero. For a correcting layer (NeuTRENO), `W[n, 0]` is its λ; layers that reuse V_0 read no weights.
        With `inference=True` (no gradient needed): one `LayerMix` per layer instead, see `layer_mixes`.
        """
        if inference:
            return self.layer_mixes()
        if self.fixed_weights is not None:
            return self.fixed_weights
        return self.mixing_weights(self._device())

    def mixing_weights(self, device: torch.device) -> torch.Tensor:
        """`forward()`'s matrix computed afresh on `device`, always float32 (whatever the default dtype is while
        transformers builds the model, e.g. `from_pretrained(..., dtype=torch.bfloat16)`).

        DeepSpeed's `zero.Init` turns every floating tensor that `torch.zeros`/`full`/`tensor` create into its training
        dtype, even when float32 is asked for; `.float()` and `new_full` are not patched, so the matrix stays exact.
        """
        size = (self.num_layers, self.num_layers)
        weights = torch.zeros(size, device=device, dtype=torch.float32).float()
        if not self.receivers:
            return weights
        receivers = torch.tensor(self.receivers, device=device, dtype=torch.long)
        if self.parameterisation == DENSE:
            columns = torch.arange(self.num_layers, device=device)
            mask = (columns[None, :] <= receivers[:, None]).float()
            init = (columns[None, :] == 0).float() * self.lambda_first_init
            init = init + (columns[None, :] == receivers[:, None]).float() * self.lambda_self_init
            return weights.index_put((receivers,), (init + self.dense_weight_offset.float()) * mask)
        first, own = self._receiver_pairs(weights)
        weights = weights.index_put((receivers, torch.zeros_like(receivers)), first.float())
        return weights.index_put((receivers, receivers), own.float())

    def layer_mixes(self) -> tuple[LayerMix, ...]:
        """Every layer's `LayerMix` for a forward pass without gradient, λ resolved once for all layers.

        Wherever it can (`_offsets_as_numbers`), each λ is a Python number: a mixing layer then folds the mix into
        v_proj's GEMM (`torch.addmm(V_0, h, Wᵀ, beta=λ_first, alpha=λ_self)`), one op where Llama has its linear, and
        the pass dispatches no op for λ at all. Fixed λ are numbers everywhere; learnable ones on the CPU when eager.
        The mixes are kept with the λ values they were built from and reused while those read the same (every step of
        `generate()`): building them is Python work worth 0.6–1 % of a small model's decode step.
        """
        offsets = self._offsets_as_numbers()
        if offsets is None:
            return self._tensor_mixes()
        if self._numeric_mixes is not None and self._numeric_mixes[0] == offsets:
            return self._numeric_mixes[1]
        firsts, owns = self.numeric_lambdas(offsets)
        rows = {layer: row for row, layer in enumerate(self.receivers)}
        first_of_layer_0 = firsts[0] if firsts and self.role == CORRECT else 0.0  # NeuTRENO's layer 0 scales V_0
        mixes = tuple(
            LayerMix(firsts[rows[layer]], owns[rows[layer]]) if layer in rows else LayerMix(first_of_layer_0, 1.0)
            for layer in range(self.num_layers)
        )
        self._numeric_mixes = (offsets, mixes)
        return mixes

    def _offsets_as_numbers(self) -> dict[str, list] | None:
        """The learnable offsets as Python lists by parameter name (`{}` for fixed λ), or None where they must stay
        tensors: under `torch.compile` (a number read from a tensor breaks the graph), for `dense` (a matrix of
        weights), for parameters off the CPU (reading them would wait for the device every step) and for sharded ones
        (FSDP2 DTensors, DeepSpeed ZeRO-3). Reading a CPU tensor's values dispatches no op.
        """
        if self.parameterisation in CONSTANT:
            return {}
        if self.parameterisation == DENSE or not readable_as_numbers(self):
            return None
        return {name: parameter.tolist() for name, parameter in self._parameters.items()}

    def numeric_lambdas(self, offsets: dict[str, list]) -> tuple[list[float], list[float]]:
        """(λ_first, λ_self) of every receiver as Python floats, from `_offsets_as_numbers`. The softmax of
        `learnable_plus` is a handful of float operations.
        """
        n = len(self.receivers)
        if self.parameterisation in CONSTANT:
            return [self.lambda_first_init] * n, [self.lambda_self_init] * n
        owns = [offset + self.lambda_self_init for offset in offsets["lambda_self_offset"]]
        if self.parameterisation == PAIR:
            return [offset + self.lambda_first_init for offset in offsets["lambda_first_offset"]], owns
        logits, (scale_offset,) = offsets["lambda_logits"], offsets["lambda_scale_offset"]
        if not logits:  # a one-layer model: no layer receives V_0
            return [], owns
        top = max(logits)
        exponentials = [math.exp(logit - top) for logit in logits]
        scale = (scale_offset + self.lambda_scale_init) / sum(exponentials)
        return [scale * exponential for exponential in exponentials], owns

    def _tensor_mixes(self) -> tuple[LayerMix, ...]:
        """`layer_mixes` with λ as tensors (see `_offsets_as_numbers` for when).

        At most six small ops per forward pass (learnable_plus: the softmax, λ_scale, λ_self, a view, an unbind).
        Learnable λ_first become a [R, 1, 1, 1, 1] column that layer 0 scales V_0 with for all R receivers at once
        (decode steps; a long prompt's receivers scale it one at a time); λ_self are unbound into 0-dim tensors.
        `dense` hands layer 0 a copy of its offsets [R, L], which it unbinds into per-source columns.
        """
        n, first_init, own_init = len(self.receivers), self.lambda_first_init, self.lambda_self_init
        first, owns = first_init, [own_init] * n
        if self.parameterisation == PAIR:
            first = (self.lambda_first_offset.float() + first_init).view(n, 1, 1, 1, 1)
            owns = (self.lambda_self_offset.float() + own_init).unbind()
        elif self.parameterisation == SOFTMAX:
            scale = self.lambda_scale_offset.float() + self.lambda_scale_init
            first = (torch.softmax(self.lambda_logits.float(), dim=0) * scale).view(n, 1, 1, 1, 1)
            owns = (self.lambda_self_offset.float() + own_init).unbind()
        elif self.parameterisation == DENSE:  # a copy: FSDP2 frees the gathered parameter after this forward
            first = self.dense_weight_offset.clone()
        rows = {layer: row for row, layer in enumerate(self.receivers)}
        return tuple(LayerMix(first, owns[rows[layer]] if layer in rows else own_init)
                     for layer in range(self.num_layers))

    @torch.no_grad()
    def lambda_table(self) -> torch.Tensor:
        """Effective (λ_first, λ_self) of every layer as a float32 CPU tensor [L, 2]; see `value_residual_lambdas`.

        Plain layers are (0, 1); a layer that reuses V_0 is (1, 0); a correcting layer shows its λ as (λ, 1 − λ), the
        mix its correction `λ(V_0 − V_n)` makes of a token's own values.
        """
        with gathered_parameters(self):
            weights = self.forward().cpu()
        table = torch.zeros(self.num_layers, 2, dtype=torch.float32)
        for layer, role in enumerate(self.roles):
            if role == PLAIN:
                table[layer] = torch.tensor([0.0, 1.0])
            elif role == REUSE:
                table[layer] = torch.tensor([1.0, 0.0])
            elif role == CORRECT:
                table[layer] = torch.stack((weights[layer, 0], 1.0 - weights[layer, 0]))
            else:
                table[layer] = torch.stack((weights[layer, 0], weights[layer, layer]))
        return table

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

    A 1-D tensor passes unchanged, so saving (which applies the reverse, this op again) writes the new layout. When
    `from_pretrained` shards the parameter (FSDP2 through `distributed_config`), the loader treats a 0-dim tensor as
    one slice along the parameter's first dim, like one expert of a stacked MoE weight, and hands each rank only the
    slices it owns: the rank that owns it gets the scalar, the others an empty list and an empty local shard.
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
    """Within the block, `module`'s own parameters are whole on every rank, whichever engine sharded them.

    FSDP2 keeps them as sharded DTensors between forward passes (they are swapped for their full tensors here); ZeRO-3
    keeps a placeholder and a partition per rank (gathered with DeepSpeed's `GatheredParameters`). Tensor parallelism
    replicates them already. Gathering is a collective: every rank must enter the block. Read-only: changes are lost.
    """
    parameters = dict(module.named_parameters(recurse=False))
    partitioned = [parameter for parameter in parameters.values() if hasattr(parameter, "ds_id")]
    with _zero3_gathered(partitioned):
        sharded = {name: parameter for name, parameter in parameters.items() if isinstance(parameter, DTensor)}
        module._parameters.update({name: nn.Parameter(p.detach().full_tensor(), False) for name, p in sharded.items()})
        try:
            yield
        finally:
            module._parameters.update(sharded)


def _zero3_gathered(parameters: list[nn.Parameter]):
    """DeepSpeed's gather for ZeRO-3-partitioned parameters (they carry a `ds_id`), or a no-op when there are none.

    Parameters with a `ds_id` were partitioned by DeepSpeed, so it is already imported; it is looked up rather than
    imported, since this file may import only torch and transformers (it is copied for `trust_remote_code`).
    """
    if not parameters:
        return contextlib.nullcontext()
    return sys.modules["deepspeed"].zero.GatheredParameters(parameters)


def fixed_value_weights(config: ResFormerConfig) -> tuple[float, float] | None:
    """(λ_first, λ_self) as Python floats when the variant's λ are constants, else None.

    Fixed λ then enter the GEMMs as exact scalars (never rounded to a bf16 tensor) and cost no per-layer tensor ops.
    For NeuTRENO λ_first is its λ.
    """
    if config.value_residual_spec.lambdas != FIXED:
        return None
    return config.value_residual_lambda_first_resolved, config.value_residual_lambda_self_resolved

