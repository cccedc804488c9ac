"""Helpers shared by every benchmark and study: the device flags, same-size Llama / ResFormer models, tables, plots,
and the documentation blocks a benchmark rewrites (timing lives in `cost/timing.py`; a timed run's JSON-lines records,
environment and deadline in `records.py`).

Benchmarks are scripts, not tests: they write markdown tables and PNGs under `benchmarks/results/` and always compare
each variant with HF `LlamaForCausalLM` of the same size measured in the same run, because absolute numbers on a
shared machine are noise while ratios measured side by side are not.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import re
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import resformer_hf
from resformer_hf import ResFormerConfig, ResFormerForCausalLM

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent

#: The name benchmarks use for the HF Llama baseline next to ResFormer's `value_residual` variants.
BASELINE = "llama"
#: Benchmark arm names with value embeddings (issue 56) in nanochat's alternating layout: `value_embeddings` (no value
#: residual) and `VARIANT+value_embeddings`.
VALUE_EMBEDDINGS = "value_embeddings"


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """`--device`, `--threads` and `--seed`, taken by every benchmark."""
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data order (default 0)")


def setup_device(args: argparse.Namespace) -> torch.device:
    """Apply `--threads` and check `--device` exists, with an error that says what to pass instead."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was given but torch sees no CUDA GPU; use --device cpu.")
    return device


def model_config(variant: str, **size) -> LlamaConfig:
    """A `LlamaConfig` (for `variant == "llama"`) or `ResFormerConfig` with exactly the same size fields."""
    if variant == BASELINE:
        return LlamaConfig(**size)
    if variant.endswith(VALUE_EMBEDDINGS):  # `value_embeddings` alone, or `VARIANT+value_embeddings`
        base = variant.removesuffix(VALUE_EMBEDDINGS).removesuffix("+") or "none"
        return ResFormerConfig(**size, value_residual=base, value_embeddings="alternating")
    return ResFormerConfig(**size, value_residual=variant)


def build_model(variant: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **size):
    """`LlamaForCausalLM` or `ResFormerForCausalLM` of the given size (the caller seeds torch first)."""
    config = model_config(variant, **size)
    model_class = LlamaForCausalLM if variant == BASELINE else ResFormerForCausalLM
    return model_class(config).to(device=device, dtype=dtype)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def environment_line(device: torch.device) -> str:
    """One line saying where and with what the numbers were measured."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or 'CPU'}"
    return (
        f"Measured {_dt.date.today().isoformat()} on {where} "
        f"({device.type}, torch threads: {torch.get_num_threads()}, "
        f"{os.cpu_count()} cores visible), torch {torch.__version__}, transformers {transformers.__version__}, "
        f"resformer-hf {resformer_hf.__version__}."
    )


def pyplot():
    """matplotlib's pyplot with a file-only backend (matplotlib is the `benchmarks` extra)."""
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit("benchmarks draw PNGs with matplotlib: pip install -e '.[benchmarks]'") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: A markdown link target that is a relative path (not a URL, an anchor or an absolute path).
_RELATIVE_LINK = re.compile(r"(\]\()(?![a-zA-Z][a-zA-Z0-9+.-]*:|#|/)([^)\s]+)(\))")


def documentation_pages(root: Path = REPO_ROOT) -> list[Path]:
    """Where result paragraphs may live: README.md and every page in docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def rewrite_readme_block(name: str, text: str, root: Path = REPO_ROOT, *, page: Path | None = None) -> Path:
    """Replace what the documentation holds between `<!-- name:begin -->` and `<!-- name:end -->` with `text`.

    Lets a benchmark regenerate the paragraphs that quote its results in the same command that measures them, without
    knowing which page (README.md or docs/*.md) holds them (`page` names the file instead, e.g. a results file).
    `text` links files relative to the repository root (`benchmarks/results/cost.md`); the links are rewritten
    relative to the page. Returns the page written.
    """
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    holders = [page] if page is not None else [
        candidate for candidate in documentation_pages(root) if begin in candidate.read_text(encoding="utf-8")]
    if len(holders) != 1:
        found = ", ".join(str(page.relative_to(root)) for page in holders) or "none"
        raise SystemExit(f"exactly one of README.md and docs/*.md must hold the {begin} ... {end} block for the "
                         f"benchmark to rewrite (found: {found}); add the markers to the page that should show it.")
    page = holders[0]
    content = page.read_text(encoding="utf-8")
    if content.count(begin) != 1 or content.count(end) != 1 or content.index(begin) > content.index(end):
        raise SystemExit(f"{page} needs exactly one {begin} ... {end} block for the benchmark to rewrite.")
    text = _RELATIVE_LINK.sub(
        lambda link: link[1] + Path(os.path.relpath(root / link[2], page.parent)).as_posix() + link[3], text.strip()
    )
    head, rest = content.split(begin)
    tail = rest.split(end)[1]
    staging = page.with_name(f".{page.name}.tmp-{os.getpid()}")
    staging.write_text(f"{head}{begin}\n{text}\n{end}{tail}", encoding="utf-8")
    os.replace(staging, page)  # the page is never left half-written
    return page
