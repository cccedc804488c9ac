"""`benchmarks/results/gpu.md` from the JSON lines of one or more GPU runs (`python -m benchmarks.gpu --report ...`).

A later run that measured the same thing (a rerun of what an earlier one skipped) replaces the earlier row; every
ratio is to the Llama measured in the same run, which the tables name by run number.
"""

from __future__ import annotations

from pathlib import Path

from .pretrain_report import section as pretrain_section
from benchmarks.common import markdown_table
from benchmarks.records import environment_of, read_records

RESULTS = Path(__file__).resolve().parents[1] / "results"
GPU_MD = RESULTS / "gpu.md"


def _mark(ok) -> str:
    return {True: "✓", False: "**✗**", None: "–"}[ok]


def _exp(value: float | None) -> str:
    return "–" if value is None else f"{value:.1e}"


CONTROL = "llama"


def latest(runs: list[list[dict]]) -> dict[tuple[str, str], tuple[int, dict]]:
    """(part, name) → (run number, record), later runs winning; skipped records never replace measured ones. The
    Llama control of each run keeps a row of its own (`.../llama@N`): a variant's ratio is to its own run's Llama."""
    found: dict[tuple[str, str], tuple[int, dict]] = {}
    for number, records in enumerate(runs, start=1):
        for record in records:
            name = record["name"]
            if name.split("/")[-1] == CONTROL and record["part"] != "correctness":
                name = f"{name}@{number}"
            key = (record["part"], name)
            if record.get("skipped") and key in found:
                continue
            found[key] = (number, record)
    return dict(sorted(found.items(), key=lambda item: (CONTROL not in item[0][1], item[1][0])))


def _model(name: str) -> str:
    """A row's model: the variant, or `llama (run N)` for a run's control."""
    variant, _, run = name.split("/")[-1].partition("@")
    return f"{variant} (run {run})" if run else variant


#: What a run's own records cannot say: the code it measured where it recorded no commit, and readings known to be
#: wrong, with why (raw records are never edited).
RUN_NOTES = {
    "run3.jsonl": "commit d32a9c9; learnable, learnable_plus, dense and DenseFormer failed their first step (λ "
                  "buffers left on the CPU by a build under `with torch.device('cuda')`, fixed in 86664fa)",
    "run4.jsonl": "commit d32a9c9, 40 s of the correctness part; DenseFormer's bf16 numerics met the autocast bug "
                  "fixed in 86664fa",
    "run5.jsonl": "commit d32a9c9 with 86664fa's buffer fix (not yet its autocast fix: DenseFormer failed again); "
                  "eager learnable_plus's memory 0.90 is wrong: DenseFormer's failed step was freed inside its "
                  "measured step (its compiled memory, 1.0000, and run 1's eager 1.0005 stand)",
}


def environment_lines(runs: list[list[dict]], paths: list[Path]) -> list[str]:
    lines = []
    for number, (records, path) in enumerate(zip(runs, paths), start=1):
        env = environment_of(records)
        done = next((r for r in records if r["name"] == "done"), None)
        parts = " ".join(env.get("parts", []))
        variants = ", ".join(env["variants"]) or "all" if "variants" in env else "not recorded"
        lines.append(
            f"- run {number} (`{path.name}`): {env.get('device')}, torch {env.get('torch')} (CUDA {env.get('cuda')}), "
            f"transformers {env.get('transformers')}, resformer-hf {env.get('resformer_hf')}, {env.get('date')}; "
            f"parts {parts}, variants {variants}; "
            + (f"finished in {done['elapsed_s']:.0f} s" if done else "stopped before the end")
            + (f"; commit {env['commit']}" if env.get("commit") else "")
            + (f"; {RUN_NOTES[path.name]}" if path.name in RUN_NOTES else ""))
    return lines


def _worst(records: list[dict], key: str) -> float | None:
    return max((record[key] for record in records if key in record), default=None)


