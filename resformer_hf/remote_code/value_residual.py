"""ResFormer's value residual: what each attention layer attends over, by the role its config gives it.

`ResFormerAttention` reads its layer's role once, in `__init__`, and its forward calls one function here per role:

| role | attends over | here |
| --- | --- | --- |
| `mix` (identity, constant, learnable, learnable_plus, sparse) | `λ_first·V_0 + λ_self·V_n` | `mixed_values` |
| `reuse` (SVFormer) | V_0 itself (no `v_proj`) | – |
| `gate` (gated) | `V_n + g·(V_0 − V_n)`, g per token and kv head | `gated_values` |
| `correct` (NeuTRENO) | V_n, then `o_proj(A_n V_n + λ(V_0 − V_n))` | `corrected_output` |
| `mix_all` (dense) | `Σ_j W[n, j]·V_j` | `depth_weighted_average.dense_values` |

Layer 0 hands its values V_0 on to the receivers (`ResidualValues`). Every λ lives in one module (`ValueResidual`),
read once per forward pass. A custom autograd function appears only where plain autograd would keep a tensor Llama
does not (V_n, NeuTRENO's corrected input). Imports only torch, transformers and sibling files (`trust_remote_code`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as _module_globals
from transformers.models.llama.modeling_llama import repeat_kv

from .configuration_resformer import CORRECT, DENSE, MIX_ALL, PAIR, PLAIN, REUSE, SOFTMAX, ResFormerConfig
from .loading import gathered_parameters
from .mix_kernels import kernels_usable, mix_backward, mix_in_place

#: What a layer hands on to later layers, passed positionally (reentrant checkpointing propagates its gradient): V_0
#: [B, H_kv, T, D]; `dense`: its buffer of every earlier layer's values [n, B, H_kv, T, D]; decoding a learnable mix,
#: each receiver's λ_first·V_0, which layer 0 scales for all receivers in one op and hands on as one tuple.
ResidualValues = torch.Tensor | tuple[torch.Tensor, ...]
#: Up to this many tokens without gradient (a decode step, a speculative draft) layer 0 scales V_0 for every receiver
#: at once; beyond it (prefill) each receiver scales it, holding one scaled copy at a time instead of R.
BATCHED_SCALING_MAX_TOKENS = 16

# ---- the λ ----------------------------------------------------------------------------------------------------------


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
            return tuple((None, None) if role == PLAIN else (self.lambda_first_init, self.lambda_self_init)
                         for role in self.roles)
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


def own_values(v_proj: nn.Module, hidden_states: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Llama's values, `v_proj(h)` as [B, H_kv, T, D]."""
    return v_proj(hidden_states).view(*hidden_states.shape[:-1], -1, head_dim).transpose(1, 2)


def hand_on(own: torch.Tensor, column: torch.Tensor | None) -> ResidualValues:
    """What layer 0 hands on: V_0; decoding a learnable mix, λ_first·V_0 of every receiver (`per_layer`'s column)."""
    return own if column is None else (own * column.to(own.dtype)).unbind(0)


# ---- mix: λ_first·V_0 + λ_self·V_n ----------------------------------------------------------------------------------


def mixed_values(v_proj: nn.Module, hidden_states: torch.Tensor, first: ResidualValues, lambda_first, lambda_self,
                 row: int, head_dim: int) -> torch.Tensor:
    """`λ_first·V_0 + λ_self·v_proj(h)`, [B, H_kv, T, D], λ floats (fixed) or 0-dim tensors (learnable). Fixed λ
    fold into v_proj's GEMM (autograd keeps h and W, as Llama's does); learnable λ need `_ProjectAndMix`, which keeps
    no V_n; decoding, layer 0 scaled V_0 already (`first[row]`) and the mix is one op beyond Llama's."""
    shape = (*hidden_states.shape[:-1], -1, head_dim)
    if isinstance(first, tuple):
        return torch.addcmul(first[row], own_values(v_proj, hidden_states, head_dim), lambda_self)
    if not is_plain_linear(v_proj):  # LoRA, hooks, tensor parallelism: called as Llama calls it
        return own_values(v_proj, hidden_states, head_dim) * lambda_self + first * lambda_first
    if torch.compiler.is_compiling():  # plain ops the partitioner sees through (a compiled Llama recomputes h)
        bias = None if v_proj.bias is None else v_proj.bias * lambda_self
        own = F.linear(hidden_states, v_proj.weight * lambda_self, bias)
        return own.view(shape).transpose(1, 2) + first * lambda_first
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    if isinstance(lambda_self, float):
        mixed = torch.addmm(token_major(first), hidden, v_proj.weight.t(), beta=lambda_first, alpha=lambda_self)
        mixed = mixed if v_proj.bias is None else mixed.add_(v_proj.bias, alpha=lambda_self)
    else:
        mixed = _ProjectAndMix.apply(hidden, v_proj.weight, v_proj.bias, first, lambda_first, lambda_self)
    return mixed.view(shape).transpose(1, 2)


