"""Decode cost of the value residual vs Llama: eager and compiled decode steps, `generate()`, and ops per step.

For every size and batch, HF `LlamaForCausalLM`, a second identical Llama (the run's noise floor) and each ResFormer
variant are built from the same seed and timed round-robin in the same process (medians of per-round ratios), so the
ratios survive a busy machine. Three ways of decoding, all greedy and without gradient:

- eager decode: bursts of single tokens through the model with the default dynamic cache holding a random context;
- compiled decode: the same through `torch.compile(model.forward)` with a static cache;
- `generate()`: prompt + new tokens with the default dynamic cache (prefill included), reported as time per call,
  i.e. Llama's tokens/s divided by the variant's.

The goal: every mixing variant <= 1.01 of Llama's time, `dense` <= 1.03, SVFormer below 1. Ops: the aten ops
one eager decode step dispatches beyond Llama's (dynamic cache, batch 1), counted exactly with a dispatch mode, so
independent of machine load; `tests/test_decode_ops.py` asserts their budget.

    python -m benchmarks.cost.bench_decode --threads 1        # CPU defaults; rewrites decode.md and the docs block

Writes `benchmarks/results/decode.md` and the docs' decode paragraph (between `<!-- decode:begin/end -->`,
in docs/results.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from resformer_hf.remote_code.variants import VARIANTS

from benchmarks.common import (
    BASELINE,
    RESULTS_DIR,
    add_device_args,
    build_model,
    environment_line,
    markdown_table,
    rewrite_readme_block,
    setup_device,
)
from benchmarks.cost.bench_cost import CONTROL, census, parse_size, round_robin_ratios, size_fields
from benchmarks.cost.settings import add_model_args
from benchmarks.cost.timing import Decoder, add_clock_arg, clock_of

MODES = ("eager decode", "compiled decode", "generate")


def goal(name: str) -> float:
    """The time ratio to Llama a variant should stay within; cells above it are bold."""
    if name in VARIANTS and VARIANTS[name].drops_value_projections:
        return 1.0
    return 1.03 if name in VARIANTS and VARIANTS[name].keeps_every_layers_values else 1.01


class Generation:
    """`generate()` of a fixed number of new tokens after a random prompt, default (dynamic) cache."""

    def __init__(self, model, batch: int, prompt_length: int, new_tokens: int, device: torch.device):
        self.model = model.eval()
        generator = torch.Generator().manual_seed(2)
        self.prompt = torch.randint(3, model.config.vocab_size, (batch, prompt_length), generator=generator).to(device)
        self.kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                           attention_mask=torch.ones_like(self.prompt))

    def run(self) -> None:
        self.model.generate(self.prompt, **self.kwargs)


def ratios_over_rounds(actions: dict, args, device: torch.device) -> tuple[dict, float]:
    """Per-round ratios to Llama of each action's median time, and Llama's median seconds."""
    ratios, seconds = round_robin_ratios(actions, args.repeats, args, device)
    return ratios, statistics.median(seconds)


def measure(hidden: int, layers: int, batch: int, args, device: torch.device) -> dict:
    """Every mode's ratios (and per-round spreads) for one size and batch."""
    size = size_fields(hidden, layers, args, max(args.context + args.steps, args.prompt + args.new_tokens) + 8)
    names = [BASELINE, CONTROL] + args.variants
    dtype = getattr(torch, args.dtype)
    models = {}
    for name in names:
        torch.manual_seed(args.seed)
        models[name] = build_model(BASELINE if name == CONTROL else name, device, dtype=dtype, **size).eval()
    result = {"hidden": hidden, "layers": layers, "batch": batch, "ratios": {}, "spread": {}, "seconds": {}}
    plans = {
        "eager decode": lambda m: Decoder(m, batch, args.context, args.steps, False, device).burst,
        "generate": lambda m: Generation(m, batch, args.prompt, args.new_tokens, device).run,
    }
    if hidden * 1000 + layers in args.compile_keys:
        plans["compiled decode"] = lambda m: Decoder(m, batch, args.context, args.steps, True, device).burst
    if batch == 1:
        result["ops"] = {n: census(Decoder(m, 1, args.context, 1, False, device).step)[0] for n, m in models.items()}
    for mode, plan in plans.items():
        start = time.perf_counter()
        actions = {name: plan(model) for name, model in models.items()}
        for action in actions.values():
            action()  # warm up (and compile)
        print(f"  {mode}: prepared in {time.perf_counter() - start:.0f} s", flush=True)
        ratios, seconds = ratios_over_rounds(actions, args, device)
        result["ratios"][mode] = {n: statistics.median(r) for n, r in ratios.items()}
        result["spread"][mode] = ratios
        result["seconds"][mode] = seconds
        print(f"  {mode} " + ", ".join(f"{n} {v:.3f}" for n, v in result["ratios"][mode].items()), flush=True)
    return result


