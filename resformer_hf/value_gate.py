"""`value_residual="gated"`: the value gate of a receiving layer and the mix it computes, with and without autograd.

Layer n attends over `V_n + g·(V_0 − V_n)` with `g = g0 − 0.5 + σ(W_g h + b_g)` for each token and kv head, where h is
the layer's normalised input (what q/k/v_proj read). Why this form:

- the mix depends on the token, as in the implementations later work trains (x-transformers'
  `learned_value_residual_mix`: `lerp(v, v_0, σ(W h + b))` per head; RWKV-7's `lerp(v, v_first, σ(...))` per channel);
- a lerp, so the weights on V_0 and V_n sum to 1 and the mix stays bounded: `g0 − 0.5 < g < g0 + 0.5`;
- W_g and b_g start at zero, so every token starts at `g0`: 0.5 gives the identity variant (and exactly
  x-transformers' gate), `g0 = 0` (`--init preserve`) gives exactly the converted Llama, whose gates still get the
  gradient `σ'(0)·h = h/4` from the first step. A fixed logit instead (`σ(z0 + W_g h)`) reaches 0 only at z0 = −∞,
  where nothing learns; a scale on σ (as `learnable_plus`'s λ_scale) would start the gate's gradient at zero. Weight
  decay pulls W_g and b_g to zero, that is the mix back to `g0`, never to "no residual";
- one mix per kv head, not per channel: one [hidden → H_kv] GEMM per layer (RWKV-7's per-channel gate needs a low-rank
  pair of GEMMs), and the fused training mix below keeps only g ([B·T, H_kv]) beyond Llama's activations.

The gates are kept in float32 like the λ (`_keep_in_fp32_modules_strict`) and split by kv head under tensor
parallelism (`"colwise"`, as v_proj). Under `torch.compile` the plain ops run instead of the fused function and keep
V_n per gated layer for the gate's gradient (measured with `tests/test_core_model.py`'s compiled bf16 step at hidden
64, 4 layers, 2 × 512 tokens: 3.2 [B, H_kv, T, D] tensors above a compiled Llama for 3 gated layers, where
`identity` is level with it); the fused function would keep h instead, as large or larger. Imports only torch and
sibling files (copied for `trust_remote_code`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .fused_mixing import _compute_dtype, _token_major


class ValueGate(nn.Linear):
    """A gated layer's gate: the logits `W_g h + b_g` of the mix of each token and kv head, from the layer's
    normalised input ([..., hidden] → [..., H_kv]). Both start at zero (`ResFormerPreTrainedModel._init_weights`),
    so the mix starts at the config's `g0` for every token, and a checkpoint without them loads at that mix."""

    def __init__(self, hidden_size: int, num_key_value_heads: int):
        super().__init__(hidden_size, num_key_value_heads, bias=True)

    def resting_shift(self) -> float:
        """How far the gate moves λ_first for a token whose gate input moves nothing: `σ(b_g) − 0.5`, averaged over
        kv heads (`ResFormerPreTrainedModel.value_residual_lambdas` reports it)."""
        return torch.sigmoid(self.bias.detach().float()).mean().item() - 0.5


