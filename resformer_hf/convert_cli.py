"""`resformer-convert SRC DST`: the command-line face of `resformer_hf.conversion.convert_llama_checkpoint`.

User errors print one line and exit with status 2 (no traceback); Ctrl-C exits with 130 and leaves no DST.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .conversion import CONVERTIBLE_VARIANTS, DEFAULT_VARIANT, DTYPES, INITS, ConversionError, convert_llama_checkpoint

PROG = "resformer-convert"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Upgrade a Llama-layout causal LM checkpoint (Llama, Mistral without sliding window, Qwen2) to "
        "ResFormer by adding the value-residual λ. By default the converted model computes exactly what the source "
        "computed, ready to be fine-tuned.",
    )
    parser.add_argument("src", metavar="SRC", help="checkpoint directory (config.json + safetensors) or Hub repo id")
    parser.add_argument("dst", metavar="DST", help="output directory (must not exist or be empty, see --overwrite)")
    parser.add_argument("--variant", choices=CONVERTIBLE_VARIANTS, default=DEFAULT_VARIANT,
                        help=f"value-residual variant (default: {DEFAULT_VARIANT})")
    parser.add_argument("--init", choices=INITS, default="preserve",
                        help="preserve: λ start where outputs equal the source's (learnable variants only); "
                        "paper: the paper's initial values, outputs change (default: preserve)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="cast floating-point weights (default: keep each tensor's dtype)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DST once the new one is complete")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="accept pytorch_model*.bin weights (loaded with weights_only=True)")
    parser.add_argument("--verify", action="store_true",
                        help="load both models and compare logits on a probe batch before committing DST")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
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
        )
    except ConversionError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # disk full, permissions: the environment, not a bug
        print(f"{PROG}: error: {error.strerror or error} ({error.filename or 'file system'})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was written to {args.dst}", file=sys.stderr)
        return 130
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
