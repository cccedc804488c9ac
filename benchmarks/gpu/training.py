"""Item 3 of the GPU run: a training step at a realistic size, every variant against a same-shape Llama.

About 134M parameters (hidden 768, 12 layers, 12 heads, vocabulary 32,000, MLP 2048), context 2048, 8 sequences
per step, float32 weights under bf16 autocast, SDPA attention, fused AdamW: what a user's first GPU run looks like.
Every model lives on the device at once so that repetitions interleave (round-robin, rotated), and each variant's
ratio is taken, round by round, to the Llama timed in the same round: the ratio reported is the geometric mean over
≥ 30 rounds with its 95% t-interval, so a 1% difference is resolved or said not to be. A second Llama of the same
shape (`llama_control`) is timed as a variant: its interval is the noise the others' must be read against. Eager
first (every variant), then `torch.compile`d models, Llama first, in order of interest while the part's time lasts
(compiling dominates: the first steps' seconds are reported). Steps run without a KV cache (`use_cache=False`), as
training should.

Memory is what `torch.cuda.max_memory_allocated` would read with only that model on the device: its parameters and
optimiser state (resident), plus the peak a step allocates beyond what was allocated before it (activations,
gradients, the loss's float32 logits). The goals: mixing variants at most 1.02 of Llama's time and 1.005 of its
memory, `dense` 1.05 / 1.03, SVFormer below 1 on both; eager time per variant: identity, constant, learnable,
learnable_plus, sparse ≤ 1.02, gated and NeuTRENO ≤ 1.03, `dense` ≤ 1.05, DenseFormer ≤ 1.10; compiled every mixing
variant ≤ 1.01 time and ≤ 1.005 memory (`dense` ≤ 1.03). Where one is missed, one profiled step of it and of Llama
gives the kernel families that differ.
"""

from __future__ import annotations

import gc
import math
import re
import statistics
import time

import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM

from resformer_hf import ResFormerConfig, ResFormerForCausalLM
from resformer_hf.remote_code.mix_kernels import kernels_run

PART = "training"
LLAMA = "llama"
CONTROL = "llama_control"  #: a second, identical Llama: the noise floor of every ratio
SIZE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=12, max_position_embeddings=2048)
SMOKE_SIZE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64)
BATCH, CONTEXT, SMOKE_BATCH, SMOKE_CONTEXT = 8, 2048, 2, 64
#: Compiled in this order while time lasts: the default variant and the other headline arms first.
PRIORITY = [LLAMA, CONTROL, "learnable_plus", "svformer", "identity", "gated", "dense", "neutreno", "learnable",
            "constant", "sparse", "denseformer", "none"]
GOALS = {"dense": (1.05, 1.03), "svformer": (1.0, 1.0), "gated": (1.03, 1.005), "neutreno": (1.03, 1.005),
         "denseformer": (1.10, 1.03)}
COMPILED_GOALS = {"dense": (1.03, 1.03), "svformer": (1.0, 1.0), "denseformer": (1.10, 1.03)}
MIXING_GOAL, COMPILED_GOAL = (1.02, 1.005), (1.01, 1.005)
TIMED_ROUNDS, SMOKE_ROUNDS = 30, 3


def goal(variant: str, mode: str = "eager") -> tuple[float, float]:
    """(time, memory) ratio to Llama the variant must stay within (strictly below for SVFormer)."""
    if mode == "compiled":
        return COMPILED_GOALS.get(variant, COMPILED_GOAL)
    return GOALS.get(variant, MIXING_GOAL)


def ratio_interval(samples: list[float], llama: list[float]) -> tuple[float, float, float]:
    """Geometric mean of the per-round ratios to Llama and its 95% t-interval (log scale: ratios multiply)."""
    logs = [math.log(mine / theirs) for mine, theirs in zip(samples, llama)]
    mean = statistics.fmean(logs)
    low, high = stats.t.interval(0.95, len(logs) - 1, mean, stats.sem(logs)) if len(logs) > 1 else (mean, mean)
    return math.exp(mean), math.exp(low), math.exp(high)


