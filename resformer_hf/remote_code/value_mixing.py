"""The value residual's training ops: each mix fused with the projection next to it, keeping no tensor beyond Llama's.

With plain autograd a learnable mix keeps the raw V_n for λ_self's gradient, `gated` keeps V_n for its gate's,
NeuTRENO keeps its corrected o_proj input and `dense` a stack of earlier values per layer (O(L²)). The functions here
save only what attention, the projections and layer 0 keep anyway, and compute every gradient exactly. They run only
when calling the projection is exactly `F.linear` (`is_plain_linear`) and not under `torch.compile`, whose partitioner
already sees through the plain formulas (`mix_values`, `gated_values`, `neutreno_correction`), which are also the
fallback and the reference the tests hold these functions to. "Keep anyway" assumes `use_cache=False` in training.
Imports only torch and transformers (copied for `trust_remote_code`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as _module_globals
from transformers.models.llama.modeling_llama import repeat_kv

from .mix_kernels import kernels_usable, mix_backward, mix_in_place

#: A layer's (λ_first, λ_self): floats when fixed, else 0-dim views of the λ table in the values' dtype.
Lambdas = tuple[float, float] | tuple[torch.Tensor, torch.Tensor]

# Global module hooks (`register_module_forward_hook` & co.) live in private dicts of torch.nn.modules.module; read
# only, and a name torch no longer has counts as "no hooks".
_GLOBAL_MODULE_HOOKS = tuple(
    getattr(_module_globals, name, {})
    for name in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")
)
_PLAIN_TENSOR_TYPES = (nn.Parameter, torch.Tensor)


def is_plain_linear(module: nn.Module, linear_class: type[nn.Linear] = nn.Linear) -> bool:
    """Whether calling `module` is exactly `F.linear(x, module.weight, module.bias)`, so a fused op may use its weight.

    False for LoRA, quantised or wrapped modules, hooks or a patched `forward` (tensor parallelism, ZeRO-3,
    offloading) and tensor-subclass weights (DTensor). Reads the module's own dicts: it runs per layer per decode step.
    """
    if type(module) is not linear_class:
        return False
    state = module.__dict__
    if ("forward" in state or state["_forward_hooks"] or state["_forward_pre_hooks"] or state["_backward_hooks"]
            or state["_backward_pre_hooks"] or any(_GLOBAL_MODULE_HOOKS)):
        return False
    parameters = state["_parameters"]
    bias = parameters["bias"]
    return type(parameters["weight"]) in _PLAIN_TENSOR_TYPES and (bias is None or type(bias) in _PLAIN_TENSOR_TYPES)


def plain_linear_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight of a bias-free `is_plain_linear` module, else None."""
    if not is_plain_linear(module) or module._parameters["bias"] is not None:
        return None
    return module._parameters["weight"]


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear` computes in here: autocast's when it is on for this device, else the tensor's."""
    if torch.is_autocast_enabled(tensor.device.type):
        return torch.get_autocast_dtype(tensor.device.type)
    return tensor.dtype


def token_major(values: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] values as the [B·T, H·D] matrix a projection writes (a view when laid out that way)."""
    return values.transpose(1, 2).reshape(-1, values.shape[1] * values.shape[3])


def heads_view(matrix: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A [B·T, H·D] matrix seen as [B, H, T, D] values shaped like `like`."""
    batch, heads, length, dim = like.shape
    return matrix.view(batch, length, heads, dim).transpose(1, 2)


# ---- ResFormer: λ_first·V_0 + λ_self·V_n ----------------------------------------------------------------------------


def mix_values(own: torch.Tensor, first: torch.Tensor, lambdas: Lambdas) -> torch.Tensor:
    """`λ_first·V_0 + λ_self·V_n` in plain ops: the reference, and the fallback for a v_proj that is not plain."""
    first_weight, own_weight = lambdas
    return own * own_weight + first * first_weight


class _ProjectAndMix(torch.autograd.Function):
    """`V' = λ_first·V_0 + λ_self·(h Wᵀ + b)`: v_proj's GEMM and the mix as one op.

    Saves h (q_proj and k_proj keep it), W as the GEMM read it (as Llama's linear does), V_0 (layer 0's attention keeps
    it) and λ. λ_self's gradient `<dV', V_n>` needs the V_n nothing keeps, but equals `<dV'ᵀh, W> + <Σ_t dV', b>`, and
    `dV'ᵀh` is the product the weight gradient computes anyway: exact, for one weight-sized dot. Fixed λ are floats
    folded into the GEMMs; learnable ones 0-dim tensors, each given its gradient as the 0-dim dot that computes it.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, first, first_weight, own_weight):
        dtype = compute_dtype(hidden)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        ctx.first_shape = first.shape
        first = token_major(first).to(dtype)  # a view of V_0 as layer 0's v_proj wrote it
        ctx.fixed = not torch.is_tensor(own_weight)
        if ctx.fixed:
            mixed = torch.addmm(first, hidden, weight.t(), beta=first_weight, alpha=own_weight)
            if bias is not None:
                mixed.add_(bias, alpha=own_weight)
            ctx.lambdas = (first_weight, own_weight)
            ctx.save_for_backward(hidden, weight, bias, first)
        else:
            mixed = F.linear(hidden, weight, bias)
            if kernels_usable(mixed, first, first_weight, own_weight):
                mix_in_place(mixed, first, first_weight, own_weight)
            else:
                mixed.mul_(own_weight).addcmul_(first, first_weight)
            ctx.save_for_backward(hidden, weight, bias, first, first_weight, own_weight)
        return mixed

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, first, *lambdas = ctx.saved_tensors
        need_hidden, need_weight, need_bias, need_first, need_first_weight, need_own_weight = ctx.needs_input_grad
        grad_hidden = grad_weight = grad_bias = grad_first_weight = grad_own_weight = None
        if ctx.fixed:
            first_weight, own_weight = ctx.lambdas
            scaled = grad if own_weight == 1.0 else grad * own_weight
            grad_first = scaled if first_weight == own_weight else grad if first_weight == 1.0 else grad * first_weight
        else:
            first_weight, own_weight = lambdas
            if kernels_usable(grad, first, first_weight, own_weight):  # both products and λ_first's dot in one pass
                grad_first, scaled, grad_first_weight = mix_backward(grad, first, first_weight, own_weight)
            else:
                both = grad * _column(first_weight, own_weight)  # λ_first·dV' and λ_self·dV' in one pass over dV'
                grad_first, scaled = both.unbind()
        if need_hidden:
            grad_hidden = scaled.mm(weight)
        if need_bias and bias is not None:
            grad_bias = scaled.sum(0)
        if need_own_weight:
            product = grad.t().mm(hidden)  # dV'ᵀh: the weight gradient before its λ_self factor
            grad_own_weight = torch.dot(product.view(-1), weight.reshape(-1))
            if bias is not None:
                grad_own_weight = grad_own_weight + torch.dot(grad.sum(0), bias)
            grad_weight = product.mul_(own_weight) if need_weight else None
        elif need_weight:
            grad_weight = scaled.t().mm(hidden)
        if need_first_weight and grad_first_weight is None:
            grad_first_weight = torch.dot(grad.reshape(-1), first.reshape(-1))  # views when contiguous
        if need_first:
            batch, heads, length, dim = ctx.first_shape
            grad_first = grad_first.view(batch, length, heads, dim).transpose(1, 2)
        return (grad_hidden, grad_weight, grad_bias, grad_first if need_first else None, grad_first_weight,
                grad_own_weight)


