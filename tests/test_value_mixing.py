"""The fused value-residual autograd functions: float64 gradcheck, the plain-op fallback, saved tensors, bf16.

`mixed_values`, `gated_values`, `dense_values` and `corrected_output` compute the mix with fused ops (custom autograd
functions where plain autograd would keep more) that save only what attention, the projections and layer 0 keep
anyway. Each is checked here
against finite differences (`torch.autograd.gradcheck`, float64) on every code path, against the plain autograd ops
they replace, and for what they save; `test_core_model.py` checks the whole model against the independent reference.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.autograd import gradcheck
from torch.func import functional_call

from resformer_hf.remote_code.depth_weighted_average import dense_values
from resformer_hf.remote_code.value_residual import (
    ValueGate,
    corrected_output,
    gated_values,
    hand_on,
    is_plain_linear,
    mixed_values,
)

BATCH, LENGTH, HIDDEN, HEAD_DIM = 2, 5, 12, 3
F64 = {"dtype": torch.float64}


def projected(matrix: torch.Tensor, heads: int) -> torch.Tensor:
    """A [B, T, H·D] projection output seen as [B, H, T, D] values, the layout the model hands the functions."""
    return matrix.view(matrix.shape[0], matrix.shape[1], heads, -1).transpose(1, 2)


def hooked(linear: nn.Linear) -> nn.Linear:
    """The same module with a no-op forward hook: calling it is no longer plain `F.linear`, so the fallback runs."""
    linear.register_forward_hook(lambda module, args, output: output)
    assert not is_plain_linear(linear)
    return linear


def saved_storages(function, *args) -> set[int]:
    """Data pointers of every tensor autograd saves while `function(*args)` runs."""
    pointers = set()

    def pack(tensor):
        pointers.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function(*args)
    return pointers


# ---- λ_first·V_0 + λ_self·v_proj(h) ------------------------------------------------------------------------------


def mixing_case(kv_heads: int, bias: bool, learnable: bool, dtype=torch.float64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    layer = MixingLayer(kv_heads, bias, dtype)
    params = {name: torch.randn(p.shape, generator=generator).to(dtype) for name, p in layer.v_proj.named_parameters()}
    hidden = torch.randn(BATCH, LENGTH, HIDDEN, generator=generator).to(dtype)
    first = torch.randn(BATCH, LENGTH, kv_heads * HEAD_DIM, generator=generator).to(dtype)  # layer 0's v_proj output
    # (λ_first, λ_self) of receiver 1 in a [2, 3] λ table, as `ValueResidual.forward` lays it out
    table = torch.tensor([[0.3, 0.7, 0.1], [0.9, -1.3, 0.5]], dtype=torch.float32 if dtype != torch.float64 else dtype)
    return layer, params, hidden, first, table if learnable else (0.7, -1.3)


def table_pair(table: torch.Tensor, column: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A receiver's λ as `ValueResidual.per_layer` hands them on: 0-dim views of one table, through one unbind."""
    flat = table.view(-1).unbind()
    return flat[column], flat[table.shape[1] + column]


class MixingLayer(nn.Module):
    """Calls v_proj and `mixed_values` as layer 2's attention does, so `functional_call` can make W and bias inputs.
    Fixed λ: V_0 scaled once, as layer 0 hands it on (`hand_on`)."""

    def __init__(self, kv_heads: int, bias: bool, dtype=torch.float64):
        super().__init__()
        self.kv_heads = kv_heads
        self.v_proj = nn.Linear(HIDDEN, kv_heads * HEAD_DIM, bias=bias).to(dtype)

    def forward(self, hidden, first, weights):
        own = projected(self.v_proj(hidden), self.kv_heads)
        first = projected(first, self.kv_heads)
        if torch.is_tensor(weights) or isinstance(weights[0], torch.Tensor):
            lambda_first, lambda_self = table_pair(weights) if torch.is_tensor(weights) else weights
        else:
            (lambda_first, lambda_self), first = (None, weights[1]), hand_on(first, weights[0])
        return mixed_values(own, first, lambda_first, lambda_self, 0, self.v_proj, hidden)


