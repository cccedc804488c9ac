"""The λ of the value residual: one module (`ValueResidual`), read once per forward pass into each layer's
(λ_first, λ_self). Imports only torch and sibling files (copied next to `config.json` for `trust_remote_code`).
"""

from __future__ import annotations

import torch
from torch import nn

from .configuration_resformer import ResFormerConfig
from .loading import gathered_parameters
from .variants import CORRECT, DENSE, MIX, MIX_ALL, PAIR, PLAIN, REUSE, SOFTMAX

#: Up to this many tokens without gradient (a decode step, a speculative draft) layer 0 scales V_0 for every receiver
#: at once; beyond it (prefill) each receiver scales it, holding one scaled copy at a time instead of R.
BATCHED_SCALING_MAX_TOKENS = 16


class ExactBuffers(nn.Module):
    """A module whose buffers `initial` and `mask` are exact float32 constants, made anew after every `_apply`
    (`.to()`, `.bfloat16()`, DeepSpeed's casts), which would round them (bf16 holds 0.4 as 0.4004)."""

    def register_exact_buffers(self) -> None:
        """Non-persistent (like Llama's `inv_freq`), on the default device, as parameters (vLLM: on the CPU)."""
        initial, mask = self.initial_buffers(torch.get_default_device())
        self.register_buffer("initial", initial, persistent=False)
        self.register_buffer("mask", mask, persistent=False)

    def exact_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers made anew where they are: float32 (float64 in a float64 model)."""
        dtype = torch.promote_types(self.initial.dtype, torch.float32)
        fresh = zip(("initial", "mask"), self.initial_buffers(self.initial.device, dtype))
        return {name: buffer for name, buffer in fresh if buffer is not None}

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._buffers.update(self.exact_buffers())
        return self


class ValueResidual(ExactBuffers):
    """Every λ of the model in one module (a softmax couples the layers; optimisers, PEFT and cards find one name).
    Learnable λ are offsets from the config's initial values: weight decay pulls them toward those values (never
    toward "no value residual"), and a checkpoint without them loads at exactly those values."""

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
        elif self.parameterisation == SOFTMAX:
            self.lambda_logits = nn.Parameter(torch.zeros(n, dtype=torch.float32))
            # Shape [1], not 0-dim: FSDP2 and DeepSpeed ZeRO refuse 0-dim parameters.
            self.lambda_scale_offset = nn.Parameter(torch.zeros(1, dtype=torch.float32))
        if self.parameterisation in (PAIR, SOFTMAX):
            self.lambda_self_offset = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        if self.parameterisation == DENSE:
            # Row r: receiver r's weights on the raw values V_0 .. V_{L-1}; columns after it unused.
            self.dense_weight_offset = nn.Parameter(torch.zeros(n, self.num_layers, dtype=torch.float32))
        self.register_exact_buffers()
        self.fixed_lambdas = self.fixed_per_layer()  # the config's floats: made once, not at every forward

    def initial_buffers(self, device: torch.device, dtype: torch.dtype = torch.float32
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The table at zero offsets, and dense's mask of the columns each row reads. Zeros then filled: DeepSpeed's
        `zero.Init` turns what `torch.full` creates into its training dtype, but not what `fill_` writes."""
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

    def forward(self) -> torch.Tensor:
        """The λ table in float32: [2, R], λ_first and λ_self of the R receivers (`dense`: [R, L], each receiver's
        weights on V_0 .. V_{L-1}). Offsets are upcast before the initial values are added, so engines that hand over
        bf16 copies round only the small offsets."""
        if self.parameterisation == PAIR:
            return torch.stack((self.lambda_first_offset, self.lambda_self_offset)) + self.initial
        if self.parameterisation == SOFTMAX:
            dtype = self.initial.dtype
            scale = self.lambda_scale_offset.to(dtype) + self.lambda_scale_init
            first = torch.softmax(self.lambda_logits.to(dtype), 0) * scale
            return torch.stack((first, self.lambda_self_offset.to(dtype))) + self.initial
        if self.parameterisation == DENSE:
            return (self.dense_weight_offset + self.initial) * self.mask
        return self.initial  # fixed λ (and `gated`'s initial mix)

    def per_layer(self, dtype: torch.dtype, tokens: int) -> tuple[tuple, ...]:
        """Each layer's (λ_first, λ_self) for one forward pass: the config's floats where fixed, else 0-dim views of
        one table cast once to the values' dtype (backward gathers their gradients in one op); `dense`: (its row of
        weights, None); (None, None) where a layer receives nothing. Decoding a learnable mix, layer 0 gets every
        receiver's λ_first as a column [R, 1, 1, 1, 1], to scale V_0 for all of them at once."""
        if not self._parameters:
            return self.fixed_lambdas
        table = self().to(dtype)
        if self.parameterisation == DENSE:
            rows = ((row, None) for row in table.unbind(0))
        else:  # flat: one unbind, whose backward is one stack
            flat = table.view(-1).unbind()
            rows = zip(flat[: table.shape[1]], flat[table.shape[1]:])
        layers = [(None, None) if role == PLAIN else next(rows) for role in self.roles]
        if self.parameterisation != DENSE and not torch.is_grad_enabled() and tokens <= BATCHED_SCALING_MAX_TOKENS:
            layers[0] = (table[0].view(-1, 1, 1, 1, 1), None)
        return tuple(layers)

    def fixed_per_layer(self) -> tuple[tuple, ...]:
        """`per_layer` where every λ is fixed: the ResFormer mix reads V_0 scaled once, by layer 0, for every receiver
        (layer 0: (λ_first, None); a receiver: (None, λ_self)); other roles read (λ_first, λ_self) themselves."""
        layers = []
        for layer, role in enumerate(self.roles):
            if role == PLAIN:
                layers.append((self.lambda_first_init if layer == 0 and MIX in self.roles else None, None))
            else:
                layers.append((None if role == MIX else self.lambda_first_init, self.lambda_self_init))
        return tuple(layers)

    @torch.no_grad()
    def lambda_table(self) -> torch.Tensor:
        """Effective (λ_first, λ_self) of every layer, float32 [L, 2] on the CPU (`value_residual_lambdas`)."""
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
        return f"parameterisation={self.parameterisation}, receivers={self.receivers}"

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # torch's `load_state_dict` (Trainer resume, PEFT, ZeRO-3) of a 0-dim λ_scale saved before it became [1].
        key = f"{prefix}lambda_scale_offset"
        if key in state_dict and state_dict[key].dim() == 0:
            state_dict[key] = state_dict[key].reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


__all__ = ["BATCHED_SCALING_MAX_TOKENS", "ExactBuffers", "ValueResidual"]
