"""Weighted sums over depth: `dense`'s values `Σ_j W[n, j]·V_j`, and DenseFormer's depth-weighted average of block
outputs (Pagliardini et al., 2024), a baseline of the paper: after block i the next block reads
`Σ_j α[i, j]·X_j` over the embeddings and block outputs so far (dilation k: `j ≡ i mod k`). Both keep the earlier
tensors once, in one buffer each sum reads with one matrix-vector product. α are offsets from the identity, like the
λ: a fresh model is exactly Llama. Imports only torch and sibling files (copied for `trust_remote_code`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from .lambdas import ExactBuffers
from .value_residual import heads_view, token_major

# ---- one buffer of earlier tensors, one matrix-vector product a layer -----------------------------------------------


def _row_strides(shape: torch.Size) -> tuple[int, ...]:
    """Strides of a [rows, B, H, T, D] stack with token-major rows, laid out as a projection writes them."""
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
    """`stack` with `values` appended as its next row, in one buffer of `capacity` rows shared across layers: a view
    with a version counter of its own (`.data`), so writing row n leaves what autograd saved of earlier prefixes
    valid (those rows never change). Any other stack is copied into a fresh buffer."""
    rows = 0 if stack is None else stack.shape[0]
    shape = torch.Size((rows + 1, *values.shape))
    if stack is not None and _is_our_stack_with_room(stack, values, capacity):
        grown = stack.data.as_strided(shape, _row_strides(shape))
    else:
        size = torch.Size((capacity, *values.shape))
        grown = torch.empty_strided(size, _row_strides(size), dtype=values.dtype, device=values.device)[: rows + 1]
        if stack is not None:
            grown[:rows].copy_(stack)
    grown[rows].copy_(values)
    return grown


def _alias(stack: torch.Tensor, row: int, shape: torch.Size) -> torch.Tensor:
    """Row `row` of a stack as a tensor of its own (`.data`: not an autograd view of the stack)."""
    strides = _row_strides(stack.shape)
    return stack.data.as_strided(shape, strides[1:], stack.storage_offset() + row * strides[0])


def _rows(stack: torch.Tensor) -> torch.Tensor:
    """A stack as a [rows, B·T·H·D] matrix of token-major rows (a view for stacks made by `_stack_with_row`)."""
    return stack.transpose(2, 3).reshape(stack.shape[0], -1)


def _in_their_dtype(function):
    """Runs `function` with autocast off: CUDA's autocast would run mv, addmv, mm and addmm in bf16 and round
    DenseFormer's float32 residual stream."""

    @functools.wraps(function)
    def wrapper(*args):
        device = next((arg.device.type for arg in args if isinstance(arg, torch.Tensor)), None)
        if device is None or not torch.is_autocast_enabled(device):
            return function(*args)
        with torch.autocast(device, enabled=False):
            return function(*args)

    return wrapper


@_in_their_dtype
def _dense_forward(own, stack, weights, layer_idx, capacity, mix, append):
    """`_DenseValues`'s forward, in their dtype (`_in_their_dtype`)."""
    rows = 0 if stack is None else stack.shape[0]
    if rows != layer_idx:
        raise RuntimeError(
            f"dense layer {layer_idx} received a stack of {rows} value tensors; it needs the values of every "
            "earlier layer, in order (pass the `residual_values` each decoder layer returns to the next one)."
        )
    grown = _stack_with_row(stack, own, capacity) if append else None
    if not mix:  # attend over the buffer row itself, so V_n is kept once (attention saves it) and `own` is freed
        return _alias(grown, rows, own.shape), grown
    vector = weights[: rows + 1].to(own.dtype)
    if append:
        mixed_rows = torch.mv(_rows(grown).t(), vector)
    else:
        mixed_rows = torch.addmv(token_major(own).reshape(-1) * vector[-1], _rows(stack).t(), vector[:-1])
    return heads_view(mixed_rows, own.shape), grown


class _DenseValues(torch.autograd.Function):
    """One layer: mix V_n with the stack of earlier values V_0..V_{n-1} and/or append V_n to it; returns (the values
    attention uses, the grown stack or None). Every stack is a prefix of one buffer, so the values are kept once (O(L),
    not the O(L²) of `torch.cat`-grown stacks); it travels as a tensor argument, as reentrant checkpointing needs."""

    @staticmethod
    def forward(ctx, own, stack, weights, layer_idx, capacity, mix, append):
        ctx.set_materialize_grads(False)
        ctx.layer_idx, ctx.mix, ctx.append, ctx.rows = layer_idx, mix, append, 0 if stack is None else stack.shape[0]
        mixed, grown = _dense_forward(own, stack, weights, layer_idx, capacity, mix, append)
        if not mix:
            ctx.save_for_backward(None, None, None)
        else:
            ctx.save_for_backward(grown if append else stack, None if append else own, weights)
        return mixed, grown

    @staticmethod
    @_in_their_dtype
    def backward(ctx, grad_mixed, grad_grown):
        stack_or_grown, own, weights = ctx.saved_tensors
        rows = ctx.rows
        grad_own = grad_stack = grad_weights = None
        if not ctx.mix or grad_mixed is None:  # V_n's gradient is its row's (plus, appended only, attention's own)
            if grad_grown is not None:
                grad_own, grad_stack = grad_grown[rows], grad_grown[:rows] if rows else None
            if grad_mixed is not None:
                grad_own = grad_mixed if grad_own is None else grad_own + grad_mixed
            return grad_own, grad_stack, None, None, None, None, None
        vector = weights[: rows + 1].to(grad_mixed.dtype)
        flat = token_major(grad_mixed).reshape(-1)
        # Each row's gradient `W[n, j]·dV'` as a rank-1 GEMM: `outer`/`addr` broadcast, which CUDA runs in its
        # non-vectorised elementwise loop (dense's largest extra in the GPU kernel profile); a GEMM streams.
        column, flat_row = vector[:, None], flat[None, :]
        if ctx.append:
            matrix = _rows(stack_or_grown)
            if grad_grown is None:
                grown_grad = torch.mm(column, flat_row)
            else:  # the later layers' gradient for every row plus this layer's, in one pass
                grown_grad = torch.addmm(_rows(grad_grown), column, flat_row)
            grown_grad = grown_grad.view(rows + 1, *grad_mixed.shape).as_strided(
                stack_or_grown.shape, _row_strides(stack_or_grown.shape)
            )
            grad_own, grad_stack = grown_grad[rows], grown_grad[:rows] if rows else None
            mixed_grads = torch.mv(matrix, flat) if ctx.needs_input_grad[2] else None
        else:
            stack = stack_or_grown
            grad_stack = torch.mm(column[:-1], flat_row).as_strided(stack.shape, _row_strides(stack.shape))
            grad_own = heads_view(flat * vector[-1], own.shape)
            mixed_grads = None
            if ctx.needs_input_grad[2]:
                own_grad = torch.dot(token_major(own).reshape(-1), flat)
                mixed_grads = torch.cat((torch.mv(_rows(stack), flat), own_grad.unsqueeze(0)))
        if mixed_grads is not None:  # columns after this layer's get no gradient
            grad_weights = F.pad(mixed_grads, (0, weights.shape[0] - rows - 1))
        return grad_own, grad_stack, grad_weights, None, None, None, None