def _column(first_weight: torch.Tensor, own_weight: torch.Tensor) -> torch.Tensor:
    """(λ_first, λ_self) as a [2, 1, 1] tensor: a view where both are views of one λ table (`ValueResidual.rows`), so
    backward reads them without an op; else stacked."""
    step = own_weight.storage_offset() - first_weight.storage_offset()
    if step and own_weight.untyped_storage().data_ptr() == first_weight.untyped_storage().data_ptr():
        return first_weight.as_strided((2, 1, 1), (step, 0, 0))
    return torch.stack((first_weight, own_weight)).view(2, 1, 1)


def project_and_mix(hidden_states: torch.Tensor, v_proj: nn.Module, first: torch.Tensor, lambdas: Lambdas,
                    head_dim: int) -> torch.Tensor:
    """A mixing layer's values `λ_first·V_0 + λ_self·v_proj(h)`, [B, H_kv, T, D], from V_0 [B, H_kv, T, D].

    Compiled: `h (λ_self·W)ᵀ + λ_first·V_0` in plain ops, which keep no copy of V_n for the partitioner to save (the
    fused op would keep h, which a compiled Llama recomputes instead).
    """
    shape = (*hidden_states.shape[:-1], -1, head_dim)
    if not is_plain_linear(v_proj):
        return mix_values(v_proj(hidden_states).view(shape).transpose(1, 2), first, lambdas)
    if torch.compiler.is_compiling():
        first_weight, own_weight = lambdas
        bias = None if v_proj.bias is None else v_proj.bias * own_weight
        own = F.linear(hidden_states, v_proj.weight * own_weight, bias).view(shape).transpose(1, 2)
        return own + first * first_weight
    dtype = compute_dtype(hidden_states)
    if torch.is_tensor(lambdas[0]) and lambdas[0].dtype != dtype:  # `ValueResidual.rows` casts them already
        lambdas = (lambdas[0].to(dtype), lambdas[1].to(dtype))
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    mixed = _ProjectAndMix.apply(hidden, v_proj.weight, v_proj.bias, first, *lambdas)
    return mixed.view(*hidden_states.shape[:-1], -1, head_dim).transpose(1, 2)

