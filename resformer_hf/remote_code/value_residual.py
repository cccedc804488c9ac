"""ResFormer's value residual: a receiving layer attends over `V' = λ_first·V_0 + λ_self·V_n`.

Here are the λ (one module for the model, one table per forward pass) and the value paths of the paper's ResFormer
variants and SVFormer: what each layer attends over and hands on to later layers. The baselines' paths are in
`neutreno.py`, `value_gate.py` and `depth_weighted_average.py`; `value_paths.py` picks a layer's path by its role.
Imports only torch, transformers and sibling files (copied for `trust_remote_code`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from .configuration_resformer import CORRECT, DENSE, FIXED, MIX_ALL, PAIR, PLAIN, REUSE, SOFTMAX, ResFormerConfig
from .mix_kernels import kernels_usable, mix_backward, mix_in_place
from .parallelism import gathered_parameters
from .projections import compute_dtype, flat_values, is_plain_linear, own_values, plain_linear_weight, token_major

# ---- the λ ----------------------------------------------------------------------------------------------------------


class LayerMix(NamedTuple):
    """One layer's λ without gradient: numbers (`readable_as_numbers`), or tensors: every receiver's λ_first as an
    [R, 1, 1, 1, 1] column (layer 0 scales V_0 for all at once) and the layer's 0-dim λ_self; `dense`'s [R, L]."""

    lambda_first: float | torch.Tensor
    lambda_self: float | torch.Tensor


def readable_as_numbers(module: nn.Module) -> bool:
    """Whether `module`'s parameters read as Python numbers for free: eager, on the CPU, not sharded."""
    if torch.compiler.is_compiling():
        return False
    return all(type(p) is nn.Parameter and p.device.type == "cpu" and not hasattr(p, "ds_id")
               for p in module._parameters.values())


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
    """Every λ of the model in one module: a softmax couples the layers, and optimisers, PEFT's `modules_to_save`
    and model cards get one name to find.

    Learnable λ are stored as offsets from the config's initial values: weight decay pulls them toward those values
    (never toward "no value residual"), and a checkpoint without them loads at exactly those values.
    """

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
        #: (the offsets read as numbers, the mixes built from them), reused while the offsets read the same
        self._numeric: tuple[tuple, tuple[LayerMix, ...]] | None = None

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

    def forward(self, gradients: bool = True) -> torch.Tensor | tuple[LayerMix, ...]:
        """The λ table in float32: [2, R], λ_first and λ_self of the R receivers (`dense`: [R, L], each receiver's
        weights on V_0 .. V_{L-1}); with `gradients=False`, one `LayerMix` per layer instead. Offsets are upcast
        before the initial values are added, so engines that hand over bf16 copies round only the small offsets."""
        if not gradients:
            return self.layer_mixes()
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

    def rows(self, table: torch.Tensor, dtype: torch.dtype) -> tuple:
        """Each layer's (λ_first, λ_self) from `forward()`'s table in the values' dtype: 0-dim views of one cast, so
        backward gathers their gradients in one op; (its row, None) for `dense`; (None, None) where fixed."""
        if not self._parameters:
            return ((None, None),) * self.num_layers
        table = table.to(dtype)
        if self.parameterisation == DENSE:
            rows = ((row, None) for row in table.unbind(0))
        else:  # flat: one unbind, whose backward is one stack
            flat = table.view(-1).unbind()
            rows = zip(flat[: table.shape[1]], flat[table.shape[1]:])
        return tuple(next(rows) if role != PLAIN else (None, None) for role in self.roles)

    def layer_mixes(self) -> tuple[LayerMix, ...]:
        """Every layer's `LayerMix` for a pass without gradient. Numbers where that is free, kept while the
        parameters read the same (every step of `generate()`): a mixing layer folds them into v_proj's GEMM and the
        pass dispatches no op for λ. Elsewhere (GPU, compiled, sharded) tensors from one table."""
        fixed = not self._parameters
        readable = fixed or (self.parameterisation != DENSE and readable_as_numbers(self))
        # Keyed by the values: a write through `.data` bumps no version counter. Reading dispatches no op.
        versions = tuple(p.tolist() for p in self._parameters.values()) if readable else None
        if readable and self._numeric is not None and self._numeric[0] == versions:
            return self._numeric[1]
        if fixed:
            mixes = self._numeric_mixes([(self.lambda_first_init, self.lambda_self_init)] * len(self.receivers))
            if not torch.compiler.is_compiling():
                self._numeric = (versions, mixes)
            return mixes
        with torch.no_grad():
            table = self.forward()
        if readable:
            self._numeric = (versions, self._numeric_mixes(list(zip(*table.tolist()))))
            return self._numeric[1]
        if self.parameterisation == DENSE:  # layer 0 starts every receiver's running mix from the whole table
            return (LayerMix(table, 1.0),) * self.num_layers
        firsts, selves = table[0].view(-1, 1, 1, 1, 1), iter(table[1].unbind())
        return tuple(LayerMix(firsts, next(selves) if role != PLAIN else 1.0) for role in self.roles)

    def _numeric_mixes(self, pairs: list) -> tuple[LayerMix, ...]:
        pairs = iter(pairs)
        mixes = [LayerMix(*next(pairs)) if role != PLAIN else LayerMix(0.0, 1.0) for role in self.roles]
        if self.receivers and self.roles[self.receivers[0]] == CORRECT:  # NeuTRENO's layer 0 scales V_0 by λ once
            mixes[0] = LayerMix(mixes[self.receivers[0]].lambda_first, 1.0)
        return tuple(mixes)

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

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # torch's `load_state_dict` (Trainer resume, PEFT, ZeRO-3) of a 0-dim λ_scale saved before it became [1].
        key = f"{prefix}lambda_scale_offset"
        if key in state_dict and state_dict[key].dim() == 0:
            state_dict[key] = state_dict[key].reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def needs_value_gradients(model: nn.Module, inputs_embeds: torch.Tensor) -> bool:
    """Whether this pass may be differentiated: autograd records and the inputs or a parameter may want a gradient."""
    if not torch.is_grad_enabled():
        return False
    return inputs_embeds.requires_grad or any(parameter.requires_grad for parameter in model.parameters())


