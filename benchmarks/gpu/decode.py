"""Item 4 of the GPU run: decoding speed, and what SVFormer's half-size values buy a server.

Models of the training part's shape (12 layers, hidden 768, 12 heads) in bf16, each against a same-shape Llama in the
same rounds:

- `generate()` with a static cache, as it runs on a GPU by default (the decode step compiled, CUDA graphs), at batch 1
  and 32 after a 4k-token context: decode tokens/s from the time of `N + 1` new tokens less that of 1 (the prefill
  cancels), medians of interleaved repetitions. Goal: mixing variants within 1.02 of Llama's time.
- Capacity: continuous batching (`generate_batch`, the plugin's paged cache) at one KV-cache budget, sized to hold
  `LLAMA_SEQUENCES` 8k-token sequences of a Llama: how many such sequences the engine's cache holds for each model,
  and the tokens/s that come out when twice SVFormer's capacity of requests are queued, each generating 256 tokens
  (enough that decoding, where holding more sequences pays, outweighs the prefills of 8k-token prompts, which cost
  both models alike). Goal: SVFormer holds and serves at least 1.6x Llama's (2L/(L+1) = 1.85 at 12
  layers is the bound).
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.distributed import DistributedHelper

from resformer_hf import ResFormerConfig, ResFormerForCausalLM

from .training import LLAMA, SIZE, SMOKE_SIZE

PART = "decode"
CAPACITY = "capacity"
PRIORITY = [LLAMA, "learnable_plus", "svformer", "identity", "gated", "dense", "neutreno", "learnable", "sparse"]
CONTEXT, NEW_TOKENS, BATCHES = 4096, 128, (1, 32)
SMOKE_CONTEXT, SMOKE_NEW_TOKENS, SMOKE_BATCHES = 48, 4, (1, 2)
SEQUENCE, CB_NEW_TOKENS, LLAMA_SEQUENCES, PAGE = 8192, 256, 8, 256
SMOKE_SEQUENCE, SMOKE_CB_NEW_TOKENS, SMOKE_PAGE = 96, 4, 16
ROUNDS, SMOKE_ROUNDS = 5, 1
DECODE_GOAL, CAPACITY_GOAL = 1.02, 1.6


def build(variant: str, size: dict, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(**size) if variant == LLAMA else ResFormerConfig(**size, value_residual=variant)
    model_class = LlamaForCausalLM if variant == LLAMA else ResFormerForCausalLM
    return model_class(config).to(device=device, dtype=torch.bfloat16).eval()


def greedy_config(new_tokens: int, smoke: bool) -> GenerationConfig:
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0, cache_implementation="static")
    if smoke:  # off the GPU generate() compiles only when told to; the eager backend traces without codegen
        config.compile_config = CompileConfig(backend="eager")
        config.compile_config._compile_all_devices = True
    return config


def timed(device: torch.device, function, *args, **kwargs) -> float:
    """Wall seconds of `function(*args, **kwargs)`, the device's queued work included."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    function(*args, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


SMOKE_VARIANTS = [LLAMA, "learnable_plus"]


def decode_speed(recorder, schedule, plan) -> None:
    device, smoke = plan.device, plan.smoke
    size = dict(SMOKE_SIZE if smoke else SIZE)
    context, new_tokens = (SMOKE_CONTEXT, SMOKE_NEW_TOKENS) if smoke else (CONTEXT, NEW_TOKENS)
    size["max_position_embeddings"] = context
    rounds = SMOKE_ROUNDS if smoke else ROUNDS
    models = {}
    batches = SMOKE_BATCHES if smoke else BATCHES
    for index, batch in enumerate(batches):
        schedule.split(index, len(batches))  # each batch size gets its share: batch 32 is not starved by batch 1
        prompt = torch.randint(3, size["vocab_size"], (batch, context - new_tokens),
                               generator=torch.Generator().manual_seed(batch)).to(device)
        long_run, short_run = greedy_config(new_tokens, smoke), greedy_config(1, smoke)
        ready = {}
        for variant in plan.pick(PRIORITY, SMOKE_VARIANTS):
            if variant != LLAMA and not schedule.allows(30.0 if not smoke else 1.0):
                recorder.write(PART, f"batch{batch}/{variant}", ok=None, skipped="time")
                continue
            with recorder.guarded(PART, f"batch{batch}/{variant}"), torch.no_grad():
                model = models.get(variant) or build(variant, size, device)
                models[variant] = model
                warm = timed(device, model.generate, prompt, generation_config=long_run)
                model.generate(prompt, generation_config=short_run)
                ready[variant] = (model, warm)
        if LLAMA not in ready:
            continue
        samples = {variant: [] for variant in ready}
        with torch.no_grad():
            for round_ in range(rounds):
                names = list(ready)[round_ % len(ready):] + list(ready)[: round_ % len(ready)]
                for variant in names:
                    model = ready[variant][0]
                    whole = timed(device, model.generate, prompt, generation_config=long_run)
                    prefill = timed(device, model.generate, prompt, generation_config=short_run)
                    samples[variant].append(max(whole - prefill, 1e-9) / (new_tokens - 1))
        step = {variant: statistics.median(values) for variant, values in samples.items()}
        for variant, seconds in step.items():
            ratio = seconds / step[LLAMA]
            spread = (max(samples[variant]) - min(samples[variant])) / seconds  # the repetitions' own noise
            recorder.write(PART, f"batch{batch}/{variant}", ok=None if variant == LLAMA else ratio <= DECODE_GOAL,
                           step_ms=seconds * 1e3, tokens_per_s=batch / seconds, time_ratio=ratio, goal=DECODE_GOAL,
                           spread=spread,
                           first_call_s=round(ready[variant][1], 1), context=context, batch=batch)
    models.clear()