# ---- report -------------------------------------------------------------------------------------------------------


def _label(name: str) -> str:
    return "Llama again (noise floor)" if name == CONTROL else f"`{name}`"


def _cell(ratio: float, name: str, rounds: list[float] | None = None) -> str:
    text = f"**{ratio:.3f}**" if ratio > goal(name) and name != CONTROL else f"{ratio:.3f}"
    if rounds and len(rounds) > 1:
        text += f" ({min(rounds):.3f}–{max(rounds):.3f})"
    return text


def command_line(args) -> str:
    sizes = " ".join(f"{h}x{n}" for h, n in args.sizes)
    compiled = " ".join(f"{h}x{n}" for h, n in args.compile_sizes) or "none"
    batches = " ".join(map(str, args.batch_sizes))
    return (f"python -m benchmarks.cost.bench_decode --sizes {sizes} --batch-sizes {batches} "
            f"--compile-sizes {compiled} --context {args.context} --steps {args.steps} --prompt {args.prompt} "
            f"--new-tokens {args.new_tokens} --repeats {args.repeats} --rounds {args.rounds} --clock {args.clock} "
            f"--device {args.device} --threads {torch.get_num_threads()}")


def _ops(results: list[dict], hidden: int, layers: int, name: str) -> str:
    for result in results:
        if (result["hidden"], result["layers"]) == (hidden, layers) and "ops" in result:
            return f"{result['ops'][name] - result['ops'][BASELINE]:+d}"
    return "–"


