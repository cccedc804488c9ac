"""The Triton mix kernels (`remote_code/mix_kernels.py`) against float32 arithmetic and against the torch ops of
`_MixOwnValues` they replace on CUDA, run on the CPU by Triton's interpreter (`TRITON_INTERPRET=1`).

Sizes are not multiples of the kernels' block, so a wrong mask or a block that is never written shows; λ are views of
one table with a storage offset, as `ValueResidual.per_layer` hands them to each layer.
"""

from __future__ import annotations

import os

import pytest
import torch

from resformer_hf.remote_code import mix_kernels, value_residual
from resformer_hf.remote_code.value_residual import _MixOwnValues, token_major

pytest.importorskip("triton")

#: One bf16 unit in the last place, relative: the GPU rounds to nearest (half of it), the interpreter truncates.
ROUNDING = 2.0**-7


@pytest.fixture
def interpreted(monkeypatch):
    """The kernels made anew in Triton's interpreter (`conftest.py` sets it before triton is imported) and `usable`
    true for contiguous CPU tensors."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not 1: these run the kernels on CPU tensors")
    mix_kernels._kernels.cache_clear()
    monkeypatch.setattr(value_residual, "kernels_usable", lambda *tensors: all(t.is_contiguous() for t in tensors))
    yield
    mix_kernels._kernels.cache_clear()


def lambda_pair(dtype=torch.bfloat16):
    """λ_first, λ_self as 0-dim views of one [2, R] table, at a storage offset (receiver 2 of 3)."""
    table = torch.tensor([[0.3, -0.7, 0.45], [1.2, 0.8, 0.55]]).to(dtype)
    rows = table.reshape(-1).unbind()
    return rows[2], rows[5]


def values(*shape, seed=0, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def within_one_rounding(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool(((actual.float() - expected).abs() <= expected.abs() * ROUNDING + 1e-30).all())


@pytest.mark.parametrize("shape", [(3, 5), (37, 300)])
def test_forward_mix_is_the_float32_mix_rounded_to_bf16(interpreted, shape):
    own, first = values(*shape), values(*shape, seed=1)
    lambda_first, lambda_self = lambda_pair()
    expected = own.float() * lambda_self.float() + first.float() * lambda_first.float()
    mixed = mix_kernels.mix(own, first, lambda_first, lambda_self)
    assert within_one_rounding(mixed, expected) and not own.equal(mixed)


@pytest.mark.parametrize("shape", [(3, 5), (37, 300)])
def test_backward_gives_both_scaled_gradients_and_lambda_firsts_dot(interpreted, shape):
    grad, first = values(*shape), values(*shape, seed=1)
    lambda_first, lambda_self = lambda_pair()
    grad_first, grad_own, dot = mix_kernels.mix_backward(grad, first, lambda_first, lambda_self)
    assert within_one_rounding(grad_first, grad.float() * lambda_first.float())
    assert within_one_rounding(grad_own, grad.float() * lambda_self.float())
    expected_dot = torch.dot(grad.double().reshape(-1), first.double().reshape(-1))
    assert dot.dtype == lambda_first.dtype
    assert abs(dot.double() - expected_dot) <= abs(expected_dot) * ROUNDING + 1e-3 * shape[0] * shape[1] ** 0.5


def test_the_mix_through_the_kernels_matches_the_torch_ops(interpreted, monkeypatch):
    """v_proj and the mix, forward and every gradient (h, W, V_0, both λ), in bf16 with the kernels and with the torch
    ops, each against the torch ops in float64: the kernels' error at most the torch ops' (which round twice in the
    forward), both at bf16's."""
    f64 = dict(dtype=torch.float64)
    inputs = dict(hidden=values(2 * 7, 24, seed=2, **f64), weight=values(16, 24, seed=3, **f64),
                  first=values(2, 2, 7, 8, seed=4, **f64),  # [B, H_kv, T, D]
                  table=torch.tensor([[0.3, -0.7], [1.2, 0.8]], dtype=torch.float64))
    upstream = values(2 * 7, 16, seed=5, dtype=torch.float64)

    def run(dtype):
        leaves = {name: tensor.to(dtype).requires_grad_() for name, tensor in inputs.items()}
        flat = leaves["table"].reshape(-1).unbind()
        # V_0 as layer 0 hands it on: [B, H_kv, T, D], a view of token-major storage
        first = leaves["first"].transpose(1, 2).reshape(14, 16).view(2, 7, 2, 8).transpose(1, 2)
        own = torch.nn.functional.linear(leaves["hidden"], leaves["weight"])  # v_proj, as the attention calls it
        projection = (leaves["hidden"], leaves["weight"], None)
        mixed = _MixOwnValues.apply(own, token_major(first), flat[1], flat[3], *projection)
        return (mixed, *torch.autograd.grad(mixed, tuple(leaves.values()), upstream.to(dtype)))

    kernels = run(torch.bfloat16)
    monkeypatch.setattr(value_residual, "kernels_usable", lambda *tensors: False)
    plain, reference = run(torch.bfloat16), run(torch.float64)
    for name, with_kernels, with_ops, exact in zip(("mix", *inputs), kernels, plain, reference):
        error = ((with_kernels.double() - exact).norm() / exact.norm()).item()
        ops_error = ((with_ops.double() - exact).norm() / exact.norm()).item()
        assert error <= max(ops_error, ROUNDING) * 1.5, (name, error, ops_error)


