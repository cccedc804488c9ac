"""The value residual's training-time mixing: autograd functions that keep no tensor beyond Llama's.

Why a module of its own: these functions exist only for the backward pass. They fuse the mix into the value projection
(`_ProjectAndMixFirst`), keep `dense`'s raw values once in a shared buffer (`_DenseValues`) and recompute NeuTRENO's
corrected o_proj input (`_CorrectedOutputProjection`), so that training holds exactly Llama's activations (`gated`'s,
`_ProjectAndGate`, is in `value_gate.py`). Without a gradient none of that is needed, and the value paths
(`value_paths.py`) mix on v_proj's output instead, which is what decoding should cost. The plain-op forms
(`mix_values`, `neutreno_correction`) are the fallback where v_proj / o_proj is not a plain `nn.Linear`, and the
reference the tests hold the fused functions to.
Imports only torch and transformers (copied next to `config.json` for `trust_remote_code`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as _module_globals
from transformers.models.llama.modeling_llama import repeat_kv

# ---- the mix at the cost of the values it must keep -----------------------------------------------------------------
#
# With plain autograd ops a learnable mix keeps one extra [B, H_kv, T, D] tensor per layer (the raw V_n, for λ_self's
# gradient), `dense` keeps every layer's concatenated stack of earlier values (O(L²) in layers), and NeuTRENO keeps the
# corrected attention output that o_proj saves next to the attention output. The autograd functions below save only
# tensors that the projections, attention or layer 0 keep anyway, and compute gradients exactly (no recomputation by
# division). Two of them use a projection's weight directly; they are used only when calling the module is exactly
# `F.linear` (see `is_plain_linear`); otherwise they call the module and the plain ops (`mix_values`, ...).
# "Keep anyway" assumes training without a KV cache (`use_cache=False`): with one, attention saves the cache's copies
# of the values instead (Llama's too), and V_0 is kept once more.

#: Row n of `ValueResidual()` (a tensor), or (λ_first, λ_self) as floats when the variant's λ are fixed.
Weights = torch.Tensor | tuple[float, float]

# Global hooks set with torch.nn.modules.module.register_module_forward_hook & co. live in private dicts of that module
# (torch 2.6 - 2.14), which torch fills and empties in place; they are only read here, and a name torch no longer has
# counts as "no hooks".
_GLOBAL_MODULE_HOOKS = tuple(
    getattr(_module_globals, name, {})
    for name in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")
)
_PLAIN_TENSOR_TYPES = (nn.Parameter, torch.Tensor)


def is_plain_linear(module: nn.Module, linear_class: type[nn.Linear] = nn.Linear) -> bool:
    """Whether calling `module` is exactly `F.linear(x, module.weight, module.bias)`: a fused path may use its weight.

    False for LoRA, quantised or FSDP-wrapped replacements (other classes), module hooks or a patched `forward` (tensor
    parallelism, DeepSpeed ZeRO-3, accelerate offloading) and tensor-subclass weights (DTensor): they keep the call.
    Runs once per layer in every decode step, so it reads the module's own dicts instead of its attributes: a
    parameter reached through `Module.__getattr__` costs a caught AttributeError each time.
    """
    if type(module) is not linear_class:  # `linear_class`: a subclass that keeps `nn.Linear.forward`
        return False
    state = module.__dict__
    if ("forward" in state or state["_forward_hooks"] or state["_forward_pre_hooks"] or state["_backward_hooks"]
            or state["_backward_pre_hooks"] or any(_GLOBAL_MODULE_HOOKS)):
        return False
    parameters = state["_parameters"]
    bias = parameters["bias"]
    return type(parameters["weight"]) in _PLAIN_TENSOR_TYPES and (bias is None or type(bias) in _PLAIN_TENSOR_TYPES)


def plain_linear_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight of `module` when calling it is exactly `F.linear(x, weight)` (a bias-free `is_plain_linear`), else
    None."""
    if not is_plain_linear(module) or module._parameters["bias"] is not None:
        return None
    return module._parameters["weight"]


