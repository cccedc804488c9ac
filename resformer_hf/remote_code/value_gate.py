"""`gated`: a receiving layer attends over `V_n + g·(V_0 − V_n)`, with a mix `g` computed per token and kv head.

Imports only torch, transformers and sibling files (copied for `trust_remote_code`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .projections import compute_dtype, flat_values, is_plain_linear, own_values, plain_linear_weight, token_major
from .value_residual import FirstValues, PathOutput, ValuePath


class ValueGate(nn.Linear):
    """A gated layer's gate: logits `W_g h + b_g` of the mix of each token and kv head ([..., hidden] → [..., H_kv]);
    the layer attends over `V_n + g·(V_0 − V_n)`, `g = g0 − 0.5 + σ(·)`.

    Why this form: a mix per token, as later work trains it (x-transformers' `lerp(v, v_0, σ(W h + b))` per head,
    RWKV-7's per channel); a lerp, so the mix stays within `g0 ± 0.5`; W_g and b_g start at zero, so every token
    starts at `g0` (0.5, x-transformers' gate; 0 with `--init preserve`, exactly the converted Llama, whose gates
    still get the gradient `h/4` at once, where a fixed logit would need −∞), weight decay pulls the mix back to `g0`,
    and a checkpoint without gates loads at it. One mix per kv head, kept float32 like the λ and split by kv head
    under tensor parallelism.
    """

    def __init__(self, hidden_size: int, num_key_value_heads: int):
        super().__init__(hidden_size, num_key_value_heads, bias=True)

    def resting_shift(self) -> float:
        """How far the gate moves λ_first for a token whose gate input moves nothing: `σ(b_g) − 0.5` averaged over
        kv heads."""
        return torch.sigmoid(self.bias.detach().float()).mean().item() - 0.5


def _shifted(sigmoid: torch.Tensor, shift: float) -> torch.Tensor:
    """The gate `σ(z) + shift`, skipping the pass when the shift is 0 (a gate started at 0.5)."""
    return sigmoid if shift == 0.0 else sigmoid + shift


def gated_values(own: torch.Tensor, first: torch.Tensor, logits: torch.Tensor, shift: float) -> torch.Tensor:
    """`V_n + g·(V_0 − V_n)`, `g = shift + σ(logits)`, from V_n, V_0 [B, H_kv, T, D] and logits [B, T, H_kv] in plain
    ops: the reference, and the path of projections that are not plain and of `torch.compile`."""
    gate = _shifted(torch.sigmoid(logits), shift).transpose(1, 2).unsqueeze(-1)
    return torch.lerp(own, first, gate.to(own.dtype))


class _ProjectAndGate(torch.autograd.Function):
    """v_proj, the gate and the lerp as one op, keeping nothing beyond Llama's activations but σ ([B·T, H_kv]).

    The gate's gradient `Σ_d dV'·(V_0 − V_n)` needs the V_n nothing keeps: backward recomputes it with the GEMM that
    made it (never by dividing by 1 − g); plain autograd would keep V_n.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, first, gate_weight, gate_bias, shift):
        dtype = compute_dtype(hidden)
        hidden, weight, gate_weight = hidden.to(dtype), weight.to(dtype), gate_weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        own = F.linear(hidden, weight, bias)
        ctx.first_shape, ctx.shift = first.shape, shift
        first = token_major(first).to(dtype)  # a view of V_0 as layer 0's v_proj wrote it
        sigmoid = torch.sigmoid(torch.addmm(gate_bias.to(dtype), hidden, gate_weight.t()))
        heads = sigmoid.shape[-1]
        mixed = torch.lerp(own.view(own.shape[0], heads, -1), first.view(first.shape[0], heads, -1),
                           _shifted(sigmoid, shift).unsqueeze(-1))
        ctx.save_for_backward(hidden, weight, bias, first, gate_weight, sigmoid)
        return mixed.view(own.shape)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, first, gate_weight, sigmoid = ctx.saved_tensors
        need_hidden, need_weight, need_bias, need_first, need_gate_weight, need_gate_bias = ctx.needs_input_grad[:6]
        heads = sigmoid.shape[-1]
        per_head = grad.reshape(grad.shape[0], heads, -1)
        gate = _shifted(sigmoid, ctx.shift).unsqueeze(-1)
        grad_own = torch.addcmul(per_head, per_head, gate, value=-1.0).view(grad.shape)  # (1 − g)·dV'
        grad_weight = grad_own.t().mm(hidden) if need_weight else None
        grad_bias = grad_own.sum(0) if bias is not None and need_bias else None
        grad_first = grad_logits = grad_gate_weight = grad_gate_bias = grad_hidden = None
        if need_first:
            batch, heads, length, dim = ctx.first_shape
            grad_first = (per_head * gate).view(batch, length, heads, dim).transpose(1, 2)
        if need_hidden or need_gate_weight or need_gate_bias:
            difference = torch.addmm(first, hidden, weight.t(), alpha=-1.0)  # V_0 − V_n, V_n's GEMM again
            if bias is not None:
                difference.sub_(bias)
            rows = per_head.shape[0] * heads
            per_token = torch.bmm(per_head.reshape(rows, 1, -1), difference.view(rows, -1, 1))  # Σ_d dV'·(V_0 − V_n)
            grad_logits = torch.ops.aten.sigmoid_backward(per_token.view(sigmoid.shape), sigmoid)
            grad_gate_weight = grad_logits.t().mm(hidden) if need_gate_weight else None
            grad_gate_bias = grad_logits.sum(0) if need_gate_bias else None
        if need_hidden:
            grad_hidden = grad_own.mm(weight).addmm_(grad_logits, gate_weight)
        return grad_hidden, grad_weight, grad_bias, grad_first, grad_gate_weight, grad_gate_bias, None


def project_and_gate(hidden_states: torch.Tensor, v_proj: nn.Linear, value_gate: nn.Linear, first: torch.Tensor,
                     shift: float, head_dim: int) -> torch.Tensor:
    """`V_n + g·(V_0 − V_n)`, [B, H_kv, T, D], `g = shift + σ(value_gate(h))`, both modules plain linears."""
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    mixed = _ProjectAndGate.apply(hidden, v_proj.weight, v_proj.bias, first, value_gate.weight, value_gate.bias,
                                  shift)
    return mixed.view(*hidden_states.shape[:-1], -1, head_dim).transpose(1, 2)


class GatedFirstValues(FirstValues):
    """`gated`'s layer 0: without gradient hands on V_0 as [B, T, H_kv, D], the layout its receivers lerp in."""

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> PathOutput:
        flat, raw = flat_values(attention.v_proj, hidden_states, self.head_dim)
        return raw.transpose(1, 2), raw, raw


class GatedValues(ValuePath):
    """`gated`'s receiving layer. With a gradient through `_ProjectAndGate`; without, beyond Llama's ops the gate's
    GEMM (`t`, `addmm`), its sigmoid, a view and the lerp, with V_n's GEMM on the [B·T, hidden] matrix (one op fewer
    than Llama's linear); a gate started off 0.5 (`--init preserve`) adds its shift."""

    first_values = GatedFirstValues

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.shift = config.value_residual_lambda_first_resolved - 0.5  #: g0 − σ(0)
        self.kv_heads = config.num_key_value_heads
        self.hidden_size = config.hidden_size

    def attach(self, attention: nn.Module) -> None:
        attention.value_gate = ValueGate(self.hidden_size, self.kv_heads)

    def mix(self, attention: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """The mix `g` on V_0 of every token and kv head ([..., H_kv], float32) for the layer's normalised input."""
        gate = attention.value_gate
        return torch.sigmoid(gate(hidden_states.to(gate.weight.dtype)).float()) + self.shift

    def with_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> PathOutput:
        v_proj, gate = attention.v_proj, attention.value_gate
        if torch.compiler.is_compiling() or not (is_plain_linear(v_proj) and is_plain_linear(gate, ValueGate)):
            # Compiled, plain ops keep V_n, less than the h the fused op keeps (a compiled Llama recomputes h).
            own = own_values(v_proj, hidden_states, self.head_dim)
            logits = gate(hidden_states.to(gate.weight.dtype))
            return gated_values(own, residual_values, logits, self.shift), residual_values, None
        mixed = project_and_gate(hidden_states, v_proj, gate, residual_values, self.shift, self.head_dim)
        return mixed, residual_values, None

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> PathOutput:
        shape = hidden_states.shape
        flat_hidden = hidden_states.reshape(-1, shape[-1])
        weight, gate = plain_linear_weight(attention.v_proj), attention.value_gate
        own = attention.v_proj(hidden_states) if weight is None else F.linear(flat_hidden, weight)
        if is_plain_linear(gate, ValueGate):  # in the values' dtype (the gate is kept float32)
            logits = torch.addmm(gate.bias.to(own.dtype), flat_hidden, gate.weight.to(own.dtype).t())
        else:  # hooked, sharded or wrapped (PEFT): called, in its own dtype
            logits = gate(flat_hidden.to(gate.weight.dtype)).to(own.dtype)
        gated = torch.sigmoid(logits)
        if self.shift:
            gated = gated.add_(self.shift)
        own = own.view(*shape[:-1], -1, self.head_dim)
        mixed = torch.lerp(own, residual_values, gated.view(*shape[:-1], -1, 1))
        return mixed.transpose(1, 2), residual_values, None
