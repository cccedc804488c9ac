"""The instruction-count part of the cost benchmark: every variant and Llama counted by callgrind.

Counts per eager decode step (dynamic cache, as `generate()`), per compiled decode step (static cache, `torch.compile`
fullgraph) and per prefill without gradient, at each size and batch, in one valgrind process per size and batch
(`instructions.py`). The first size and batch is counted `runs` times in fresh processes (the others once: a valgrind
process costs minutes): the report shows how far the runs agree, which is what makes these ratios a claim where
timings on a shared machine are not. Counts are kept in a store (`instructions.json` beside cost.md) that later
commands add to, so that the costly kinds (compiled steps: minutes per model under valgrind) can be counted for fewer
sizes by a command of their own; the report shows every count the store holds.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from benchmarks.common import BASELINE, markdown_table
from benchmarks.cost.instructions import KINDS, Job, count_instructions
from benchmarks.cost.settings import goal

#: Cached tokens before each counted decode step, and prompt length of the counted prefill: the setting
#: `tests/test_decode_instructions.py` gates, so the report and the gate count the same step.
CONTEXT = 64


def measure_instructions(sizes, batches, names, kinds=KINDS, runs: int = 2, number: int = 4, vocab_size: int = 2048,
                         head_dim: int = 32) -> dict:
    """{"counts": [{(name, hidden, layers, batch, kind): instructions per call} per run], ...}; runs after the first
    hold the first size and batch only. `save_counts` adds a result to the store."""
    counts: list[dict] = [{} for _ in range(runs)]
    for group, (hidden, layers, batch) in enumerate((h, n, b) for h, n in sizes for b in batches):
        jobs = [Job(name, hidden, layers, batch, kind, CONTEXT, 1 if kind == "prefill" else number, vocab_size,
                    head_dim) for kind in kinds for name in [BASELINE, *names]]
        for run in range(runs if group == 0 else 1):
            print(f"counting instructions: {hidden}x{layers}, batch {batch}, run {run + 1} ...", flush=True)
            for job, count in count_instructions(jobs).items():
                counts[run][(job.name, hidden, layers, batch, job.kind)] = count
    return {"counts": counts, "number": number, "sizes": [tuple(size) for size in sizes], "batches": list(batches),
            "names": list(names), "kinds": [kind for kind in KINDS if kind in kinds],
            "settings": {"number": number, "vocab_size": vocab_size, "head_dim": head_dim, "context": CONTEXT}}


def _union(first: list, second: list) -> list:
    return list(dict.fromkeys([*map(_hashable, first), *map(_hashable, second)]))


def _hashable(item):
    return tuple(item) if isinstance(item, list) else item


def save_counts(result: dict, path: Path) -> dict:
    """Add `result` to the store at `path` and return what the store then holds.

    Counting commands may run side by side (one per size, each a valgrind process of its own): under a lock, the store
    is read again and this result's counts join it (a count made again replaces the stored one); a store of other
    settings is replaced. Written to a temporary file and renamed, so it is never half-written.
    """
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stored = load_counts(path)
        if stored is not None and stored.get("settings") == result["settings"]:
            runs = max(len(stored["counts"]), len(result["counts"]))
            counts = [{**(stored["counts"][r] if r < len(stored["counts"]) else {}),
                       **(result["counts"][r] if r < len(result["counts"]) else {})} for r in range(runs)]
            result = {**result, "counts": counts, "sizes": _union(stored["sizes"], result["sizes"]),
                      "batches": _union(stored["batches"], result["batches"]),
                      "names": _union(stored["names"], result["names"]),
                      "kinds": [kind for kind in KINDS if kind in {*stored["kinds"], *result["kinds"]}],
                      "commands": _union(stored.get("commands", []), result.get("commands", []))}
        data = {**result, "counts": [{"|".join(map(str, key)): count for key, count in run.items()}
                                     for run in result["counts"]]}
        staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        staging.write_text(json.dumps(data, indent=1))
        staging.replace(path)
    return result


def load_counts(path: Path) -> dict | None:
    """What `save_counts` wrote, or None when there is nothing yet."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())

    def key(text: str) -> tuple:
        name, hidden, layers, batch, kind = text.split("|")
        return name, int(hidden), int(layers), int(batch), kind

    data["counts"] = [{key(text): count for text, count in run.items()} for run in data["counts"]]
    data["sizes"] = [tuple(size) for size in data["sizes"]]
    return data


