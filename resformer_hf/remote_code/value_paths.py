"""What each attention layer does with values: one value path per layer, chosen once from the layer's role.

As transformers picks a layer's attention function from `ALL_ATTENTION_FUNCTIONS` by name, a ResFormer attention
layer gets its value path from `VALUE_PATHS` by the role its config gives it (`VARIANTS` in
`configuration_resformer.py`). A path says which values the layer attends over (before the KV cache update), what it
hands on to later layers, and (NeuTRENO) what it adds to the attention output, in both kinds of forward pass:

- with a gradient, through the fused functions of `value_mixing.py`, which keep training memory at Llama's;
- without one (decoding, evaluation, serving), on v_proj's output, with the per-layer `LayerMix` of
  `ValueResidual(gradients=False)`: λ as Python numbers where they read for free (the mix then folds into v_proj's
  GEMM), else as tensors.

A variant is one path class here plus its `VARIANTS` entry. Imports only torch, transformers and sibling files
(copied for `trust_remote_code`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from .configuration_resformer import CORRECT, FIXED, GATE, MIX, MIX_ALL, PLAIN, REUSE, ResFormerConfig
from .depth_weighted_average import dense_values
from .value_mixing import (
    ValueGate,
    corrected_output_projection,
    gated_values,
    is_plain_linear,
    plain_linear_weight,
    project_and_gate,
    project_and_mix,
)

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


def needs_value_gradients(model: nn.Module, inputs_embeds: torch.Tensor) -> bool:
    """Whether this forward pass may be differentiated, so the fused training mix (`value_mixing.py`) must run.

    True when autograd is recording and anything the mix depends on can want a gradient: the input embeddings or any
    parameter of the model (LoRA adapters included). `torch.no_grad()`, `generate()` and frozen models take the
    value paths' mix without gradient (`value_paths.py`), which computes the same values with Llama's ops plus one
    per mixing layer.
    """
    if not torch.is_grad_enabled():
        return False
    return inputs_embeds.requires_grad or any(parameter.requires_grad for parameter in model.parameters())


#: (values attention attends over [B, H_kv, T, D], residual values for later layers, what `project_output` reads)
ValueStep = tuple[torch.Tensor, object, object]


def _own_values(v_proj: nn.Module, hidden_states: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`v_proj(h)` as [B, H_kv, T, D], as Llama computes it (a plain `nn.Linear` applied as its `F.linear`)."""
    weight = plain_linear_weight(v_proj)
    raw = v_proj(hidden_states) if weight is None else F.linear(hidden_states, weight)
    return raw.view(*hidden_states.shape[:-1], -1, head_dim).transpose(1, 2)