# ---- gated: V_n + g·(V_0 − V_n), g from the token -------------------------------------------------------------------


class ValueGate(nn.Linear):
    """A gated layer's gate: the logits `W_g h + b_g` of the mix of each token and kv head, from the layer's
    normalised input ([..., hidden] → [..., H_kv]); the layer attends over `V_n + g·(V_0 − V_n)`, g = g0 − 0.5 + σ(·).

    Why this form: a mix per token, as later work trains it (x-transformers' `lerp(v, v_0, σ(W h + b))` per head,
    RWKV-7's per channel); a lerp, so the mix stays within `g0 ± 0.5`; W_g and b_g start at zero, so every token
    starts at `g0` (0.5: x-transformers' gate; 0, `--init preserve`: exactly the converted Llama, whose gates still
    get the gradient `h/4` from the first step, where a fixed logit would need −∞ and a scale on σ would start at a
    zero gradient), weight decay pulls the mix back to `g0`, and a checkpoint without them loads at it. One mix per kv
    head (one small GEMM per layer), kept float32 like the λ and split by kv head under tensor parallelism.
    """

    def __init__(self, hidden_size: int, num_key_value_heads: int):
        super().__init__(hidden_size, num_key_value_heads, bias=True)

    def resting_shift(self) -> float:
        """How far the gate moves λ_first for a token whose gate input moves nothing: `σ(b_g) − 0.5`, averaged over
        kv heads (`ResFormerPreTrainedModel.value_residual_lambdas` reports it)."""
        return torch.sigmoid(self.bias.detach().float()).mean().item() - 0.5


