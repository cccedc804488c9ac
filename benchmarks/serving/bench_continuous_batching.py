"""SVFormer and cross-layer attention (CLA2, SVFormer × CLA2) in transformers' continuous batching: KV bytes per
cached token and tokens per memory budget, next to a same-size HF `LlamaForCausalLM`, and greedy equality of
`generate_batch` with `generate()`.

    python -m benchmarks.serving.bench_continuous_batching  # CPU, a few minutes; writes results/continuous_batching.md

- Paged cache (the engine behind `generate_batch` and `transformers serve --continuous-batching`): the
  `PagedAttentionCache` the engine builds for the model's config, with the engine's own constructor call, for
  `--num-blocks` Llama-sized blocks; bytes per cached token = its data bytes / the tokens its blocks hold (trash
  sectors excluded). With the plugin's allocator (installed by `import resformer_hf`) and with transformers' stock one.
- `generate()`'s cache: `resformer_hf.cache_nbytes` of the cache greedy `generate()` returns, over its tokens.
- Tokens in one budget: `--budget-mib` / bytes per cached token.
- Greedy equality: `generate_batch` on prompts of mixed lengths vs `generate()` one prompt at a time.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import cache as paged_cache_module
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.distributed import DistributedHelper

import resformer_hf
from resformer_hf.integrations.paged_cache import StoredKeysValuesAllocator

from benchmarks import common
from benchmarks.common import BASELINE, RESULTS_DIR, add_device_args, build_model, setup_device
from benchmarks.serving.kv_cache_shares import KV_CACHE_SHARES

#: name: (config fields, share of the Llama's bytes per token as a formula and as a function of L)
MODELS = {BASELINE: (dict(value_residual=BASELINE), "1", lambda layers: 1.0), **KV_CACHE_SHARES}
PROMPT_LENGTHS = (5, 23, 61, 12)


@contextlib.contextmanager
def stock_allocator():
    """transformers' own full-attention allocator in the engine's registry (what the plugin replaces)."""
    saved = dict(paged_cache_module.ATTN_TYPE_TO_ALLOCATOR)
    for key, allocator in saved.items():
        if allocator is StoredKeysValuesAllocator:
            paged_cache_module.ATTN_TYPE_TO_ALLOCATOR[key] = FullAttentionCacheAllocator
    try:
        yield
    finally:
        paged_cache_module.ATTN_TYPE_TO_ALLOCATOR.update(saved)


def paged_bytes_per_token(config, num_blocks: int, dtype: torch.dtype, device: torch.device) -> float:
    """Bytes per cached token of the paged cache transformers' continuous batching builds for `config`."""
    cb_config = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=64, max_memory_percent=0.5)
    cache = paged_cache_module.PagedAttentionCache(config, cb_config, device, DistributedHelper(None, None),
                                                   dtype=dtype)
    data_bytes = cache.num_sectors * cache.bytes_per_sector
    tokens = sum(allocator.num_blocks * allocator.tokens_per_page for allocator in cache.cache_allocators.values())
    return data_bytes / tokens


def generate_bytes_per_token(model, prompt: list[int], new_tokens: int) -> float:
    output = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=new_tokens, do_sample=False,
                            return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    cache = getattr(output, "cache", None) or output.past_key_values
    return resformer_hf.cache_nbytes(cache) / (output.sequences.shape[1] - 1)


def greedy_equal(model, prompts: list[list[int]], new_tokens: int) -> bool:
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = [model.generate(torch.tensor([p], device=model.device), generation_config=config)[0, len(p):].tolist()
                for p in prompts]
    outputs = model.generate_batch(prompts, generation_config=config,
                                   continuous_batching_config=ContinuousBatchingConfig(num_blocks=16,
                                                                                       max_batch_tokens=128))
    got = {int(request_id.rsplit("_", 1)[1]): list(output.generated_tokens) for request_id, output in outputs.items()}
    return [got.get(index) for index in range(len(prompts))] == expected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(parser)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=8, help="paged-cache blocks to build (default 8)")
    parser.add_argument("--budget-mib", type=float, default=1024.0, help="memory budget for the cache (default 1 GiB)")
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    device = setup_device(args)
    size = dict(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                max_position_embeddings=512, pad_token_id=0)
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    budget = int(args.budget_mib * 2**20)
    rows = []
    llama = None
    for name, (fields, formula, share) in MODELS.items():
        fields = dict(fields)
        torch.manual_seed(args.seed)
        model = build_model(fields.pop("value_residual"), device, **size, **fields).eval()
        paged = paged_bytes_per_token(model.config, args.num_blocks, torch.float32, device)
        with stock_allocator():
            stock = paged_bytes_per_token(model.config, args.num_blocks, torch.float32, device)
        dense = generate_bytes_per_token(model, prompts[2], args.new_tokens)
        llama = llama or (dense, paged, stock)
        goal = share(args.layers)
        rows.append([name, f"{dense:,.0f}", f"{paged:,.0f}", f"{stock:,.0f}",
                     f"{formula} = {goal:.4f}", f"{dense / llama[0]:.4f}", f"{paged / llama[1]:.4f}",
                     f"{stock / llama[2]:.4f}", f"{budget // paged:,.0f}", f"{llama[1] / paged:.3f}x",
                     greedy_equal(model, prompts, args.new_tokens)])
    mib = f"{args.budget_mib:g} MiB"
    header = ["model", "KV B/token: generate()", "paged, with the plugin", "paged, stock allocator",
              "goal: / Llama", "generate() / Llama", "paged (plugin) / Llama", "paged (stock) / Llama",
              f"tokens in {mib}, paged (plugin)", "tokens / Llama's",
              "generate_batch == generate() (greedy, with the plugin)"]
    text = "\n".join([
        "# SVFormer and cross-layer attention in continuous batching",
        "",
        f"`python -m benchmarks.serving.bench_continuous_batching` — {args.layers} layers, hidden {args.hidden}, "
        f"{args.heads} heads / {args.kv_heads} kv heads, float32. {common.environment_line(device)}",
        "",
        common.markdown_table(header, rows),
        "",
        "Bytes per cached token are exact (the paged cache's data bytes over the tokens its blocks hold; "
        "`cache_nbytes` of `generate()`'s cache over its tokens); they do not depend on load. transformers' stock "
        "allocator (`FullAttentionCacheAllocator`) gives every layer its own key and value pages, so SVFormer's "
        "layers n >= 1 would store copies of layer 0's values and cross-layer attention's consumers pages they "
        "never need; "
        "`import resformer_hf` replaces it with `resformer_hf.integrations.paged_cache.StoredKeysValuesAllocator`, "
        "which gives pages only to the layers that store keys or values (the stock layout for any other model). The "
        "engine sizes a cache of `num_blocks` in Llama-sized blocks, so one budget holds the inverse ratio of tokens.",
        "",
    ])
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "continuous_batching.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
