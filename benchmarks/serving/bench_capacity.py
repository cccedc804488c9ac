"""Decode-heavy serving capacity: SVFormer against a Llama of the same shape under transformers' continuous batching
(`generate_batch`, the plugin's paged cache), at KV-cache budgets that bind the Llama at about 4 and 8 sequences.

SVFormer stores V_0 once, so one budget holds 2L/(L+1) times a Llama's sequences; every layer still reads V_0 over
the whole context, so the KV bytes read per generated token are a Llama's. More sequences per step turn into more
tokens/s only where a decode step's time is the weights' (read once per step whatever the batch), not the KV reads':
a model of ~1.2B parameters with 8:1 grouped-query attention, decode-heavy requests (1-1.5k-token prompts, 128 new
tokens), a queue of 3x what SVFormer's cache holds, so the cache binds for both models throughout. The benchmark's
own numbers say whether that regime was reached: step time against batch size (flat: weights dominate), and the
concurrency each model kept.

For each budget, the models run in interleaved rounds (the order rotated each round) after one warm-up run each
(compiling, CUDA-graph capture), so a busy machine slows both alike: generated tokens/s (wall time of
`generate_batch`), the sequences the cache holds, the concurrency per engine step (active requests) and the median
time of a step at each concurrency. The attention is whatever transformers' continuous batching picks on the device
(flash paged attention where flash-attn is installed, CUDA graphs where the attention needs no mask); each run
records it. Goal on a GPU: SVFormer >= 1.6x Llama's tokens/s at the tightest budget, beside the ideal 2L/(L+1).

On a lent GPU machine, as the GPU run (`benchmarks/gpu/__main__.py`) is prepared: torch there, transformers 5.24.0
carried as a wheel in `.whl/`, one command from the repository root. 128 new tokens a request keep both budgets'
warm-ups and rounds inside one device call at the step time transformers' continuous batching takes on a GPU
(host-bound, flat in the batch size: docs/serving.md). `--seconds` (default 480) caps it: a round that would not
fit is recorded as skipped, and every result is a JSON line flushed as it is measured, so a run cut short keeps what
it measured:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 -m benchmarks.serving.bench_capacity --out $OUT

then here, from the JSON lines it wrote:

    python -m benchmarks.serving.bench_capacity --report $OUT/capacity.jsonl  # writes benchmarks/results/capacity.md

`--smoke` runs it at toy size on the CPU in seconds (tests/test_benchmarks.py runs it in CI, so the command does not
rot); its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from benchmarks.common import RESULTS_DIR, markdown_table
from benchmarks.gpu.decode import build, cache_sequences, timed
from benchmarks.records import Recorder, Schedule, describe_environment, environment_of, open_run, read_records

PART = "capacity"
MODELS = ("llama", "svformer")
#: ~1.2B parameters, 8:1 grouped-query attention (head dim 128): the weights, not the KV reads, dominate a decode step.
SIZE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
            num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0)
SMOKE_SIZE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
#: (prompt tokens from, to; new tokens; page size; Llama sequences per budget; measured rounds)
WORKLOAD = dict(prompt=(1024, 1536), new_tokens=128, page=256, budgets=(4, 8), rounds=2)
SMOKE_WORKLOAD = dict(prompt=(12, 24), new_tokens=16, page=8, budgets=(2, 4), rounds=1)
QUEUE = 3  #: requests queued per budget: this many times what SVFormer's cache holds
GOAL = 1.6


@contextlib.contextmanager
def steps_recorded(steps: list):
    """While in the block, every engine step appends (time, active requests) to `steps`, and its resolved settings
    (attention, CUDA graphs) land in `steps` once as a dict."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

    original = ContinuousBatchProcessor.prepare_next_batch

    def prepare_next_batch(self) -> bool:
        ready = original(self)
        if ready:
            if not steps:
                steps.append({"cuda_graphs": str(getattr(self.cb_config, "use_cuda_graph", None)),
                              "attention": getattr(getattr(self, "config", None), "_attn_implementation", None)})
            steps.append((time.perf_counter(), len(self.scheduler.active_requests)))
        return ready

    ContinuousBatchProcessor.prepare_next_batch = prepare_next_batch
    try:
        yield
    finally:
        ContinuousBatchProcessor.prepare_next_batch = original


