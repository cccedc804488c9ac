"""The value residual itself: every λ of a ResFormer and the few lines that mix values with them.

Everything specific to Value Residual Learning (Zhou et al., ACL 2025, arXiv 2410.17897) lives here and in the variant
registry (`VARIANTS` in `configuration_resformer.py`); the modeling file only wires it into Llama's attention.
Imports only torch and transformers (copied for `trust_remote_code`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import repeat_kv

from .configuration_resformer import CORRECT, DENSE, FIXED, PAIR, PLAIN, REUSE, SOFTMAX, ResFormerConfig


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
        n = len(self.receivers)
        if self.parameterisation == PAIR:
            self.lambda_first_offset = nn.Parameter(torch.zeros(n))
            self.lambda_self_offset = nn.Parameter(torch.zeros(n))
        elif self.parameterisation == SOFTMAX:
            self.lambda_logits = nn.Parameter(torch.zeros(n))
            self.lambda_scale_offset = nn.Parameter(torch.zeros(()))
            self.lambda_self_offset = nn.Parameter(torch.zeros(n))
        elif self.parameterisation == DENSE:
            # Row r: offsets of receiving layer receivers[r] on the raw values V_0 .. V_{L-1}; columns > layer unused.
            self.dense_weight_offset = nn.Parameter(torch.zeros(n, self.num_layers))
        # Fixed λ give a constant matrix: build it once instead of ~10 tiny ops per forward, which cost several % of a
        # small model's prefill. A non-persistent buffer follows `.to(device)` / device maps like Llama's rotary
        # `inv_freq`; like it, `_init_weights` rebuilds it when transformers loads on the meta device.
        fixed = self.mixing_weights(torch.device("cpu")) if self.parameterisation == FIXED else None
        self.register_buffer("fixed_weights", fixed, persistent=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Zero every offset (λ back to the initial values in the config) and rebuild the fixed matrix in place."""
        for parameter in self.parameters(recurse=False):
            parameter.zero_()
        if self.fixed_weights is not None:
            self.fixed_weights.copy_(self.mixing_weights(self.fixed_weights.device))

    def _receiver_pairs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(λ_first, λ_self) of each receiving layer, as differentiable tensors of shape [len(receivers)]."""
        if self.parameterisation == PAIR:
            return self.lambda_first_offset + self.lambda_first_init, self.lambda_self_offset + self.lambda_self_init
        if self.parameterisation == SOFTMAX:
            scale = self.lambda_scale_offset + self.lambda_scale_init
            return scale * torch.softmax(self.lambda_logits, dim=0), self.lambda_self_offset + self.lambda_self_init
        n = len(self.receivers)
        exact = dict(device=device, dtype=torch.float32)  # not the default dtype: bf16 would round 0.4 to 0.4004
        return torch.full((n,), self.lambda_first_init, **exact), torch.full((n,), self.lambda_self_init, **exact)

    def _device(self) -> torch.device:
        parameter = next(self.parameters(), None)
        return parameter.device if parameter is not None else torch.device("cpu")

    def forward(self) -> torch.Tensor:
        """Mixing weights `W` [L, L], float32: a mixing layer n attends over `Σ_{j<n} W[n, j]·V_j + W[n, n]·V_n`.

        Only rows of receiving layers are meaningful, and outside a dense parameterisation only columns 0 and n are
        non-zero. For a correcting layer (NeuTRENO), `W[n, 0]` is its λ; layers that reuse V_0 read no weights.
        """
        if self.fixed_weights is not None:
            return self.fixed_weights
        return self.mixing_weights(self._device())

    def mixing_weights(self, device: torch.device) -> torch.Tensor:
        """`forward()`'s matrix computed afresh on `device`, always float32 (whatever the default dtype is while
        transformers builds the model, e.g. `from_pretrained(..., dtype=torch.bfloat16)`)."""
        size = (self.num_layers, self.num_layers)
        weights = torch.zeros(size, device=device, dtype=torch.float32)
        if not self.receivers:
            return weights
        receivers = torch.tensor(self.receivers, device=device, dtype=torch.long)
        if self.parameterisation == DENSE:
            columns = torch.arange(self.num_layers, device=device)
            mask = (columns[None, :] <= receivers[:, None]).float()
            init = (columns[None, :] == 0).float() * self.lambda_first_init
            init = init + (columns[None, :] == receivers[:, None]).float() * self.lambda_self_init
            return weights.index_put((receivers,), (init + self.dense_weight_offset.float()) * mask)
        first, own = self._receiver_pairs(device)
        weights = weights.index_put((receivers, torch.zeros_like(receivers)), first.float())
        return weights.index_put((receivers, receivers), own.float())

    @torch.no_grad()
    def lambda_table(self) -> torch.Tensor:
        """Effective (λ_first, λ_self) of every layer as a float32 CPU tensor [L, 2]; see `value_residual_lambdas`.

        Plain layers are (0, 1); a layer that reuses V_0 is (1, 0); a correcting layer shows its λ as (λ, 1 − λ), the
        mix its correction `λ(V_0 − V_n)` makes of a token's own values.
        """
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


def mix_values(own_values: torch.Tensor, residual_values: torch.Tensor, weights: torch.Tensor, layer_idx: int):
    """`V'_n = Σ_j weights[j]·residual_values[j] + weights[n]·V_n`, on the un-repeated kv heads.

    `residual_values` stacks the raw values the layer may mix in ([1, B, H_kv, T, D] holding V_0, or V_0..V_{n-1} for
    `dense`); `weights` is row n of `ValueResidual()`.
    """
    weights = weights.to(own_values.dtype)
    mixed = own_values * weights[layer_idx]
    for j in range(residual_values.shape[0]):
        mixed = torch.addcmul(mixed, residual_values[j], weights[j])  # one fused kernel instead of mul + add
    return mixed


def neutreno_correction(
    first_values: torch.Tensor, own_values: torch.Tensor, weights: torch.Tensor, num_key_value_groups: int
) -> torch.Tensor:
    """NeuTRENO's per-token term `λ(V_0 − V_n)`, repeated to the query heads and laid out like attention output
    ([B, T, H_q, D]) so it can be added to `A_n V_n` before `o_proj`. λ is `weights[0]` (row n of
    `ValueResidual()`)."""
    difference = repeat_kv(first_values - own_values, num_key_value_groups)
    return (difference * weights[0].to(difference.dtype)).transpose(1, 2)