def _flat_values(v_proj: nn.Module, hidden_states: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """v_proj's output as the [B·T, H_kv·D] matrix its GEMM writes, and that matrix seen as [B, T, H_kv, D].

    A plain `nn.Linear` is applied as its GEMM on the [B·T, hidden] matrix (what `F.linear` does inside); anything
    else (LoRA, quantised, hooked) is called.
    """
    shape = hidden_states.shape
    weight = plain_linear_weight(v_proj)
    if weight is not None:
        flat = F.linear(hidden_states.reshape(-1, shape[-1]), weight)
    else:
        out = v_proj(hidden_states)
        flat = out.reshape(-1, out.shape[-1])
    return flat, flat.view(*shape[:-1], -1, head_dim)


class ValuePath:
    """Llama's values: the layer's own `v_proj(h)`, with or without gradient; residual values pass through.

    The path of every layer that neither hands values on nor receives any, and the base of the others. A path holds
    only what the config fixes for its layer; the modules it uses are the attention's (PEFT or tensor parallelism may
    replace them after construction).
    """

    #: The path of layer 0 when this path's layers read V_0 (None: no other path, as for `dense`)
    first_values: type[ValuePath] | None = None

    def __init__(self, config: ResFormerConfig, layer_idx: int):
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        #: (λ_first, λ_self) as floats when the variant's λ are fixed: they enter the GEMMs exact, at no op's cost
        self.fixed = None
        if config.value_residual_spec.lambdas == FIXED:
            self.fixed = (config.value_residual_lambda_first_resolved, config.value_residual_lambda_self_resolved)

    def attach(self, attention: nn.Module) -> None:
        """Add or drop the attention modules this path needs; called once, when the attention is built."""

    def __call__(self, attention: nn.Module, hidden_states: torch.Tensor, residual_values, lambda_first, lambda_self,
                 gradients: bool) -> ValueStep:
        """The layer's values from its normalised input, with its λ from `ValueResidual`: with `gradients` 0-dim views
        of the λ table (`dense`: its row of weights), replaced by the floats where λ are fixed; without, a
        `LayerMix`'s two fields."""
        if gradients:
            if self.fixed:
                lambda_first, lambda_self = self.fixed
            return self.with_gradient(attention, hidden_states, residual_values, lambda_first, lambda_self)
        return self.without_gradient(attention, hidden_states, residual_values, lambda_first, lambda_self)

    def with_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        own = _own_values(attention.v_proj, hidden_states, self.head_dim)
        return own, residual_values, own

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        return self.with_gradient(attention, hidden_states, residual_values, lambda_first, lambda_self)

    def project_output(self, attention: nn.Module, attn_output: torch.Tensor, input_shape, residual_values, own_values,
                       gradients: bool) -> torch.Tensor:
        """o_proj of the attention output ([B, T, H_q, D]; vLLM's [T, H_q·D]), as Llama does."""
        return attention.o_proj(attn_output.reshape(*input_shape, -1).contiguous())


# ---- layer 0: the values later layers read ---------------------------------------------------------------------


class FirstValues(ValuePath):
    """Layer 0 of a variant whose later layers mix in V_0: attends over its own values and hands them on.

    With a gradient it hands on V_0 itself ([B, H_kv, T, D]); without one, whatever its receivers mix
    with fastest: the [B·T, H_kv·D] matrix layer 0's GEMM wrote (λ as numbers, folded into each receiver's GEMM), or
    λ_first·V_0 per receiver (learnable λ as tensors; scaled when asked for beyond `BATCHED_SCALING_MAX_TOKENS`).
    """

    def with_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        own = _own_values(attention.v_proj, hidden_states, self.head_dim)
        return own, own, own

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        if isinstance(lambda_first, float):
            flat, raw = _flat_values(attention.v_proj, hidden_states, self.head_dim)
            return raw.transpose(1, 2), flat, raw
        own = _own_values(attention.v_proj, hidden_states, self.head_dim)
        first = lambda_first.to(own.dtype)  # [R, 1, 1, 1, 1]: λ cast to the values' dtype
        if own.shape[-2] > BATCHED_SCALING_MAX_TOKENS:
            return own, ScaledPerReceiver(own, first.unbind(0)), own
        return own, (own * first).unbind(0), own


class SVFormerFirstValues(FirstValues):
    """Layer 0 of SVFormer: hands on V_0 itself ([B, H_kv, T, D] without gradient), which later layers attend over."""

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        flat, raw = _flat_values(attention.v_proj, hidden_states, self.head_dim)
        own = raw.transpose(1, 2)
        return own, own, raw


class NeutrenoFirstValues(FirstValues):
    """Layer 0 of NeuTRENO: without gradient hands on λ·V_0 as [B, T, H_kv, D], the layout of the correction."""

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        flat, raw = _flat_values(attention.v_proj, hidden_states, self.head_dim)
        return raw.transpose(1, 2), raw * lambda_first, raw


# ---- receivers ---------------------------------------------------------------------------------------------------


class MixedValues(ValuePath):
    """ResFormer's receiving layer: attends over `λ_first·V_0 + λ_self·V_n`.

    With a gradient, v_proj's GEMM and the mix are one fused function that keeps nothing beyond Llama's activations
    (`project_and_mix`). Without one, with λ as numbers, one GEMM: `addmm(V_0, h, Wᵀ, beta=λ_first,
    alpha=λ_self)`, where Llama has its linear; with λ as tensors, v_proj as Llama and one `addcmul` on its output.
    """

    first_values = FirstValues

    def __init__(self, config: ResFormerConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.row = config.value_residual_receivers.index(layer_idx)  #: index among the receivers

    def with_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        mixed = project_and_mix(hidden_states, attention.v_proj, residual_values, (lambda_first, lambda_self),
                                self.head_dim)
        return mixed, residual_values, None

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        if not isinstance(lambda_first, float):  # learnable λ as tensors: λ_self a 0-dim tensor, λ_first·V_0 scaled
            own = _own_values(attention.v_proj, hidden_states, self.head_dim)
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


class SVFormerValues(ValuePath):
    """SVFormer's receiving layer: no v_proj; attends over layer 0's values V_0 themselves."""

    first_values = SVFormerFirstValues

    def attach(self, attention: nn.Module) -> None:
        attention.v_proj = None

    def with_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        return residual_values, residual_values, None

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        return residual_values, residual_values, None


class NeutrenoValues(ValuePath):
    """NeuTRENO's receiving layer: attends over V_n, then adds `λ(V_0 − V_n)` to the attention output before o_proj.

    With a gradient through a fused o_proj that recomputes the corrected input in backward instead of keeping it;
    without one from λ·V_0 and the raw values, both [B, T, H_kv, D]: one op beyond Llama's with one query head per kv
    head (the sum replaces Llama's reshape copy before o_proj).
    """

    first_values = NeutrenoFirstValues

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        flat, raw = _flat_values(attention.v_proj, hidden_states, self.head_dim)
        return raw.transpose(1, 2), residual_values, raw

    def project_output(self, attention, attn_output, input_shape, residual_values, own_values,
                       gradients) -> torch.Tensor:
        groups, lam = attention.num_key_value_groups, self.fixed[0]
        if gradients:
            return corrected_output_projection(attn_output.reshape(*input_shape, -1, self.head_dim), residual_values,
                                               own_values, attention.o_proj, lam, groups)
        correction = torch.sub(residual_values, own_values, alpha=lam)  # [B, T, H_kv, D], λ·V_0 from layer 0
        if groups == 1 and attn_output.dim() == correction.dim():
            # The contiguous correction first: the sum is laid out like it, replacing Llama's reshape copy.
            return attention.o_proj(torch.add(correction, attn_output).reshape(*input_shape, -1))
        grouped = attn_output.reshape(*input_shape, -1, groups, self.head_dim)
        corrected = grouped + correction.reshape(*input_shape, grouped.shape[-3], 1, self.head_dim)
        return attention.o_proj(corrected.reshape(*input_shape, -1))


class DenseValues(ValuePath):
    """`dense`: a layer whose raw values later layers read appends them to the stack; a receiving layer attends over
    `Σ_{j<n} W[n, j]·V_j + W[n, n]·V_n`. The path of layer 0, of every layer up to the last receiver, and of receivers.

    With a gradient the raw values are kept once, in one buffer shared by all layers (`dense_values`). Without one,
    layer 0 starts one running mix `Σ_j W[r, j]·V_j` per receiver r, which each later layer updates in place with its
    own values; a receiver then adds its own λ_self·V_n (`dense`'s λ are always tensors).
    """

    def __init__(self, config: ResFormerConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        receivers = config.value_residual_receivers
        self.mixes = config.value_residual_layer_roles[layer_idx] == MIX_ALL
        self.rows = max(receivers, default=0)  #: rows of the value buffer: one per layer up to the last reader
        self.appends = layer_idx < self.rows
        self.row = receivers.index(layer_idx) if self.mixes else -1

    def with_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        own = _own_values(attention.v_proj, hidden_states, self.head_dim)
        values, residual_values = dense_values(own, residual_values, lambda_first, self.layer_idx, self.rows,
                                               mix=self.mixes, append=self.appends)
        return values, residual_values, own

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        own = _own_values(attention.v_proj, hidden_states, self.head_dim)
        if self.layer_idx == 0:  # one running mix per receiver, from the whole [R, L] table
            columns = lambda_first.to(own.dtype).view(*lambda_first.shape, 1, 1, 1, 1).unbind(1)
            return own, (own * columns[0], columns), own
        mixes, columns = residual_values
        mixes = mixes.addcmul_(columns[self.layer_idx], own)  # made by layer 0 in this pass: in place keeps one copy
        return (mixes[self.row] if self.mixes else own), (mixes, columns), own


class GatedFirstValues(FirstValues):
    """Layer 0 of `"gated"`: without gradient hands on V_0 as [B, T, H_kv, D], the layout its receivers lerp in."""

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        flat, raw = _flat_values(attention.v_proj, hidden_states, self.head_dim)
        return raw.transpose(1, 2), raw, raw


class GatedValues(ValuePath):
    """`"gated"`'s receiving layer: attends over `V_n + g·(V_0 − V_n)`, with `g = g0 − 0.5 + σ(W_g h + b_g)` computed
    for each token and kv head by its `value_gate` (`ValueGate` says why this form).

    With a gradient the projection and the lerp are one fused function that keeps only σ ([B·T, H_kv]) beyond
    Llama's activations (`project_and_gate`). Without one, beyond Llama's ops: the gate's GEMM (`t`, `addmm`), its
    sigmoid, a view of it and the lerp, with V_n's GEMM on the [B·T, hidden] matrix (one op fewer than Llama's
    linear); a gate started elsewhere than 0.5 (`g0 ≠ 0.5`, e.g. `--init preserve`) adds the shift.
    """

    first_values = GatedFirstValues

    def __init__(self, config: ResFormerConfig, layer_idx: int):
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

    def with_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        v_proj, gate = attention.v_proj, attention.value_gate
        if torch.compiler.is_compiling() or not (is_plain_linear(v_proj) and is_plain_linear(gate, ValueGate)):
            # Compiled: plain ops keep V_n for the gate's gradient, less than the h the fused function keeps, which a
            # compiled Llama recomputes instead (see `value_mixing.project_and_mix`).
            own = _own_values(v_proj, hidden_states, self.head_dim)
            logits = gate(hidden_states.to(gate.weight.dtype))
            return gated_values(own, residual_values, logits, self.shift), residual_values, None
        mixed = project_and_gate(hidden_states, v_proj, gate, residual_values, self.shift, self.head_dim)
        return mixed, residual_values, None

    def without_gradient(self, attention, hidden_states, residual_values, lambda_first, lambda_self) -> ValueStep:
        shape = hidden_states.shape
        flat_hidden = hidden_states.reshape(-1, shape[-1])
        weight, gate = plain_linear_weight(attention.v_proj), attention.value_gate
        own = attention.v_proj(hidden_states) if weight is None else F.linear(flat_hidden, weight)
        if is_plain_linear(gate, ValueGate):  # in the values' dtype (the gate is kept float32, as the λ are)
            logits = torch.addmm(gate.bias.to(own.dtype), flat_hidden, gate.weight.to(own.dtype).t())
        else:  # hooked, sharded or wrapped (PEFT): called, in its own dtype
            logits = gate(flat_hidden.to(gate.weight.dtype)).to(own.dtype)
        gated = torch.sigmoid(logits)
        if self.shift:
            gated = gated.add_(self.shift)
        own = own.view(*shape[:-1], -1, self.head_dim)
        mixed = torch.lerp(own, residual_values, gated.view(*shape[:-1], -1, 1))
        return mixed.transpose(1, 2), residual_values, None


#: The path of a receiving layer, by role: what `ResFormerAttention` looks up, as transformers looks up attention
#: functions. Each receiving path names the path of layer 0 that feeds it (`first_values`).
VALUE_PATHS: dict[str, type[ValuePath]] = {
    PLAIN: ValuePath,
    MIX: MixedValues,
    MIX_ALL: DenseValues,
    REUSE: SVFormerValues,
    CORRECT: NeutrenoValues,
    GATE: GatedValues,
}


def value_path_for(config: ResFormerConfig, layer_idx: int) -> ValuePath:
    """The value path of layer `layer_idx`: its role's when it receives; when a later layer reads its values, the
    path that hands them on (layer 0: its receivers' `first_values`; `dense`: the receiving path itself); else
    Llama's."""
    receiving = VALUE_PATHS[config.value_residual_spec.role]
    if config.value_residual_layer_roles[layer_idx] != PLAIN:
        return receiving(config, layer_idx)
    if layer_idx in config.value_residual_sources and layer_idx < max(config.value_residual_receivers, default=0):
        source = receiving.first_values if layer_idx == 0 and receiving.first_values else receiving
        return source(config, layer_idx)
    return ValuePath(config, layer_idx)


__all__ = ["VALUE_PATHS", "ValuePath", "value_path_for"]
