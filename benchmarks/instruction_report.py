"""The instruction-count part of the cost benchmark: every variant and Llama counted by callgrind, twice.

Counts per eager decode step (dynamic cache, as `generate()`), per compiled decode step (static cache, `torch.compile`
fullgraph) and per prefill without gradient, at each size and batch, in one valgrind process per size and batch
(`instructions.py`). Each group is counted `runs` times in fresh processes: the report shows how far the runs agree,
which is what makes these ratios a claim where timings on a shared machine are not.
"""

from __future__ import annotations

from cost_settings import goal
from instructions import KINDS, Job, count_instructions

from common import BASELINE, markdown_table

#: Cached tokens before each counted decode step, and prompt length of the counted prefill (the issue's setting).
CONTEXT = 64


def measure_instructions(sizes, batches, names, kinds=KINDS, runs: int = 2, number: int = 4, vocab_size: int = 2048,
                         head_dim: int = 32) -> dict:
    """{"counts": [{(name, hidden, layers, batch, kind): instructions per call} per run], ...}."""
    counts: list[dict] = [{} for _ in range(runs)]
    for hidden, layers in sizes:
        for batch in batches:
            jobs = [Job(name, hidden, layers, batch, kind, CONTEXT, 1 if kind == "prefill" else number, vocab_size,
                        head_dim) for kind in kinds for name in [BASELINE, *names]]
            for run in range(runs):
                print(f"counting instructions: {hidden}x{layers}, batch {batch}, run {run + 1}/{runs} ...", flush=True)
                for job, count in count_instructions(jobs).items():
                    counts[run][(job.name, hidden, layers, batch, job.kind)] = count
    return {"counts": counts, "sizes": list(sizes), "batches": list(batches), "names": list(names),
            "kinds": list(kinds), "number": number}


def agreement(result: dict) -> float:
    """Largest relative difference between two runs' counts of the same call (0 when counted once)."""
    first, *others = result["counts"]
    return max((abs(other[key] - count) / count for other in others for key, count in first.items()), default=0.0)


def _ratio(result: dict, name: str, hidden: int, layers: int, batch: int, kind: str) -> str:
    counts = result["counts"][0]
    ratio = counts[(name, hidden, layers, batch, kind)] / counts[(BASELINE, hidden, layers, batch, kind)]
    bold = ratio > goal("decode" if "decode" in kind else "prefill", name, hidden)
    return f"**{ratio:.4f}**" if bold else f"{ratio:.4f}"


def _llama_line(result: dict, hidden: int, layers: int, batch: int) -> str:
    runs = result["counts"]
    return ", ".join(
        f"{kind} " + " / ".join(f"{run[(BASELINE, hidden, layers, batch, kind)] / 1e6:.4f}" for run in runs) + " M"
        for kind in result["kinds"])


def instruction_section(result: dict) -> str:
    """cost.md's instruction tables: every size and batch, ratios to Llama with Llama's counts of every run."""
    runs = len(result["counts"])
    lines = [
        "## Instructions per call (callgrind; deterministic)",
        f"Instructions executed per call, counted by valgrind's callgrind (`benchmarks/instructions.py`, "
        f"`PYTHONHASHSEED=0`, one thread), as a ratio to Llama's: eager decode step after {CONTEXT} cached tokens "
        f"(dynamic cache, as `generate()`, mean of {result['number']}), compiled decode step (`torch.compile` "
        f"fullgraph, static cache), prefill of {CONTEXT} tokens without gradient. Unlike the timings above these do "
        f"not depend on machine load: counted {runs} times in fresh processes, the counts of every call agree to "
        f"{agreement(result):.1e} relative (Llama's, per run, below). Bold: above the goal (decode 1.01, "
        "`dense` 1.03, "
        "NeuTRENO 1.02, SVFormer 1.00; prefill as prefill time).",
    ]
    for hidden, layers in result["sizes"]:
        for batch in result["batches"]:
            lines += ["", f"### hidden {hidden}, {layers} layers, batch {batch}",
                      f"Llama, millions of instructions per call (run {' / '.join(map(str, range(1, runs + 1)))}): "
                      f"{_llama_line(result, hidden, layers, batch)}.", "",
                      markdown_table(["variant", *result["kinds"]],
                                     [[f"`{name}`", *(_ratio(result, name, hidden, layers, batch, kind)
                                                      for kind in result["kinds"])] for name in result["names"]])]
    return "\n".join(lines)


def instruction_readme_block(result: dict, command: str) -> str:
    """The README's instruction table: batch 1 (and the first batch otherwise), every size and kind."""
    batch = 1 if 1 in result["batches"] else result["batches"][0]
    header = ["variant"] + [f"{kind} {h}×{n}" for kind in result["kinds"] for h, n in result["sizes"]]
    rows = [[f"`{name}`"] + [_ratio(result, name, h, n, batch, kind) for kind in result["kinds"]
                             for h, n in result["sizes"]] for name in result["names"]]
    hidden, layers = result["sizes"][0]
    return "\n".join([
        f"**Instructions** (`{command}`, [cost.md](benchmarks/results/cost.md), written by that command): "
        f"instructions per eager decode step (dynamic cache), compiled decode step (static cache) and prefill without "
        f"gradient, counted by callgrind, as a ratio to Llama's, batch {batch}. Deterministic: counted "
        f"{len(result['counts'])} times in fresh processes they agree to {agreement(result):.1e} relative (Llama "
        f"{hidden}×{layers}: {_llama_line(result, hidden, layers, batch)}). Bold: above the goal (decode 1.01, "
        "`dense` "
        "1.03, NeuTRENO 1.02, SVFormer 1.00). `tests/test_decode_instructions.py` holds eager decode to these goals.",
        "",
        markdown_table(header, rows),
    ])
