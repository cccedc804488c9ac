"""`resformer-quickstart`: the whole workflow in one offline command, on a small model, in about a minute on a CPU.

The flags map one to one onto `resformer_hf.quickstart.QuickstartSettings`; the work is `run_quickstart`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..conversion.bases import base_names
from ..remote_code.variants import DEFAULT_VARIANT, convertible_variants
from .common import OneLineParser, add_debug_flag, positive_float, positive_int, run_command, seed

PROG = "resformer-quickstart"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Convert a small Llama to ResFormer, fine-tune it with the transformers Trainer, generate a "
        "sample and write a Hub-ready folder with a model card. Runs offline on built-in defaults.",
    )
    source = parser.add_argument_group("model and data")
    source.add_argument("--model", help=f"checkpoint (directory or Hub id) of a {base_names()} to convert; "
                        "default: build a small random Llama (4 layers, hidden 128) with a tokenizer trained on the "
                        "data")
    source.add_argument("--tokenizer", help="tokenizer directory or Hub id; default: the --model's own, else a BPE "
                        "trained on the data")
    data = source.add_mutually_exclusive_group()
    data.add_argument("--data", nargs="+", metavar="FILE", help="UTF-8 text files to train on (default: the bundled "
                      "English sample)")
    data.add_argument("--dataset", help="a `datasets` name (Hub or local script/folder) with a text column")
    source.add_argument("--dataset-config", help="configuration name of --dataset")
    source.add_argument("--text-column", default="text", help="column of --dataset holding the text (default: text)")
    method = parser.add_argument_group("conversion and training")
    method.add_argument("--variant", choices=convertible_variants(), default=DEFAULT_VARIANT,
                        help=f"value-residual variant (default: {DEFAULT_VARIANT}, as ResFormerConfig)")
    method.add_argument("--init", choices=("preserve", "paper"), default=None,
                        help="λ initialisation of the conversion (default: preserve when converting a --model with a "
                        "learnable variant, so training starts from its outputs; else paper, the paper's values)")
    method.add_argument("--steps", type=positive_int, default=100, help="training steps (default: 100)")
    method.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step (default: 8)")
    method.add_argument("--block-size", type=positive_int, default=128, help="tokens per sequence (default: 128)")
    method.add_argument("--learning-rate", type=positive_float, default=2e-3,
                        help="peak learning rate (default: 2e-3)")
    method.add_argument("--vocab-size", type=positive_int, default=2000,
                        help="size of the BPE trained when no tokenizer is available (default: 2000)")
    method.add_argument("--seed", type=seed, default=0, help="random seed, 0 .. 2**32-1 (default: 0)")
    out = parser.add_argument_group("output")
    out.add_argument("--output", default="resformer-quickstart", help="Hub-ready output folder (default: "
                     "./resformer-quickstart)")
    out.add_argument("--overwrite", action="store_true", help="replace a non-empty --output folder once the new one "
                     "is complete (never one that holds --model, --tokenizer or the data)")
    out.add_argument("--prompt", default="It is a truth universally acknowledged", help="prompt of the sample")
    out.add_argument("--max-new-tokens", type=positive_int, default=40, help="length of the sample (default: 40)")
    out.add_argument("--push-to-hub", metavar="REPO", help="also upload the folder to this Hub repo (needs network "
                     "and a token: `hf auth login`)")
    out.add_argument("--private", action="store_true", help="create the --push-to-hub repo as private")
    add_debug_flag(parser)
    return parser


def _quickstart(args: argparse.Namespace) -> int:
    if not args.debug:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        logging.getLogger("datasets").setLevel(logging.ERROR)
    from ..quickstart import QuickstartSettings, run_quickstart

    settings = QuickstartSettings(
        model=args.model,
        tokenizer=args.tokenizer,
        data_files=tuple(args.data or ()),
        dataset=args.dataset,
        dataset_config=args.dataset_config,
        text_column=args.text_column,
        variant=args.variant,
        init=args.init,
        steps=args.steps,
        batch_size=args.batch_size,
        block_size=args.block_size,
        learning_rate=args.learning_rate,
        vocab_size=args.vocab_size,
        seed=args.seed,
        output=args.output,
        overwrite=args.overwrite,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        push_to_hub=args.push_to_hub,
        private=args.private,
    )
    run_quickstart(settings, say=lambda line: print(line, flush=True))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(PROG, build_parser(), _quickstart, argv,
                       interrupted_note=lambda args: f"nothing was written to {args.output}")


if __name__ == "__main__":
    sys.exit(main())
