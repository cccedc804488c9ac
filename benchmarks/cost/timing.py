"""Timing on a shared machine: the `--clock` flag, round-robin medians, and the decoder the cost benchmarks time."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache, StaticCache

from resformer_hf.remote_code._compat import with_cache
from resformer_hf.remote_code.cache_resformer import share_first_layer_values


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