def cache_sequences(model, cb_config: ContinuousBatchingConfig, sequence: int, device: torch.device) -> tuple:
    """(sequences of `sequence` tokens the engine's paged cache holds, its data bytes) for `model` and `cb_config`."""
    cache = PagedAttentionCache(model.config, cb_config, device, DistributedHelper(None, None), dtype=torch.bfloat16)
    pages = -(-sequence // cb_config.page_size)
    sequences = min(allocator.num_blocks // pages for allocator in cache.cache_allocators.values())
    data_bytes = cache.num_sectors * cache.bytes_per_sector
    del cache
    return sequences, data_bytes


def capacity(recorder, schedule, plan) -> None:
    device, smoke = plan.device, plan.smoke
    size = dict(SMOKE_SIZE if smoke else SIZE)
    sequence, new_tokens, page = (SMOKE_SEQUENCE, SMOKE_CB_NEW_TOKENS, SMOKE_PAGE) if smoke else (
        SEQUENCE, CB_NEW_TOKENS, PAGE)
    size["max_position_embeddings"] = sequence
    # The budget in Llama-sized blocks (what `num_blocks` counts): LLAMA_SEQUENCES whole sequences of a Llama.
    blocks = LLAMA_SEQUENCES * -(-sequence // page)
    cb_config = ContinuousBatchingConfig(num_blocks=blocks, page_size=page, max_batch_tokens=sequence,
                                         max_memory_percent=0.9)
    generation = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    held, requests = {}, None
    for variant in (LLAMA, "svformer", "learnable_plus"):
        if variant != LLAMA and not schedule.allows(20.0 if not smoke else 1.0):
            recorder.write(CAPACITY, variant, ok=None, skipped="time")
            continue
        with recorder.guarded(CAPACITY, variant), torch.no_grad():
            model = build(variant, size, device)
            sequences, data_bytes = cache_sequences(model, cb_config, sequence, device)
            held[variant] = sequences
            if requests is None:  # twice what the larger cache holds (SVFormer's), the same queue for every model
                svformer = build("svformer", size, device) if variant != "svformer" else model
                count = 2 * max(sequences, cache_sequences(svformer, cb_config, sequence, device)[0])
                del svformer
                generator = torch.Generator().manual_seed(11)
                length = sequence - new_tokens
                requests = [torch.randint(3, size["vocab_size"], (length,), generator=generator).tolist()
                            for _ in range(count)]
            seconds = timed(device, model.generate_batch, requests, generation_config=generation,
                            continuous_batching_config=cb_config)
            tokens_per_s = len(requests) * new_tokens / seconds
            ratio = {} if variant == LLAMA else dict(
                sequences_ratio=sequences / held[LLAMA], tokens_per_s_ratio=tokens_per_s / held["llama_tps"])
            if variant == LLAMA:
                held["llama_tps"] = tokens_per_s
            ok = None if variant != "svformer" else min(ratio.values()) >= CAPACITY_GOAL
            recorder.write(CAPACITY, variant, ok=ok, sequences=sequences, cache_bytes=data_bytes,
                           requests=len(requests), sequence_tokens=sequence, new_tokens=new_tokens,
                           seconds=seconds, tokens_per_s=tokens_per_s, goal=CAPACITY_GOAL, **ratio)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