class Trainee:
    """One model with its fused AdamW and a fixed batch: `step()` is one optimiser step under bf16 autocast."""

    def __init__(self, variant: str, size: dict, batch: torch.Tensor, device: torch.device):
        torch.manual_seed(0)
        llama = variant in (LLAMA, CONTROL)
        config = LlamaConfig(**size) if llama else ResFormerConfig(**size, value_residual=variant)
        config._attn_implementation = "sdpa"
        model_class = LlamaForCausalLM if llama else ResFormerForCausalLM
        self.variant, self.device, self.batch = variant, device, batch
        with device:  # initialised where it trains: seconds saved per model on a GPU
            self.model = model_class(config).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.forward = self.model

    def compile(self, backend: str) -> None:
        self.forward = torch.compile(self.model, backend=backend)

    def step(self) -> float:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.forward(input_ids=self.batch, labels=self.batch, use_cache=False).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def resident_bytes(self) -> int:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [value for state in self.optimizer.state.values() for value in state.values()
                    if isinstance(value, torch.Tensor)]
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors if tensor.device == self.device)

    def peak_bytes(self) -> int:
        """Resident bytes plus the peak one step allocates beyond what was allocated before it."""
        if self.device.type != "cuda":
            return self.resident_bytes()
        gc.collect()  # what a failed model's traceback still held would be freed inside the step and hide its peak
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self.step()
        torch.cuda.synchronize()
        return self.resident_bytes() + torch.cuda.max_memory_allocated() - before


def timed_step(trainee: Trainee) -> float:
    """Seconds of one step (device events on a GPU)."""
    if trainee.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        trainee.step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    started = time.perf_counter()
    trainee.step()
    return time.perf_counter() - started


def interleaved(trainees: dict[str, Trainee], rounds: int) -> dict[str, list[float]]:
    """Step seconds of each in every round, timed round-robin with the order rotated every round."""
    samples = {name: [] for name in trainees}
    names = list(trainees)
    for round_ in range(rounds):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            samples[name].append(timed_step(trainees[name]))
    return samples


def record_ratios(recorder, mode: str, trainees: dict[str, Trainee], samples: dict[str, list[float]], peaks: dict,
                  tokens: int, extra: dict | None = None) -> dict[str, tuple[float, float]]:
    ratios = {}
    for name, seconds in samples.items():
        step_s = statistics.median(seconds)
        time_ratio, low, high = ratio_interval(seconds, samples[LLAMA])
        memory_ratio = peaks[name] / peaks[LLAMA]
        ratios[name] = (time_ratio, memory_ratio)
        time_goal, memory_goal = goal(name, mode)
        strict = name == "svformer"
        ok = None if name in (LLAMA, CONTROL) else (
            (time_ratio < time_goal and memory_ratio < memory_goal) if strict
            else (time_ratio <= time_goal and memory_ratio <= memory_goal))
        recorder.write(PART, f"{mode}/{name}", ok=ok, step_ms=step_s * 1e3, tokens_per_s=tokens / step_s,
                       time_ratio=time_ratio, time_interval=[low, high], rounds=len(seconds), peak_bytes=peaks[name],
                       memory_ratio=memory_ratio, goal=[time_goal, memory_goal], **(extra or {}).get(name, {}))
    return ratios


def _kernel_family(name: str) -> str:
    """A kernel's name without the serial number inductor appends (`triton_poi_fused_mul_12`), so that the same
    generated kernel in two models is one row."""
    return re.sub(r"_\d+$", "", name)[:90]


