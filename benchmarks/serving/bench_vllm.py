"""vLLM decode throughput and KV cache: learnable_plus, SVFormer, CLA2 and SVFormer × CLA2 vs a Llama of the same
size, in the same run.

The Llamas serve with vLLM's Transformers modeling backend (`model_impl="transformers"`); the ResFormers with this
plugin's vLLM model (`resformer_hf.integrations.vllm_plugin`, picked by vLLM's default `model_impl="auto"`), which is
the same backend, stores an SVFormer's values once (keys per layer, layer 0's values in one store) and gives
cross-layer attention's consumer layers their producer's cache (vLLM's own cross-layer KV sharing).

Needs vLLM (docs/serving.md); run it in that virtualenv from the repository root:

    python -m benchmarks.serving.bench_vllm

One vLLM engine per model, all alive at once in this process, timed round-robin (one greedy `generate()` of a batch
per model per round, the first round discarded, the order rotated each round), so a busy machine slows every model
alike; each ratio is the median over rounds of the model's throughput over the Llama's in the same round. A second
Llama with other random weights is the noise floor: its ratio says how far apart two identical architectures land.
Decode throughput = generated tokens / wall time of the `generate()` call (prompts are short, so decode dominates).
Also records the KV cache vLLM allocates per token for each model (cache bytes given / cache tokens it holds) and
how many tokens that cache holds.

`--kv-only` loads the engines and records the KV cache only (exact, minutes instead of hours on a shared CPU), into
benchmarks/results/vllm_kv_cache.md by default. Otherwise writes benchmarks/results/vllm.md. Engines are created
under `if __name__ == "__main__"` (vLLM may start processes with `spawn`, which re-imports this file), and the top
level imports nothing heavy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.serving.kv_cache_shares import KV_CACHE_SHARES

RESULTS = Path(__file__).resolve().parents[1] / "results" / "vllm.md"
KV_RESULTS = Path(__file__).resolve().parents[1] / "results" / "vllm_kv_cache.md"
MODELS = ("llama", "learnable_plus", "svformer", "cla2", "svformer_cla2", "llama_2")
#: ResFormer models: config fields, and their ideal KV bytes per token over a Llama's as a function of L.
RESFORMERS = {"learnable_plus": (dict(value_residual="learnable_plus"), "1", lambda layers: 1.0), **KV_CACHE_SHARES}


def build_folders(root: Path, size: dict) -> dict[str, Path]:
    """Hub folders for every model: Llamas with seeds 0 and 1, ResFormers with seed 0's weights (so every model has
    the same shapes) and λ moved off their initial values."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from resformer_hf import ResFormerConfig, ResFormerForCausalLM
    from resformer_hf.hub import save_for_hub
    from resformer_hf.text import sample_text, train_tokenizer

    tokenizer = train_tokenizer([sample_text(200_000)], size["vocab_size"])
    special = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("pad", "bos", "eos")}
    shape = {**size, **special, "vocab_size": len(tokenizer)}
    folders = {}
    for name, seed in (("llama", 0), ("llama_2", 1)):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
        folders[name] = root / name
        model.save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    for name, (fields, _, _) in RESFORMERS.items():
        torch.manual_seed(0)
        model = ResFormerForCausalLM(ResFormerConfig(**shape, **fields)).eval()
        with torch.no_grad():
            for parameter in model.model.value_residual.parameters():
                parameter.uniform_(-0.4, 0.4)
        folders[name] = save_for_hub(model, root / name, tokenizer=tokenizer)
    return folders


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per batch size (plus one discarded)")
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--kv-only", action="store_true",
                        help="load the engines and record the KV cache only (no timing); writes vllm_kv_cache.md")
    parser.add_argument("--output", type=Path, default=None, help="default: results/vllm.md (vllm_kv_cache.md "
                        "with --kv-only)")
    args = parser.parse_args(argv)
    args.output = args.output or (KV_RESULTS if args.kv_only else RESULTS)

    import os

    # Every engine's core and worker in this process: no engine processes left spinning between their turns
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    from resformer_hf.integrations.vllm_plugin import register

    from benchmarks.common import environment_line, markdown_table

    register()  # what vLLM's plugin loader does when the plugin is installed; explicit, so a source checkout works

    size = dict(hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab_size,
                max_position_embeddings=1024)
    head_dim = args.hidden_size // args.heads
    kv_bytes = args.kv_cache_mib * 2**20
    with tempfile.TemporaryDirectory() as scratch:
        folders = build_folders(Path(scratch), size)
        engines, load_seconds, per_token, cache_tokens = {}, {}, {}, {}
        for name in MODELS:
            start = time.perf_counter()
            engines[name] = LLM(
                model=str(folders[name]), model_impl="transformers" if name.startswith("llama") else "auto",
                trust_remote_code=True, dtype="float32",
                enforce_eager=True, max_model_len=args.prompt_tokens + args.new_tokens + 16,
                kv_cache_memory_bytes=kv_bytes, seed=0, distributed_executor_backend="uni",
            )
            load_seconds[name] = time.perf_counter() - start
            cache = engines[name].llm_engine.vllm_config.cache_config
            cache_tokens[name] = cache.num_gpu_blocks * cache.block_size
            per_token[name] = kv_bytes / cache_tokens[name]
            print(f"loaded {name} in {load_seconds[name]:.1f} s; KV bytes/token {per_token[name]:.0f}", flush=True)

        if args.kv_only:
            engines.clear()
            text = kv_report(args, per_token, cache_tokens, load_seconds, head_dim, size, argv)
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(text)
            print(text)
            return
        generator = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        throughput: dict[tuple[str, int], list[float]] = {}
        for batch in args.batches:
            prompts = [{"prompt_token_ids": torch.randint(3, size["vocab_size"], (args.prompt_tokens,),
                                                          generator=generator).tolist()} for _ in range(batch)]
            for round_index in range(args.rounds + 1):
                shift = round_index % len(MODELS)  # rotate who goes first
                order = MODELS[shift:] + MODELS[:shift]
                for name in order:
                    tick = time.perf_counter()
                    outputs = engines[name].generate(prompts, params, use_tqdm=False)
                    seconds = time.perf_counter() - tick
                    generated = sum(len(output.outputs[0].token_ids) for output in outputs)
                    assert generated == batch * args.new_tokens, generated
                    if round_index:
                        throughput.setdefault((name, batch), []).append(generated / seconds)
                print(f"batch {batch} round {round_index} done", flush=True)
        for engine in engines.values():
            del engine
        engines.clear()

    rows = []
    for batch in args.batches:
        base = throughput[("llama", batch)]
        for name in MODELS:
            values = throughput[(name, batch)]
            ratios = [value / llama for value, llama in zip(values, base)]  # paired: the same round
            rows.append((batch, name, f"{statistics.median(values):.1f}", f"{min(values):.1f}–{max(values):.1f}",
                         f"{statistics.median(ratios):.3f}", f"{min(ratios):.2f}–{max(ratios):.2f}",
                         f"{per_token[name]:.0f}", f"{per_token[name] / per_token['llama']:.4f}",
                         f"{cache_tokens[name]}", f"{cache_tokens[name] / cache_tokens['llama']:.3f}"))
    header = ("batch", "model", "decode tok/s (median)", "range", "/ Llama (median of rounds)", "ratio range",
              "KV bytes/token", "KV / Llama", "cache tokens", "tokens / Llama")
    command = "python -m benchmarks.serving.bench_vllm " + " ".join(sys.argv[1:] if argv is None else argv)
    svformer_ideal = (args.layers + 1) / (2 * args.layers)
    text = "\n".join([
        "# vLLM decode throughput and KV cache: ResFormer vs Llama",
        "",
        f"Model size: hidden {args.hidden_size}, {args.layers} layers, {args.heads} query heads, {args.kv_heads} kv "
        f"heads, head dim {head_dim}, vocab {size['vocab_size']}, float32. Served by vLLM's Transformers modeling "
        "backend: the Llamas with `model_impl=\"transformers\"`, the ResFormers with this plugin's vLLM model "
        "(`model_impl=\"auto\"`; an SVFormer stores keys per layer and layer 0's values once), all with "
        "`trust_remote_code=True`, `enforce_eager=True`; one engine per model, all loaded at once, each in this "
        "process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, uni executor). Each "
        f"round: one greedy `generate()` per model of a batch of {args.prompt_tokens}-token prompts, "
        f"{args.new_tokens} new tokens each (`ignore_eos`); {args.rounds} rounds after one discarded, the order "
        "rotated each round; the ratio is the median over rounds of the model's tok/s over the Llama's in the same "
        "round. `llama_2` is a second Llama (other random weights): the noise floor. Goal: learnable_plus and "
        "svformer ≥ 0.98 of Llama.",
        "",
        markdown_table(header, rows),
        "",
        f"KV bytes/token: the KV cache vLLM was given ({args.kv_cache_mib} MiB) over the tokens it holds in it "
        "(cache tokens). "
        f"SVFormer in vLLM: {per_token['svformer'] / per_token['llama']:.4f} of Llama's bytes per token, "
        f"{cache_tokens['svformer'] / cache_tokens['llama']:.3f}× the tokens in the same memory; the ideal, "
        f"what transformers' cache keeps, is (L+1)/(2L) = {svformer_ideal:.4f} (2L/(L+1) = {1 / svformer_ideal:.3f}×"
        f" the tokens). CLA2: {per_token['cla2'] / per_token['llama']:.4f} (ideal 0.5); SVFormer × CLA2: "
        f"{per_token['svformer_cla2'] / per_token['llama']:.4f} (ideal (L/2+1)/(2L) = "
        f"{RESFORMERS['svformer_cla2'][2](args.layers):.4f}). Exact: they do not depend on load.",
        "",
        f"{environment_line(torch.device('cpu'))} vLLM {vllm.__version__}, CPU backend (torch threads: the "
        "driver's; a shared machine). Engine load times (s): "
        + ", ".join(f"{n} {s:.0f}" for n, s in load_seconds.items()) + ".",
        f"Command: `{command.strip()}`",
        "",
    ])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)