# ---- value paths ----------------------------------------------------------------------------------------------------

#: What a layer hands on to later layers: V_0 with a gradient; without one, whatever its variant's receivers mix with
#: fastest (`FirstValues`). Only the variant's own paths read it; the decoder loop passes it on unopened.
ResidualValues = object
#: A value path's (values attention attends over [B, H_kv, T, D], residual values handed on, what project_output reads)
PathOutput = tuple[torch.Tensor, ResidualValues, object]

#: Up to this many tokens (a decode step, a speculative draft) layer 0 scales V_0 for all R receivers in one op;
#: beyond it (prefill) each receiver scales V_0 when it runs, holding one scaled copy at a time instead of R.
BATCHED_SCALING_MAX_TOKENS = 16


class ScaledPerReceiver(NamedTuple):
    """λ_first[r]·V_0 for receiver r, computed when receiver r asks for it (long inputs; see above)."""

    values: torch.Tensor  #: V_0 [B, H_kv, T, D]
    first: tuple[torch.Tensor, ...]  #: one [1, 1, 1, 1] λ_first per receiver, in the values' dtype

    def __getitem__(self, row: int) -> torch.Tensor:
        return self.values * self.first[row]


class ValuePath:
    """Llama's values, `v_proj(h)`; residual values pass through. Holds only what the config fixes for its layer: the
    modules it uses are the attention's (PEFT or tensor parallelism may replace them after construction)."""

    #: The path of layer 0 when this path's layers read V_0 (None: no other path, as for `dense`)
    first_values: type[ValuePath] | None = None

    def __init__(self, config: ResFormerConfig, layer_idx: int):
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        #: fixed λ as floats: they enter the GEMMs exact, at no op's cost
        self.fixed = None
        if config.value_residual_spec.lambdas == FIXED:
            self.fixed = (config.value_residual_lambda_first_resolved, config.value_residual_lambda_self_resolved)

    def attach(self, attention: nn.Module) -> None:
        """Add or drop the attention modules this path needs; called once, when the attention is built."""

    def __call__(self, attention: nn.Module, hidden_states: torch.Tensor, residual_values, lambda_first, lambda_self,
                 gradients: bool) -> PathOutput:
        """The layer's values from its normalised input, with its λ from `ValueResidual`: with `gradients` views of
        the λ table (the floats where fixed); without, a `LayerMix`'s two fields."""
        if gradients:
            if self.fixed:
                lambda_first, lambda_self = self.fixed
            return self.with_gradient(attention, hidden_states, residual_values, lambda_first, lambda_self)
        return self.without_gradient(attention, hidden_states, residual_values, lambda_first, lambda_self)

    def with_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> PathOutput:
        own = own_values(attention.v_proj, hidden_states, self.head_dim)
        return own, residual_values, own

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> PathOutput:
        return self.with_gradient(attention, hidden_states, residual_values, lambda_first, lambda_self)

    def project_output(self, attention, attn_output, input_shape, residual_values, own, gradients) -> torch.Tensor:
        """o_proj of the attention output ([B, T, H_q, D]; vLLM's [T, H_q·D]), as Llama does."""
        return attention.o_proj(attn_output.reshape(*input_shape, -1).contiguous())