def mix_values(
    own_values: torch.Tensor, residual_values: torch.Tensor, weights: Weights, layer_idx: int
) -> torch.Tensor:
    """`V'_n = Σ_j weights[j]·residual_values[j] + weights[n]·V_n` with plain torch ops, on the un-repeated kv heads.

    `residual_values` stacks the raw values the layer may mix in ([1, B, H_kv, T, D] holding V_0, or V_0..V_{n-1} for
    `dense`); `weights` is row n of `ValueResidual()`, or the fixed pair (λ_first, λ_self). The fused functions here
    compute the same thing for less memory; this is their fallback and their reference in the tests.
    """
    if isinstance(weights, tuple):
        return torch.add(own_values * weights[1], residual_values[0], alpha=weights[0])
    weights = weights.to(own_values.dtype)
    mixed = own_values * weights[layer_idx]
    for j in range(residual_values.shape[0]):
        mixed = torch.addcmul(mixed, residual_values[j], weights[j])  # one fused kernel instead of mul + add
    return mixed


def neutreno_correction(
    first_values: torch.Tensor, own_values: torch.Tensor, weights: Weights, num_key_value_groups: int
) -> torch.Tensor:
    """NeuTRENO's per-token term `λ(V_0 − V_n)`, repeated to the query heads and laid out like attention output
    ([B, T, H_q, D]) so it can be added to `A_n V_n` before `o_proj`. λ is `weights[0]` (row n of
    `ValueResidual()`, or the fixed pair)."""
    difference = repeat_kv(first_values - own_values, num_key_value_groups)
    lam = weights[0] if isinstance(weights, tuple) else weights[0].to(difference.dtype)
    return (difference * lam).transpose(1, 2)


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear` would compute in here: autocast's when it is on for this device, else the tensor's."""
    device_type = tensor.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return tensor.dtype


def _token_major(values: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] values as the [B·T, H·D] matrix a projection writes them in (a view when laid out that way)."""
    return values.transpose(1, 2).reshape(-1, values.shape[1] * values.shape[3])


def _heads_view(matrix: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of `_token_major`: a [B·T, H·D] matrix seen as [B, H, T, D] values shaped like `like`."""
    batch, heads, length, dim = like.shape
    return matrix.view(batch, length, heads, dim).transpose(1, 2)


def _pair(weights: Weights, layer_idx: int, dtype: torch.dtype):
    """(λ_first, λ_self) of a layer: floats as they are, or 0-dim tensors in the values' dtype."""
    if isinstance(weights, tuple):
        return weights
    return weights[0].to(dtype), weights[layer_idx].to(dtype)


def _scaled(tensor: torch.Tensor, scale, in_place: bool = False) -> torch.Tensor:
    """`tensor * scale`, skipping the pass when `scale` is the float 1.0 (e.g. λ_self of `constant` and `sparse`)."""
    if isinstance(scale, float) and scale == 1.0:
        return tensor
    return tensor.mul_(scale) if in_place else tensor * scale


class _ProjectAndMixFirst(torch.autograd.Function):
    """`V'_n = a·V_0 + b·(h Wᵀ + bias)`: layer n's value projection and the mix in one GEMM.

    Saves h (which q_proj and k_proj save anyway), W and V_0 (which layer 0's attention saves): nothing extra. λ_self's
    gradient `<dV', V_n>` needs the V_n that nothing keeps, but it equals `<dV'ᵀh, W> + <Σ_t dV', bias>`, and `dV'ᵀh`
    is the product the weight gradient computes anyway, so it comes exact (no recomputation, no division by λ_self)
    and costs one [H_kv·D, hidden] product.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, residual_values, weights, layer_idx):
        dtype = _compute_dtype(hidden)
        hidden, weight_c = hidden.to(dtype), weight.to(dtype)
        first = _token_major(residual_values[0]).to(dtype)  # a view of V_0 as layer 0's v_proj wrote it
        first_weight, own_weight = _pair(weights, layer_idx, dtype)
        if isinstance(first_weight, float):
            mixed = torch.addmm(first, hidden, weight_c.t(), beta=first_weight, alpha=own_weight)
        else:
            mixed = torch.mul(first, first_weight).addmm_(hidden, _scaled(weight_c, own_weight).t())
        if bias is not None:
            mixed = mixed.add_(bias.to(dtype) * own_weight)
        fixed = isinstance(weights, tuple)
        ctx.save_for_backward(hidden, weight, bias, first, *(() if fixed else (first_weight, own_weight)))
        ctx.fixed, ctx.layer_idx = weights if fixed else None, layer_idx
        ctx.values_shape, ctx.stack_rows = residual_values.shape[1:], residual_values.shape[0]
        ctx.lambdas_shape = None if fixed else weights.shape
        return mixed

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, first, *pair = ctx.saved_tensors
        first_weight, own_weight = ctx.fixed or pair
        need_hidden, need_weight, need_bias, need_values, need_lambdas = ctx.needs_input_grad[:5]
        weight_c = weight.to(grad.dtype)
        grad_hidden = grad_weight = grad_bias = grad_values = grad_lambdas = None
        if need_hidden:
            grad_hidden = grad.mm(_scaled(weight_c, own_weight))
        if need_weight or need_lambdas:
            product = grad.t().mm(hidden)  # dV'ᵀh: the weight gradient before its λ_self factor
            if need_lambdas:
                grad_own = torch.dot(product.reshape(-1).float(), weight_c.reshape(-1).float())
                grad_first = torch.dot(grad.reshape(-1), first.reshape(-1)).float()
            grad_weight = _scaled(product, own_weight, in_place=True) if need_weight else None
        if bias is not None and (need_bias or need_lambdas):
            grad_sum = grad.sum(0)
            if need_lambdas:
                grad_own = grad_own + (grad_sum.float() * bias.float()).sum()
            grad_bias = grad_sum * own_weight if need_bias else None
        if need_values:
            batch, heads, length, dim = ctx.values_shape
            scaled = _scaled(grad, first_weight).view(batch, length, heads, dim).transpose(1, 2)
            if ctx.stack_rows == 1:
                grad_values = scaled.unsqueeze(0)
            else:
                grad_values = scaled.new_zeros((ctx.stack_rows, *ctx.values_shape))
                grad_values[0] = scaled
        if need_lambdas:
            grad_lambdas = grad.new_zeros(ctx.lambdas_shape, dtype=torch.float32)
            grad_lambdas[0], grad_lambdas[ctx.layer_idx] = grad_first, grad_own
        return grad_hidden, grad_weight, grad_bias, grad_values, grad_lambdas, None


