"""Triton kernels for the learnable mix `λ_first·V_0 + λ_self·V_n` on CUDA, forward and backward.

Why: PyTorch runs an elementwise op with a 0-dim *CUDA* operand (each λ is a view of the λ table) in its
non-vectorised loop (a Python number would take the vectorised one, but reading λ as numbers waits for the GPU): the
largest share of `learnable_plus`'s extra training time in the GPU kernel profile (`benchmarks/results/gpu/`). These
read each λ once per program and stream the values in wide blocks: the forward mix of v_proj's output, and
the backward's two scaled gradients with λ_first's dot in one pass over dV' and V_0.

Used for contiguous CUDA tensors once checked on the device (`kernels_usable`); `value_residual._MixOwnValues`'s torch
ops are the reference and every other device's path (`tests/test_mix_kernels.py` holds the kernels to them under
`TRITON_INTERPRET=1`). Triton is optional (CUDA builds of torch bring it).
"""

import functools

import torch
from transformers.utils import logging

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path runs
    triton = None

logger = logging.get_logger(__name__)

#: Elements per program: 8 KiB of bf16 per operand, 16-byte loads across 4 warps.
BLOCK = 4096

if triton is not None:

    def _mix_forward(own_ptr, first_ptr, lambda_first_ptr, lambda_self_ptr, mixed_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        lambda_first = tl.load(lambda_first_ptr).to(tl.float32)
        lambda_self = tl.load(lambda_self_ptr).to(tl.float32)
        own = tl.load(own_ptr + offsets, mask=inside).to(tl.float32)
        first = tl.load(first_ptr + offsets, mask=inside).to(tl.float32)
        mixed = own * lambda_self + first * lambda_first
        tl.store(mixed_ptr + offsets, mixed.to(mixed_ptr.dtype.element_ty), mask=inside)

    def _mix_backward(grad_ptr, first_ptr, lambda_first_ptr, lambda_self_ptr, grad_first_ptr, grad_own_ptr,
                      partial_ptr, n, BLOCK: tl.constexpr):
        program = tl.program_id(0)
        offsets = program.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        lambda_first = tl.load(lambda_first_ptr).to(tl.float32)
        lambda_self = tl.load(lambda_self_ptr).to(tl.float32)
        grad = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        first = tl.load(first_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        tl.store(grad_first_ptr + offsets, (grad * lambda_first).to(grad_first_ptr.dtype.element_ty), mask=inside)
        tl.store(grad_own_ptr + offsets, (grad * lambda_self).to(grad_own_ptr.dtype.element_ty), mask=inside)
        tl.store(partial_ptr + program, tl.sum(grad * first, axis=0))


@functools.cache
def _kernels():
    """The kernels, compiled (or, under `TRITON_INTERPRET=1`, interpreted) on first use."""
    return triton.jit(_mix_forward), triton.jit(_mix_backward)


def kernels_usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels apply (per layer, forward and backward): Triton installed, every tensor a contiguous CUDA
    tensor of one dtype, and the kernels checked on that device (`_working`)."""
    return (triton is not None and all(t.is_cuda and t.is_contiguous() for t in tensors)
            and len({t.dtype for t in tensors}) == 1 and _working(tensors[0].device, tensors[0].dtype))


def kernels_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the mix runs as these kernels for values of `dtype` on `device` (what a benchmark reports)."""
    device = torch.device(device)
    return triton is not None and device.type == "cuda" and _working(device, dtype)


@functools.cache
def _working(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels build and agree with float32 arithmetic on `device`, checked once on first use: a Triton
    that cannot build them (or builds them wrong) costs a warning and the torch ops' speed, never a training run."""
    generator = torch.Generator(device).manual_seed(0)
    own, first = (torch.randn(3, BLOCK + 5, generator=generator, device=device).to(dtype) for _ in range(2))
    lambdas = torch.stack((torch.full((), 0.3), torch.full((), 0.8))).to(device, dtype)
    expected = own.float() * lambdas[1].float() + first.float() * lambdas[0].float()
    try:
        mixed = mix(own, first, lambdas[0], lambdas[1])
        grad_first, grad_own, dot = mix_backward(own, first, lambdas[0], lambdas[1])
    except Exception as error:  # noqa: BLE001 - any failure to build or launch means: use the torch ops
        logger.warning(f"The Triton mix kernels do not run on {device} ({error!r}); the value mix uses torch ops.")
        return False
    close = functools.partial(torch.allclose, rtol=2.0**-7, atol=1e-6)
    working = (close(mixed.float(), expected) and close(grad_first.float(), own.float() * lambdas[0].float())
               and close(grad_own.float(), own.float() * lambdas[1].float())
               and close(dot.float(), (own.float() * first.float()).sum(), rtol=1e-2, atol=1e-2))
    if not working:
        logger.warning(f"The Triton mix kernels disagree with torch on {device}; the value mix uses torch ops.")
    return working


def mix(own: torch.Tensor, first: torch.Tensor, lambda_first: torch.Tensor, lambda_self: torch.Tensor) -> torch.Tensor:
    """`λ_self·own + λ_first·first` (float32 arithmetic, one rounding) in one pass, λ 0-dim tensors."""
    n, mixed = own.numel(), torch.empty_like(own)
    _kernels()[0][(triton.cdiv(n, BLOCK),)](own, first, lambda_first, lambda_self, mixed, n, BLOCK=BLOCK)
    return mixed


def mix_backward(grad: torch.Tensor, first: torch.Tensor, lambda_first: torch.Tensor, lambda_self: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(λ_first·dV', λ_self·dV', <dV', V_0>) in one pass; the dot is summed in float32, returned in λ's dtype."""
    n = grad.numel()
    programs = triton.cdiv(n, BLOCK)
    grad_first, grad_own = torch.empty_like(grad), torch.empty_like(grad)
    partial = torch.empty(programs, dtype=torch.float32, device=grad.device)
    _kernels()[1][(programs,)](grad, first, lambda_first, lambda_self, grad_first, grad_own, partial, n, BLOCK=BLOCK)
    return grad_first, grad_own, partial.sum().to(lambda_first.dtype)