class FirstValues(ValuePath):
    """Layer 0: attends over its own values and hands them on. With a gradient V_0 itself; without, what its
    receivers mix with fastest: the [B·T, H_kv·D] matrix its GEMM wrote (λ as numbers), or λ_first·V_0 per receiver
    (λ as tensors; scaled when asked for beyond `BATCHED_SCALING_MAX_TOKENS`)."""

    def with_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> PathOutput:
        own = own_values(attention.v_proj, hidden_states, self.head_dim)
        return own, own, own

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> PathOutput:
        if isinstance(lambda_first, float):
            flat, raw = flat_values(attention.v_proj, hidden_states, self.head_dim)
            return raw.transpose(1, 2), flat, raw
        own = own_values(attention.v_proj, hidden_states, self.head_dim)
        first = lambda_first.to(own.dtype)  # [R, 1, 1, 1, 1]
        if own.shape[-2] > BATCHED_SCALING_MAX_TOKENS:
            return own, ScaledPerReceiver(own, first.unbind(0)), own
        return own, (own * first).unbind(0), own


class MixedValues(ValuePath):
    """A receiving layer: attends over `λ_first·V_0 + λ_self·V_n`. With a gradient v_proj's GEMM and the mix are one
    fused op (`_ProjectAndMix`); without, λ as numbers fold into one `addmm` where Llama has its linear, λ as tensors
    add one `addcmul` to v_proj's output."""

    first_values = FirstValues

    def __init__(self, config: ResFormerConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.row = config.value_residual_receivers.index(layer_idx)  #: index among the receivers

    def with_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> PathOutput:
        mixed = project_and_mix(hidden_states, attention.v_proj, residual_values, (lambda_first, lambda_self),
                                self.head_dim)
        return mixed, residual_values, None

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> PathOutput:
        if not isinstance(lambda_first, float):  # λ_first·V_0 already scaled by layer 0
            own = own_values(attention.v_proj, hidden_states, self.head_dim)
            return torch.addcmul(residual_values[self.row], own, lambda_self), residual_values, None
        shape = hidden_states.shape
        weight = plain_linear_weight(attention.v_proj)
        if weight is not None:
            flat = torch.addmm(residual_values, hidden_states.reshape(-1, shape[-1]), weight.t(),
                               beta=lambda_first, alpha=lambda_self)
        else:
            flat = torch.add(attention.v_proj(hidden_states).reshape(residual_values.shape) * lambda_self,
                             residual_values, alpha=lambda_first)
        return flat.view(*shape[:-1], -1, self.head_dim).transpose(1, 2), residual_values, None


class SVFormerFirstValues(FirstValues):
    """SVFormer's layer 0: hands on V_0 itself, which later layers attend over."""

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> PathOutput:
        flat, raw = flat_values(attention.v_proj, hidden_states, self.head_dim)
        own = raw.transpose(1, 2)
        return own, own, raw


class SVFormerValues(ValuePath):
    """SVFormer's receiving layer: no v_proj; attends over V_0 itself."""

    first_values = SVFormerFirstValues

    def attach(self, attention: nn.Module) -> None:
        attention.v_proj = None

    def with_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> PathOutput:
        return residual_values, residual_values, None


# ---- the training mix -----------------------------------------------------------------------------------------------

#: A layer's (λ_first, λ_self): floats when fixed, else 0-dim views of the λ table in the values' dtype.
Lambdas = tuple[float, float] | tuple[torch.Tensor, torch.Tensor]


def mix_values(own: torch.Tensor, first: torch.Tensor, lambdas: Lambdas) -> torch.Tensor:
    """`λ_first·V_0 + λ_self·V_n` in plain ops: the reference, and the path of a v_proj that is not plain."""
    first_weight, own_weight = lambdas
    return own * own_weight + first * first_weight


class _ProjectAndMix(torch.autograd.Function):
    """`V' = λ_first·V_0 + λ_self·(h Wᵀ + b)`: v_proj's GEMM and the mix as one op, keeping nothing Llama does not.

    Saves h (q_proj and k_proj keep it), W, V_0 (layer 0's attention keeps it) and λ. λ_self's gradient `<dV', V_n>`
    needs the V_n nothing keeps, but equals `<dV'ᵀh, W> + <Σ_t dV', b>`, and `dV'ᵀh` is the weight gradient's own
    product: exact, for one weight-sized dot. On CUDA the learnable mix runs as Triton kernels (`mix_kernels.py`).
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
        if need_first:
            batch, heads, length, dim = ctx.first_shape
            grad_first = grad_first.view(batch, length, heads, dim).transpose(1, 2)
        return (grad_hidden, grad_weight, grad_bias, grad_first if need_first else None, grad_first_weight,
                grad_own_weight)


def _column(first_weight: torch.Tensor, own_weight: torch.Tensor) -> torch.Tensor:
    """(λ_first, λ_self) as [2, 1, 1]: a view where both are views of one λ table (`ValueResidual.rows`), else
    stacked."""
    step = own_weight.storage_offset() - first_weight.storage_offset()
    if step and own_weight.untyped_storage().data_ptr() == first_weight.untyped_storage().data_ptr():
        return first_weight.as_strided((2, 1, 1), (step, 0, 0))
    return torch.stack((first_weight, own_weight)).view(2, 1, 1)


def project_and_mix(hidden_states: torch.Tensor, v_proj: nn.Module, first: torch.Tensor, lambdas: Lambdas,
                    head_dim: int) -> torch.Tensor:
    """`λ_first·V_0 + λ_self·v_proj(h)`, [B, H_kv, T, D]. Compiled: `h (λ_self·W)ᵀ + λ_first·V_0` in plain ops, which
    keep no V_n for the partitioner to save (the fused op would keep h, which a compiled Llama recomputes)."""
    shape = (*hidden_states.shape[:-1], -1, head_dim)
    if not is_plain_linear(v_proj):
        return mix_values(v_proj(hidden_states).view(shape).transpose(1, 2), first, lambdas)
    if torch.compiler.is_compiling():
        first_weight, own_weight = lambdas
        bias = None if v_proj.bias is None else v_proj.bias * own_weight
        own = F.linear(hidden_states, v_proj.weight * own_weight, bias).view(shape).transpose(1, 2)
        return own + first * first_weight
    dtype = compute_dtype(hidden_states)
    if torch.is_tensor(lambdas[0]) and lambdas[0].dtype != dtype:
        lambdas = (lambdas[0].to(dtype), lambdas[1].to(dtype))
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    mixed = _ProjectAndMix.apply(hidden, v_proj.weight, v_proj.bias, first, *lambdas)
    return mixed.view(shape).transpose(1, 2)
