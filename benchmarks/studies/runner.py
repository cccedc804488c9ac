"""Trains the runs a study's plan needs and the store lacks, one at a time, each saved as soon as it finishes (an
interrupted study resumes where it stopped; processes side by side share the work out run by run, `store.claim`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from resformer_hf.analysis import attention_entropy, lambda_table, token_similarity, value_gate_statistics

from benchmarks.common import environment_line, setup_device
from benchmarks.studies.corpora import corpus_folder
from benchmarks.studies.data import Data, batch_order, prepare_data, read_corpus
from benchmarks.studies.plan import PlannedRun
from benchmarks.studies.spec import Settings
from benchmarks.studies.store import RunStore
from benchmarks.studies.training import cache_bytes_per_token, non_embedding_parameters, seeded_model, train

#: Validation blocks the attention-entropy, token-similarity and value-gate analysis runs on after training.
ANALYSIS_SEQUENCES = 8


def open_device(device: str, threads: int | None) -> torch.device:
    """The training device, with float32 matmuls kept in float32 on a GPU (no TF32), so its runs are the CPU's up to
    the order of floating-point sums."""
    device = setup_device(argparse.Namespace(device=device, threads=threads))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def load_data(settings: Settings) -> tuple[Data, str]:
    """The study's tokenized data and a description for its table."""
    if settings.sample_chars:
        from resformer_hf.text import SAMPLE_DESCRIPTION, sample_text

        texts = [sample_text(settings.sample_chars)]
        description = f"first {settings.sample_chars:,} characters of the {SAMPLE_DESCRIPTION}"
    else:
        folder = corpus_folder(settings.corpus, build_it=True)
        names = [p.name for p in sorted(folder.glob("*.txt"))]
        listed = ", ".join(names) if len(names) <= 6 else f"{len(names)} files: {', '.join(names[:3])}, …"
        texts, description = read_corpus(folder), f"{folder.name}/ ({listed})"
    data = prepare_data(texts, vocab_size=settings.vocab_size, val_fraction=settings.val_fraction,
                        seq_len=settings.seq_len, val_tokens=settings.val_tokens)
    description += (f"; byte-level BPE of {data.vocab_size} tokens trained on the training split; "
                    f"{data.train.numel() / 1e6:.2f}M training tokens, validation on {data.val.numel() / 1e3:.0f}k "
                    f"held-out tokens (evenly spaced blocks of the last {settings.val_fraction:.0%} of each file)")
    return data, description


def train_from_scratch(run: PlannedRun, data: Data, device: torch.device) -> dict:
    """Train the run's model from its seeded initialisation; its curve, then the analysis of the trained model."""
    budget = run.settings.budget()
    model = seeded_model(run.arm.model, run.arm.size(run.settings), data, run.settings.seq_len, run.seed, device)
    order = batch_order(len(data.train), budget.batch_size, budget.steps, run.seed)
    result = train(model, data, budget, order, device, label=run.label)
    probe = data.val[:ANALYSIS_SEQUENCES].to(device)
    result.update(
        attention_entropy=attention_entropy(model, probe).tolist(),
        token_similarity=token_similarity(model, probe).tolist(),
        lambdas=lambda_table(model).tolist(),
        parameters=sum(p.numel() for p in model.parameters()),
        non_embedding_parameters=non_embedding_parameters(model),
        cache_bytes_per_token=cache_bytes_per_token(model, data.val[0].to(device)),
    )
    gates = value_gate_statistics(model, probe)  # `gated`: the mix its gates give these tokens, per layer
    if gates:
        result["value_gate_statistics"] = {str(layer): statistics for layer, statistics in gates.items()}
    return result


class Progress:
    """`[done/total runs] elapsed, ETA`, weighing each run by its tokens × context (what its cost grows with)."""

    def __init__(self, runs: list[PlannedRun]):
        self.left = {id(run): self.weight(run) for run in runs}
        self.total, self.done, self.count, self.started = len(runs), 0.0, 0, time.monotonic()

    @staticmethod
    def weight(run: PlannedRun) -> float:
        return float(run.identity["budget"]["tokens"] * run.settings.seq_len)

    def finished(self, run: PlannedRun) -> None:
        self.done += self.left.pop(id(run))
        self.count += 1
        elapsed = time.monotonic() - self.started
        eta = elapsed / self.done * sum(self.left.values()) if self.done else 0.0
        print(f"[{self.count}/{self.total} runs] elapsed {elapsed / 60:.0f} min, ETA {eta / 60:.0f} min", flush=True)


def provenance(device: torch.device, data_description: str, command: str) -> dict:
    """What a stored run records besides its identity and result: where it ran, on what text, from which command."""
    return {"environment": environment_line(device), "data": data_description, "command": command}


def train_missing(runs: list[PlannedRun], store: RunStore, device: torch.device, command: str, *,
                  fresh: bool = False) -> int:
    """Train every planned run the store lacks (`fresh`: every planned run again); returns how many were trained."""
    datasets = {}

    def train(run: PlannedRun) -> tuple[dict, dict]:
        data_key = repr(sorted(run.identity["data"].items()))
        if data_key not in datasets:
            datasets.clear()  # one corpus in memory at a time
            datasets[data_key] = load_data(run.settings)
        data, description = datasets[data_key]
        result = train_from_scratch(run, data, device)
        return result, provenance(device, description, command)

    return share_out([run for run in runs if fresh or run.identity not in store], store, train, fresh=fresh)


def share_out(todo: list[PlannedRun], store: RunStore, train: Callable[[PlannedRun], tuple[dict, dict]], *,
              fresh: bool = False) -> int:
    """Train and store each run of `todo` (`train` gives its result and provenance) while holding its claim; returns
    how many were trained here.

    A run that another process is training is left to it and come back to at the end: read from the store if that
    process stored it, trained here if it died."""
    progress, trained, held_elsewhere = Progress(todo), 0, []

    def train_one(run: PlannedRun, wait: bool) -> int | None:
        """1 when trained here, 0 when found stored, None when another process holds it (only if not `wait`)."""
        with store.claim(run.identity, wait=wait) as claimed:
            if not claimed:
                return None
            if not fresh and run.identity in store:  # another process finished it meanwhile
                print(f"{run.label}: done, skipped", flush=True)
                return 0
            print(f"training {run.label}", flush=True)
            result, provenance = train(run)
            if not store.put(run.identity, result, provenance, replace=fresh):
                print(f"{run.label}: another process stored it first; its run is kept", flush=True)
            return 1

    for run in todo:
        outcome = train_one(run, wait=False)
        if outcome is None:
            print(f"{run.label}: another process is training it; back to it at the end", flush=True)
            held_elsewhere.append(run)
            continue
        trained += outcome
        progress.finished(run)
    for run in held_elsewhere:
        print(f"{run.label}: waiting for the process training it (trained here if that process dies)", flush=True)
        trained += train_one(run, wait=True)
        progress.finished(run)
    return trained
