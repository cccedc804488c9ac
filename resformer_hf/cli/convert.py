"""`resformer-convert SRC DST`: the command-line face of `resformer_hf.conversion.convert_llama_checkpoint`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..conversion import DTYPES, INITS, convert_llama_checkpoint
from ..conversion.bases import base_names
from ..hub.refresh_code import refresh_remote_code
from ..remote_code.variants import DEFAULT_CONVERSION_VARIANT, convertible_variants
from .common import OneLineParser, add_debug_flag, run_command

PROG = "resformer-convert"


class _ConvertParser(OneLineParser):
    """SRC and DST are required unless --refresh-code names a folder to update in place (then neither is taken)."""

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if parsed.refresh_code is not None and (parsed.src is not None or parsed.dst is not None):
            self.error("--refresh-code FOLDER takes no SRC or DST: it changes FOLDER's code in place")
        if parsed.refresh_code is not None:
            given = [flag for flag, dest in _CONVERSION_FLAGS.items() if getattr(parsed, dest) not in (None, False)]
            if given:
                self.error(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply with --refresh-code, "
                           "which only replaces a folder's code; drop them")
        if parsed.refresh_code is None and parsed.dst is None:
            self.error(f"the following arguments are required: {'SRC, DST' if parsed.src is None else 'DST'}")
        if parsed.variant is None:
            parsed.variant = DEFAULT_CONVERSION_VARIANT
        if parsed.init is None:
            parsed.init = "preserve"
        return parsed


# Flags that only a conversion reads (defaults None/False, so that giving one with --refresh-code is noticed).
_CONVERSION_FLAGS = {"--variant": "variant", "--init": "init", "--dtype": "dtype", "--overwrite": "overwrite",
                     "--allow-pickle": "allow_pickle", "--verify": "verify", "--no-progress": "no_progress",
                     "--value-embeddings": "value_embeddings"}


def _layers_or_layout(text: str) -> str | list[int]:
    """--value-embeddings: a layout name (alternating, u_net) or comma-separated layer indices (0,2,5)."""
    try:
        return [int(part) for part in text.split(",")] if text[:1].isdigit() else text
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a layout name nor layer indices like 1,3,5") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _ConvertParser(
        prog=PROG,
        description=f"Upgrade a causal LM checkpoint ({base_names()}) to ResFormer by adding the value-residual λ; "
        "the converted model keeps its base's architecture (q/k norms, block norms, window layers). By default it "
        "computes exactly what the source computed, ready to be fine-tuned. Exit status: 0 done, 2 bad input, "
        "1 environment error, 130/143 interrupted (nothing is left behind).",
    )
    parser.add_argument("src", metavar="SRC", nargs="?",
                        help="checkpoint directory (config.json + safetensors) or Hub repo id")
    parser.add_argument("dst", metavar="DST", nargs="?",
                        help="output directory (must not exist or be empty, see --overwrite)")
    parser.add_argument("--refresh-code", metavar="FOLDER",
                        help="instead of converting: replace the remote code (*.py, config.json's auto_map) of a "
                        "ResFormer folder written by an older plugin with this one's, in place; weights untouched")
    parser.add_argument("--variant", choices=convertible_variants(), default=None,
                        help=f"value-residual variant (default: {DEFAULT_CONVERSION_VARIANT})")
    parser.add_argument("--init", choices=INITS, default=None,
                        help="preserve: λ start where outputs equal the source's (learnable variants only); "
                        "paper: the paper's initial values, outputs change (default: preserve)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="cast floating-point weights (default: keep each tensor's dtype); refused if a value "
                        "does not fit the new dtype")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty DST once the new one is complete")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="accept pytorch_model*.bin weights (loaded with weights_only=True)")
    parser.add_argument("--verify", action="store_true",
                        help="load both models and compare logits on a probe batch before committing DST; fails on "
                        "any NaN or infinity")
    parser.add_argument("--value-embeddings", metavar="LAYOUT", type=_layers_or_layout, default=None,
                        help="add value-embedding tables (zero: outputs unchanged) to these layers: alternating, "
                        "u_net, or indices such as 1,3,5 (default: none)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_debug_flag(parser)
    return parser


def _convert(args: argparse.Namespace) -> int:
    if args.refresh_code is not None:
        written = refresh_remote_code(args.refresh_code)
        print(f"refreshed {args.refresh_code}: {', '.join(written)}")
        return 0
    report = convert_llama_checkpoint(
        args.src,
        args.dst,
        variant=args.variant,
        init=args.init,
        dtype=args.dtype,
        overwrite=args.overwrite,
        allow_pickle=args.allow_pickle,
        verify=args.verify,
        progress=not args.no_progress,
        value_embeddings=args.value_embeddings,
    )
    print(report.summary())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(PROG, build_parser(), _convert, argv, interrupted_note=_interrupted_note)


def _interrupted_note(args: argparse.Namespace) -> str:
    if args.refresh_code is not None:
        return f"every file of {args.refresh_code} is whole (each is replaced by one rename)"
    return f"nothing was written to {args.dst}"


if __name__ == "__main__":
    sys.exit(main())
