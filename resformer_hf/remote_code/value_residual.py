"""ResFormer's value residual: what each attention layer attends over, by the role its config gives it.

`ResFormerAttention` reads its layer's role once, in `__init__`, and its forward calls one function here per role:

| role | attends over | here |
| --- | --- | --- |
| `mix` (identity, constant, learnable, learnable_plus, sparse) | `λ_first·V_0 + λ_self·V_n` | `mixed_values` |
| `reuse` (SVFormer) | V_0 itself (no `v_proj`) | – |
| `gate` (gated) | `V_n + g·(V_0 − V_n)`, g per token and kv head | `gated_values` |
| `correct` (NeuTRENO) | V_n, then `o_proj(A_n V_n + λ(V_0 − V_n))` | `corrected_output` |
| `mix_all` (dense) | `Σ_j W[n, j]·V_j` | `depth_weighted_average.dense_values` |

Each function takes the layer's own values `V_n = v_proj(h)` as the attention computed them, Llama's line unchanged
(vLLM's fuser turns q, k and v into one GEMM). Layer 0 hands its values V_0 on to the receivers (`ResidualValues`);
every λ lives in one module (`lambdas.ValueResidual`), read once per forward pass. A custom autograd function appears
only where plain autograd would keep a tensor Llama does not (V_n, NeuTRENO's corrected input). Imports only torch,
transformers and sibling files (`trust_remote_code`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as _module_globals
from transformers.models.llama.modeling_llama import repeat_kv

from .mix_kernels import kernels_usable, mix, mix_backward
from .value_embeddings import GATE_CHANNELS

#: What a layer hands on to later layers, passed positionally (reentrant checkpointing propagates its gradient): V_0
#: [B, H_kv, T, D]; `dense`: its buffer of every earlier layer's values [n, B, H_kv, T, D]; decoding a learnable mix,
#: each receiver's λ_first·V_0, which layer 0 scales for all receivers in one op and hands on as one tuple.
ResidualValues = torch.Tensor | tuple[torch.Tensor, ...]

# ---- calling a projection as Llama does -----------------------------------------------------------------------------

# Global module hooks live in private dicts of torch.nn.modules.module; read only, and a missing name means no hooks.
_GLOBAL_MODULE_HOOKS = tuple(getattr(_module_globals, name, {}) for name in (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks"))


def is_plain_linear(module: nn.Module, linear_class: type[nn.Linear] = nn.Linear) -> bool:
    """Whether calling `module` is exactly `F.linear(x, module.weight, module.bias)`, so a fused op may use its weight:
    not for LoRA, quantised or wrapped modules, hooks or a patched `forward` (tensor parallelism, ZeRO-3, offloading)
    or tensor-subclass weights (DTensor). Reads the module's own dicts: it runs per layer per decode step."""
    if type(module) is not linear_class:
        return False
    state = module.__dict__
    if ("forward" in state or state["_forward_hooks"] or state["_forward_pre_hooks"] or state["_backward_hooks"]
            or state["_backward_pre_hooks"] or any(_GLOBAL_MODULE_HOOKS)):
        return False
    weight, bias = state["_parameters"]["weight"], state["_parameters"]["bias"]
    plain = (nn.Parameter, torch.Tensor)
    return type(weight) in plain and (bias is None or type(bias) in plain)


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear` computes in here: autocast's when it is on for this device, else the tensor's."""
    if torch.is_autocast_enabled(tensor.device.type):
        return torch.get_autocast_dtype(tensor.device.type)
    return tensor.dtype


def token_major(values: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] values as the [B·T, H·D] matrix a projection writes (a view when laid out that way)."""
    return values.transpose(1, 2).reshape(-1, values.shape[1] * values.shape[3])


def heads_view(matrix: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A token-major [B·T, H·D] matrix seen as [B, H, T, D] values of `shape`: the inverse of `token_major`."""
    batch, heads, length, dim = shape
    return matrix.view(batch, length, heads, dim).transpose(1, 2)


def hand_on(own: torch.Tensor, scale) -> ResidualValues:
    """What layer 0 hands on: V_0, or λ_first·V_0 once for every receiver (fixed λ: a float; decoding a learnable
    mix: `per_layer`'s column, one scaled copy per receiver)."""
    if scale is None:
        return own
    return own * scale if isinstance(scale, float) else (own * scale.to(own.dtype)).unbind(0)


def kept_projection(v_proj: nn.Module, hidden_states: torch.Tensor, own: torch.Tensor) -> tuple:
    """(h, W, b) of `own = v_proj(h)` where autograd keeps h and W for v_proj anyway, so a value op may keep them too
    at no cost: a plain, trained linear that read h as it is. Under autocast v_proj reads a private cast of h, and
    keeping h would cost more than keeping V_n: (None, None, None)."""
    if is_plain_linear(v_proj) and v_proj.weight.requires_grad and own.dtype == hidden_states.dtype == (
            v_proj.weight.dtype):
        return hidden_states, v_proj.weight, v_proj.bias
    return None, None, None


# ---- mix: λ_first·V_0 + λ_self·V_n ----------------------------------------------------------------------------------


def mixed_values(own: torch.Tensor, first: ResidualValues, lambda_first, lambda_self, row: int,
                 v_proj: nn.Module | None, hidden_states: torch.Tensor) -> torch.Tensor:
    """`λ_first·V_0 + λ_self·V_n` [B, H_kv, T, D] from this layer's `own = v_proj(h)`, λ floats (fixed) or 0-dim
    tensors (learnable). `lambda_first` None: `first` is λ_first·V_0 already, which layer 0 scaled once for every
    receiver (fixed λ; decoding a learnable mix, a tuple with a row per receiver), and the mix is one op that plain
    autograd keeps nothing for. A learnable mix with gradient is `_MixOwnValues`, which keeps nothing Llama does not;
    compiled, plain ops the partitioner sees through."""
    if isinstance(first, tuple):
        first, lambda_first = first[row], None
    if lambda_first is None:
        if isinstance(lambda_self, float):
            return torch.add(first, own, alpha=lambda_self)
        return torch.addcmul(first, own, lambda_self)
    if torch.compiler.is_compiling() and is_plain_linear(v_proj):
        # λ_self folded into v_proj's weight, as the paper writes it: the partitioner keeps h and W, and the graph
        # drops the unscaled `own` (plain `own * λ_self` would keep it for λ_self's gradient)
        bias = None if v_proj.bias is None else v_proj.bias * lambda_self
        scaled = F.linear(hidden_states, v_proj.weight * lambda_self, bias).view(own.transpose(1, 2).shape)
        return scaled.transpose(1, 2) + first * lambda_first
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        projection = kept_projection(v_proj, hidden_states, own)
        mixed = _MixOwnValues.apply(token_major(own), token_major(first), lambda_first, lambda_self, *projection)
        return heads_view(mixed, own.shape)
    return torch.addcmul(own * lambda_self, first, lambda_first)


class _MixOwnValues(torch.autograd.Function):
    """`V' = λ_first·V_0 + λ_self·V_n` for learnable λ on token-major values, keeping nothing Llama does not.

    λ_self's gradient `<dV', V_n>` needs the V_n nothing keeps. Where autograd keeps v_proj's h and W anyway
    (`kept_projection`) it is `<dV'ᵀh, W> + <Σ_t dV', b>`, and `dV'ᵀh` is v_proj's weight gradient before its λ_self
    factor: this op then computes v_proj's gradients itself (exact, for one weight-sized dot) and hands v_proj's own
    backward none, so that runs nothing. Under autocast (v_proj read a private cast of h) it keeps V_n instead. On
    CUDA the mix runs as Triton kernels (`mix_kernels.py`).
    """

    @staticmethod
    def forward(ctx, own, first, first_weight, own_weight, hidden, weight, bias):
        ctx.projected = weight is not None
        first_weight, own_weight = first_weight.to(own.dtype), own_weight.to(own.dtype)
        if kernels_usable(own, first, first_weight, own_weight):
            mixed = mix(own, first, first_weight, own_weight)
        else:
            mixed = torch.mul(own, own_weight).addcmul_(first, first_weight)
        kept = (hidden, weight, bias) if ctx.projected else (own, None, None)
        ctx.save_for_backward(first, first_weight, own_weight, *kept)
        return mixed

    @staticmethod
    def backward(ctx, grad):
        first, first_weight, own_weight, hidden_or_own, weight, bias = ctx.saved_tensors
        need_own, need_first, need_first_weight, need_own_weight, need_hidden, need_weight, need_bias = (
            ctx.needs_input_grad)
        grad_first_weight = grad_own_weight = grad_hidden = grad_weight = grad_bias = None
        if kernels_usable(grad, first, first_weight, own_weight):  # both products and λ_first's dot in one pass
            grad_first, scaled, grad_first_weight = mix_backward(grad, first, first_weight, own_weight)
        else:
            grad_first, scaled = (grad * _column(first_weight, own_weight)).unbind()
        if need_first_weight and grad_first_weight is None:
            grad_first_weight = torch.dot(grad.reshape(-1), first.reshape(-1))
        grad_first = grad_first if need_first else None
        if not ctx.projected:  # V_n kept
            grad_own_weight = torch.dot(grad.reshape(-1), hidden_or_own.reshape(-1)) if need_own_weight else None
            return scaled if need_own else None, grad_first, grad_first_weight, grad_own_weight, None, None, None
        hidden = hidden_or_own
        flat = hidden.reshape(-1, hidden.shape[-1])
        if need_own_weight:
            product = grad.t().mm(flat)  # dV'ᵀh: the weight gradient before its λ_self factor
            grad_own_weight = torch.dot(product.view(-1), weight.reshape(-1))
            if bias is not None:
                grad_own_weight = grad_own_weight + torch.dot(grad.sum(0), bias)
            grad_weight = product.mul_(own_weight) if need_weight else None
        elif need_weight:
            grad_weight = scaled.t().mm(flat)
        if need_bias and bias is not None:
            grad_bias = scaled.sum(0)
        if need_hidden:
            grad_hidden = scaled.mm(weight).view(hidden.shape)
        return None, grad_first, grad_first_weight, grad_own_weight, grad_hidden, grad_weight, grad_bias


def _column(first_weight: torch.Tensor, own_weight: torch.Tensor) -> torch.Tensor:
    """(λ_first, λ_self) as [2, 1, 1]: a view where both are views of one λ table (`per_layer`), else stacked."""
    step = own_weight.storage_offset() - first_weight.storage_offset()
    if step and own_weight.untyped_storage().data_ptr() == first_weight.untyped_storage().data_ptr():
        return first_weight.as_strided((2, 1, 1), (step, 0, 0))
    return torch.stack((first_weight, own_weight)).view(2, 1, 1)


# ---- gate: V_n + g·(V_0 − V_n), g per token and kv head ------------------------------------------------------------


class ValueGate(nn.Linear):
    """A gated layer's gate: logits `W_g x̂[..., :C] + b_g` of the mix `g = g0 − 0.5 + σ(·)` of each token and kv head,
    from the first C = 12 channels of the layer's normalised input x̂, as nanochat's and modded-nanogpt's gates read
    theirs (a fourth linear over all of x̂ would hide q, k and v from vLLM's QKV fuser). A lerp per head, as
    x-transformers mixes (`lerp(v, v_0, σ(·))`); W_g and b_g start at zero, so every token starts at `g0` (0.5; 0 with
    `--init preserve`, exactly the converted Llama, whose gates still get gradient), and weight decay pulls the mix
    back to `g0`. Kept float32 like the λ."""

    def __init__(self, hidden_size: int, num_key_value_heads: int):
        super().__init__(min(GATE_CHANNELS, hidden_size), num_key_value_heads, bias=True)

    def resting_shift(self) -> float:
        """How far the gate moves λ_first for a token whose gate input moves nothing: `σ(b_g) − 0.5` averaged over
        kv heads."""
        return torch.sigmoid(self.bias.detach().float()).mean().item() - 0.5

    def mix(self, hidden_states: torch.Tensor, shift: float) -> torch.Tensor:
        """The mix `g` on V_0 of every token and kv head ([..., H_kv], float32) for the layer's normalised input."""
        return torch.sigmoid(gate_logits(self, hidden_states, self.in_features).float()) + shift


def gate_logits(gate: nn.Module, hidden_states: torch.Tensor, channels: int) -> torch.Tensor:
    """The gate's logits [..., H_kv] from the first `channels` of x̂ (`gate` may be an engine's own linear)."""
    return gate(hidden_states[..., :channels].to(gate.weight.dtype))


def gated_values(own: torch.Tensor, first: torch.Tensor, gate: nn.Module, hidden_states: torch.Tensor, shift: float,
                 channels: int, v_proj: nn.Module | None) -> torch.Tensor:
    """`V_n + g·(V_0 − V_n)`, [B, H_kv, T, D], `g = shift + σ(gate(x̂[..., :C]))`, from this layer's `own = v_proj(h)`;
    with gradient `_GatedMix` keeps nothing beyond Llama's activations but σ; compiled, plain ops."""
    sigmoid = torch.sigmoid(gate_logits(gate, hidden_states, channels))
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        projection = kept_projection(v_proj, hidden_states, own)
        mixed = _GatedMix.apply(token_major(own), token_major(first), sigmoid.reshape(-1, sigmoid.shape[-1]), shift,
                                *projection)
        return heads_view(mixed, own.shape)
    gate = (sigmoid + shift if shift else sigmoid).transpose(1, 2).unsqueeze(-1).to(own.dtype)
    return torch.lerp(own, first, gate)


class _GatedMix(torch.autograd.Function):
    """The lerp `V_n + g·(V_0 − V_n)` per kv head on token-major values. The gate's gradient `Σ_d dV'·(V_0 − V_n)`
    needs the V_n nothing keeps: backward recomputes it with v_proj's GEMM where autograd keeps h and W anyway
    (`kept_projection`), else (autocast) it is kept."""

    @staticmethod
    def forward(ctx, own, first, sigmoid, shift, hidden, weight, bias):
        ctx.shift, ctx.projected = shift, weight is not None
        heads = sigmoid.shape[-1]
        gate = (sigmoid + shift if shift else sigmoid).to(own.dtype)
        mixed = torch.lerp(own.view(own.shape[0], heads, -1), first.view(first.shape[0], heads, -1), gate[..., None])
        ctx.save_for_backward(first, sigmoid, *((hidden, weight, bias) if ctx.projected else (own, None, None)))
        return mixed.view(own.shape)

    @staticmethod
    def backward(ctx, grad):
        first, sigmoid, hidden_or_own, weight, bias = ctx.saved_tensors
        need_own, need_first, need_sigmoid = ctx.needs_input_grad[:3]
        heads = sigmoid.shape[-1]
        per_head = grad.reshape(grad.shape[0], heads, -1)
        gate = (sigmoid + ctx.shift if ctx.shift else sigmoid).to(grad.dtype).unsqueeze(-1)
        grad_own = torch.addcmul(per_head, per_head, gate, value=-1.0).view(grad.shape) if need_own else None
        grad_first = (per_head * gate).view(grad.shape) if need_first else None
        grad_sigmoid = None
        if need_sigmoid:
            if ctx.projected:  # V_0 − V_n, V_n's GEMM again
                flat = hidden_or_own.reshape(-1, hidden_or_own.shape[-1])
                difference = torch.addmm(first, flat, weight.t(), alpha=-1.0)
                difference = difference if bias is None else difference.sub_(bias)
            else:
                difference = first - hidden_or_own
            rows = per_head.shape[0] * heads
            per_token = torch.bmm(per_head.reshape(rows, 1, -1), difference.view(rows, -1, 1))
            grad_sigmoid = per_token.view(sigmoid.shape).to(sigmoid.dtype)
        return grad_own, grad_first, grad_sigmoid, None, None, None, None


# ---- correct (NeuTRENO): o_proj(A_n V_n + λ(V_0 − V_n)) -------------------------------------------------------------


def corrected_output(attn_output: torch.Tensor, first: torch.Tensor, own: torch.Tensor, o_proj: nn.Module, lam: float,
                     groups: int) -> torch.Tensor:
    """`o_proj(A_n V_n + λ(V_0 − V_n))` from the attention output [B, T, H_q, D] and V_0, V_n [B, H_kv, T, D]: the
    kv heads broadcast to their query heads, not copied; fused (`_CorrectedOutputProjection`) for a plain o_proj."""
    if is_plain_linear(o_proj):
        return _CorrectedOutputProjection.apply(attn_output, first, own, o_proj.weight, o_proj.bias, lam, groups)
    corrected = attn_output + (repeat_kv(first - own, groups) * lam).transpose(1, 2)
    return o_proj(corrected.reshape(*attn_output.shape[:2], -1).contiguous())


def _corrected(attn_output: torch.Tensor, first: torch.Tensor, own: torch.Tensor, lam: float, groups: int):
    """`A_n V_n + λ(V_0 − V_n)` as the [B, T, H_q·D] input of o_proj."""
    batch, length, heads, dim = attn_output.shape
    difference = (first - own).transpose(1, 2).unsqueeze(3)  # [B, T, H_kv, 1, D]
    grouped = attn_output.view(batch, length, heads // groups, groups, dim)
    return torch.add(grouped, difference, alpha=lam).reshape(batch, length, heads * dim)


class _CorrectedOutputProjection(torch.autograd.Function):
    """Keeps the attention output, V_0 and V_n (attention and layer 0 keep them) and recomputes the corrected input
    in backward, rather than keep a tensor Llama does not."""

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


__all__ = ["ResidualValues", "ValueGate", "corrected_output", "gated_values", "hand_on", "mixed_values"]