def project_and_mix_first(
    hidden_states: torch.Tensor, v_proj: nn.Linear, residual_values: torch.Tensor, weights: Weights, layer_idx: int,
    head_dim: int,
) -> torch.Tensor:
    """A mixing layer's attention values `λ_first·V_0 + λ_self·v_proj(h)`, [B, H_kv, T, D], saving nothing extra.

    `residual_values` is the [1, B, H_kv, T, D] stack holding V_0. Falls back to calling `v_proj` and `mix_values`
    when `v_proj` is not a plain `nn.Linear` (then λ_self's gradient keeps V_n alive, as plain autograd does).
    """
    input_shape = hidden_states.shape[:-1]
    if not is_plain_linear(v_proj):
        own_values = v_proj(hidden_states).view(*input_shape, -1, head_dim).transpose(1, 2)
        return mix_values(own_values, residual_values, weights, layer_idx)
    if torch.compiler.is_compiling():
        return _project_and_mix_traced(hidden_states, v_proj, residual_values, weights, layer_idx, head_dim)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    mixed = _ProjectAndMixFirst.apply(hidden, v_proj.weight, v_proj.bias, residual_values, weights, layer_idx)
    return mixed.view(*input_shape, -1, head_dim).transpose(1, 2)


def _project_and_mix_traced(
    hidden_states: torch.Tensor, v_proj: nn.Linear, residual_values: torch.Tensor, weights: Weights, layer_idx: int,
    head_dim: int,
) -> torch.Tensor:
    """`project_and_mix_first` under `torch.compile`: plain ops that AOTAutograd's partitioner can see through.

    The autograd function above must save h for its backward; compiled, Llama saves no such tensor (the partitioner
    recomputes the normed input of q/k/v from the residual stream), so the function would keep one [B·T, hidden]
    tensor per mixing layer beyond Llama's (measured on an H200: `identity` 1.026 of a compiled Llama's peak memory).
    Written as `h (λ_self·W)ᵀ + λ_first·V_0`, autograd needs only what the partitioner can recompute or already keeps:
    λ_self's gradient is `<(dV')ᵀh, W>` through the product `λ_self·W`, with no copy of V_n.
    """
    first_weight, own_weight = weights if isinstance(weights, tuple) else (weights[0], weights[layer_idx])
    bias = v_proj.bias if v_proj.bias is None else v_proj.bias * own_weight
    own = F.linear(hidden_states, _scaled(v_proj.weight, own_weight), bias)
    own = own.view(*hidden_states.shape[:-1], -1, head_dim).transpose(1, 2)
    first = residual_values[0]
    return torch.add(own, first * first_weight.to(first.dtype) if torch.is_tensor(first_weight) else first,
                     alpha=1.0 if torch.is_tensor(first_weight) else first_weight)


