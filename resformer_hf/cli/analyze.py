"""`resformer-analyze MODEL_DIR [MODEL_DIR ...] --text FILE --out DIR`: per-layer attention entropy, token similarity
and λ of ResFormer / Llama checkpoints, as `summary.md` and PNGs (`resformer_hf.analysis.analyze_checkpoints`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .common import OneLineParser, add_debug_flag, positive_int, run_command

PROG = "resformer-analyze"


def _at_least_two(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value} must be at least 2")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Per-layer attention entropy, token similarity and λ of ResFormer / Llama checkpoints.",
    )
    parser.add_argument("model_dirs", nargs="+", metavar="MODEL_DIR", help="checkpoint(s) to analyse and compare")
    parser.add_argument("--text", required=True, help="UTF-8 text file the models read")
    parser.add_argument("--out", required=True, help="output folder for summary.md and the PNGs")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path (default: the first MODEL_DIR)")
    parser.add_argument("--max-tokens", type=_at_least_two, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--num-sequences", type=positive_int, default=4,
                        help="sequences cut from the text (default 4)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--no-plots", action="store_true", help="write only summary.md (no matplotlib needed)")
    add_debug_flag(parser)
    return parser


def _analyze(args: argparse.Namespace) -> int:
    from ..analysis import analyze_checkpoints, read_text_file

    summary = analyze_checkpoints(
        args.model_dirs,
        read_text_file(args.text),
        args.out,
        tokenizer_path=args.tokenizer,
        max_tokens=args.max_tokens,
        num_sequences=args.num_sequences,
        device=args.device,
        plots=not args.no_plots,
    )
    print(f"wrote {summary}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(PROG, build_parser(), _analyze, argv)


if __name__ == "__main__":
    sys.exit(main())