def correctness_section(found) -> list[str]:
    cases = list(dict.fromkeys(name.split("/")[0] for part, name in found if part == "correctness"))
    rows, failures = [], []
    for case in cases:
        get = {suffix: found.get(("correctness", f"{case}/{suffix}"), (None, {}))[1] for suffix in (
            "float32/T8", "float32/T40", "bfloat16/T8", "bfloat16/T40", "attention", "cache", "cache/compiled",
            "continuous_batching")}
        fp32, bf16 = [get["float32/T8"], get["float32/T40"]], [get["bfloat16/T8"], get["bfloat16/T40"]]
        attention, cache, compiled, batching = (get[key] for key in (
            "attention", "cache", "cache/compiled", "continuous_batching"))
        checks = [*fp32, *bf16, attention, cache, compiled, batching]
        failures += [f"{case}/{r.get('name', '')}: {r.get('error', '')}" for r in checks if r.get("ok") is False]
        worst = _worst
        rows.append([
            case,
            _exp(worst(fp32, "logits")) + " / " + _exp(worst(fp32, "no_grad_logits")),
            _exp(worst(fp32, "grads")),
            f"{_exp(worst(bf16, 'autocast_logits'))} / {_exp(worst(bf16, 'bf16_weights_logits'))}",
            _exp(worst(bf16, "autocast_grads")),
            _exp(max((attention.get(k, 0) for k in ("eager", "sdpa", "flex_attention")), default=None)
                 if attention.get("ok") is not None else None),
            _mark(cache.get("ok")), _mark(compiled.get("ok")), _mark(batching.get("ok")),
            _mark(all(r.get("ok") for r in checks) if all(r.get("ok") is not None for r in checks) else (
                False if any(r.get("ok") is False for r in checks) else None)),
        ])
    header = ["case", "fp32 logits: grad / no-grad", "fp32 grads", "bf16 logits: autocast / bf16 weights",
              "bf16 grads", "eager, sdpa, flex (worst)", "cache: dynamic, static", "static + compile(fullgraph)",
              "continuous batching", "all"]
    lines = ["## Correctness (float32, TF32 off; bf16)", "",
             "Relative L2 errors against `tests/reference.py` in float64 on the CPU (prompts of 8 and 40 tokens, the "
             "worse shown); float32 must stay within 1e-4, bf16 within three times the Llama control's error. Cache "
             "columns: greedy tokens equal `generate()` without a cache; continuous batching: `generate_batch` equals "
             "`generate()` on four prompts of mixed lengths.", "", markdown_table(header, rows), ""]
    skipped = [name for (part, name), (_, r) in found.items() if part == "correctness" and r.get("skipped")]
    if skipped:
        lines += [f"Not reached in the run's time: {', '.join(skipped)}.", ""]
    if failures:
        lines += ["Failed: " + "; ".join(failures), ""]
    return lines


def training_section(found) -> list[str]:
    setup = found.get(("training", "setup"), (None, {}))[1]
    lines = ["## Training step (134M parameters, context 2048, bf16 autocast, SDPA, fused AdamW)", "",
             f"Batch {setup.get('batch')} × {setup.get('context')} tokens per step, no KV cache; step ms: medians of "
             "interleaved steps; time / Llama: the geometric mean of each round's ratio to the Llama timed in that "
             "round, with its 95% t-interval (`llama_control`, a second identical Llama, shows the noise; a ratio "
             "without one is a run's from before, a ratio of medians over 8 rounds); memory: "
             "parameters and optimiser state plus the step's peak. Goals (`benchmarks/gpu/training.py`): eager "
             "mixing variants ≤ 1.02 time and ≤ 1.005 memory (gated, NeuTRENO 1.03; `dense` 1.05 / 1.03; DenseFormer "
             "1.10), compiled ≤ 1.01 / 1.005 (`dense` 1.03), SVFormer below 1 on both."
             + {True: " The learnable mix ran as its Triton kernels.",
                False: " The learnable mix ran as torch ops (its Triton kernels did not run on this device)."}.get(
                 setup.get("mix_kernels"), ""), ""]
    for mode in ("eager", "compiled"):
        rows = []
        for (part, name), (run, record) in found.items():
            if part != "training" or not name.startswith(f"{mode}/") or name.count("/") != 1:
                continue
            variant = _model(name)
            if record.get("skipped") or "time_ratio" not in record:
                rows.append([variant, "–", "–", "–", "–", "–", run, record.get("skipped") or record.get("error", "")])
                continue
            interval = record.get("time_interval")
            ratio = f"{record['time_ratio']:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")
            rows.append([variant, f"{record['step_ms']:.1f}", f"{record['tokens_per_s'] / 1e3:.0f}k",
                         ratio, f"{record['memory_ratio']:.4f}",
                         f"{record['peak_bytes'] / 2**30:.2f}", run,
                         _mark(record.get("ok")) + (f" (first step {record['first_step_s']:.0f} s)"
                                                    if "first_step_s" in record else "")])
        lines += [f"### {mode}", "", markdown_table(["model", "step ms", "tokens/s", "time / Llama", "memory / Llama",
                                                    "peak GiB", "run", "goal"], rows), ""]
    return lines


