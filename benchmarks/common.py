"""Helpers shared by the benchmark scripts: building same-size Llama / ResFormer pairs, timing, tables, plots.

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
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

import resformer_hf
from resformer_hf import ResFormerConfig, ResFormerForCausalLM
from resformer_hf._compat import with_cache
from resformer_hf.cache_resformer import share_first_layer_values

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent

#: The name benchmarks use for the HF Llama baseline next to ResFormer's `value_residual` variants.
BASELINE = "llama"


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
    return ResFormerConfig(**size, value_residual=variant)


def build_model(variant: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **size):
    """`LlamaForCausalLM` or `ResFormerForCausalLM` of the given size (the caller seeds torch first)."""
    config = model_config(variant, **size)
    model_class = LlamaForCausalLM if variant == BASELINE else ResFormerForCausalLM
    return model_class(config).to(device=device, dtype=dtype)


def add_clock_arg(parser: argparse.ArgumentParser) -> None:
    """`--clock wall|cpu`, for the benchmarks that time CPU work on a machine they may share."""
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="time with the wall clock (default) or this process's CPU time (CPU device only): on a "
                        "shared machine CPU time leaves out the waiting for a core, which is most of the noise")


def clock_of(args: argparse.Namespace, device: torch.device) -> Callable[[], float]:
    """The timer `--clock` asks for; CPU time cannot see a GPU's work, so it is refused there."""
    if args.clock == "cpu" and device.type != "cpu":
        raise SystemExit("--clock cpu times CPU work only; use the wall clock on a GPU")
    return time.process_time if args.clock == "cpu" else time.perf_counter


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so wall-clock timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(
    actions: dict[str, Callable[[], None]], repeats: int, warmup: int, device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds of each action, timed round-robin so load changes on a shared machine hit all of them alike.

    `clock` is wall time by default; `time.process_time` (CPU seconds of this process, CPU device only) leaves out the
    time other processes hold the cores, which on a shared machine is most of the noise."""
    for _ in range(warmup):
        for action in actions.values():
            action()
    samples: dict[str, list[float]] = {name: [] for name in actions}
    names = list(actions)
    for repeat in range(repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:  # rotate: no fixed position bias
            action = actions[name]
            synchronize(device)
            start = clock()
            action()
            synchronize(device)
            samples[name].append(clock() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


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


class Decoder:
    """Decodes bursts of single tokens after a random context, rewinding the cache after each burst."""

    def __init__(self, model, batch: int, context: int, steps: int, compiled: bool, device: torch.device):
        self.model, self.steps, self.compiled = model.eval(), steps, compiled
        self.forward = torch.compile(model.forward) if compiled else model
        generator = torch.Generator().manual_seed(1)
        prompt = torch.randint(3, model.config.vocab_size, (batch, context), generator=generator).to(device)
        if compiled:
            self.cache = StaticCache(config=model.config, max_cache_len=context + steps)
        else:
            self.cache = DynamicCache(config=model.config)
        if getattr(model.config, "layers_without_value_projection", None):  # SVFormer: values once, as generate()
            share_first_layer_values(self.cache)
        with torch.no_grad():
            out = model(prompt, **with_cache(self.cache), use_cache=True, logits_to_keep=1)  # eager prefill
        self.token = out.logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def burst(self) -> None:
        token = self.token
        for _ in range(self.steps):
            token = self.forward(token, **with_cache(self.cache), use_cache=True).logits[:, -1:].argmax(-1)
        for layer in self.cache.layers:  # rewind to the context: every burst decodes at the same length
            if self.compiled:
                layer.cumulative_length.sub_(self.steps)
            else:
                layer.crop(-self.steps)

    @torch.no_grad()
    def step(self) -> None:
        """One decode step, then rewound (what the op census counts)."""
        self.forward(self.token, **with_cache(self.cache), use_cache=True)
        for layer in self.cache.layers:
            layer.crop(-1)