def _row_strides(shape: torch.Size) -> tuple[int, ...]:
    """Strides of a [rows, B, H, T, D] stack whose rows are laid out token-major ([B, T, H, D]) like a projection's
    output, so that copying V_n into a row is a plain memory copy and a row is a [B·T·H·D] vector."""
    rows, batch, heads, length, dim = shape
    return batch * length * heads * dim, length * heads * dim, dim, heads * dim, 1


def _is_our_stack_with_room(stack: torch.Tensor, values: torch.Tensor, capacity: int) -> bool:
    """Whether `stack` is a prefix of a `capacity`-row value buffer (made by `_DenseValues`) with a free next row."""
    shape = stack.shape
    row = values.numel() * values.element_size()
    return (
        stack.dtype == values.dtype and stack.device == values.device and shape[1:] == values.shape
        and shape[0] < capacity and stack.storage_offset() == 0 and stack.stride() == _row_strides(shape)
        and stack.untyped_storage().nbytes() == capacity * row
    )


def _stack_with_row(stack: torch.Tensor | None, values: torch.Tensor, capacity: int) -> torch.Tensor:
    """`stack` with `values` appended as its next row, sharing one buffer of `capacity` rows across layers.

    The result is a new tensor on the same storage (its own version counter), so writing row n does not touch what
    autograd saved from earlier layers' prefixes: those rows never change. A stack that is not such a prefix (the first
    layer, a pipeline stage boundary, a torch.compile trace) is copied into a fresh buffer.
    """
    rows = 0 if stack is None else stack.shape[0]
    shape = torch.Size((rows + 1, *values.shape))
    if stack is not None and not torch.compiler.is_compiling() and _is_our_stack_with_room(stack, values, capacity):
        storage = stack.untyped_storage()
        grown = torch.empty(0, dtype=values.dtype, device=values.device).set_(storage, 0, shape, _row_strides(shape))
    else:
        size = shape if torch.compiler.is_compiling() else torch.Size((capacity, *values.shape))
        grown = torch.empty_strided(size, _row_strides(size), dtype=values.dtype, device=values.device)[: rows + 1]
        if stack is not None:
            grown[:rows].copy_(stack)
    grown[rows].copy_(values)
    return grown


def _alias(stack: torch.Tensor, row: int, shape: torch.Size) -> torch.Tensor:
    """Row `row` of a stack as a separate tensor on the same storage (not an autograd view of the stack)."""
    strides = _row_strides(stack.shape)
    alias = torch.empty(0, dtype=stack.dtype, device=stack.device)
    return alias.set_(stack.untyped_storage(), stack.storage_offset() + row * strides[0], shape, strides[1:])


def _rows(stack: torch.Tensor) -> torch.Tensor:
    """A stack as a [rows, B·T·H·D] matrix of token-major rows (a view for stacks made by `_stack_with_row`)."""
    return stack.transpose(2, 3).reshape(stack.shape[0], -1)


