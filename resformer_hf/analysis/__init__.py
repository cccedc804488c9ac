"""The paper's analyses for any ResFormer or Llama checkpoint: attention entropy, token similarity, λ table.

`metrics` computes the per-layer numbers, `plots` draws them (matplotlib, the optional `analysis` extra), `report`
writes a comparison of several checkpoints as `summary.md`. The command is `resformer-analyze`
(`resformer_hf.cli.analyze`): `resformer-analyze MODEL_DIR [MODEL_DIR ...] --text FILE --out DIR`.
"""

from __future__ import annotations

from .metrics import attention_entropy, lambda_table, token_similarity, value_gate_statistics
from .plots import plot_attention_entropy, plot_lambdas, plot_per_layer, plot_token_similarity
from .report import AnalysisError, analyze_checkpoints, read_text_file

__all__ = [
    "AnalysisError",
    "analyze_checkpoints",
    "attention_entropy",
    "lambda_table",
    "plot_attention_entropy",
    "plot_lambdas",
    "plot_per_layer",
    "plot_token_similarity",
    "read_text_file",
    "token_similarity",
    "value_gate_statistics",
]