def decode_section(found) -> list[str]:
    rows = []
    for (part, name), (run, record) in found.items():
        if part != "decode":
            continue
        batch, variant = name.split("/")[0], _model(name)
        if "time_ratio" not in record:
            rows.append([batch.removeprefix("batch"), variant, "–", "–", "–", run,
                         record.get("skipped") or record.get("error", "")])
            continue
        rows.append([record["batch"], variant, f"{record['step_ms']:.2f}", f"{record['tokens_per_s']:,.0f}",
                     f"{record['time_ratio']:.3f}", run, _mark(record.get("ok"))])
    return ["## Decoding: `generate()`, static cache, compiled (4k context)", "",
            "Per-token time from `N + 1` new tokens less 1 (the prefill cancels), medians of interleaved calls; "
            "goal ≤ 1.02 of Llama's time for mixing variants.", "",
            markdown_table(["batch", "model", "ms / step", "tokens/s", "time / Llama", "run", "goal"], rows), ""]


def capacity_section(found) -> list[str]:
    rows = []
    for (part, name), (run, record) in found.items():
        if part != "capacity":
            continue
        name = _model(name)
        if "sequences" not in record:
            rows.append([name, "–", "–", "–", "–", "–", run, record.get("skipped") or record.get("error", "")])
            continue
        rows.append([name, record["sequences"], f"{record['cache_bytes'] / 2**30:.2f}",
                     f"{record.get('sequences_ratio', 1.0):.2f}", f"{record['tokens_per_s']:,.0f}",
                     f"{record.get('tokens_per_s_ratio', 1.0):.2f}", run, _mark(record.get("ok"))])
    first = next((r for (p, _), (_, r) in found.items() if p == "capacity" and "requests" in r), {})
    return ["## Serving capacity: continuous batching at one KV-cache budget", "",
            f"`generate_batch` with the plugin's paged cache, {first.get('requests')} requests of "
            f"{first.get('sequence_tokens')} tokens ({first.get('new_tokens')} generated), one cache budget for "
            "every model; goal: SVFormer ≥ 1.6× Llama's sequences and tokens/s.", "",
            markdown_table(["model", "8k sequences held", "cache GiB", "× Llama", "tokens/s", "× Llama", "run",
                            "goal"], rows), ""]


def write_report(*paths: Path, out: Path = GPU_MD) -> Path:
    paths = [Path(path) for path in paths]
    runs = [read_records(path) for path in paths]
    found = latest(runs)
    lines = ["# ResFormer on a GPU", "",
             "`python -m benchmarks.gpu` (the install line and options: `benchmarks/gpu/__main__.py`); every ratio "
             "is to a same-shape HF `LlamaForCausalLM` measured in the same run. Raw results: "
             + ", ".join(f"[{p.name}](gpu/{p.name})" for p in paths) + ".", "",
             *environment_lines(runs, paths), "",
             *correctness_section(found), *training_section(found), *capacity_section(found),
             *decode_section(found), *pretrain_section(runs, out.with_name("gpu_pretrain.png"))]
    out.write_text("\n".join(lines), encoding="utf-8")
    return out