def dense_values(
    own: torch.Tensor, earlier: torch.Tensor | tuple | None, weights: torch.Tensor | None, layer_idx: int,
    capacity: int, mix: bool, append: bool,
) -> tuple[torch.Tensor, torch.Tensor | tuple | None]:
    """`Σ_{j<n} W[n, j]·V_j + W[n, n]·V_n` when layer n mixes (else V_n), and the stack with V_n appended when a
    later layer reads it; DenseFormer passes block outputs as [B, 1, T, C]. A layer writes only its own row, so it
    must not run twice on one stack with other inputs in one graph (checkpointing's recompute writes the same values).
    Compiled, the stack is a tuple and the sum plain ops, which the compiler fuses, keeping each V_j once."""
    if torch.compiler.is_compiling():
        earlier = () if earlier is None else tuple(earlier)
        values = own
        if mix:
            values = own * weights[layer_idx]
            for j, earlier_values in enumerate(earlier):
                values = values + earlier_values * weights[j]
        return values, (earlier + (own,) if append else earlier)
    values, grown = _DenseValues.apply(own, earlier, weights, layer_idx, capacity, mix, append)
    return values, (grown if append else earlier)


# ---- DenseFormer ----------------------------------------------------------------------------------------------------


class DepthWeightedAverage(ExactBuffers):
    """Every depth weight of a DenseFormer: offsets [L, L + 1] from the identity, masked to each row's sources."""

    def __init__(self, num_layers: int, dilation: int = 1):
        super().__init__()
        self.dilation = dilation
        self.weight_offset = nn.Parameter(torch.zeros(num_layers, num_layers + 1, dtype=torch.float32))
        self.register_exact_buffers()

    @classmethod
    def for_config(cls, config) -> DepthWeightedAverage | None:
        """The module a model with `config` holds: one for DenseFormer, None for every other variant."""
        if not config.value_residual_spec.depth_weighted_average:
            return None
        return cls(config.num_hidden_layers, config.denseformer_dilation_resolved)

    def initial_buffers(self, device: torch.device, dtype: torch.dtype = torch.float32
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """α at zero offsets (the identity: block i reads X_i) and the mask of each row's sources."""
        rows = self.weight_offset.shape[0]
        block = torch.arange(1, rows + 1, device=device)[:, None]  # row r is block i = r + 1
        source = torch.arange(rows + 1, device=device)[None, :]
        mask = (source <= block) & ((block - source) % self.dilation == 0)
        return (source == block).to(dtype), mask.to(dtype)

    def forward(self) -> torch.Tensor:
        """α [L, L + 1] in float32 (offsets upcast by type promotion, as for the λ), masked to each row's sources."""
        return (self.weight_offset + self.initial) * self.mask

    def begin(self, embeddings: torch.Tensor) -> DepthStream:
        """The stream of one forward pass, starting at the embeddings `X_0`."""
        return DepthStream(self().to(embeddings.dtype), embeddings)

    def extra_repr(self) -> str:
        return f"layers={self.weight_offset.shape[0]}, dilation={self.dilation}"


class DepthStream:
    """The block outputs of one forward pass, kept once in a buffer of rows X_0 .. X_{L-1} shared by every average."""

    def __init__(self, weights: torch.Tensor, embeddings: torch.Tensor):
        self.weights, self.rows = weights.unbind(0), weights.shape[0]  # views: backward stacks their gradients once
        self.blocks = 0
        # The first block reads X_0 from the buffer's row, so the embeddings are kept once, as Llama keeps them.
        first, self.stack = dense_values(embeddings.unsqueeze(1), None, None, 0, self.rows, mix=False, append=True)
        self.first = first.squeeze(1)

    def after_block(self, block_output: torch.Tensor) -> torch.Tensor:
        """`Σ_j α[i, j]·X_j` for the block that just returned `X_i`: one matrix-vector product over the buffer."""
        self.blocks = block = self.blocks + 1
        average, self.stack = dense_values(block_output.unsqueeze(1), self.stack, self.weights[block - 1], block,
                                           self.rows, mix=True, append=block < self.rows)
        return average.squeeze(1)


__all__ = ["DepthStream", "DepthWeightedAverage", "dense_values"]