def kv_report(args, per_token: dict, cache_tokens: dict, load_seconds: dict, head_dim: int, size: dict,
              argv) -> str:
    """The `--kv-only` table: bytes per cached token and tokens in the cache, each model over the Llama and the
    ideal ratio."""
    import torch
    import vllm

    from benchmarks.common import environment_line, markdown_table

    ideal = {"llama": ("1", 1.0), "llama_2": ("1", 1.0)}
    ideal.update({name: (formula, share(args.layers)) for name, (_, formula, share) in RESFORMERS.items()})
    header = ("model", "KV bytes/token", "KV / Llama", "ideal", "cache tokens", "tokens / Llama")
    rows = [(name, f"{per_token[name]:.0f}", f"{per_token[name] / per_token['llama']:.4f}",
             f"{ideal[name][0]} = {ideal[name][1]:.4f}", f"{cache_tokens[name]}",
             f"{cache_tokens[name] / cache_tokens['llama']:.3f}") for name in MODELS]
    command = "python -m benchmarks.serving.bench_vllm " + " ".join(sys.argv[1:] if argv is None else argv)
    return "\n".join([
        "# vLLM KV cache: ResFormer vs Llama",
        "",
        f"Model size: hidden {args.hidden_size}, {args.layers} layers, {args.heads} query heads, {args.kv_heads} kv "
        f"heads, head dim {head_dim}, vocab {size['vocab_size']}, float32; served as in [vllm.md](vllm.md) (the "
        "ResFormers with this plugin's vLLM model). KV bytes/token: the KV cache vLLM was given "
        f"({args.kv_cache_mib} MiB) over the tokens it holds in it (cache tokens, whole blocks). Exact: they do not "
        "depend on load.",
        "",
        markdown_table(header, rows),
        "",
        f"{environment_line(torch.device('cpu'))} vLLM {vllm.__version__} (CPU backend). Engine load times (s): "
        + ", ".join(f"{n} {s:.0f}" for n, s in load_seconds.items()) + ".",
        f"Command: `{command.strip()}`",
        "",
    ])


if __name__ == "__main__":
    main()
