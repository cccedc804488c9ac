"""What every pre-training study's command line shares: the data, size, budget and seed flags, and turning them into
data, a budget, a model size and the study's run store.

The study scripts (`bench_pretrain.py`, `bench_param_efficiency.py`, `bench_uptrain.py`, `bench_svformer_gqa.py`,
`bench_context_length.py`, `bench_lr_sweep.py`) only choose what to train and how to report it; what two of them need
lives in `study_data.py`, `study_training.py`, `study_statistics.py`, `run_store.py` and here, so a number means the
same thing in every table.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from common import environment_line, setup_device
from run_store import RunStore, portable_config, portable_path
from study_data import DEFAULT_CORPUS, Data, prepare_data, read_corpus
from study_training import Budget, ModelSize


def add_study_args(parser: argparse.ArgumentParser, *, tokens: int, hidden: int = 128, layers: int = 6,
                   heads: int = 4, eval_every: int = 50, num_seeds: int = 3, size_flags: bool = True) -> None:
    """Data, size, budget and seed flags shared by the studies, with each study's defaults (`size_flags=False`: the
    study sets model sizes its own way)."""
    data = parser.add_argument_group("data")
    data.add_argument("--corpus-dir", type=Path, default=DEFAULT_CORPUS, help="folder of *.txt training text")
    data.add_argument("--sample-chars", type=int, default=None,
                      help="train on the first N characters of the bundled sample instead of --corpus-dir (tests)")
    data.add_argument("--val-fraction", type=float, default=0.02, help="held-out tail of each file (default 0.02)")
    data.add_argument("--val-tokens", type=int, default=32768, help="held-out tokens scored per evaluation")
    data.add_argument("--vocab-size", type=int, default=2048)
    if size_flags:
        size = parser.add_argument_group("model size")
        size.add_argument("--hidden-size", type=int, default=hidden)
        size.add_argument("--layers", type=int, default=layers)
        size.add_argument("--heads", type=int, default=heads)
        size.add_argument("--intermediate-size", type=int, default=None, help="default: 8/3 hidden, multiple of 32")
    budget = parser.add_argument_group("training budget")
    budget.add_argument("--tokens", type=int, default=tokens, help=f"training tokens per model (default {tokens:,})")
    budget.add_argument("--seq-len", type=int, default=128)
    budget.add_argument("--batch-size", type=int, default=16)
    budget.add_argument("--lr", type=float, default=3e-3)
    budget.add_argument("--warmup", type=float, default=0.05, help="warmup fraction of the steps")
    budget.add_argument("--weight-decay", type=float, default=0.1)
    budget.add_argument("--eval-every", type=int, default=eval_every, help="steps between validation evaluations")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help=f"seeds (init and data order; the same for every model within a seed); default: "
                        f"{num_seeds} seeds from --seed")
    parser.set_defaults(num_seeds=num_seeds)
    parser.add_argument("--fresh", action="store_true", help="retrain runs already saved with the same settings")
    parser.add_argument("--report-only", action="store_true", help="rebuild the table and plot from the saved runs")


def seeds_from_args(args: argparse.Namespace) -> list[int]:
    """`--seeds`, or `--num-seeds` consecutive seeds starting at `--seed` (common's flag, default 0)."""
    return list(args.seeds) if args.seeds else list(range(args.seed, args.seed + args.num_seeds))


def load_texts(args: argparse.Namespace) -> tuple[list[str], str]:
    """The study's documents and a description for its table."""
    if args.sample_chars:
        from resformer_hf.text import SAMPLE_DESCRIPTION, sample_text

        return [sample_text(args.sample_chars)], f"first {args.sample_chars:,} characters of the {SAMPLE_DESCRIPTION}"
    names = [p.name for p in sorted(Path(args.corpus_dir).glob("*.txt"))]
    listed = ", ".join(names) if len(names) <= 6 else f"{len(names)} files: {', '.join(names[:3])}, …"
    return read_corpus(args.corpus_dir), f"{args.corpus_dir.name}/ ({listed})"


def data_from_args(args: argparse.Namespace) -> tuple[Data, str]:
    texts, description = load_texts(args)
    data = prepare_data(texts, vocab_size=args.vocab_size, val_fraction=args.val_fraction, seq_len=args.seq_len,
                        val_tokens=args.val_tokens)
    description += (f"; byte-level BPE of {data.vocab_size} tokens trained on the training split; "
                    f"{data.train.numel() / 1e6:.2f}M training tokens, validation on {data.val.numel() / 1e3:.0f}k "
                    f"held-out tokens (evenly spaced blocks of the last {args.val_fraction:.0%} of each file)")
    return data, description


def budget_from_args(args: argparse.Namespace, tokens: int | None = None) -> Budget:
    return Budget(tokens=tokens or args.tokens, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                  warmup=args.warmup, weight_decay=args.weight_decay, eval_every=args.eval_every)


def size_from_args(args: argparse.Namespace, **overrides) -> ModelSize:
    fields = dict(hidden_size=args.hidden_size, layers=args.layers, heads=args.heads,
                  kv_heads=getattr(args, "kv_heads", None), intermediate_size=args.intermediate_size,
                  cross_layer_attention=getattr(args, "cross_layer_attention", None))
    fields.update(overrides)
    return ModelSize(**fields)


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that regenerates a study's results, as its table quotes it."""
    arguments = sys.argv[1:] if argv is None else argv
    arguments = [portable_path(a) if os.path.isabs(a) and os.path.exists(a) else a for a in arguments]
    return " ".join([f"python benchmarks/{script}", *arguments])


def study_config(args: argparse.Namespace, *extra: str) -> dict:
    """The flags that decide a study's numbers: a saved run is reused only while they are unchanged."""
    names = ["corpus_dir", "sample_chars", "val_fraction", "val_tokens", "vocab_size", "hidden_size", "layers",
             "heads", "intermediate_size", "tokens", "seq_len", "batch_size", "lr", "warmup", "weight_decay",
             "eval_every", "device", *extra]
    config = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return portable_config(config)


def open_study(args: argparse.Namespace, name: str, *config_flags: str) -> RunStore:
    """The study's run store `OUT/<name>.json`, keyed by `study_config(args, *config_flags)`."""
    args.out.mkdir(parents=True, exist_ok=True)
    return RunStore(args.out / f"{name}.json", study_config(args, *config_flags), fresh=args.fresh)


def prepare_training(
    store: RunStore, args: argparse.Namespace, script: str, argv: Sequence[str] | None, *, describe_size: bool = True
) -> tuple[torch.device, Data]:
    """Device and data for the runs still to train; records in the store how and on what they are measured."""
    device = setup_device(args)
    data, description = data_from_args(args)
    meta = {"command": command_line(script, argv), "environment": environment_line(device)}
    if describe_size:
        meta["size"] = size_from_args(args).describe()
    store.meta.update(meta, budget=budget_from_args(args).describe(), data=description)
    return device, data
