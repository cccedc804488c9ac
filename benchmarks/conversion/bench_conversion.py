"""Cost of `resformer-convert`: peak memory and throughput on a synthetic ~1B-parameter sharded Llama checkpoint.

Goals: peak RSS <= 1.5 x the largest shard (the converter streams one shard at a time), and throughput
>= 0.5 x a plain file copy of the same bytes (`shutil.copyfile`, i.e. the kernel's copy), timed round-robin in the
same run so both see the same disk and page cache.

The checkpoint is written directly with safetensors (random bf16 tensors in Llama's names and shapes, an index and a
config.json), no model is built. Each conversion runs in a fresh child process whose peak RSS (`VmHWM` of
/proc/self/status) therefore measures the conversion plus the interpreter (torch + transformers imports), which is
reported separately. The synthetic files are deleted afterwards.

    python -m benchmarks.conversion.bench_conversion                        # ~1B params, bf16, 1024 and 512 MiB shards
    python -m benchmarks.conversion.bench_conversion --params 3e8 --shard-sizes-mb 128 --repeats 2

Writes `benchmarks/results/conversion.{md,png}`.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from benchmarks.common import RESULTS_DIR, add_device_args, environment_line, markdown_table, pyplot, setup_device
from benchmarks.records import child_result

RSS_GOAL = 1.5
THROUGHPUT_GOAL = 0.5

#: Runs in the child: imports first (their RSS is the baseline), then one conversion; prints a JSON line.
_CHILD = """
import json, sys, time
from resformer_hf import convert_llama_checkpoint

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

after_imports = status("VmRSS")
start = time.perf_counter()
report = convert_llama_checkpoint(sys.argv[1], sys.argv[2], progress=False)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "after_imports": after_imports, "peak": status("VmHWM"),
                  "bytes": report.total_bytes, "tensors": report.num_tensors}))