def mix_first(layer: MixingLayer, params: dict, hidden, first, weights) -> torch.Tensor:
    params = {f"v_proj.{name}": value for name, value in params.items()}
    return functional_call(layer, params, (hidden, first, weights))


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("learnable", [False, True])
@pytest.mark.parametrize("kept", ["projection", "values"])  # v_proj's h and W, or (a hooked v_proj) V_n
def test_mixed_values_pass_gradcheck_and_match_plain_ops(kv_heads, bias, learnable, kept):
    layer, params, hidden, first, weights = mixing_case(kv_heads, bias, learnable)
    if kept == "values":
        hooked(layer.v_proj)
    names = list(params)
    inputs = [t.requires_grad_() for t in (hidden, first, *params.values(), *([weights] if learnable else []))]

    def fused(hidden, first, *rest):
        return mix_first(layer, dict(zip(names, rest)), hidden, first, rest[len(names)] if learnable else weights)

    assert gradcheck(fused, inputs)
    own = projected(torch.nn.functional.linear(hidden, *params.values()), kv_heads)
    first_weight, own_weight = (weights[0, 1], weights[1, 1]) if learnable else weights
    expected = first_weight * projected(first, kv_heads) + own_weight * own
    assert torch.allclose(fused(*inputs), expected, atol=1e-12)
    if learnable:  # λ that are not views of one table take the stacked path, with the same values and gradients
        pair = [t.detach().clone().requires_grad_() for t in (weights[0, 1], weights[1, 1])]
        mix_first(layer, dict(zip(names, params.values())), hidden, first, tuple(pair)).sum().backward()
        weights.grad = None
        fused(*inputs).sum().backward()
        assert torch.allclose(torch.stack([t.grad for t in pair]), weights.grad[:, 1], atol=1e-12)


def run_mix(layer: MixingLayer, params, hidden, first, weights, learnable: bool):
    """Output and every input gradient of `sum(out * ramp)` for fresh leaf copies of the inputs."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, first, *params.values())]
    lambdas = weights.detach().clone().requires_grad_() if learnable else weights
    out = mix_first(layer, dict(zip(params, leaves[2:])), leaves[0], leaves[1], lambdas)
    (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return [out.float()] + [t.grad.float() for t in leaves] + ([lambdas.grad[:, 1]] if learnable else [])


def test_the_mix_computes_v_projs_gradients_itself_where_it_keeps_its_input():
    """Kept projection: v_proj's own backward gets no gradient and runs no GEMM (the mix's backward computes h's and
    W's gradients, λ_self's scale on them); its gradients are still exactly v_proj's."""
    layer, params, hidden, first, weights = mixing_case(2, True, True)
    ops = []

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    leaves = [t.detach().clone().requires_grad_() for t in (hidden, first, *params.values())]
    out = mix_first(layer, dict(zip(params, leaves[2:])), leaves[0], leaves[1], weights.requires_grad_())
    with Ops():
        (out * torch.linspace(-1, 1, out.numel(), **F64).view(out.shape)).sum().backward()
    assert ops.count("mm") == 2, ops  # dV'ᵀh (W's gradient and λ_self's) and dV'·W (h's): none from v_proj itself
    hooked(layer.v_proj)
    plain = run_mix(layer, params, hidden, first, weights.detach(), learnable=True)
    for leaf, expected in zip(leaves, plain[1:]):
        assert torch.allclose(leaf.grad.float(), expected, atol=1e-6)


@pytest.mark.parametrize("learnable", [False, True])
def test_the_mix_saves_only_what_the_projections_and_layer_zero_keep(learnable):
    """With v_proj's h and W kept anyway, the mix saves h, W and V_0 (kept by the projections and layer 0); where
    v_proj reads another copy of h (here: a hook; autocast), it keeps the raw V_n λ_self's gradient needs."""
    layer, _, hidden, first, weights = mixing_case(2, False, learnable)
    hidden, first = hidden.requires_grad_(), first.requires_grad_()
    lambdas = weights.requires_grad_() if learnable else weights
    kept = {t.untyped_storage().data_ptr() for t in (hidden, first, layer.v_proj.weight,
                                                     *([lambdas] if learnable else []))}
    assert saved_storages(layer, hidden, first, lambdas) <= kept
    hooked(layer.v_proj)
    assert len(saved_storages(layer, hidden, first, lambdas) - kept) == (1 if learnable else 0)


def test_bfloat16_mix_gradients_stay_close_to_float32():
    """bf16 sanity: the fused path's gradients are as close to fp32 as the plain bf16 ops' are."""
    errors = {}
    for path in ("fused", "plain"):
        results = {}
        for dtype in (torch.float32, torch.bfloat16):
            layer, params, hidden, first, weights = mixing_case(2, True, True, dtype=dtype, seed=3)
            if path == "plain":
                hooked(layer.v_proj)
            results[dtype] = run_mix(layer, params, hidden, first, weights, learnable=True)
        errors[path] = [((low - high).norm() / high.norm()).item()
                        for low, high in zip(results[torch.bfloat16], results[torch.float32])]
    for fused, plain in zip(errors["fused"], errors["plain"]):
        assert fused < 2e-2 and fused <= 2 * plain + 2e-3, errors


