"""The pre-training comparison (part `pretrain`) as gpu.md reports it, its plot, and its finished arms in the
study store: read from the JSON lines of one or more runs (a run stopped at its deadline and the call that continued
it, or a later call that added arms), each arm compared with the Llama of its own seed."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.common import BASELINE, markdown_table, pyplot
from benchmarks.records import describe_environment, environment_of, read_records
from benchmarks.studies.reports.seeds import save
from benchmarks.studies.seed_statistics import interpolate_curve, tokens_to_reach
from benchmarks.studies.store import RunStore, portable_path

PART = "pretrain"
#: The setup and data facts every reported run must share (else its curves are not comparable).
SAME = ("size", "budget")
SAME_DATA = ("corpus_digest", "tokenizer_digest", "seq_len")


@dataclass
class Arm:
    key: str
    setup: dict
    curve: dict[int, float] = field(default_factory=dict)  #: tokens → validation loss
    final: dict | None = None  #: the `final/KEY` record, once the arm finished
    tokens_per_s: float | None = None
    first_steps: list[float] = field(default_factory=list)

    @property
    def points(self) -> list[tuple[int, float]]:
        return sorted(self.curve.items())

    @property
    def tokens(self) -> int:
        return max(self.curve, default=0)


def collect(runs: list[list[dict]]) -> tuple[dict[str, Arm], dict | None, dict | None]:
    """Every arm's curve and final record over the runs, the data record and the setup; refuses runs of different
    data, model or budget. A run that continued from a checkpoint extends its arms' curves; one that started afresh
    replaces them."""
    arms: dict[str, Arm] = {}
    data = setup = None
    for records in runs:
        resumed = any(r["part"] == PART and r["name"] == "resumed" for r in records)
        for record in records:
            if record["part"] != PART:
                continue
            name, _, key = record["name"].partition("/")
            if name == "data":
                if data and any(data[k] != record[k] for k in SAME_DATA):
                    raise SystemExit("these runs pre-trained on different corpora or tokenizers: report them apart")
                data = record
            elif name == "setup":
                if setup and any(setup[k] != record[k] for k in SAME):
                    raise SystemExit("these runs pre-trained different models or budgets: report them apart")
                setup = record
                for arm_key, described in record["arms"].items():
                    if not resumed or arm_key not in arms:
                        arms[arm_key] = Arm(arm_key, described)
            elif name == "eval":
                arms[key].curve[record["tokens"]] = record["val_loss"]
                arms[key].tokens_per_s = record.get("tokens_per_s") or arms[key].tokens_per_s
            elif name == "compiled":
                arms[key].first_steps.append(record["first_step_s"])
            elif name == "final":
                arms[key].final = record
                arms[key].curve = {int(tokens): loss for tokens, loss in record["curve"]}
                arms[key].tokens_per_s = record["tokens_per_s"]
    return arms, data, setup


def compare(arm: Arm, llama: Arm | None, budget_tokens: int) -> tuple[str, str]:
    """(Δ to the same seed's Llama at the arm's last evaluation, fewer tokens to reach Llama's final loss)."""
    if llama is None or arm is llama:
        return "–", "–"
    delta = "–"
    if arm.curve and llama.tokens >= arm.tokens:
        there = float(interpolate_curve(llama.points, [arm.tokens])[0])
        delta = f"{arm.curve[arm.tokens] - there:+.4f}"
        delta += "" if arm.final and llama.final else f" (at {arm.tokens / 1e6:.1f}M tokens)"
    if not llama.final:
        return delta, "Llama unfinished"
    reached = tokens_to_reach(arm.points, llama.final["final_val_loss"])
    if reached is None:
        return delta, f"not reached in {arm.tokens / 1e6:.1f}M"
    return delta, f"{100 * (1 - reached / budget_tokens):.1f}%"


def passes(epochs: float) -> str:
    return "no block seen twice" if epochs <= 1 else f"{epochs:.2f} passes over them"


def section(runs: list[list[dict]], image: Path) -> list[str]:
    arms, data, setup = collect(runs)
    if not arms or data is None or setup is None:
        return []
    budget_tokens = setup["steps"] * setup["tokens_per_step"]
    rows = []
    for key, arm in arms.items():
        llama = arms.get(f"{BASELINE}@{arm.setup['seed']}")
        delta, fewer = compare(arm, llama, budget_tokens)
        status = "finished" if arm.final else f"stopped at {arm.tokens / 1e6:.1f}M"
        rows.append([key, f"{arm.setup['parameters'] / 1e6:.1f}M", f"{arm.tokens / 1e6:.1f}M ({status})",
                     f"{arm.curve[arm.tokens]:.4f}" if arm.curve else "–", delta, fewer,
                     f"{arm.tokens_per_s:,.0f}" if arm.tokens_per_s else "–",
                     ", ".join(f"{s:.0f}" for s in arm.first_steps) or "–"])
    lines = [
        "## Pre-training at the paper's smallest scale", "",
        f"Model: {setup['size']}; {setup['budget']}; float32 weights under bf16 autocast, `torch.compile` "
        f"({setup['backend']}). Text: {data['files']:,} Python source files of the machine's own installation "
        f"({data['bytes'] / 1e6:.0f} MB, one per content; corpus digest `{data['corpus_digest'][:16]}`), "
        f"{data['held_out_files']:,} of them held out; a byte-level BPE of {data['vocab_size']:,} tokens trained on "
        f"{data['tokenizer_files']:,} training files; {data['train_tokens_read'] / 1e6:.1f}M training tokens read "
        f"({passes(setup['epochs'])}), validation on {data['val_tokens_scored'] / 1e6:.2f}M held-out "
        "tokens. The arms of a seed start from the same weights and see the same batches, in lockstep.", "",
        markdown_table(["arm", "parameters", "tokens trained", "val loss", "Δ vs same seed's Llama",
                        "fewer tokens to reach Llama's final loss", "tokens/s", "first step s (compiling)"], rows), "",
        "*Fewer tokens* is the paper's metric (20.3% at 82M–468M parameters): `1 − tokens to reach the same seed's "
        "Llama's final validation loss / budget`, interpolating linearly between evaluations. Tokens/s: the arm's "
        "own steps timed with device events, compiling excluded.",
    ]
    llamas = [arm for key, arm in arms.items() if key.startswith(f"{BASELINE}@") and arm.final]
    if len(llamas) > 1:
        finals = ", ".join(f"{arm.key} {arm.final['final_val_loss']:.4f}" for arm in llamas)
        spread = max(a.final["final_val_loss"] for a in llamas) - min(a.final["final_val_loss"] for a in llamas)
        lines += ["", f"Seed noise: the Llama seeds end at {finals} (range {spread:.4f})."]
    plot(arms, image)
    return [*lines, "", f"![pre-training curves]({image.name})", ""]


def plot(arms: dict[str, Arm], path: Path) -> None:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, (key, arm) in enumerate(arms.items()):
        if not arm.curve:
            continue
        tokens, losses = (np.array(values) for values in zip(*arm.points[1:] or arm.points))
        color = "black" if key.startswith(f"{BASELINE}@") else f"C{index}"
        style = ["-", "--", ":", "-."][arm.setup["seed"] % 4]  # a seed's arms share a line style
        left.plot(tokens / 1e6, losses, color=color, ls=style, label=key, lw=1.5)
        llama = arms.get(f"{BASELINE}@{arm.setup['seed']}")
        if llama and llama is not arm and llama.curve:
            shared = tokens[tokens <= llama.tokens]
            right.plot(shared / 1e6, losses[: len(shared)] - interpolate_curve(llama.points, shared), color=color,
                       ls=style, label=f"{key} − {llama.key}")
    left.set(xlabel="training tokens (M)", ylabel="validation loss", title="Validation loss")
    right.axhline(0, color="grey", lw=1)
    right.set(xlabel="training tokens (M)", ylabel="val loss − same seed's Llama", title="Difference to Llama")
    save(plt, figure, (left, right), path)


def store_runs(paths: list[Path], store: RunStore) -> list[Path]:
    """Store every finished arm of these runs under the identity it recorded; returns the files written (an arm
    already stored keeps its first record)."""
    written = []
    for path in paths:
        records = read_records(path)
        environment = environment_of(records)
        data = next((r for r in records if r["part"] == PART and r["name"] == "data"), None)
        for record in records:
            if record["part"] != PART or not record["name"].startswith("final/") or not record.get("complete"):
                continue
            result = {key: record[key] for key in ("curve", "train_curve", "final_val_loss", "train_seconds",
                                                   "tokens_per_s", "first_step_s", "parameters",
                                                   "non_embedding_parameters", "lambdas")}
            described = (f"{data['files']:,} Python source files of the machine's installation, corpus digest "
                         f"{data['corpus_digest']}" if data else "see the records")
            provenance = {"environment": describe_environment(environment), "data": described,
                          "command": environment.get("command", ""), "records": portable_path(path)}
            if store.put(record["identity"], result, provenance):
                written.append(store.path(record["identity"]))
    return written