def test_the_kernels_are_not_used_off_cuda_or_on_strided_tensors():
    contiguous = torch.ones(4, 4)
    assert not mix_kernels.kernels_usable(contiguous, contiguous)  # CPU tensors take the torch ops
    if mix_kernels.triton is not None and torch.cuda.is_available():
        cuda = contiguous.cuda()
        assert mix_kernels.kernels_usable(cuda, cuda) and not mix_kernels.kernels_usable(cuda.t()[:, :2], cuda)


@pytest.mark.parametrize("variant", ["learnable", "learnable_plus"])
def test_a_training_step_through_the_kernels_gives_the_torch_ops_gradients(interpreted, monkeypatch, variant):
    """A bf16-autocast training step of a whole model, λ as the views `ValueResidual.per_layer` hands each layer.
    The λ are compared as the table's gradient, each layer's (dλ_first, dλ_self): what the kernels compute. The
    parameters behind it (learnable_plus: softmax logits, scale) add torch's own Jacobian, whose cancellation turns
    both paths' bf16 roundings into ~3 % either way (seed 0), so they are compared only as non-zero."""
    from helpers import model_with_random_lambdas, tiny_config

    model = model_with_random_lambdas(tiny_config(variant))
    input_ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))

    def gradients():
        model.zero_grad(set_to_none=True)
        table = {}
        def keep(module, args, output):
            output.register_hook(lambda grad: table.update(grad=grad.clone()))

        hook = model.model.value_residual.register_forward_hook(keep)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids, labels=input_ids, use_cache=False).loss.backward()
        hook.remove()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return {"lambda table": table["grad"], **grads}

    calls = []
    usable = value_residual.kernels_usable
    monkeypatch.setattr(value_residual, "kernels_usable", lambda *tensors: calls.append(usable(*tensors)) or calls[-1])
    with_kernels = gradients()
    assert any(calls)  # forward and backward ran through the kernels
    monkeypatch.setattr(value_residual, "kernels_usable", lambda *tensors: False)
    with_ops = gradients()
    lambda_names = [name for name in with_ops if "value_residual" in name]
    for name, grad in with_ops.items():
        if name not in lambda_names:
            error = ((with_kernels[name] - grad).norm() / grad.norm()).item()
            assert error <= 1.5e-2, (name, error)  # measured ≤ 1.0 %; dλ_first 10 % high in every layer: 2.5–4.5 %
    assert lambda_names and all(with_kernels[name].abs().sum() > 0 for name in lambda_names)


def test_kernels_that_disagree_with_torch_on_a_device_are_not_used(interpreted, monkeypatch):
    """The first use on a device checks the kernels against float32 arithmetic: a Triton that builds them wrong (or not
    at all) leaves the torch ops in place, with a warning, instead of training on wrong values."""
    mix_kernels._working.cache_clear()
    assert mix_kernels._working(torch.device("cpu"), torch.bfloat16)
    mix_kernels._working.cache_clear()
    real = mix_kernels.mix  # built wrong: λ_first and λ_self swapped
    monkeypatch.setattr(mix_kernels, "mix", lambda own, first, lf, ls: real(own, first, ls, lf))
    assert not mix_kernels._working(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(mix_kernels, "mix_backward", lambda *args: 1 / 0)
    mix_kernels._working.cache_clear()
    assert not mix_kernels._working(torch.device("cpu"), torch.bfloat16)
    mix_kernels._working.cache_clear()
