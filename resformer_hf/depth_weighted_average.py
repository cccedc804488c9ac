"""DenseFormer's depth-weighted average (Pagliardini et al., 2024), the baseline the ResFormer paper compares with.

After block i (1-based) the next block reads `Y_i = Σ_j α[i, j]·X_j` over the embeddings `X_0` and the block outputs
`X_1 .. X_i` (with dilation k only `j ≡ i mod k`), instead of the plain residual stream `X_i`. The α are learnable
and stored as offsets from the identity (α[i, i] = 1, the rest 0), like the λ of `value_residual.py`: a fresh or
converted model is exactly Llama, weight decay pulls toward the plain residual stream, and a checkpoint without them
loads as Llama. The average is per token, so caching needs nothing. Without a gradient the α are read as Python
numbers where that is free (`no_grad_mixing.readable_as_numbers`), as the λ are: one op per source instead of three.
Imports only torch and its sibling files (copied for `trust_remote_code`).
"""

from __future__ import annotations

import torch
from torch import nn

from .no_grad_mixing import readable_as_numbers


def depth_sources(num_layers: int, dilation: int) -> list[list[int]]:
    """For each block i = 1..L (row i - 1): the indices j of the `X_j` its average reads, ascending."""
    return [[j for j in range(i + 1) if (i - j) % dilation == 0] for i in range(1, num_layers + 1)]


class DepthWeightedAverage(nn.Module):
    """Every DWA weight of a DenseFormer: offsets [L, L + 1] from the identity; entries outside a row's sources are
    unused (and get no gradient)."""

    def __init__(self, num_layers: int, dilation: int = 1):
        super().__init__()
        self.sources, self.dilation = depth_sources(num_layers, dilation), dilation
        self.weight_offset = nn.Parameter(torch.zeros(num_layers, num_layers + 1, dtype=torch.float32))

    @classmethod
    def for_config(cls, config) -> DepthWeightedAverage | None:
        """The module a model with `config` holds: one for DenseFormer, None for every other variant."""
        if not config.value_residual_spec.depth_weighted_average:
            return None
        return cls(config.num_hidden_layers, config.denseformer_dilation_resolved)

    def weights(self) -> torch.Tensor:
        """α [L, L + 1] in float32 (offsets upcast first, as for the λ), masked to each row's sources."""
        device, rows = self.weight_offset.device, len(self.sources)
        block = torch.arange(1, rows + 1, device=device)[:, None]  # row r is block i = r + 1
        source = torch.arange(rows + 1, device=device)[None, :]
        mask = (source <= block) & ((block - source) % self.dilation == 0)
        return ((source == block).float() + self.weight_offset.float()) * mask

    def begin(self, embeddings: torch.Tensor, inference: bool = False) -> DepthStream:
        """The running stream of one forward pass, starting at the embeddings `X_0`; with `inference` (no gradient
        wanted) the α as Python numbers where `readable_as_numbers` allows, else as tensors."""
        if inference and readable_as_numbers(self):
            offsets = self.weight_offset.tolist()
            rows = [[offset + (j == row + 1) for j, offset in enumerate(offsets[row])] for row in range(len(offsets))]
            return DepthStream(rows, self.sources, [embeddings])
        return DepthStream(self.weights().to(embeddings.dtype).unbind(0), self.sources, [embeddings])

    def extra_repr(self) -> str:
        return f"layers={len(self.sources)}, sources={self.sources}"


class DepthStream:
    """The block outputs of one forward pass so far; `after_block` gives the next block's input."""

    def __init__(self, rows: tuple[torch.Tensor, ...] | list[list[float]], sources: list[list[int]],
                 outputs: list[torch.Tensor]):
        self.rows, self.sources, self.outputs = rows, sources, outputs

    def after_block(self, block_output: torch.Tensor) -> torch.Tensor:
        """`Σ_j α[i, j]·X_j` for the block that just returned `X_i` (one multiply-add per source: each product
        keeps only the α and an `X_j` that is alive anyway, never a stacked copy of the stream)."""
        self.outputs.append(block_output)
        row, sources = self.rows[len(self.outputs) - 2], self.sources[len(self.outputs) - 2]
        average = block_output * row[sources[-1]]
        if isinstance(row, list):  # α as numbers, no gradient: one op per source, into the fresh product
            for j in sources[:-1]:
                average.add_(self.outputs[j], alpha=row[j])
            return average
        for j in sources[:-1]:
            average = average + self.outputs[j] * row[j]
        return average


__all__ = ["DepthStream", "DepthWeightedAverage", "depth_sources"]