def write_report(results: list[dict], args, device: torch.device) -> str:
    names = [CONTROL] + args.variants
    lines = [
        "# Decode cost of the value residual vs Llama (same size, same run)",
        f"Regenerate: `{command_line(args)}` (also rewrites the docs' decode paragraph). "
        + environment_line(device),
        "",
        f"Ratios of {'CPU' if args.clock == 'cpu' else 'wall-clock'} time to HF `LlamaForCausalLM` of the same size "
        "(1.000 = as fast; bold = above the issue-21 goal: "
        f"1.01, `dense` 1.03, SVFormer 1.0), median over {args.rounds} rounds of the median of {args.repeats} "
        "interleaved repeats (order rotated each repeat), lowest and highest per-round ratio in brackets. The first "
        "row times a second, identical Llama: the run's noise floor. Eager/compiled decode: bursts of "
        f"{args.steps} single tokens after {args.context} cached tokens (dynamic cache eager, static cache under "
        f"`torch.compile`, default mode); generate: `generate()` of {args.new_tokens} new tokens after a "
        f"{args.prompt}-token prompt, default dynamic cache, prefill included (time ratio = Llama's tokens/s over "
        "the variant's). Ops: aten ops one eager decode step dispatches beyond Llama's (batch 1, exact). "
        f"Vocab {args.vocab_size}, head dim {args.head_dim}, {args.dtype}, no gradient.",
        "",
        "Without a gradient the mix runs on v_proj's output (`resformer_hf/remote_code/value_residual.py`): "
        "λ are resolved once per forward pass for all layers and each mixing layer adds one fused op (`dense` three, "
        "NeuTRENO two), never touching a weight; training keeps the fused autograd functions.",
    ]
    for result in results:
        hidden, layers, batch = result["hidden"], result["layers"], result["batch"]
        seconds = ", ".join(f"{mode} {s * 1000:.1f} ms" for mode, s in result["seconds"].items())
        lines += ["", f"## hidden {hidden}, {layers} layers, batch {batch}", f"Llama per call: {seconds}.", ""]
        modes = [mode for mode in MODES if mode in result["ratios"]]
        header = ["variant"] + modes + (["ops per decode step"] if "ops" in result else [])
        rows = []
        for name in names:
            row = [_label(name)]
            row += [_cell(result["ratios"][m][name], name, result["spread"][m][name]) for m in modes]
            if "ops" in result:
                row.append(f"{result['ops'][name] - result['ops'][BASELINE]:+d}")
            rows.append(row)
        lines.append(markdown_table(header, rows))
    Path(args.out, "decode.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return readme_block(results, args, device)


def readme_block(results: list[dict], args, device: torch.device) -> str:
    """One table: each mode's worst ratio over the batch sizes, per size, and the ops per decode step."""
    sizes = list(dict.fromkeys((r["hidden"], r["layers"]) for r in results))
    columns = [(mode, size) for mode in MODES for size in sizes
               if any(mode in r["ratios"] and (r["hidden"], r["layers"]) == size for r in results)]
    header = ["variant"] + [f"{mode} {h}×{n}" for mode, (h, n) in columns] + [f"ops {h}×{n}" for h, n in sizes]
    measured = "; ".join(f"{h}×{n}: " + " and ".join(str(r["batch"]) for r in results if (r["hidden"], r["layers"])
                                                         == (h, n)) for h, n in sizes)  # what a cut-short run has
    rows = []
    for name in [CONTROL] + args.variants:
        row = [_label(name)]
        for mode, size in columns:
            worst = max(r["ratios"][mode][name] for r in results
                        if mode in r["ratios"] and (r["hidden"], r["layers"]) == size)
            row.append(_cell(worst, name))
        row += [_ops(results, h, n, name) for h, n in sizes]
        rows.append(row)
    text = (
        f"**Decode** (`{command_line(args)}`, [decode.md](benchmarks/results/decode.md); this paragraph and table are "
        "written by that command): time of eager decode steps (dynamic cache), compiled decode steps (static cache) "
        f"and `generate()` (dynamic cache, prefill included), {'CPU' if args.clock == 'cpu' else 'wall-clock'} time "
        "as a ratio to a same-size Llama timed round-robin in the "
        f"same process, the worst of batch {measured} for each size, {device.type}, "
        f"{torch.get_num_threads()} thread(s); ops: aten ops one eager decode step dispatches beyond Llama's "
        "(batch 1, exact). Bold marks a ratio above the goal (1.01, `dense` 1.03, SVFormer 1.0); the first row is a "
        "second, identical Llama: the noise floor of the run. Without a gradient the mix runs on v_proj's output, "
        "one fused op per mixing layer (`dense` three, NeuTRENO two), λ resolved once per forward pass."
    )
    return text + "\n\n" + markdown_table(header, rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(parser)
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[(256, 8), (512, 12)], metavar="HIDDENxLAYERS")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--compile-sizes", nargs="*", type=parse_size, default=None, metavar="HIDDENxLAYERS",
                        help="sizes that also time compiled decode (default: all of --sizes; none: no compile)")
    parser.add_argument("--context", type=int, default=128, help="cached tokens / prompt length (default 128)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed burst (default 16)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens of a generate() call (default 32)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per generate() call (default 32)")
    add_model_args(parser)
    add_clock_arg(parser)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite the docs' decode paragraph")
    args = parser.parse_args(argv)
    args.compile_sizes = args.sizes if args.compile_sizes is None else args.compile_sizes
    args.compile_keys = {h * 1000 + n for h, n in args.compile_sizes}
    device = setup_device(args)
    clock_of(args, device)  # refuses --clock cpu on a GPU before anything is built
    Path(args.out).mkdir(parents=True, exist_ok=True)
    # Every model's forward runs through the same transformers wrapper code, and dynamo caches graphs per code object:
    # with the default limit of 8 the later models would silently fall back to eager.
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 1024
    results = []
    for hidden, layers in args.sizes:
        for batch in args.batch_sizes:
            print(f"hidden {hidden}, {layers} layers, batch {batch} ...", flush=True)
            results.append(measure(hidden, layers, batch, args, device))
            block = write_report(results, args, device)  # after every setting: a cut-short run leaves what it has
            if not args.no_readme:
                rewrite_readme_block("decode", block)
    print(f"wrote {Path(args.out) / 'decode.md'}" + ("" if args.no_readme else " and the docs' decode paragraph"))


if __name__ == "__main__":
    sys.exit(main())