def step_summary(steps: list) -> dict:
    """Mean concurrency over the steps, and the median step time (ms) at each concurrency (a step's time: until the
    next step)."""
    settings = steps[0] if steps and isinstance(steps[0], dict) else {}
    marks = [step for step in steps if isinstance(step, tuple)]
    by_concurrency: dict[int, list[float]] = {}
    for (at, active), (next_at, _) in zip(marks, marks[1:]):
        by_concurrency.setdefault(active, []).append(next_at - at)
    return dict(settings, steps=len(marks),
                mean_concurrency=statistics.fmean(active for _, active in marks) if marks else 0.0,
                max_concurrency=max((active for _, active in marks), default=0),
                step_ms={str(active): round(1e3 * statistics.median(times), 3)
                         for active, times in sorted(by_concurrency.items())})


def timed_batch(device: torch.device, model, requests: list[list[int]], generation: GenerationConfig,
                cb_config: ContinuousBatchingConfig) -> tuple[float, dict]:
    """(wall seconds, outputs) of one `generate_batch` of `requests`."""
    outputs: dict = {}
    seconds = timed(device, lambda: outputs.update(model.generate_batch(
        requests, generation_config=generation, continuous_batching_config=cb_config)))
    return seconds, outputs


def requests_for(count: int, prompt: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt[0], prompt[1] + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for length in lengths]