class _DenseValues(torch.autograd.Function):
    """One `dense` layer: mix V_n with the stack of earlier raw values V_0..V_{n-1} and/or append V_n to it.

    Every layer's stack is a prefix of one buffer (`_stack_with_row`), so the raw values are kept once: O(L) memory,
    not the O(L²) of `torch.cat`-grown stacks that each stay alive for backward. The stack still travels from layer to
    layer as a tensor argument, which reentrant activation checkpointing needs to propagate its gradient. Returns
    (the values attention uses, the grown stack or None).
    """

    @staticmethod
    def forward(ctx, own, stack, weights, layer_idx, capacity, mix, append):
        ctx.set_materialize_grads(False)
        ctx.layer_idx, ctx.mix, ctx.append, ctx.rows = layer_idx, mix, append, 0 if stack is None else stack.shape[0]
        if ctx.rows != layer_idx:
            raise RuntimeError(
                f"dense layer {layer_idx} received a stack of {ctx.rows} value tensors; it needs the values of every "
                "earlier layer, in order (pass the `residual_values` each decoder layer returns to the next one)."
            )
        grown = _stack_with_row(stack, own, capacity) if append else None
        if not mix:  # attend over the buffer row itself, so V_n is kept once (attention saves it) and `own` is freed
            ctx.save_for_backward(None, None, None)
            return (own if torch.compiler.is_compiling() else _alias(grown, ctx.rows, own.shape)), grown
        if mix:
            vector = weights[: ctx.rows + 1].to(own.dtype)
            if append:
                mixed_rows = torch.mv(_rows(grown).t(), vector)
            else:
                mixed_rows = torch.addmv(_token_major(own).reshape(-1) * vector[-1], _rows(stack).t(), vector[:-1])
            mixed = _heads_view(mixed_rows.view(-1, own.shape[1] * own.shape[3]), own)
        ctx.save_for_backward(grown if append else stack, None if append else own, weights if mix else None)
        return mixed, grown

    @staticmethod
    def backward(ctx, grad_mixed, grad_grown):
        stack_or_grown, own, weights = ctx.saved_tensors
        rows = ctx.rows
        grad_own = grad_stack = grad_weights = None
        if not ctx.mix:  # append only: V_n's gradient is its row's plus what attention sent to the row itself
            if grad_grown is not None:
                grad_own, grad_stack = grad_grown[rows], grad_grown[:rows] if rows else None
            if grad_mixed is not None:
                grad_own = grad_mixed if grad_own is None else grad_own + grad_mixed
            return grad_own, grad_stack, None, None, None, None, None
        if grad_mixed is None:
            if grad_grown is not None:
                grad_own, grad_stack = grad_grown[rows], grad_grown[:rows] if rows else None
            return grad_own, grad_stack, None, None, None, None, None
        vector = weights[: rows + 1].to(grad_mixed.dtype)
        flat = _token_major(grad_mixed).reshape(-1)
        if ctx.append:
            matrix = _rows(stack_or_grown)
            if grad_grown is None:
                grown_grad = torch.outer(vector, flat)
            else:  # the later layers' gradient for every row plus this layer's, in one pass
                grown_grad = torch.addr(_rows(grad_grown), vector, flat)
            grown_grad = grown_grad.view(rows + 1, *grad_mixed.shape).as_strided(
                stack_or_grown.shape, _row_strides(stack_or_grown.shape)
            )
            grad_own, grad_stack = grown_grad[rows], grown_grad[:rows] if rows else None
            mixed_grads = torch.mv(matrix, flat) if ctx.needs_input_grad[2] else None
        else:
            stack = stack_or_grown
            grad_stack = torch.outer(vector[:-1], flat).as_strided(stack.shape, _row_strides(stack.shape))
            grad_own = _heads_view((flat * vector[-1]).view(-1, own.shape[1] * own.shape[3]), own)
            mixed_grads = None
            if ctx.needs_input_grad[2]:
                own_grad = torch.dot(_token_major(own).reshape(-1), flat)
                mixed_grads = torch.cat((torch.mv(_rows(stack), flat), own_grad.unsqueeze(0)))
        if mixed_grads is not None:
            grad_weights = torch.zeros_like(weights)
            grad_weights[: rows + 1] = mixed_grads
        return grad_own, grad_stack, grad_weights, None, None, None, None


