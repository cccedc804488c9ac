"""SVFormer's inference memory: KV-cache bytes, peak process memory and decode speed vs Llama of the same size.

HF `LlamaForCausalLM`, a ResFormer (`learnable_plus`) and an SVFormer of the same size are built from the same seed.
Ratios to Llama are measured in the same run. Goal: SVFormer's cache is exactly (L+1)/(2L) of Llama's.

    python -m benchmarks.cost.bench_svformer_cache                       # CPU defaults (1 thread), under 10 minutes
    python -m benchmarks.cost.bench_svformer_cache --device cuda --hidden 1024 --layers 16 --contexts 2048 8192 32768

- Cache bytes and peak memory: each (model, context) runs the stock `generate()` (greedy, its default dynamic cache)
  in a fresh process: the peak bytes of live tensors it creates, checked after every aten op
  (`live_bytes.PeakLiveTensorBytes`: deterministic, unlike RSS; `torch.cuda.max_memory_allocated` above what was
  allocated before on CUDA). Cache bytes are `resformer_hf.cache_nbytes` of the returned
  cache (shared storage counted once).
- Decode tokens/s: timing whole generate() calls in separate processes on a shared machine measures the neighbours,
  so all three models are prefilled once in one process, with the cache generate() would build (the default dynamic
  cache, and a static cache as `cache_implementation="static"` builds it), and then take turns decoding bursts of
  tokens through it (the forward generate() runs per step), the cache rewound after each burst; medians over bursts.

Writes `benchmarks/results/svformer_cache.{md,png}` and the docs' SVFormer table (`<!-- svformer-cache:... -->`,
in docs/svformer-memory.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from transformers import StaticCache

from resformer_hf.remote_code._compat import cache_of, with_cache
from resformer_hf.remote_code.cache_resformer import share_first_layer_values

from benchmarks import common
from benchmarks.common import (
    BASELINE,
    RESULTS_DIR,
    add_device_args,
    build_model,
    pyplot,
    rewrite_readme_block,
    setup_device,
)
from benchmarks.cost.live_bytes import PeakLiveTensorBytes
from benchmarks.cost.timing import interleaved_medians
from benchmarks.records import child_result

MODELS = [BASELINE, "learnable_plus", "svformer"]
CACHES = ("dynamic", "static")
MIB = 2**20


# ---- one measurement, in its own process ----------------------------------------------------------------------------


def measure_memory(job: dict) -> dict:
    """Prefill `context` random tokens and greedily decode `new_tokens` with generate(); cache bytes and peak."""
    import resformer_hf

    device = setup_device(argparse.Namespace(device=job["device"], threads=job["threads"]))
    model = seeded_model(job["model"], job, device)
    prompt = random_prompt(job, device)
    greedy = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(prompt[:, :16], max_new_tokens=4, **greedy)  # one-time costs (kernels, allocator) first
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        with PeakLiveTensorBytes() as live:
            out = model.generate(prompt, max_new_tokens=job["new_tokens"], min_new_tokens=job["new_tokens"],
                                 return_dict_in_generate=True, **greedy)
        peak_delta = live.peak
        if device.type == "cuda":
            peak_delta = torch.cuda.max_memory_allocated(device) - before
    return {"cache_bytes": resformer_hf.cache_nbytes(cache_of(out)), "peak_delta_bytes": peak_delta}


def seeded_model(name: str, job: dict, device: torch.device):
    torch.manual_seed(job["seed"])
    return build_model(name, device=device, dtype=getattr(torch, job["dtype"]), **job["size"]).eval()


def random_prompt(job: dict, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(job["seed"] + 1)
    prompt = torch.randint(3, job["size"]["vocab_size"], (job["batch_size"], job["context"]), generator=generator)
    return prompt.to(device)


def generation_cache(model, kind: str, max_cache_len: int):
    """The cache generate() builds: None (the model's default dynamic cache) or a static cache, with SVFormer's values
    stored once as `cache_implementation="static"` makes it."""
    if kind == "dynamic":
        return None
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    if getattr(model.config, "layers_without_value_projection", None):
        share_first_layer_values(cache)
    return cache


def rewind(cache, kind: str, steps: int) -> None:
    """Back to the prompt, so every burst decodes at the same context length."""
    if kind == "dynamic":
        cache.crop(-steps)
    else:  # a static cache keeps its buffers; positions past the counter are masked and overwritten next time
        for layer in cache.layers:
            layer.cumulative_length.sub_(steps)


@torch.inference_mode()
def decode_speeds(job: dict, repeats: int, kind: str) -> dict[str, float]:
    """Median decode tokens/s of each model at one context with a `kind` cache, the models taking turns by burst."""
    device = setup_device(argparse.Namespace(device=job["device"], threads=job["threads"]))
    prompt = random_prompt(job, device)
    steps = job["new_tokens"]
    states = {}
    for name in MODELS:
        model = seeded_model(name, job, device)
        cache = generation_cache(model, kind, job["context"] + steps)
        out = model(prompt, **with_cache(cache), use_cache=True, logits_to_keep=1)
        states[name] = (model, cache_of(out), out.logits[:, -1:].argmax(-1))

    def burst(name: str) -> None:
        model, cache, token = states[name]
        for _ in range(steps):
            token = model(token, **with_cache(cache), use_cache=True).logits[:, -1:].argmax(-1)
        rewind(cache, kind, steps)

    seconds = interleaved_medians({name: (lambda name=name: burst(name)) for name in MODELS}, repeats=repeats,
                                  warmup=1, device=device)
    return {name: steps / seconds[name] for name in MODELS}


def run_in_fresh_process(job: dict) -> dict:
    return child_result(["-m", "benchmarks.cost.bench_svformer_cache", "--worker", json.dumps(job)],
                        f"measurement {job['model']} @ {job['context']} failed")


# ---- the benchmark --------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(parser)
    # One thread by default: on a shared CPU, torch's default of one thread per core oversubscribes and the timings
    # become noise.
    parser.set_defaults(threads=1)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers L (default 8)")
    parser.add_argument("--head-dim", type=int, default=64, help="attention head size (default 64)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: as many as query heads)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size (default 4096)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192], help="prompt lengths")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[32, 32, 16],
                        help="tokens per decode burst / generate() call, one value or one per context")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7, help="timed decode bursts per (model, context) (median)")
    parser.add_argument("--memory-repeats", type=int, default=1, help="fresh-process generate() runs per point")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "svformer_cache", help="path stem for .md/.png")
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite the docs' SVFormer table")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if len(args.new_tokens) == 1:
        args.new_tokens = args.new_tokens * len(args.contexts)
    if len(args.new_tokens) != len(args.contexts):
        parser.error(f"--new-tokens takes one value or one per context ({len(args.contexts)}), got {args.new_tokens}")
    if min(args.new_tokens) < 3:
        parser.error("--new-tokens must be at least 3 to time decoding")
    heads = args.hidden // args.head_dim
    if heads * args.head_dim != args.hidden:
        parser.error(f"--hidden {args.hidden} must be a multiple of --head-dim {args.head_dim}")
    if args.kv_heads is not None and heads % args.kv_heads:
        parser.error(f"--kv-heads {args.kv_heads} must divide the {heads} query heads")
    return args


def size_fields(args: argparse.Namespace) -> dict:
    heads = args.hidden // args.head_dim
    return dict(
        vocab_size=args.vocab_size, hidden_size=args.hidden, intermediate_size=round(args.hidden * 8 / 3 / 32) * 32,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=args.kv_heads or heads,
        max_position_embeddings=max(c + n for c, n in zip(args.contexts, args.new_tokens)), tie_word_embeddings=False,
    )


def collect(args: argparse.Namespace) -> dict[tuple[str, int], dict]:
    results = {}
    for context, new_tokens in zip(args.contexts, args.new_tokens):
        job = dict(context=context, new_tokens=new_tokens, size=size_fields(args), batch_size=args.batch_size,
                   dtype=args.dtype, device=args.device, threads=args.threads, seed=args.seed)
        memory: dict[str, list[dict]] = {name: [] for name in MODELS}
        for _ in range(args.memory_repeats):
            for name in MODELS:
                memory[name].append(run_in_fresh_process({**job, "model": name}))
        speeds = {kind: decode_speeds(job, repeats=args.repeats, kind=kind) for kind in CACHES}
        for name in MODELS:
            runs = memory[name]
            results[name, context] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            for kind in CACHES:
                results[name, context][f"decode_tok_s_{kind}"] = speeds[kind][name]
            print(f"context {context} {name}: {results[name, context]}", flush=True)
    return results


def report(args: argparse.Namespace, medians: dict) -> str:
    target = (args.layers + 1) / (2 * args.layers)
    rows = []
    for context in args.contexts:
        base = medians[BASELINE, context]
        for name in MODELS:
            m = medians[name, context]
            rows.append([
                context, name,
                f"{m['cache_bytes'] / MIB:.2f}", f"{m['cache_bytes'] / base['cache_bytes']:.4f}",
                f"{m['peak_delta_bytes'] / MIB:.1f}", f"{m['peak_delta_bytes'] / base['peak_delta_bytes']:.3f}",
                *(cell for kind in CACHES for cell in (
                    f"{m[f'decode_tok_s_{kind}']:.1f}",
                    f"{m[f'decode_tok_s_{kind}'] / base[f'decode_tok_s_{kind}']:.3f}",
                )),
            ])
    header = ["context", "model", "cache MiB", "cache / Llama", "generate peak MiB", "peak / Llama",
              "decode tok/s (dynamic)", "/ Llama", "decode tok/s (static)", "/ Llama"]
    size = size_fields(args)
    return "\n".join([
        "# SVFormer KV cache vs Llama",
        "",
        f"Model size: hidden {args.hidden}, {args.layers} layers, {size['num_attention_heads']} query heads, "
        f"{size['num_key_value_heads']} kv heads, head dim {args.head_dim}, vocab {args.vocab_size}; batch "
        f"{args.batch_size}, {args.dtype}; new tokens per context {dict(zip(args.contexts, args.new_tokens))}. "
        f"Memory: one greedy `generate()` per point in a fresh process with the default dynamic cache (median of "
        f"{args.memory_repeats}); decode tok/s: median of {args.repeats} interleaved bursts through the default "
        "dynamic cache and through a static cache (`cache_implementation=\"static\"`, sized context + new tokens).",
        f"Target cache ratio for SVFormer: (L+1)/(2L) = {target:.4f}.",
        "",
        common.markdown_table(header, rows),
        "",
        "`generate peak MiB`: peak bytes of the live tensors generate() creates (KV cache, activations, logits), "
        "checked after every aten op (`benchmarks/cost/live_bytes.py`): deterministic, the same in every run, unlike "
        "the RSS samples this column held before; on CUDA the peak allocated bytes above those allocated before.",
        "",
        common.environment_line(torch.device(args.device)),
        f"Command: `{' '.join(['python -m benchmarks.cost.bench_svformer_cache', *sys.argv[1:]])}`",
        "",
    ])


def plot(args: argparse.Namespace, medians: dict, path: Path) -> None:
    plt = pyplot()
    metrics = [("cache_bytes", "KV-cache bytes / Llama"), ("peak_delta_bytes", "generate() peak memory / Llama"),
               ("decode_tok_s", "decode tokens/s / Llama")]
    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    for axis, (key, title) in zip(axes, metrics):
        for name in MODELS[1:]:
            for kind in CACHES if key == "decode_tok_s" else (None,):
                field = f"{key}_{kind}" if kind else key
                ratios = [medians[name, c][field] / medians[BASELINE, c][field] for c in args.contexts]
                style = "--" if kind == "static" else "-"
                axis.plot(args.contexts, ratios, style, marker="o", label=f"{name}, {kind} cache" if kind else name)
        axis.axhline(1.0, color="grey", linestyle=":", label="Llama")
        if key != "decode_tok_s":
            axis.axhline((args.layers + 1) / (2 * args.layers), color="red", linestyle="--", label="(L+1)/(2L)")
        axis.set_xscale("log", base=2)
        axis.set_xticks(args.contexts, [str(c) for c in args.contexts])
        axis.set_xlabel("context (tokens)")
        axis.set_title(title)
        axis.legend(fontsize="small")
    figure.suptitle(f"SVFormer vs Llama, hidden {args.hidden} x {args.layers} layers ({args.device})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def readme_table(args: argparse.Namespace, medians: dict) -> str:
    """The docs' SVFormer table: SVFormer's ratios to Llama at each context."""
    rows = []
    for context in args.contexts:
        sv, base = medians["svformer", context], medians[BASELINE, context]
        rows.append([context, f"{sv['cache_bytes'] / base['cache_bytes']:.4f}",
                     f"{sv['peak_delta_bytes'] / base['peak_delta_bytes']:.2f}",
                     *(f"{sv[f'decode_tok_s_{kind}'] / base[f'decode_tok_s_{kind}']:.2f}" for kind in CACHES)])
    kv = f"{args.kv_heads} kv heads" if args.kv_heads else "MHA"
    threads = f"{args.threads} CPU thread" + ("s" if args.threads > 1 else "") if args.device == "cpu" else args.device
    command = " ".join(["python -m benchmarks.cost.bench_svformer_cache", *sys.argv[1:]])
    return "\n".join([
        f"Measured by `{command}` (hidden {args.hidden}, {args.layers} layers, {kv}, {args.dtype}, batch "
        f"{args.batch_size}, {threads}; ratios to a same-size `LlamaForCausalLM` in the same run; full table and plot "
        "in `benchmarks/results/svformer_cache.*`; this table is written by that command):",
        "",
        common.markdown_table(["context", "cache / Llama", "`generate()` peak memory / Llama",
                        "decode tokens/s / Llama (dynamic cache)", "(static cache)"], rows),
    ])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(measure_memory(json.loads(args.worker))))
        return
    setup_device(args)
    medians = collect(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    text = report(args, medians)
    args.output.with_suffix(".md").write_text(text)
    plot(args, medians, args.output.with_suffix(".png"))
    print(text)
    if not args.no_readme:
        rewrite_readme_block("svformer-cache", readme_table(args, medians))
        print("rewrote the docs' SVFormer table")


if __name__ == "__main__":
    main()