def run(recorder: Recorder, schedule: Schedule, device: torch.device, smoke: bool) -> None:
    size, work = (SMOKE_SIZE, SMOKE_WORKLOAD) if smoke else (SIZE, WORKLOAD)
    dtype = torch.float32 if smoke else torch.bfloat16
    models = {name: build(name, size, device).to(dtype) for name in MODELS}
    layers = size["num_hidden_layers"]
    pages = -(-(work["prompt"][1] + work["new_tokens"]) // work["page"])
    generation = GenerationConfig(max_new_tokens=work["new_tokens"], min_new_tokens=work["new_tokens"],
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
    warm_up = GenerationConfig(**{**generation.to_diff_dict(), "max_new_tokens": 8, "min_new_tokens": 8})
    for index, llama_sequences in enumerate(work["budgets"]):
        schedule.split(index, len(work["budgets"]))
        cb_config = ContinuousBatchingConfig(num_blocks=llama_sequences * pages, page_size=work["page"],
                                             max_batch_tokens=work["prompt"][1] + 512, max_memory_percent=0.9)
        held = {name: cache_sequences(model, cb_config, pages * work["page"], device)[0]
                for name, model in models.items()}
        queue = requests_for(QUEUE * max(held.values()), work["prompt"], size["vocab_size"], seed=index)
        budget = f"{llama_sequences}seq"
        last: dict[str, float] = {}
        for round_ in range(work["rounds"] + 1):  # round 0: the warm-up, a short run of what one cache holds
            names = list(MODELS[round_ % len(MODELS):] + MODELS[:round_ % len(MODELS)])
            for name in names:
                if round_ and not schedule.allows(1.2 * last.get(name, 0.0)):
                    recorder.write(PART, f"{budget}/{name}", ok=None, round=round_, skipped="time")
                    continue
                steps: list = []
                with recorder.guarded(PART, f"{budget}/{name}"), torch.no_grad(), steps_recorded(steps):
                    requests = queue if round_ else queue[:held[name]]
                    seconds, outputs = timed_batch(device, models[name], requests,
                                                   generation if round_ else warm_up, cb_config)
                    last[name] = seconds
                    if not round_:
                        continue
                    new_tokens = sum(len(output.generated_tokens) for output in outputs.values())
                    answered = new_tokens == len(requests) * work["new_tokens"]  # every request, to its length
                    recorder.write(PART, f"{budget}/{name}", ok=answered, round=round_, budget_llama_sequences=
                                   llama_sequences, sequences=held[name], requests=len(requests),
                                   prompt_tokens=sum(map(len, requests)), new_tokens=new_tokens, seconds=seconds,
                                   tokens_per_s=new_tokens / seconds, layers=layers,
                                   ideal=2 * layers / (layers + 1), **step_summary(steps))


def summarise(records: list[dict]) -> list[dict]:
    """Per budget: each model's median tokens/s over its rounds, sequences held, mean concurrency, and SVFormer's
    ratios to the Llama."""
    runs = [r for r in records if r.get("part") == PART and "tokens_per_s" in r]
    rows = []
    for budget in sorted({r["budget_llama_sequences"] for r in runs}):
        at = {name: [r for r in runs if r["budget_llama_sequences"] == budget and r["name"].endswith(f"/{name}")]
              for name in MODELS}
        if not all(at.values()):
            continue
        median = {name: statistics.median(r["tokens_per_s"] for r in at[name]) for name in MODELS}
        rows.append(dict(budget=budget, rounds=min(len(at[name]) for name in MODELS), ideal=at["svformer"][0]["ideal"],
                         **{f"{name}_{key}": value for name in MODELS for key, value in (
                             ("tokens_per_s", median[name]), ("sequences", at[name][0]["sequences"]),
                             ("concurrency", statistics.fmean(r["mean_concurrency"] for r in at[name])))},
                         sequences_ratio=at["svformer"][0]["sequences"] / at["llama"][0]["sequences"],
                         tokens_ratio=median["svformer"] / median["llama"]))
    return rows


def write_report(path: Path, out: Path = RESULTS_DIR / "capacity.md") -> Path:
    records = read_records(path)
    rows = summarise(records)
    environment = environment_of(records)
    runs = [r for r in records if r.get("part") == PART and "tokens_per_s" in r]
    table = markdown_table(
        ["budget (Llama sequences)", "rounds", "sequences held: Llama / SVFormer",
         "mean concurrency: Llama / SVFormer", "tokens/s: Llama / SVFormer", "SVFormer / Llama tokens/s",
         "sequences ratio", "ideal 2L/(L+1)"],
        [[row["budget"], row["rounds"], f"{row['llama_sequences']} / {row['svformer_sequences']}",
          f"{row['llama_concurrency']:.1f} / {row['svformer_concurrency']:.1f}",
          f"{row['llama_tokens_per_s']:,.0f} / {row['svformer_tokens_per_s']:,.0f}", f"**{row['tokens_ratio']:.2f}x**",
          f"{row['sequences_ratio']:.2f}x", f"{row['ideal']:.2f}x"] for row in rows])
    steps = markdown_table(["run", "attention", "CUDA graphs", "median step ms at concurrency"],
                           [[r["name"], r.get("attention"), r.get("cuda_graphs"),
                             ", ".join(f"{k}: {v}" for k, v in r["step_ms"].items())]
                            for r in runs if r["round"] == 1])
    tightest = rows[0] if rows else None
    verdict = "no complete budget" if tightest is None else (
        f"at the tightest budget SVFormer served {tightest['tokens_ratio']:.2f}x the Llama's tokens/s (goal {GOAL}x, "
        f"ideal {tightest['ideal']:.2f}x): goal {'met' if tightest['tokens_ratio'] >= GOAL else 'not met'}")
    text = "\n".join([
        "# Decode-heavy serving capacity: SVFormer vs Llama (continuous batching)", "",
        f"`python -m benchmarks.serving.bench_capacity`. {describe_environment(environment)}"
        f"{' Smoke: toy sizes on the CPU.' if environment.get('smoke') else ''} "
        "Tokens/s: the median over interleaved rounds after a warm-up. See the module docstring for the workload.", "",
        table, "", f"Verdict: {verdict}.", "", "Step time against concurrency (first measured round):", "", steps, ""])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("capacity-run"), help="folder for capacity.jsonl")
    parser.add_argument("--seconds", type=float, default=480.0, help="time for the whole run (default 480)")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (what CI runs)")
    parser.add_argument("--report", type=Path, metavar="JSONL", help="write benchmarks/results/capacity.md from a run")
    parser.add_argument("--report-to", type=Path, default=RESULTS_DIR / "capacity.md", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.report:
        print(f"wrote {write_report(args.report, args.report_to)}")
        return
    device, recorder, schedule = open_run(args.out / "capacity.jsonl", args.smoke, args.seconds, {PART: 1.0})
    schedule.begin(PART)
    run(recorder, schedule, device, args.smoke)
    recorder.done(schedule)


if __name__ == "__main__":
    main()