class _ProjectAndGate(torch.autograd.Function):
    """`V' = V_n + g·(V_0 − V_n)` with `V_n = h Wᵀ + b` and `g = shift + σ(h W_gᵀ + b_g)` per token and kv head: a
    gated layer's value projection, its gate and the lerp, keeping nothing beyond Llama's activations but σ
    ([B·T, H_kv]).

    Saves h (which q_proj and k_proj save anyway), W, W_g, V_0 (which layer 0's attention saves) and σ; the gate reads
    the same h as v_proj, so no second copy of it is kept (autocast gives every linear it runs its own cast input).
    The gate's gradient `Σ_d dV'·(V_0 − V_n)` needs V_n, which nothing keeps: backward recomputes it with the GEMM
    that made it (as large as the forward's v_proj), never by dividing by 1 − g; plain autograd (`gated_values`) would
    keep V_n instead.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, residual_values, gate_weight, gate_bias, shift):
        dtype = _compute_dtype(hidden)
        hidden = hidden.to(dtype)
        own = F.linear(hidden, weight.to(dtype), None if bias is None else bias.to(dtype))
        first = _token_major(residual_values[0]).to(dtype)  # a view of V_0 as layer 0's v_proj wrote it
        sigmoid = torch.sigmoid(F.linear(hidden, gate_weight.to(dtype), gate_bias.to(dtype)))
        heads = sigmoid.shape[-1]
        gate = _shifted(sigmoid, shift).unsqueeze(-1)
        mixed = torch.lerp(own.view(own.shape[0], heads, -1), first.view(first.shape[0], heads, -1), gate)
        ctx.save_for_backward(hidden, weight, bias, first, gate_weight, sigmoid)
        ctx.shift = shift
        ctx.values_shape, ctx.stack_rows = residual_values.shape[1:], residual_values.shape[0]
        return mixed.view(own.shape)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, first, gate_weight, sigmoid = ctx.saved_tensors
        need_hidden, need_weight, need_bias, need_values, need_gate_weight, need_gate_bias = ctx.needs_input_grad[:6]
        heads = sigmoid.shape[-1]
        per_head = grad.view(grad.shape[0], heads, -1)
        gate = _shifted(sigmoid, ctx.shift).unsqueeze(-1)
        grad_own = torch.addcmul(per_head, per_head, gate, value=-1.0).view(grad.shape)  # (1 − g)·dV'
        weight_c = weight.to(grad.dtype)
        grad_weight = grad_own.t().mm(hidden) if need_weight else None
        grad_bias = grad_own.sum(0) if bias is not None and need_bias else None
        grad_values = grad_logits = grad_gate_weight = grad_gate_bias = None
        if need_values:
            batch, heads, length, dim = ctx.values_shape
            scaled = (per_head * gate).view(batch, length, heads, dim).transpose(1, 2)
            if ctx.stack_rows == 1:
                grad_values = scaled.unsqueeze(0)
            else:
                grad_values = scaled.new_zeros((ctx.stack_rows, *ctx.values_shape))
                grad_values[0] = scaled
        if need_hidden or need_gate_weight or need_gate_bias:
            own = F.linear(hidden, weight_c, None if bias is None else bias.to(grad.dtype))  # V_n again
            difference = first.view(per_head.shape) - own.view(per_head.shape)
            grad_logits = (per_head * difference).sum(-1) * sigmoid * (1 - sigmoid)  # dL/dz through σ
            grad_gate_weight = grad_logits.t().mm(hidden) if need_gate_weight else None
            grad_gate_bias = grad_logits.sum(0) if need_gate_bias else None
        grad_hidden = None
        if need_hidden:
            grad_hidden = grad_own.mm(weight_c).addmm_(grad_logits, gate_weight.to(grad.dtype))
        return grad_hidden, grad_weight, grad_bias, grad_values, grad_gate_weight, grad_gate_bias, None


def _shifted(sigmoid: torch.Tensor, shift: float) -> torch.Tensor:
    """The gate `σ(z) + shift`, skipping the pass when the shift is 0 (a gate started at the identity's 0.5)."""
    return sigmoid if shift == 0.0 else sigmoid + shift


def gated_values(own_values: torch.Tensor, residual_values: torch.Tensor, logits: torch.Tensor,
                 shift: float) -> torch.Tensor:
    """`V_n + g·(V_0 − V_n)` with `g = shift + σ(logits)`, in plain torch ops: V_n [B, H_kv, T, D], the stack holding
    V_0, and the gate's logits [B, T, H_kv]. The fused `project_and_gate` computes the same for less memory; this is
    its fallback (a v_proj or gate that is not a plain linear, `torch.compile`) and its reference in the tests."""
    gate = _shifted(torch.sigmoid(logits), shift).transpose(1, 2).unsqueeze(-1)
    return torch.lerp(own_values, residual_values[0], gate.to(own_values.dtype))


def project_and_gate(
    hidden_states: torch.Tensor, v_proj: nn.Linear, value_gate: nn.Linear, residual_values: torch.Tensor,
    shift: float, head_dim: int,
) -> torch.Tensor:
    """A gated layer's attention values `V_n + g·(V_0 − V_n)`, [B, H_kv, T, D], with `g = shift + σ(value_gate(h))`,
    saving nothing beyond σ. `residual_values` is the [1, B, H_kv, T, D] stack holding V_0; `v_proj` and
    `value_gate` must be plain linears (the caller checks, `gated_values` is the other way)."""
    input_shape = hidden_states.shape[:-1]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    mixed = _ProjectAndGate.apply(hidden, v_proj.weight, v_proj.bias, residual_values, value_gate.weight,
                                  value_gate.bias, shift)
    return mixed.view(*input_shape, -1, head_dim).transpose(1, 2)


__all__ = ["ValueGate", "gated_values", "project_and_gate"]