@pytest.mark.parametrize("learnable", [False, True])
def test_the_mix_under_bf16_autocast_matches_plain_ops(learnable):
    """Trainer(bf16=True) on CPU trains under autocast: v_proj reads a cast of h, the mix keeps V_n."""
    results = []
    for path in ("mix", "plain"):
        layer, params, hidden, first, weights = mixing_case(2, True, learnable, dtype=torch.float32)
        if path == "plain":
            hooked(layer.v_proj)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if path == "plain":  # the mix as plain autograd ops
                layer.forward = lambda h, f, w, layer=layer: _plain_mix(layer, h, f, w)
            results.append(run_mix(layer, params, hidden, first.bfloat16(), weights, learnable=learnable))
    for fused, plain in zip(*results):
        assert torch.allclose(fused, plain, rtol=2e-2, atol=2e-2)


def _plain_mix(layer: MixingLayer, hidden, first, weights):
    own = projected(layer.v_proj(hidden), layer.kv_heads)
    lambda_first, lambda_self = table_pair(weights) if torch.is_tensor(weights) else weights
    return lambda_first * projected(first, layer.kv_heads) + lambda_self * own


# ---- gated: V_n + g·(V_0 − V_n), g = shift + σ(W_g x̂[..., :12] + b_g) per token and kv head -----------------------

GATE_HIDDEN = 16  # wider than the gate's 12 channels, so that the slice is exercised


class GatingLayer(nn.Module):
    """Calls v_proj and `gated_values` as a gated layer does, so `functional_call` can make W, W_g inputs."""

    def __init__(self, kv_heads: int, bias: bool, shift: float, dtype=torch.float64):
        super().__init__()
        self.kv_heads, self.shift = kv_heads, shift
        self.v_proj = nn.Linear(GATE_HIDDEN, kv_heads * HEAD_DIM, bias=bias).to(dtype)
        self.value_gate = ValueGate(GATE_HIDDEN, kv_heads).to(dtype)

    def forward(self, hidden, first):
        own = projected(self.v_proj(hidden), self.kv_heads)
        return gated_values(own, projected(first, self.kv_heads), self.value_gate, hidden, self.shift,
                            self.value_gate.in_features, self.v_proj)