class _ProjectAndGate(torch.autograd.Function):
    """`V' = V_n + g·(V_0 − V_n)`, `V_n = h Wᵀ + b`, `g = shift + σ(h W_gᵀ + b_g)` per token and kv head: v_proj, the
    gate and the lerp as one op, keeping nothing beyond Llama's activations but σ ([B·T, H_kv]).

    Saves h (q_proj and k_proj keep it), W and W_g as the GEMMs read them, V_0 and σ. The gate's gradient
    `Σ_d dV'·(V_0 − V_n)` needs the V_n nothing keeps: backward recomputes it with the GEMM that made it, never by
    dividing by 1 − g; plain autograd (`gated_values`) would keep V_n instead.
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
            grad_logits = torch.ops.aten.sigmoid_backward(per_token.view(sigmoid.shape), sigmoid)  # through σ
            grad_gate_weight = grad_logits.t().mm(hidden) if need_gate_weight else None
            grad_gate_bias = grad_logits.sum(0) if need_gate_bias else None
        if need_hidden:
            grad_hidden = grad_own.mm(weight).addmm_(grad_logits, gate_weight)
        return grad_hidden, grad_weight, grad_bias, grad_first, grad_gate_weight, grad_gate_bias, None


def _shifted(sigmoid: torch.Tensor, shift: float) -> torch.Tensor:
    """The gate `σ(z) + shift`, skipping the pass when the shift is 0 (a gate started at the identity's 0.5)."""
    return sigmoid if shift == 0.0 else sigmoid + shift


def gated_values(own: torch.Tensor, first: torch.Tensor, logits: torch.Tensor, shift: float) -> torch.Tensor:
    """`V_n + g·(V_0 − V_n)` with `g = shift + σ(logits)` in plain ops, from V_n and V_0 [B, H_kv, T, D] and the gate's
    logits [B, T, H_kv]: the reference, and the fallback (projections that are not plain, `torch.compile`)."""
    gate = _shifted(torch.sigmoid(logits), shift).transpose(1, 2).unsqueeze(-1)
    return torch.lerp(own, first, gate.to(own.dtype))


def project_and_gate(hidden_states: torch.Tensor, v_proj: nn.Linear, value_gate: nn.Linear, first: torch.Tensor,
                     shift: float, head_dim: int) -> torch.Tensor:
    """A gated layer's values `V_n + g·(V_0 − V_n)`, [B, H_kv, T, D], with `g = shift + σ(value_gate(h))`; `v_proj` and
    `value_gate` plain linears (the caller checks)."""
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    mixed = _ProjectAndGate.apply(hidden, v_proj.weight, v_proj.bias, first, value_gate.weight, value_gate.bias,
                                  shift)
    return mixed.view(*hidden_states.shape[:-1], -1, head_dim).transpose(1, 2)


# ---- NeuTRENO: o_proj(A_n V_n + λ(V_0 − V_n)) -----------------------------------------------------------------------


def neutreno_correction(first: torch.Tensor, own: torch.Tensor, lam: float, groups: int) -> torch.Tensor:
    """NeuTRENO's term `λ(V_0 − V_n)` from V_0 and V_n [B, H_kv, T, D], repeated to the query heads and laid out like
    attention output ([B, T, H_q, D]): the reference, and the fallback for an o_proj that is not plain."""
    return (repeat_kv(first - own, groups) * lam).transpose(1, 2)


class _CorrectedOutputProjection(torch.autograd.Function):
    """NeuTRENO's `o_proj(A_n V_n + λ(V_0 − V_n))` without keeping the corrected input for o_proj's weight gradient.

    Saves the attention output, V_0 and V_n (attention and layer 0 keep them anyway) and W as the GEMM read it, and
    recomputes the corrected input in backward (two elementwise passes) rather than keep a tensor Llama does not.
    """

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
            per_kv_head = grad_corrected  # summed over each kv head's query heads, as [B, H_kv, T, D]
            if ctx.groups > 1:
                per_kv_head = grad_corrected.view(batch, length, heads // ctx.groups, ctx.groups, dim).sum(3)
            scaled = per_kv_head.transpose(1, 2) * ctx.lam
            grad_first = scaled if need_first else None
            grad_own = scaled.neg() if need_own else None
        return grad_output, grad_first, grad_own, grad_weight, grad_bias, None, None


def _corrected(attn_output: torch.Tensor, first: torch.Tensor, own: torch.Tensor, lam: float, groups: int):
    """`A_n V_n + λ(V_0 − V_n)` as the [B, T, H_q·D] input of o_proj; the kv heads are broadcast, not copied."""
    batch, length, heads, dim = attn_output.shape
    difference = (first - own).transpose(1, 2).unsqueeze(3)  # [B, T, H_kv, 1, D]
    grouped = attn_output.view(batch, length, heads // groups, groups, dim)
    return torch.add(grouped, difference, alpha=lam).reshape(batch, length, heads * dim)


def corrected_output_projection(attn_output: torch.Tensor, first: torch.Tensor, own: torch.Tensor, o_proj: nn.Module,
                                lam: float, groups: int) -> torch.Tensor:
    """NeuTRENO's `o_proj(A_n V_n + λ(V_0 − V_n))` from attention output [B, T, H_q, D], V_0, V_n [B, H_kv, T, D]."""
    if is_plain_linear(o_proj):
        return _CorrectedOutputProjection.apply(attn_output, first, own, o_proj.weight, o_proj.bias, lam, groups)
    corrected = attn_output + neutreno_correction(first, own, lam, groups)
    return o_proj(corrected.reshape(*attn_output.shape[:2], -1).contiguous())