def dense_values(
    own_values: torch.Tensor, residual_values: torch.Tensor | None, weights: torch.Tensor, layer_idx: int,
    capacity: int, mix: bool, append: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A `dense` layer's attention values and the stack it passes on: `Σ_{j<n} W[n, j]·V_j + W[n, n]·V_n` when it
    mixes (else V_n itself), and the stack of raw values with V_n appended when a later layer reads it.

    `capacity` is the number of rows the stack can reach (the last reading layer's index); layer 0 passes `None` as
    `residual_values` and allocates the buffer, once per forward pass. A layer writes only its own row, so a decoder
    layer must not run twice on the same stack with different inputs in one graph (activation checkpointing's
    recompute writes the same values again, which is fine).
    """
    values, grown = _DenseValues.apply(own_values, residual_values, weights, layer_idx, capacity, mix, append)
    return values, (grown if append else residual_values)


class _CorrectedOutputProjection(torch.autograd.Function):
    """NeuTRENO's `o_proj(A_n V_n + λ(V_0 − V_n))` without keeping the corrected tensor for o_proj's weight gradient.

    Plain autograd keeps both the attention output (attention's backward needs it) and the corrected tensor (o_proj's
    weight gradient needs it). This saves the attention output, V_0 and V_n, which attention and layer 0 keep anyway,
    and recomputes the corrected tensor (two elementwise passes) in backward. λ is a fixed float.
    """

    @staticmethod
    def forward(ctx, attn_output, residual_values, own, weight, bias, lam, groups):
        ctx.lam, ctx.groups = lam, groups
        corrected = _corrected(attn_output, residual_values[0], own, lam, groups)
        ctx.save_for_backward(attn_output, residual_values, own, weight, bias)
        return torch.nn.functional.linear(corrected, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        attn_output, residual_values, own, weight, bias = ctx.saved_tensors
        need_output, need_values, need_own, need_weight, need_bias = ctx.needs_input_grad[:5]
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_output = grad_values = grad_own = grad_weight = grad_bias = None
        if need_weight:
            corrected = _corrected(attn_output, residual_values[0], own, ctx.lam, ctx.groups)
            grad_weight = grad_2d.t().mm(corrected.reshape(grad_2d.shape[0], -1).to(grad.dtype))
        if bias is not None and need_bias:
            grad_bias = grad_2d.sum(0)
        if need_output or need_values or need_own:
            grad_corrected = grad_2d.mm(weight.to(grad.dtype)).view(attn_output.shape)
            grad_output = grad_corrected if need_output else None
            batch, length, heads, dim = attn_output.shape
            per_kv_head = grad_corrected  # the gradient summed over each kv head's query heads, as [B, H_kv, T, D]
            if ctx.groups > 1:
                per_kv_head = grad_corrected.view(batch, length, heads // ctx.groups, ctx.groups, dim).sum(3)
            per_kv_head = per_kv_head.transpose(1, 2)
            grad_values = (per_kv_head * ctx.lam).unsqueeze(0) if need_values else None
            grad_own = per_kv_head * -ctx.lam if need_own else None
        return grad_output, grad_values, grad_own, grad_weight, grad_bias, None, None


def _corrected(attn_output: torch.Tensor, first: torch.Tensor, own: torch.Tensor, lam: float, groups: int):
    """`A_n V_n + λ(V_0 − V_n)` as the [B, T, H_q·D] input of o_proj; the kv heads are broadcast, not copied."""
    batch, length, heads, dim = attn_output.shape
    difference = (first - own).transpose(1, 2).unsqueeze(3)  # [B, T, H_kv, 1, D]
    grouped = attn_output.view(batch, length, heads // groups, groups, dim)
    return torch.add(grouped, difference, alpha=lam).reshape(batch, length, heads * dim)


def corrected_output_projection(
    attn_output: torch.Tensor, residual_values: torch.Tensor, own_values: torch.Tensor, o_proj: nn.Linear,
    weights: Weights, groups: int,
) -> torch.Tensor:
    """NeuTRENO's `o_proj(A_n V_n + λ(V_0 − V_n))` from attention output [B, T, H_q, D], keeping no extra tensor when
    `o_proj` is a plain `nn.Linear` and λ is fixed; otherwise the plain ops and the module call."""
    if isinstance(weights, tuple) and is_plain_linear(o_proj):
        return _CorrectedOutputProjection.apply(
            attn_output, residual_values, own_values, o_proj.weight, o_proj.bias, weights[0], groups
        )
    corrected = attn_output + neutreno_correction(residual_values[0], own_values, weights, groups)
    return o_proj(corrected.reshape(*attn_output.shape[:2], -1).contiguous())