def gating_case(kv_heads: int, bias: bool, shift: float, dtype=torch.float64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    layer = GatingLayer(kv_heads, bias, shift, dtype)
    params = {name: torch.randn(p.shape, generator=generator).to(dtype) for name, p in layer.named_parameters()}
    hidden = torch.randn(BATCH, LENGTH, GATE_HIDDEN, generator=generator).to(dtype)
    first = torch.randn(BATCH, LENGTH, kv_heads * HEAD_DIM, generator=generator).to(dtype)
    return layer, params, hidden, first


def run_gate(layer: GatingLayer, params: dict, hidden, first) -> list[torch.Tensor]:
    """Output and every input gradient of `sum(out * ramp)` for fresh leaf copies of the inputs."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, first, *params.values())]
    out = functional_call(layer, dict(zip(params, leaves[2:])), (leaves[0], leaves[1]))
    (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return [out.float()] + [t.grad.float() for t in leaves]


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shift", [0.0, -0.5])  # started at the identity's 0.5, or at 0 (`--init preserve`)
@pytest.mark.parametrize("kept", ["projection", "values"])
def test_gated_values_pass_gradcheck_and_match_the_equation(kv_heads, bias, shift, kept):
    layer, params, hidden, first = gating_case(kv_heads, bias, shift)
    if kept == "values":
        hooked(layer.v_proj)
    names = list(params)

    def fused(hidden, first, *weights):
        return functional_call(layer, dict(zip(names, weights)), (hidden, first))

    inputs = [t.requires_grad_() for t in (hidden, first, *params.values())]
    assert gradcheck(fused, inputs)
    weights = dict(zip(names, params.values()))
    own = projected(torch.nn.functional.linear(hidden, weights["v_proj.weight"], weights.get("v_proj.bias")), kv_heads)
    logits = hidden[..., :12] @ weights["value_gate.weight"].T + weights["value_gate.bias"]  # the first 12 channels
    gate = (shift + torch.sigmoid(logits)).transpose(1, 2).unsqueeze(-1)  # [B, H_kv, T, 1]
    expected = (1 - gate) * own + gate * projected(first, kv_heads)
    assert torch.allclose(fused(*inputs), expected, atol=1e-12)


def test_the_gate_saves_only_sigma_beyond_what_the_projections_and_layer_zero_keep():
    """With v_proj's h and W kept anyway: h, W, W_g, V_0 (kept by the projections and layer 0) and σ [B·T, H_kv];
    where v_proj reads another copy of h, also the raw V_n the gate's gradient needs."""
    layer, _, hidden, first = gating_case(2, False, 0.0)
    hidden, first = hidden.requires_grad_(), first.requires_grad_()
    kept = {t.untyped_storage().data_ptr() for t in (hidden, first, *layer.parameters())}
    assert len(saved_storages(layer, hidden, first) - kept) == 1  # σ, BATCH·LENGTH·H_kv numbers
    hooked(layer.v_proj)
    assert len(saved_storages(layer, hidden, first) - kept) == 2  # σ and V_n


def test_the_gate_under_bf16_autocast_matches_plain_ops():
    """Under autocast v_proj reads a cast of h and the gate keeps V_n: the same values and gradients as the lerp in
    plain autograd ops."""
    results = []
    for path in ("gate", "plain"):
        layer, params, hidden, first = gating_case(2, True, -0.5, dtype=torch.float32, seed=3)
        if path == "plain":
            layer.forward = lambda h, f, layer=layer: _plain_gate(layer, h, f)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(run_gate(layer, params, hidden, first.bfloat16()))
    for fused, plain in zip(*results):
        assert torch.allclose(fused, plain, rtol=2e-2, atol=2e-2)


def _plain_gate(layer: GatingLayer, hidden, first):
    own = projected(layer.v_proj(hidden), layer.kv_heads)
    gate = layer.shift + torch.sigmoid(layer.value_gate(hidden[..., :12]))
    return torch.lerp(own, projected(first, layer.kv_heads), gate.transpose(1, 2).unsqueeze(-1).to(own.dtype))


# ---- dense: every layer's values, one buffer -----------------------------------------------------------------------


def dense_chain(weights: torch.Tensor, *values: torch.Tensor, receivers=(1, 2, 3), foreign_stack: bool = False):
    """Run `dense_values` through len(values) layers like the model does; returns every layer's attention values."""
    stack, outputs = None, []
    last_reader = max(receivers)
    for layer, matrix in enumerate(values):
        own = projected(matrix, 2)
        if foreign_stack and stack is not None:
            stack = stack.clone()  # e.g. a pipeline-stage boundary: not a prefix of the layer's buffer
        mix, append = layer in receivers, layer < last_reader
        if mix or append:  # as the model does: a layer that does neither just attends over its own values
            own, stack = dense_values(own, stack, weights[layer], layer, last_reader, mix=mix, append=append)
        outputs.append(own)
    return torch.cat([output.reshape(-1) for output in outputs])


def dense_inputs(layers: int = 4, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(layers, layers, generator=generator, **F64).tril().requires_grad_()
    values = [torch.randn(BATCH, LENGTH, 2 * HEAD_DIM, generator=generator, **F64).requires_grad_()
              for _ in range(layers)]
    return weights, values


@pytest.mark.parametrize("receivers", [(1, 2, 3), (2, 3), (1, 2)])
@pytest.mark.parametrize("foreign_stack", [False, True])
def test_dense_values_pass_gradcheck_and_match_the_plain_sum(receivers, foreign_stack):
    weights, values = dense_inputs()
    assert gradcheck(lambda w, *v: dense_chain(w, *v, receivers=receivers, foreign_stack=foreign_stack),
                     [weights, *values])
    raw = [projected(matrix, 2) for matrix in values]
    expected = [sum(weights[n, j] * raw[j] for j in range(n + 1)) if n in receivers else raw[n] for n in range(4)]
    expected = torch.cat([e.reshape(-1) for e in expected])
    assert torch.allclose(dense_chain(weights, *values, receivers=receivers, foreign_stack=foreign_stack), expected)


def test_dense_layers_share_one_buffer_of_raw_values():
    """O(L) memory: every layer's stack is a prefix of the same storage, and only that storage is saved."""
    weights, values = dense_inputs(layers=5)
    stack, stacks, saved = None, [], set()

    def pack(tensor):
        saved.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        for layer, matrix in enumerate(values[:-1]):
            _, stack = dense_values(projected(matrix, 2), stack, weights[layer], layer, 4, mix=layer > 0, append=True)
            stacks.append(stack)
    assert len({s.untyped_storage().data_ptr() for s in stacks}) == 1
    assert [s.shape[0] for s in stacks] == [1, 2, 3, 4]
    assert saved <= {stacks[0].untyped_storage().data_ptr(), weights.untyped_storage().data_ptr()}


def test_dense_values_refuse_a_stack_that_skips_layers():
    weights, values = dense_inputs()
    with pytest.raises(RuntimeError, match=r"dense layer 2 received a stack of 1 value tensors"):
        dense_values(projected(values[2], 2), projected(values[0], 2).unsqueeze(0), weights[2], 2, 3, True, True)


# ---- NeuTRENO: o_proj(A V_n + λ(V_0 − V_n)) -----------------------------------------------------------------------


class CorrectingLayer(nn.Module):
    """Calls `corrected_output` as a NeuTRENO layer does (λ = 0.4), with its o_proj."""

    def __init__(self, groups: int, bias: bool, kv_heads: int = 2):
        super().__init__()
        self.groups, self.kv_heads = groups, kv_heads
        self.o_proj = nn.Linear(kv_heads * groups * HEAD_DIM, HIDDEN, bias=bias).double()

    def forward(self, attn_output, first, own):
        first, own = projected(first, self.kv_heads), projected(own, self.kv_heads)
        return corrected_output(attn_output, first, own, self.o_proj, 0.4, self.groups)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_corrected_output_passes_gradcheck_and_matches_plain_ops(groups, bias):
    generator = torch.Generator().manual_seed(1)
    layer = CorrectingLayer(groups, bias)
    params = {f"o_proj.{name}": torch.randn(parameter.shape, generator=generator, **F64)
              for name, parameter in layer.o_proj.named_parameters()}
    attn_output = torch.randn(BATCH, LENGTH, 2 * groups, HEAD_DIM, generator=generator, **F64)
    first, own = (torch.randn(BATCH, LENGTH, 2 * HEAD_DIM, generator=generator, **F64) for _ in range(2))
    inputs = [t.requires_grad_() for t in (attn_output, first, own, *params.values())]

    def corrected(attn_output, first, own, *weights):
        return functional_call(layer, dict(zip(params, weights)), (attn_output, first, own))

    assert gradcheck(corrected, inputs)
    # λ(V_0 − V_n), each kv head repeated for its query heads, laid out like the attention output [B, T, H_q, D]
    difference = (0.4 * (first - own)).view(BATCH, LENGTH, 2, 1, HEAD_DIM).expand(-1, -1, -1, groups, -1)
    difference = difference.reshape(BATCH, LENGTH, 2 * groups, HEAD_DIM)
    expected = torch.nn.functional.linear((attn_output + difference).reshape(BATCH, LENGTH, -1), *params.values())
    assert torch.allclose(corrected(*inputs), expected, atol=1e-12)
    plain_layer = CorrectingLayer(groups, bias)
    hooked(plain_layer.o_proj)
    assert torch.allclose(functional_call(plain_layer, params, (attn_output, first, own)), expected, atol=1e-12)


def test_corrected_output_saves_no_corrected_copy():
    """Fused: attention output, V_0, V_n and W only (attention and layer 0 keep the first three anyway)."""
    layer = CorrectingLayer(groups=2, bias=False)
    attn_output = torch.randn(BATCH, LENGTH, 4, HEAD_DIM, **F64).requires_grad_()
    first, own = (torch.randn(BATCH, LENGTH, 2 * HEAD_DIM, **F64).requires_grad_() for _ in range(2))
    kept = {t.untyped_storage().data_ptr() for t in (attn_output, first, own, layer.o_proj.weight)}
    assert saved_storages(layer, attn_output, first, own) <= kept
    hooked(layer.o_proj)
    assert len(saved_storages(layer, attn_output, first, own) - kept) == 1  # o_proj's corrected input


def test_corrected_output_under_bf16_autocast_matches_the_plain_path():
    results = []
    for path in ("fused", "plain"):
        torch.manual_seed(2)
        layer = CorrectingLayer(groups=2, bias=True).float()
        if path == "plain":
            hooked(layer.o_proj)
        attn_output = torch.randn(BATCH, LENGTH, 4, HEAD_DIM, dtype=torch.bfloat16).requires_grad_()
        first, own = (torch.randn(BATCH, LENGTH, 2 * HEAD_DIM).bfloat16().requires_grad_() for _ in range(2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(attn_output, first, own)
        out.float().sum().backward()
        grads = [t.grad.float() for t in (attn_output, first, own, layer.o_proj.weight, layer.o_proj.bias)]
        assert layer.o_proj.weight.grad.dtype == torch.float32
        results.append([out.float(), *grads])
    for fused, plain in zip(*results):
        assert torch.allclose(fused, plain, rtol=2e-2, atol=5e-2)