def agreement(result: dict) -> float:
    """Largest relative difference between two runs' counts of the same call (0 when counted once)."""
    first, *others = result["counts"]
    return max((abs(count - first[key]) / first[key] for other in others for key, count in other.items()),
               default=0.0)


def _ratio(result: dict, name: str, hidden: int, layers: int, batch: int, kind: str) -> str:
    counts = result["counts"][0]
    if (name, hidden, layers, batch, kind) not in counts or (BASELINE, hidden, layers, batch, kind) not in counts:
        return "–"  # not counted at this size and batch
    ratio = counts[(name, hidden, layers, batch, kind)] / counts[(BASELINE, hidden, layers, batch, kind)]
    bold = ratio > goal("decode" if "decode" in kind else "prefill", name, hidden)
    return f"**{ratio:.4f}**" if bold else f"{ratio:.4f}"


def _llama_line(result: dict, hidden: int, layers: int, batch: int) -> str:
    key = (BASELINE, hidden, layers, batch)
    return ", ".join(
        f"{kind} " + " / ".join(f"{run[(*key, kind)] / 1e6:.4f}" for run in result["counts"] if (*key, kind) in run)
        + " M" for kind in result["kinds"] if (*key, kind) in result["counts"][0])


KIND_DESCRIPTIONS = {
    "decode": f"eager decode step after {CONTEXT} cached tokens (dynamic cache, as `generate()`)",
    "compiled decode": "compiled decode step (`torch.compile` fullgraph, static cache)",
    "prefill": f"prefill of {CONTEXT} tokens without gradient",
}


def _determinism(result: dict) -> str:
    runs = len(result["counts"])
    if runs == 1:
        return "counted once"
    hidden, layers = result["sizes"][0]
    return (f"counted {runs} times in fresh processes, hidden {hidden} × {layers} layers, batch "
            f"{result['batches'][0]}, every call's counts agree to {agreement(result):.1e} relative")


def instruction_section(result: dict) -> str:
    """cost.md's instruction tables: every size and batch, ratios to Llama with Llama's counts of every run."""
    kinds = "; ".join(KIND_DESCRIPTIONS[kind] for kind in result["kinds"])
    lines = [
        "## Instructions per call (callgrind; deterministic)",
        f"Instructions executed per call, counted by valgrind's callgrind (`benchmarks/cost/instructions.py`, "
        f"`PYTHONHASHSEED=0`, one thread), as a ratio to Llama's, decode steps the mean of {result['number']}: "
        f"{kinds}. Unlike the timings above these do not depend on machine load ({_determinism(result)}; Llama's "
        "counts below). Bold: above the goal (decode 1.01, `dense` 1.03, NeuTRENO 1.02, SVFormer 1.00; prefill as "
        "prefill time).",
    ]
    for hidden, layers in result["sizes"]:
        for batch in result["batches"]:
            if not any(key[1:4] == (hidden, layers, batch) for key in result["counts"][0]):
                continue  # no command counted this size at this batch
            lines += ["", f"### hidden {hidden}, {layers} layers, batch {batch}",
                      f"Llama, millions of instructions per call: {_llama_line(result, hidden, layers, batch)}.", "",
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
        f"**Instructions** ({command}, [cost.md](benchmarks/results/cost.md), written by these commands): "
        f"instructions per call ({'; '.join(KIND_DESCRIPTIONS[kind] for kind in result['kinds'])}), counted by "
        f"callgrind, as a ratio to Llama's, batch {batch}. Deterministic: {_determinism(result)} (Llama "
        f"{hidden}×{layers}: {_llama_line(result, hidden, layers, batch)}). Bold: above the goal (decode 1.01, "
        "`dense` "
        "1.03, NeuTRENO 1.02, SVFormer 1.00). `tests/test_decode_instructions.py` holds eager decode to these goals.",
        "",
        markdown_table(header, rows),
    ])
