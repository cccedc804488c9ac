"""Exact costs of value embeddings (issue 56) against HF Llama of the same size: parameters, training memory, saved
activations, and the aten ops and bytes a training step, a prefill and an eager decode step dispatch beyond Llama's.

Counts, not timings (`bench_cost`'s byte accounting and `OpCensus`), so the shared machine's load does not move them:

    python -m benchmarks.cost.value_embedding_costs      # writes benchmarks/results/value_embeddings_cost.md
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import BASELINE, RESULTS_DIR, build_model, environment_line, markdown_table
from benchmarks.cost.bench_cost import Trainer, census, training_bytes_cpu
from benchmarks.cost.settings import size_fields
from benchmarks.cost.timing import Decoder

ARMS = ["learnable_plus", "value_embeddings", "learnable_plus+value_embeddings"]
CASES = [((128, 4), 128), ((128, 4), 512), ((256, 8), 128)]
BATCH, VOCAB, HEAD_DIM, DECODE_CONTEXT = 2, 2048, 32, 64


def measure(hidden: int, layers: int, seq_len: int, arms: list[str]) -> list[list[str]]:
    """One row per arm: each quantity as a ratio to Llama's (ops as a difference)."""
    size = size_fields(hidden, layers, VOCAB, HEAD_DIM, seq_len + 1)
    batch = torch.randint(0, VOCAB, (BATCH, seq_len), generator=torch.Generator().manual_seed(0))
    counts = {}
    for name in [BASELINE, *arms]:
        torch.manual_seed(0)
        trainer = Trainer(build_model(name, **size), batch)
        memory = training_bytes_cpu(trainer)  # a step: the census below counts one with AdamW state, as bench_cost
        decoder = Decoder(trainer.model, BATCH, DECODE_CONTEXT, 1, False, torch.device("cpu"))
        counts[name] = dict(parameters=sum(p.numel() for p in trainer.model.parameters()),
                            memory=memory.total, saved=memory.saved_activations,
                            step=census(trainer.step), prefill=census(trainer.prefill), decode=census(decoder.step))
    llama = counts[BASELINE]

    def ops(name, kind):
        (ops, written), (llama_ops, llama_written) = counts[name][kind], llama[kind]
        return f"{ops - llama_ops:+d}, {written / llama_written:.4f}"

    rows = []
    for name in arms:
        added = counts[name]["parameters"] - llama["parameters"]
        rows.append([f"{hidden}×{layers}, {seq_len}", f"`{name}`",
                     f"{added:+,} ({added / llama['parameters']:+.1%})",
                     f"{counts[name]['memory'] / llama['memory']:.3f}",
                     f"{counts[name]['saved'] / llama['saved']:.4f}",
                     ops(name, "step"), ops(name, "prefill"), ops(name, "decode")])
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=ARMS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [row for (hidden, layers), seq_len in CASES for row in measure(hidden, layers, seq_len, args.arms)]
    header = ["size, sequence", "arm", "parameters added", "training memory", "saved activations", "step: ops, bytes",
              "prefill: ops, bytes", "decode step: ops, bytes"]
    text = "\n".join([
        "# Value embeddings: exact costs vs Llama (same size, same run)",
        f"Regenerate: `python -m benchmarks.cost.value_embedding_costs`. {environment_line(torch.device('cpu'))}",
        f"Batch {BATCH}, vocab {VOCAB}, head dim {HEAD_DIM}, MHA, float32, `alternating` tables (layers 1, 3 of 4; "
        "1, 3, 5, 7 of 8). Training memory: parameters, gradients, AdamW state and every tensor autograd saves (once "
        "per storage); saved activations: those tensors alone; ops: aten ops beyond Llama's, bytes: bytes their "
        "outputs write relative to Llama's (a training step after a first, once AdamW's state exists; a decode step "
        f"after {DECODE_CONTEXT} cached tokens, dynamic cache).",
        "", markdown_table(header, rows), ""])
    path = RESULTS_DIR / "value_embeddings_cost.md"
    path.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
