"""Triton kernels for the learnable mix `λ_first·V_0 + λ_self·V_n` on CUDA, forward and backward.

Why: PyTorch runs an elementwise op whose operand is a 0-dim *CUDA* tensor (each λ is a view of the λ table) in its
non-vectorised loop, the scalar broadcast with stride 0 (a Python number takes the vectorised path, but reading λ as
numbers would wait for the GPU every step). On an H200 that loop was 1.35 of the 1.9 ms `learnable_plus` added to a
72 ms training step. These kernels read each λ once per program and stream the values in wide blocks: the forward mix
in place on v_proj's output (one pass, where `mul_` + `addcmul_` made two), the backward's two scaled gradients and
λ_first's dot in one pass over dV' and V_0 (where a broadcast multiply and a dot made two).

Used for contiguous CUDA tensors only (`kernels_usable`); `value_mixing._ProjectAndMix`'s torch ops are the reference and
every other device's path, and `tests/test_mix_kernels.py` holds these to them on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1`). Triton is optional (CUDA builds of torch bring it): without it the torch ops run.
"""

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path runs
    triton = None

#: Elements per program: 8 KiB of bf16 per operand, 16-byte loads across 4 warps.
BLOCK = 4096

if triton is not None:

    def _mix_forward(own_ptr, first_ptr, lambda_first_ptr, lambda_self_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        lambda_first = tl.load(lambda_first_ptr).to(tl.float32)
        lambda_self = tl.load(lambda_self_ptr).to(tl.float32)
        own = tl.load(own_ptr + offsets, mask=inside).to(tl.float32)
        first = tl.load(first_ptr + offsets, mask=inside).to(tl.float32)
        mixed = own * lambda_self + first * lambda_first
        tl.store(own_ptr + offsets, mixed.to(own_ptr.dtype.element_ty), mask=inside)

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
    """Whether the kernels apply: Triton installed, and every tensor a contiguous CUDA tensor of one dtype."""
    return (triton is not None and all(t.is_cuda and t.is_contiguous() for t in tensors)
            and len({t.dtype for t in tensors}) == 1)


def mix_in_place(own: torch.Tensor, first: torch.Tensor, lambda_first: torch.Tensor, lambda_self: torch.Tensor
         ) -> torch.Tensor:
    """`own ← λ_self·own + λ_first·first` in place (float32 arithmetic, one rounding), λ 0-dim tensors."""
    n = own.numel()
    _kernels()[0][(triton.cdiv(n, BLOCK),)](own, first, lambda_first, lambda_self, n, BLOCK=BLOCK)
    return own


def mix_backward(grad: torch.Tensor, first: torch.Tensor, lambda_first: torch.Tensor, lambda_self: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(λ_first·dV', λ_self·dV', <dV', V_0>) in one pass; the dot is summed in float32, returned in λ's dtype."""
    n = grad.numel()
    programs = triton.cdiv(n, BLOCK)
    grad_first, grad_own = torch.empty_like(grad), torch.empty_like(grad)
    partial = torch.empty(programs, dtype=torch.float32, device=grad.device)
    _kernels()[1][(programs,)](grad, first, lambda_first, lambda_self, grad_first, grad_own, partial, n, BLOCK=BLOCK)
    return grad_first, grad_own, partial.sum().to(lambda_first.dtype)