class _ProjectAndMix(torch.autograd.Function):
    """`V' = λ_first·V_0 + λ_self·(h Wᵀ + b)` for learnable λ: v_proj's GEMM and the mix as one op, keeping nothing
    Llama does not.

    Saves h (q_proj and k_proj keep it), W, V_0 (layer 0's attention keeps it) and λ. λ_self's gradient `<dV', V_n>`
    needs the V_n nothing keeps, but equals `<dV'ᵀh, W> + <Σ_t dV', b>`, and `dV'ᵀh` is the weight gradient's own
    product: exact, for one weight-sized dot. On CUDA the mix runs as Triton kernels (`mix_kernels.py`).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, first, first_weight, own_weight):
        dtype = compute_dtype(hidden)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        first_weight, own_weight = first_weight.to(dtype), own_weight.to(dtype)
        ctx.first_shape = first.shape
        first = token_major(first).to(dtype)  # a view of V_0 as layer 0's v_proj wrote it
        mixed = F.linear(hidden, weight, bias)
        if kernels_usable(mixed, first, first_weight, own_weight):
            mix_in_place(mixed, first, first_weight, own_weight)
        else:
            mixed.mul_(own_weight).addcmul_(first, first_weight)
        ctx.save_for_backward(hidden, weight, bias, first, first_weight, own_weight)
        return mixed

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, first, first_weight, own_weight = ctx.saved_tensors
        need_hidden, need_weight, need_bias, need_first, need_first_weight, need_own_weight = ctx.needs_input_grad
        grad_hidden = grad_weight = grad_bias = grad_first_weight = grad_own_weight = None
        if kernels_usable(grad, first, first_weight, own_weight):  # both products and λ_first's dot in one pass
            grad_first, scaled, grad_first_weight = mix_backward(grad, first, first_weight, own_weight)
        else:
            grad_first, scaled = (grad * _column(first_weight, own_weight)).unbind()
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
            grad_first_weight = torch.dot(grad.reshape(-1), first.reshape(-1))
        grad_first = heads_view(grad_first, ctx.first_shape) if need_first else None
        return grad_hidden, grad_weight, grad_bias, grad_first, grad_first_weight, grad_own_weight


def _column(first_weight: torch.Tensor, own_weight: torch.Tensor) -> torch.Tensor:
    """(λ_first, λ_self) as [2, 1, 1]: a view where both are views of one λ table (`per_layer`), else stacked."""
    step = own_weight.storage_offset() - first_weight.storage_offset()
    if step and own_weight.untyped_storage().data_ptr() == first_weight.untyped_storage().data_ptr():
        return first_weight.as_strided((2, 1, 1), (step, 0, 0))
    return torch.stack((first_weight, own_weight)).view(2, 1, 1)


# ---- gate: V_n + g·(V_0 − V_n), g per token and kv head ------------------------------------------------------------


class ValueGate(nn.Linear):
    """A gated layer's gate: logits `W_g h + b_g` of the mix `g = g0 − 0.5 + σ(·)` of each token and kv head. A lerp
    per head, as x-transformers mixes (`lerp(v, v_0, σ(W h + b))`); W_g and b_g start at zero, so every token starts
    at `g0` (0.5; 0 with `--init preserve`, exactly the converted Llama, whose gates still get the gradient `h/4`), and
    weight decay pulls the mix back to `g0`. Kept float32 like the λ."""

    def __init__(self, hidden_size: int, num_key_value_heads: int):
        super().__init__(hidden_size, num_key_value_heads, bias=True)

    def resting_shift(self) -> float:
        """How far the gate moves λ_first for a token whose gate input moves nothing: `σ(b_g) − 0.5` averaged over
        kv heads."""
        return torch.sigmoid(self.bias.detach().float()).mean().item() - 0.5

    def mix(self, hidden_states: torch.Tensor, shift: float) -> torch.Tensor:
        """The mix `g` on V_0 of every token and kv head ([..., H_kv], float32) for the layer's normalised input."""
        return torch.sigmoid(self(hidden_states.to(self.weight.dtype)).float()) + shift