def profile_difference(recorder, mode: str, llama: Trainee, other: Trainee) -> None:
    """One profiled step of each: device time by kernel family, the families that differ most, and the totals."""
    on_gpu = other.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CUDA if on_gpu else torch.profiler.ProfilerActivity.CPU]
    totals = {}
    for trainee in (llama, other):
        with torch.profiler.profile(activities=activities) as profiler:
            trainee.step()
            if on_gpu:
                torch.cuda.synchronize()
        times: dict[str, float] = {}
        for event in profiler.key_averages():
            spent = event.self_device_time_total if on_gpu else event.self_cpu_time_total
            if spent and (not on_gpu or event.device_type == torch.autograd.DeviceType.CUDA):
                times[_kernel_family(event.key)] = times.get(_kernel_family(event.key), 0.0) + spent
        totals[trainee.variant] = times
    mine, llamas = totals[other.variant], totals[llama.variant]
    differences = sorted(((mine.get(key, 0.0) - llamas.get(key, 0.0), key) for key in set(mine) | set(llamas)),
                         reverse=True)
    recorder.write(PART, f"{mode}/{other.variant}/profile", ok=None, total_us=round(sum(mine.values())),
                   llama_total_us=round(sum(llamas.values())),
                   more_us=[[key, round(delta, 1)] for delta, key in differences[:12] if delta > 0],
                   less_us=[[key, round(delta, 1)] for delta, key in differences[-5:] if delta < 0])


def measure(recorder, schedule, mode: str, trainees: dict[str, Trainee], rounds: int, tokens: int,
            extra: dict | None = None) -> None:
    peaks = {name: trainee.peak_bytes() for name, trainee in trainees.items()}
    samples = interleaved(trainees, rounds)
    ratios = record_ratios(recorder, mode, trainees, samples, peaks, tokens, extra)
    missed = [name for name, (t, m) in ratios.items()
              if name not in (LLAMA, CONTROL) and (t > goal(name, mode)[0] or m > goal(name, mode)[1])]
    for name in sorted(missed, key=lambda name: -ratios[name][0]):  # where a goal is missed: what the time went on
        if not schedule.allows(3.0):
            break
        with recorder.guarded(PART, f"{mode}/{name}/profile"):
            profile_difference(recorder, mode, trainees[LLAMA], trainees[name])


SMOKE_VARIANTS = [LLAMA, CONTROL, "learnable_plus"]


def run(recorder, schedule, plan) -> None:
    device, smoke = plan.device, plan.smoke
    variants = plan.pick(PRIORITY, SMOKE_VARIANTS)
    size, batch_size, context = (SMOKE_SIZE, SMOKE_BATCH, SMOKE_CONTEXT) if smoke else (SIZE, BATCH, CONTEXT)
    rounds = SMOKE_ROUNDS if smoke else TIMED_ROUNDS
    batch = torch.randint(3, size["vocab_size"], (batch_size, context), generator=torch.Generator().manual_seed(0))
    batch = batch.to(device)
    tokens = batch.numel()
    trainees: dict[str, Trainee] = {}
    for name in variants:
        with recorder.guarded(PART, f"eager/{name}"):
            trainee = Trainee(name, size, batch, device)
            trainee.step()  # optimiser state exists from here on: it counts as resident
            trainees[name] = trainee
    recorder.write(PART, "setup", ok=LLAMA in trainees, parameters={
        name: sum(p.numel() for p in trainee.model.parameters()) for name, trainee in trainees.items()},
        batch=batch_size, context=context, mix_kernels=kernels_run(device, torch.bfloat16))
    if LLAMA not in trainees:
        return
    measure(recorder, schedule, "eager", trainees, rounds, tokens)
    compiled: dict[str, Trainee] = {}
    compile_seconds: dict[str, dict] = {}
    backend = "aot_eager" if smoke else "inductor"
    for name in [name for name in variants if name in trainees]:
        if not schedule.allows(45.0 if not smoke else 1.0) and name != LLAMA:
            recorder.write(PART, f"compiled/{name}", ok=None, skipped="time")
            continue
        with recorder.guarded(PART, f"compiled/{name}"):
            trainee = trainees[name]
            trainee.compile(backend)
            started = time.perf_counter()
            trainee.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            first = time.perf_counter() - started
            trainee.step()
            compiled[name] = trainee
            compile_seconds[name] = {"first_step_s": round(first, 1)}
            print(f"compiled {name}: first step {first:.1f}s", flush=True)
    if LLAMA in compiled and len(compiled) > 1:
        measure(recorder, schedule, "compiled", compiled, rounds, tokens, compile_seconds)
    for trainee in trainees.values():
        trainee.optimizer.state.clear()
    trainees.clear()
    compiled.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