"""


def llama_size(params: float) -> dict:
    """TinyLlama-like shape (hidden 2048, GQA 32/4 heads, vocab 32000, untied) with the layer count that gives
    about `params` parameters."""
    hidden, intermediate, heads, kv_heads, vocab = 2048, 5632, 32, 4, 32000
    head_dim = hidden // heads
    per_layer = hidden * (2 * hidden + 2 * kv_heads * head_dim) + 3 * hidden * intermediate + 2 * hidden
    layers = max(2, round((params - 2 * vocab * hidden - hidden) / per_layer))
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=False,
                max_position_embeddings=2048, dtype="bfloat16")


def tensor_shapes(size: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Llama's saved tensors in save order."""
    h, i, v = size["hidden_size"], size["intermediate_size"], size["vocab_size"]
    kv = size["num_key_value_heads"] * h // size["num_attention_heads"]
    shapes = [("model.embed_tokens.weight", (v, h))]
    for n in range(size["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes += [
            (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
        ]
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def write_synthetic_checkpoint(directory: Path, size: dict, shard_bytes: int, seed: int) -> list[Path]:
    """Random bf16 tensors packed greedily into shards of at most `shard_bytes` (one shard in memory at a time)."""
    directory.mkdir(parents=True)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in tensor_shapes(size):
        nbytes = math.prod(shape) * 2
        if groups[-1] and used + nbytes > shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append((name, shape))
        used += nbytes
    generator = torch.Generator().manual_seed(seed)
    weight_map, total, paths = {}, 0, []
    for number, group in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        tensors = {key: torch.randn(shape, generator=generator, dtype=torch.bfloat16) for key, shape in group}
        save_file(tensors, directory / name, metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        paths.append(directory / name)
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = LlamaConfig(**size)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    return paths


def timed_copy(src: Path, dst: Path) -> float:
    """A plain copy of every file of the checkpoint (the same bytes the converter reads)."""
    start = time.perf_counter()
    dst.mkdir()
    for path in sorted(src.iterdir()):
        shutil.copyfile(path, dst / path.name)
    return time.perf_counter() - start


def timed_buffered_copy(src: Path, dst: Path, chunk: int = 64 * 2**20) -> float:
    """The same copy through user space (read/write in 64 MiB chunks), as a program that looks at the bytes must do;
    context for the goal, which is set against the kernel copy."""
    start = time.perf_counter()
    dst.mkdir()
    for path in sorted(src.iterdir()):
        with open(path, "rb") as source, open(dst / path.name, "wb") as target:
            while block := source.read(chunk):
                target.write(block)
    return time.perf_counter() - start


def timed_conversion(src: Path, dst: Path) -> dict:
    return child_result(["-c", _CHILD, str(src), str(dst)], "conversion failed", HF_HUB_OFFLINE="1",
                        TRANSFORMERS_OFFLINE="1")


def measure(work: Path, size: dict, shard_mb: int, repeats: int, seed: int) -> dict:
    src = work / f"llama-{shard_mb}"
    shards = write_synthetic_checkpoint(src, size, shard_mb * 2**20, seed)
    largest = max(path.stat().st_size for path in shards)
    source_bytes = sum(path.stat().st_size for path in src.iterdir())
    copies, buffered, conversions = [], [], []
    try:
        for _ in range(repeats):  # round-robin: all see the same disk state and page cache
            copies.append(timed_copy(src, work / "copy"))
            shutil.rmtree(work / "copy")
            buffered.append(timed_buffered_copy(src, work / "copy"))
            shutil.rmtree(work / "copy")
            conversions.append(timed_conversion(src, work / "converted"))
            shutil.rmtree(work / "converted")
    finally:
        shutil.rmtree(src, ignore_errors=True)
        for leftover in ("copy", "converted"):
            shutil.rmtree(work / leftover, ignore_errors=True)
    copy_s = statistics.median(copies)
    buffered_s = statistics.median(buffered)
    convert_s = statistics.median(c["seconds"] for c in conversions)
    peak = max(c["peak"] for c in conversions)
    after_imports = statistics.median(c["after_imports"] for c in conversions)
    return dict(shard_mb=shard_mb, shards=len(shards), largest=largest, source_bytes=source_bytes, copy_s=copy_s,
                buffered_s=buffered_s,
                convert_s=convert_s, peak=peak, after_imports=after_imports,
                tensors=conversions[0]["tensors"], written=conversions[0]["bytes"])


def write_results(rows: list[dict], size: dict, params: int, args, device) -> None:
    gib, mib = 2**30, 2**20
    table = markdown_table(
        ["shard size limit", "shards", "largest shard", "RSS after imports", "peak RSS", "peak / largest shard",
         "(peak − imports) / largest shard", "copy", "buffered copy", "convert", "throughput vs copy",
         "vs buffered copy"],
        [[f"{r['shard_mb']} MiB", r["shards"], f"{r['largest'] / mib:.0f} MiB", f"{r['after_imports'] / mib:.0f} MiB",
          f"{r['peak'] / mib:.0f} MiB", f"**{r['peak'] / r['largest']:.2f}×**",
          f"{(r['peak'] - r['after_imports']) / r['largest']:.2f}×",
          f"{r['copy_s']:.2f} s ({r['source_bytes'] / gib / r['copy_s']:.2f} GiB/s)",
          f"{r['buffered_s']:.2f} s ({r['source_bytes'] / gib / r['buffered_s']:.2f} GiB/s)",
          f"{r['convert_s']:.2f} s ({r['source_bytes'] / gib / r['convert_s']:.2f} GiB/s)",
          f"**{r['copy_s'] / r['convert_s']:.2f}**", f"{r['buffered_s'] / r['convert_s']:.2f}"] for r in rows],
    )
    largest_tensor = max(math.prod(shape) for _, shape in tensor_shapes(size)) * 2
    met_rss = all(r["peak"] / r["largest"] <= RSS_GOAL for r in rows)
    met_speed = all(r["copy_s"] / r["convert_s"] >= THROUGHPUT_GOAL for r in rows)
    rss_rows = ", ".join(f"{r['peak'] / r['largest']:.2f}× at {r['shard_mb']} MiB" for r in rows)
    speed_rows = ", ".join(f"{r['copy_s'] / r['convert_s']:.2f}× at {r['shard_mb']} MiB" for r in rows)
    command = " ".join(["python -m benchmarks.conversion.bench_conversion", *sys.argv[1:]])
    text = f"""# Conversion: peak memory and throughput

`{command}`

Synthetic Llama checkpoint: {params / 1e9:.2f} B parameters (hidden {size['hidden_size']}, {size['num_hidden_layers']}
layers, GQA {size['num_attention_heads']}/{size['num_key_value_heads']} heads, vocab {size['vocab_size']}, untied),
bf16, {rows[0]['source_bytes'] / gib:.2f} GiB, random tensors written directly with safetensors.
Converted with the defaults (`variant="learnable"`, `init="preserve"`: {rows[0]['tensors']} tensors out)
in a fresh process per run; median of {args.repeats} runs, each timed round-robin against a plain copy
(`shutil.copyfile`) of the same files. Conversion is disk and memory work and uses no accelerator
(`--device {device}` does not change it).

{table}

- Goal peak RSS ≤ {RSS_GOAL}× the largest shard: **{'met' if met_rss else 'not met'}** ({rss_rows}).
  Peak RSS is the child's `VmHWM`, interpreter included; "(peak − imports)" is what the conversion itself adds.
  The converter writes each
  output file tensor by tensor (header first, each tensor read through its own short-lived `safe_open` mapping), so
  it adds about one tensor, not one shard: the largest here is the embedding, {largest_tensor / mib:.0f} MiB.
- Goal throughput ≥ {THROUGHPUT_GOAL}× a plain copy: **{'met' if met_speed else 'not met'}** ({speed_rows}). "copy" is
  `shutil.copyfile`, which copies inside the kernel (`copy_file_range`/`sendfile`) without the bytes ever reaching
  the process; "buffered copy" reads and writes the same files through user space in 64 MiB chunks, which is what
  any program that looks at the tensors pays at least. The converter writes straight from the memory-mapped
  source, so it pays page faults on every 4 KiB page of the source but no extra copy.
- Not covered: `--dtype` (a cast holds one cast tensor more) and `--verify` (loads both models).

{environment_line(device)}
"""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "conversion.md").write_text(text)

    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['shard_mb']} MiB shards" for r in rows]
    x = range(len(rows))
    width = 0.25
    left.bar([i - width for i in x], [r["largest"] / mib for r in rows], width, label="largest shard")
    left.bar(list(x), [r["after_imports"] / mib for r in rows], width, label="RSS after imports")
    left.bar([i + width for i in x], [r["peak"] / mib for r in rows], width, label="peak RSS")
    for i, r in enumerate(rows):
        left.hlines(RSS_GOAL * r["largest"] / mib, i - 1.5 * width, i + 1.5 * width, colors="red", linestyles="--",
                    label=f"goal {RSS_GOAL}× shard" if i == 0 else None)
    left.set_xticks(list(x), labels)
    left.set_ylabel("MiB")
    left.set_title("Peak memory of one conversion")
    left.legend(fontsize=8)
    right.bar([i - width for i in x], [r["source_bytes"] / gib / r["copy_s"] for r in rows], width,
              label="plain file copy (kernel)")
    right.bar(list(x), [r["source_bytes"] / gib / r["buffered_s"] for r in rows], width,
              label="buffered copy (user space)")
    right.bar([i + width for i in x], [r["source_bytes"] / gib / r["convert_s"] for r in rows], width,
              label="resformer-convert")
    for i, r in enumerate(rows):
        right.annotate(f"{r['copy_s'] / r['convert_s']:.2f}× copy", (i + width, r["source_bytes"] / gib /
                       r["convert_s"]), ha="center", va="bottom", fontsize=8)
    right.set_xticks(list(x), labels)
    right.set_ylabel("GiB/s")
    right.set_title("Throughput (median)")
    right.legend(fontsize=8)
    figure.suptitle(f"Llama → ResFormer conversion, {params / 1e9:.2f} B params bf16")
    figure.tight_layout()
    figure.savefig(RESULTS_DIR / "conversion.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_args(parser)
    parser.add_argument("--params", type=float, default=1e9, help="approximate parameter count (default 1e9)")
    parser.add_argument("--shard-sizes-mb", type=int, nargs="+", default=[1024, 512],
                        help="shard size limits to measure, MiB (default 1024 512)")
    parser.add_argument("--repeats", type=int, default=3, help="round-robin repeats per shard size (default 3)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where to write the synthetic checkpoint (default: a temp dir; needs ~3x its size free)")
    args = parser.parse_args()
    device = setup_device(args)
    size = llama_size(args.params)
    params = sum(math.prod(shape) for _, shape in tensor_shapes(size))
    work = Path(tempfile.mkdtemp(prefix="bench-conversion-", dir=args.workdir))
    rows = []
    try:
        for shard_mb in args.shard_sizes_mb:
            rows.append(measure(work, size, shard_mb, args.repeats, args.seed))
            r = rows[-1]
            print(f"{shard_mb} MiB shards: peak {r['peak'] / 2**20:.0f} MiB = {r['peak'] / r['largest']:.2f}x largest "
                  f"shard; convert {r['convert_s']:.2f} s vs copy {r['copy_s']:.2f} s "
                  f"({r['copy_s'] / r['convert_s']:.2f}x)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(rows, size, params, args, device)
    print(f"wrote {RESULTS_DIR / 'conversion.md'} and conversion.png")


if __name__ == "__main__":
    main()