def gated_values(v_proj: nn.Module, gate: ValueGate, hidden_states: torch.Tensor, first: torch.Tensor, shift: float,
                 head_dim: int) -> torch.Tensor:
    """`V_n + g·(V_0 − V_n)`, [B, H_kv, T, D], `g = shift + σ(gate(h))`: fused (`_ProjectAndGate`) for plain linears,
    else, and compiled, plain ops (a compiled Llama recomputes h, so they keep less than the fused op)."""
    if torch.compiler.is_compiling() or not (is_plain_linear(v_proj) and is_plain_linear(gate, ValueGate)):
        logits = gate(hidden_states.to(gate.weight.dtype))
        mix = torch.sigmoid(logits) + shift if shift else torch.sigmoid(logits)
        own = own_values(v_proj, hidden_states, head_dim)
        return torch.lerp(own, first, mix.transpose(1, 2).unsqueeze(-1).to(own.dtype))
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    mixed = _ProjectAndGate.apply(hidden, v_proj.weight, v_proj.bias, first, gate.weight, gate.bias, shift)
    return mixed.view(*hidden_states.shape[:-1], -1, head_dim).transpose(1, 2)


class _ProjectAndGate(torch.autograd.Function):
    """v_proj, the gate and the lerp as one op, keeping nothing beyond Llama's activations but σ ([B·T, H_kv]). The
    gate's gradient `Σ_d dV'·(V_0 − V_n)` needs the V_n nothing keeps: backward recomputes it with its GEMM."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, first, gate_weight, gate_bias, shift):
        dtype = compute_dtype(hidden)
        hidden, weight, gate_weight = hidden.to(dtype), weight.to(dtype), gate_weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        own = F.linear(hidden, weight, bias)
        ctx.first_shape, ctx.shift = first.shape, shift
        first = token_major(first).to(dtype)  # a view of V_0 as layer 0's v_proj wrote it
        sigmoid = torch.sigmoid(torch.addmm(gate_bias.to(dtype), hidden, gate_weight.t()))
        gate = sigmoid + shift if shift else sigmoid
        heads = sigmoid.shape[-1]
        mixed = torch.lerp(own.view(own.shape[0], heads, -1), first.view(first.shape[0], heads, -1), gate[..., None])
        ctx.save_for_backward(hidden, weight, bias, first, gate_weight, sigmoid)
        return mixed.view(own.shape)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, first, gate_weight, sigmoid = ctx.saved_tensors
        need_hidden, need_weight, need_bias, need_first, need_gate_weight, need_gate_bias = ctx.needs_input_grad[:6]
        heads = sigmoid.shape[-1]
        per_head = grad.reshape(grad.shape[0], heads, -1)
        gate = (sigmoid + ctx.shift if ctx.shift else sigmoid).unsqueeze(-1)
        grad_own = torch.addcmul(per_head, per_head, gate, value=-1.0).view(grad.shape)  # (1 − g)·dV'
        grad_weight = grad_own.t().mm(hidden) if need_weight else None
        grad_bias = grad_own.sum(0) if bias is not None and need_bias else None
        grad_first = grad_logits = grad_gate_weight = grad_gate_bias = grad_hidden = None
        if need_first:
            grad_first = heads_view(per_head * gate, ctx.first_shape)
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


__all__ = ["ResidualValues", "ValueGate", "ValueResidual", "corrected_output", "gated_values", "mixed_values"]
