"""The value mix of a forward pass that needs no gradient (decoding, evaluation, serving): on v_proj's output.

Training mixes through `fused_mixing.py`; `ValueResidual` (`value_residual.py`) resolves the λ once per forward pass
into one `LayerMix` per layer, and each attention layer hands its mix to `mix_on_output`. Imports only torch and
transformers (copied for `trust_remote_code`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from .configuration_resformer import CORRECT, MIX, MIX_ALL, PLAIN, REUSE
from .fused_mixing import corrected_output_projection as fused_corrected_output_projection
from .fused_mixing import plain_linear_weight

# Training mixes through `fused_mixing.py`, whose autograd functions fold λ_self into v_proj's weight to keep no extra
# tensor for backward; at decode that rescales the whole [H_kv·D, hidden] weight per layer per token. Without a
# gradient the values are mixed after the projection instead: O(H_kv·D) per token, the weight never touched.

#: Up to this many tokens per forward pass (a decode step, a speculative draft) layer 0 scales V_0 for all R receivers
#: in one op; beyond it (a prompt's prefill) each receiver scales V_0 when it runs, so that prefill holds one scaled
#: copy of V_0 at a time instead of R (R·B·H_kv·T·D elements: more than the cache's values for long prompts).
BATCHED_SCALING_MAX_TOKENS = 16


class ScaledPerReceiver(NamedTuple):
    """λ_first[r]·V_0 for receiver r, computed when receiver r asks for it (long inputs; see above)."""

    values: torch.Tensor  #: V_0 [B, H_kv, T, D]
    first: tuple[torch.Tensor, ...]  #: one [1, 1, 1, 1] λ_first per receiver, in the values' dtype

    def __getitem__(self, row: int) -> torch.Tensor:
        return self.values * self.first[row]


class LayerMix(NamedTuple):
    """What one layer does with values in a forward pass that needs no gradient (`ValueResidual(inference=True)`).

    `first` and `first_init` are shared by all layers (layer 0 scales V_0 with them); `own` is this layer's λ_self.
    """

    role: str  #: this layer's role (PLAIN for layers that do not receive)
    kind: str  #: the receiving layers' role in this variant, which decides what layer 0 hands on
    layer: int
    row: int  #: this layer's index among the receivers, -1 for other layers
    starts: bool  #: layer 0, whose values later layers read
    extends: bool  #: `dense`: a later layer whose values even later layers read
    first: float | torch.Tensor  #: λ_first (float), a [R, 1, 1, 1, 1] column (learnable), or dense offsets [R, L]
    first_init: float | None  #: λ_first's configured value (`dense` adds it to its offsets)
    own: float | torch.Tensor  #: λ_self: a float, or a 0-dim tensor for a receiver whose learnable λ are tensors


def readable_as_numbers(module: nn.Module) -> bool:
    """Whether `module`'s own parameters can be read as Python numbers for free in a pass without gradient.

    Not under `torch.compile` (reading a tensor's value breaks the graph), nor off the CPU (each read would wait for
    the device), nor for sharded parameters (FSDP2 DTensors, DeepSpeed ZeRO-3). Reading a CPU tensor dispatches no op.
    """
    if torch.compiler.is_compiling():
        return False
    return all(type(p) is nn.Parameter and p.device.type == "cpu" and not hasattr(p, "ds_id")
               for p in module._parameters.values())


def needs_value_gradients(model: nn.Module, inputs_embeds: torch.Tensor) -> bool:
    """Whether this forward pass may be differentiated, so the fused training mix (`fused_mixing.py`) must run.

    True when autograd is recording and anything the mix depends on can want a gradient: the input embeddings or any
    parameter of the model (LoRA adapters included). `torch.no_grad()`, `generate()` and frozen models take the
    inference mix (`mix_on_output`), which computes the same values with Llama's ops plus one per mixing layer.
    """
    if not torch.is_grad_enabled():
        return False
    return inputs_embeds.requires_grad or any(parameter.requires_grad for parameter in model.parameters())


def mix_on_output(
    mix: LayerMix, v_proj: nn.Module | None, hidden_states: torch.Tensor, residual_values, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None, object]:
    """A layer's (attention values [B, H_kv, T, D], raw values for NeuTRENO, residual values for later layers)
    without gradient.

    With λ as numbers (`LayerMix.first` a float: fixed λ on every device, learnable λ where they read for free, see
    `ValueResidual.layer_mixes`) a mixing layer's v_proj and its mix are one GEMM,
    `addmm(V_0, h, Wᵀ, beta=λ_first, alpha=λ_self)`, and V_0 travels as the [B·T, H_kv·D] matrix layer 0's GEMM
    wrote. Otherwise (learnable λ as tensors: off the CPU, compiled or sharded; `dense` always) v_proj runs as in
    Llama and at most one op mixes (dense: three) on its output; what travels then is λ_first·V_0 per receiver
    (`learnable`, `learnable_plus`; scaled when asked for beyond `BATCHED_SCALING_MAX_TOKENS`), or for `dense` the
    running mixes `Σ_j W[r, j]·V_j` of every receiver r (updated in place) with the per-source weight columns. Layers
    that neither start nor receive the residual run v_proj as Llama does, in both cases.
    """
    if mix.role == REUSE:
        return residual_values, None, residual_values
    if isinstance(mix.first, float) and (mix.starts or mix.role != PLAIN):  # never `dense`: its λ are tensors
        return _mix_with_numbers(mix, v_proj, hidden_states, residual_values, head_dim)
    weight = plain_linear_weight(v_proj)
    raw = v_proj(hidden_states) if weight is None else F.linear(hidden_states, weight)
    own = raw.view(*hidden_states.shape[:-1], -1, head_dim).transpose(1, 2)
    if mix.starts:
        return own, raw, _first_values(mix, own)
    if mix.role == MIX:  # learnable λ as tensors: λ_self a 0-dim tensor, λ_first·V_0 scaled by layer 0
        return torch.addcmul(residual_values[mix.row], own, mix.own), None, residual_values
    if mix.role == MIX_ALL or mix.extends:
        mixes, columns = residual_values
        mixes = mixes.addcmul_(columns[mix.layer], own)  # made by layer 0 in this pass: in place keeps one copy
        values = torch.add(mixes[mix.row], own, alpha=mix.own) if mix.role == MIX_ALL else own
        return values, None, (mixes, columns)
    return own, raw, residual_values


def _mix_with_numbers(mix: LayerMix, v_proj: nn.Module, hidden_states: torch.Tensor, residual_values,
                      head_dim: int) -> tuple[torch.Tensor, torch.Tensor | None, object]:
    """`mix_on_output` with λ as Python numbers: Llama's ops for every layer, the mix folded into the GEMM.

    A plain `nn.Linear` v_proj is applied as its GEMM on the [B·T, hidden] matrix (what `F.linear` does inside);
    anything else (LoRA, quantised, hooked) is called, and a mixing layer then adds one op. NeuTRENO's layer 0 hands
    on λ·V_0 ([B, T, H_kv, D]) and its layers their raw values in that layout for `corrected_output_projection`.
    """
    shape = hidden_states.shape
    weight = plain_linear_weight(v_proj)
    if mix.role == MIX:  # never layer 0: the config refuses it as a receiver
        if weight is not None:
            flat = torch.addmm(residual_values, hidden_states.reshape(-1, shape[-1]), weight.t(),
                               beta=mix.first, alpha=mix.own)
        else:
            flat = torch.add(v_proj(hidden_states).reshape(residual_values.shape) * mix.own, residual_values,
                             alpha=mix.first)
        return flat.view(*shape[:-1], -1, head_dim).transpose(1, 2), None, residual_values
    if weight is not None:
        flat = F.linear(hidden_states.reshape(-1, shape[-1]), weight)
    else:
        out = v_proj(hidden_states)
        flat = out.reshape(-1, out.shape[-1])
    raw = flat.view(*shape[:-1], -1, head_dim)
    own = raw.transpose(1, 2)
    if mix.starts:
        if mix.kind == MIX:
            return own, raw, flat
        if mix.kind == CORRECT:
            return own, raw, raw * mix.first
        return own, raw, own  # REUSE: SVFormer's later layers attend over V_0 itself
    return own, raw, residual_values  # CORRECT: NeuTRENO's receivers hand on their raw values for the correction


def _first_values(mix: LayerMix, own: torch.Tensor):
    """What layer 0 hands on with λ as tensors (see `mix_on_output`), the λ cast to the values' dtype: only learnable
    λ (`mix` or `dense` receivers) are ever tensors; fixed ones, SVFormer's and NeuTRENO's included, are numbers."""
    if mix.kind == MIX_ALL:  # W[:, 0] = offsets + λ_first; the λ_self diagonal is added by each receiver itself
        columns = mix.first.to(own.dtype).view(*mix.first.shape, 1, 1, 1, 1).unbind(1)
        return own * (columns[0] + mix.first_init), columns
    first = mix.first.to(own.dtype)  # [R, 1, 1, 1, 1]
    if own.shape[-2] > BATCHED_SCALING_MAX_TOKENS:
        return ScaledPerReceiver(own, first.unbind(0))
    return (own * first).unbind(0)


def corrected_output_projection(
    attn_output: torch.Tensor, input_shape: tuple[int, ...], residual_values, own_values: torch.Tensor,
    o_proj: nn.Module, weights, groups: int, head_dim: int,
) -> torch.Tensor:
    """NeuTRENO's `o_proj(A_n V_n + λ(V_0 − V_n))` from the attention output as the attention function returns it
    ([B, T, H_q, D]; vLLM's [T, H_q·D]), for hidden states of shape `input_shape + (hidden,)`.

    Without gradient (`weights` a `LayerMix`) from λ·V_0 and the raw values, both [B, T, H_kv, D]: one op beyond
    Llama's with one query head per kv head (the sum replaces Llama's reshape copy before o_proj); with a gradient,
    the fused training form.
    """
    if not isinstance(weights, LayerMix):
        return fused_corrected_output_projection(
            attn_output.reshape(*input_shape, -1, head_dim), residual_values, own_values, o_proj, weights, groups)
    correction = torch.sub(residual_values, own_values, alpha=weights.first)  # [B, T, H_kv, D]
    if groups == 1 and attn_output.dim() == correction.dim():
        # The contiguous correction first: the sum is laid out like it, replacing Llama's reshape copy of the output.
        return o_proj(torch.add(correction, attn_output).reshape(*input_shape, -1))
    grouped = attn_output.reshape(*input_shape, -1, groups, head_dim)
    corrected = grouped + correction.reshape(*input_shape, grouped.shape[-3], 1, head_dim)
    return o_proj(corrected.reshape(*input_shape, -1))
