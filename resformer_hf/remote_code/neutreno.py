"""NeuTRENO (Nguyen et al., 2023), a baseline of the ResFormer paper: a receiving layer attends over its own values
and adds `λ(V_0 − V_n)` to the attention output, `o_proj(A_n V_n + λ(V_0 − V_n))`.

Imports only torch, transformers and sibling files (copied for `trust_remote_code`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import repeat_kv

from .projections import compute_dtype, flat_values, is_plain_linear
from .value_residual import FirstValues, PathOutput, ValuePath


def neutreno_correction(first: torch.Tensor, own: torch.Tensor, lam: float, groups: int) -> torch.Tensor:
    """`λ(V_0 − V_n)` from V_0, V_n [B, H_kv, T, D], repeated to the query heads and laid out like attention output
    ([B, T, H_q, D]): the reference, and the path of an o_proj that is not plain."""
    return (repeat_kv(first - own, groups) * lam).transpose(1, 2)


def _corrected(attn_output: torch.Tensor, first: torch.Tensor, own: torch.Tensor, lam: float, groups: int):
    """`A_n V_n + λ(V_0 − V_n)` as the [B, T, H_q·D] input of o_proj; the kv heads are broadcast, not copied."""
    batch, length, heads, dim = attn_output.shape
    difference = (first - own).transpose(1, 2).unsqueeze(3)  # [B, T, H_kv, 1, D]
    grouped = attn_output.view(batch, length, heads // groups, groups, dim)
    return torch.add(grouped, difference, alpha=lam).reshape(batch, length, heads * dim)


class _CorrectedOutputProjection(torch.autograd.Function):
    """`o_proj(A_n V_n + λ(V_0 − V_n))` that keeps the attention output, V_0 and V_n (attention and layer 0 keep them)
    and recomputes the corrected input in backward, rather than keep a tensor Llama does not."""

    @staticmethod
    def forward(ctx, attn_output, first, own, weight, bias, lam, groups):
        dtype = compute_dtype(attn_output)
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        ctx.lam, ctx.groups = lam, groups
        ctx.save_for_backward(attn_output, first, own, weight, bias)
        return F.linear(_corrected(attn_output, first, own, lam, groups).to(dtype), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        attn_output, first, own, weight, bias = ctx.saved_tensors
        need_output, need_first, need_own, need_weight, need_bias = ctx.needs_input_grad[:5]
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_output = grad_first = grad_own = grad_weight = grad_bias = None
        if need_weight:
            corrected = _corrected(attn_output, first, own, ctx.lam, ctx.groups)
            grad_weight = grad_2d.t().mm(corrected.view(grad_2d.shape[0], -1).to(grad.dtype))
        if bias is not None and need_bias:
            grad_bias = grad_2d.sum(0)
        if need_output or need_first or need_own:
            grad_corrected = grad_2d.mm(weight).view(attn_output.shape)
            grad_output = grad_corrected if need_output else None
            batch, length, heads, dim = attn_output.shape
            per_kv_head = grad_corrected  # summed over each kv head's query heads
            if ctx.groups > 1:
                per_kv_head = grad_corrected.view(batch, length, heads // ctx.groups, ctx.groups, dim).sum(3)
            scaled = per_kv_head.transpose(1, 2) * ctx.lam
            grad_first = scaled if need_first else None
            grad_own = scaled.neg() if need_own else None
        return grad_output, grad_first, grad_own, grad_weight, grad_bias, None, None


def corrected_output_projection(attn_output: torch.Tensor, first: torch.Tensor, own: torch.Tensor, o_proj: nn.Module,
                                lam: float, groups: int) -> torch.Tensor:
    """`o_proj(A_n V_n + λ(V_0 − V_n))` from attention output [B, T, H_q, D], V_0 and V_n [B, H_kv, T, D]."""
    if is_plain_linear(o_proj):
        return _CorrectedOutputProjection.apply(attn_output, first, own, o_proj.weight, o_proj.bias, lam, groups)
    corrected = attn_output + neutreno_correction(first, own, lam, groups)
    return o_proj(corrected.reshape(*attn_output.shape[:2], -1).contiguous())


class NeutrenoFirstValues(FirstValues):
    """NeuTRENO's layer 0: without gradient hands on λ·V_0 as [B, T, H_kv, D], the layout of the correction."""

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> PathOutput:
        flat, raw = flat_values(attention.v_proj, hidden_states, self.head_dim)
        return raw.transpose(1, 2), raw * lambda_first, raw


class NeutrenoValues(ValuePath):
    """NeuTRENO's receiving layer. With a gradient through `_CorrectedOutputProjection`; without, from λ·V_0 and the
    raw values, both [B, T, H_kv, D]: with one query head per kv head one op beyond Llama's (the sum replaces Llama's
    reshape copy before o_proj)."""

    first_values = NeutrenoFirstValues

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> PathOutput:
        flat, raw = flat_values(attention.v_proj, hidden_states, self.head_dim)
        return raw.transpose(1, 2), residual_values, raw

    def project_output(self, attention, attn_output, input_shape, residual_values, own, gradients) -> torch.Tensor:
        groups, lam = attention.num_key_value_groups, self.fixed[0]
        if gradients:
            return corrected_output_projection(attn_output.reshape(*input_shape, -1, self.head_dim), residual_values,
                                               own, attention.o_proj, lam, groups)
        correction = torch.sub(residual_values, own, alpha=lam)  # [B, T, H_kv, D], λ·V_0 from layer 0
        if groups == 1 and attn_output.dim() == correction.dim():
            # The contiguous correction first: the sum is laid out like it, replacing Llama's reshape copy.
            return attention.o_proj(torch.add(correction, attn_output).reshape(*input_shape, -1))
        grouped = attn_output.reshape(*input_shape, -1, groups, self.head_dim)
        corrected = grouped + correction.reshape(*input_shape, grouped.shape[-3], 1, self.head_dim)
        return attention.o_proj(corrected.reshape(*input_shape, -1))
