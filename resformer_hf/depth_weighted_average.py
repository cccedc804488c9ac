"""DenseFormer's depth-weighted average (Pagliardini et al., 2024), the baseline the ResFormer paper compares with.

After block i (1-based) the next block reads `Y_i = Σ_j α[i, j]·X_j` over the embeddings `X_0` and the block outputs
`X_1 .. X_i` (with dilation k only `j ≡ i mod k`), instead of the plain residual stream `X_i`. The α are stored as
offsets from the identity (α[i, i] = 1, the rest 0), like the λ of `value_residual.py`: a fresh or converted model is
exactly Llama, weight decay pulls toward the plain residual stream, and a checkpoint without them loads as Llama. The
outputs are kept once, in one buffer that every average reads with one matrix-vector product (`dense_values`, the op
`dense` mixes values with). Imports only torch and its sibling files (copied for `trust_remote_code`).
"""

from __future__ import annotations

import torch
from torch import nn

from .value_mixing import dense_values
from .value_residual import ExactBuffers, readable_as_numbers


class DepthWeightedAverage(ExactBuffers):
    """Every DWA weight of a DenseFormer: offsets [L, L + 1] from the identity; entries outside a row's sources are
    masked out (and get no gradient)."""

    def __init__(self, num_layers: int, dilation: int = 1):
        super().__init__()
        self.dilation = dilation
        self.weight_offset = nn.Parameter(torch.zeros(num_layers, num_layers + 1, dtype=torch.float32))
        initial, mask = self.initial_buffers(torch.device("cpu"))
        self.register_buffer("initial", initial, persistent=False)  # rebuilt by `_init_weights` after a meta build
        self.register_buffer("mask", mask, persistent=False)

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

    def begin(self, embeddings: torch.Tensor, inference: bool = False) -> DepthStream | NumericDepthStream:
        """The stream of one forward pass, starting at the embeddings `X_0`; without gradient on the CPU, with α read
        as numbers (`readable_as_numbers`)."""
        if inference and readable_as_numbers(self):
            with torch.no_grad():
                return NumericDepthStream(self().tolist(), embeddings)
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


class NumericDepthStream:
    """A pass without gradient on the CPU: α as numbers, one multiply-add per source. At decode sizes the buffer's
    views cost more instructions than the few ops they save there."""

    def __init__(self, weights: list[list[float]], embeddings: torch.Tensor):
        self.weights, self.outputs, self.first = weights, [embeddings], embeddings

    def after_block(self, block_output: torch.Tensor) -> torch.Tensor:
        row = self.weights[len(self.outputs) - 1]
        average = block_output * row[len(self.outputs)]
        for j, output in enumerate(self.outputs):
            if row[j]:  # sources only (the others are masked to 0)
                average.add_(output, alpha=row[j])
        self.outputs.append(block_output)
        return average


__all__ = ["DepthStream", "DepthWeightedAverage", "NumericDepthStream"]
