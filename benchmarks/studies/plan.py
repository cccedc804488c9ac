"""From a declaration to runs: each (grid cell, arm, seed) of a study as the identity that names it in the store.

A run's identity is everything that determines what it produces — the text and its tokenization, the model, the
budget, the seed, the device kind and `RUN_CODE` — and nothing else (not the study that asks for it), so any two
studies that need the same run share it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from resformer_hf.remote_code.value_embeddings import GATE_CHANNELS
from resformer_hf.remote_code.variants import GATE, VARIANTS

from benchmarks.studies.corpora import corpus_folder
from benchmarks.studies.spec import Arm, Continuation, ContinuedArm, ImpossibleSettings, Settings, Study
from benchmarks.studies.store import digest, portable_path
from benchmarks.studies.training import Budget, ModelSize

#: The version of the code that turns an identity into numbers (data pipeline, model classes, training loop). Bump it
#: with a change that alters what a run produces: runs of the old version are then trained again, not mixed in.
RUN_CODE = 1
#: The key of the uptrain study's pre-training run among its results.
PRETRAIN = "pretrain"


@dataclass(frozen=True)
class PlannedRun:
    """One run a study asks for: where it sits in the study (cell, arm, seed) and its identity in the store."""

    cell: object  #: the grid value (None without a grid)
    arm: Arm | ContinuedArm | None  #: None: the uptrain study's pre-trained Llama
    seed: int
    settings: Settings  #: the study's settings in this cell
    identity: dict

    @property
    def key(self) -> str:
        """How the study's report names the run: `ARM/seedN` (the uptrain pre-training: `pretrain`)."""
        return PRETRAIN if self.arm is None else f"{self.arm.name}/seed{self.seed}"

    @property
    def label(self) -> str:
        cell = "" if self.cell is None else f" {self.cell}"
        return f"{self.key}{cell}"


def data_identity(settings: Settings) -> dict:
    corpus = ({"sample_chars": settings.sample_chars} if settings.sample_chars
              else portable_path(corpus_folder(settings.corpus)))
    return {"corpus": corpus, "vocab_size": settings.vocab_size, "val_fraction": settings.val_fraction,
            "val_tokens": settings.val_tokens, "seq_len": settings.seq_len}


def model_identity(variant: str, size: ModelSize) -> dict:
    """The model's shape with every default made explicit, so `kv_heads=None` and `kv_heads=heads` are one run."""
    cla = size.cross_layer_attention if (size.cross_layer_attention or 1) > 1 else None
    ve = {"value_embeddings": size.value_embeddings if isinstance(size.value_embeddings, str)
          else list(size.value_embeddings)} if size.value_embeddings else {}  # only when set: older runs keep names
    # gated's gate reads the first channels of its input since issue 66 (all of them before): a model of its own
    gated = variant in VARIANTS and VARIANTS[variant].role == GATE
    gate = {"value_gate_channels": min(GATE_CHANNELS, size.hidden_size)} if gated else {}
    return {"variant": variant, "hidden_size": size.hidden_size, "layers": size.layers, "heads": size.heads,
            "kv_heads": size.kv_heads or size.heads, "intermediate_size": size.intermediate,
            "cross_layer_attention": cla, **ve, **gate}


def budget_identity(budget: Budget) -> dict:
    return {"tokens": budget.tokens, "batch_size": budget.batch_size, "lr": budget.lr, "warmup": budget.warmup,
            "weight_decay": budget.weight_decay, "eval_every": budget.eval_every, "min_lr_rate": budget.min_lr_rate}


def device_kind(device: str | torch.device) -> str:
    return torch.device(device).type


def scratch_identity(settings: Settings, variant: str, size: ModelSize, seed: int, device: str,
                     budget: Budget | None = None) -> dict:
    """A model trained from its seeded initialisation on the whole training split."""
    return {"kind": "pretrain", "code": RUN_CODE, "device": device_kind(device), "data": data_identity(settings),
            "model": model_identity(variant, size), "budget": budget_identity(budget or settings.budget()),
            "seed": seed}


def split_identity(continuation: Continuation, part: str) -> dict:
    return {"continue_fraction": continuation.continue_fraction, "seed": continuation.pretrain_seed, "part": part}


def uptrain_identities(settings: Settings, continuation: Continuation, arm: ContinuedArm, seed: int,
                       device: str) -> tuple[dict, dict]:
    """(the pre-trained source's identity, the arm's continuation's): a continuation names the run it starts from."""
    size = ModelSize(settings.hidden_size, settings.layers, settings.heads, None, settings.intermediate_size)
    budget = settings.budget(continuation.pretrain_tokens, continuation.pretrain_lr)
    start = scratch_identity(settings, continuation.source, size, continuation.pretrain_seed, device, budget)
    if continuation.source_fields:  # only when set: the Llama's runs keep their names
        start["model"]["source_fields"] = dict(continuation.source_fields)
    start["split"] = split_identity(continuation, "pretrain")
    identity = {"kind": "continue", "code": RUN_CODE, "device": device_kind(device), "start": digest(start),
                "data": data_identity(settings), "split": split_identity(continuation, "continue"),
                "arm": {"variant": arm.variant, "init": arm.init, "lambda_overrides": dict(arm.lambda_overrides),
                        "lambda_lr_scale": arm.lambda_lr_scale,
                        **({"value_embeddings": arm.value_embeddings} if arm.value_embeddings else {})},
                "budget": budget_identity(settings.budget()), "seed": seed}
    return start, identity


def cells(study: Study, settings: Settings, values: tuple | None = None, *,
          possible_only: bool = False) -> dict[object, Settings]:
    """Each grid cell's settings (one cell, None, without a grid); `possible_only` leaves out the cells the settings
    make impossible (a declared context that --tokens-per-step does not divide) instead of refusing them."""
    if study.grid is None:
        return {None: settings}
    found = {}
    for value in values or study.grid.values:
        try:
            here = settings.at(study.grid.name, value)
            here.budget()
        except ImpossibleSettings:
            if not possible_only:
                raise
            continue
        found[value] = here
    return found


def plan(study: Study, settings: Settings, seeds: list[int], arms: list[str], cell_settings: dict, device: str,
         continuation: Continuation | None = None, only: dict[str, set] | None = None) -> list[PlannedRun]:
    """Every run of the study, cell by cell and seed-major (an interrupted study has whole seeds to report); `only`
    limits an arm to some cells (a study tuned on another: each arm at its best learning rate)."""
    runs = []
    for cell, here in cell_settings.items():
        if study.continuation is not None:
            start = None
            for seed in seeds:
                for name in arms:
                    start, identity = uptrain_identities(here, continuation, study.arm(name), seed, device)
                    runs.append(PlannedRun(cell, study.arm(name), seed, here, identity))
            if start is not None:
                runs.insert(0, PlannedRun(cell, None, continuation.pretrain_seed, here, start))
            continue
        for seed in seeds:
            for name in arms:
                if only is not None and cell not in only.get(name, ()):
                    continue
                arm = study.arm(name)
                own = dataclasses.replace(here, lr=arm.lr) if getattr(arm, "lr", None) else here  # its tuned lr
                runs.append(PlannedRun(cell, arm, seed, own,
                                       scratch_identity(own, arm.model, arm.size(own), seed, device)))
    return runs


def with_overrides(study: Study, overrides: dict) -> tuple[Settings, Continuation | None]:
    """The study's settings and continuation with the command line's values in place of the declared ones."""
    fields = {f.name for f in dataclasses.fields(Settings)}
    settings = dataclasses.replace(study.settings, **{k: v for k, v in overrides.items() if k in fields})
    continuation = study.continuation
    names = {f.name for f in dataclasses.fields(Continuation)}
    if continuation is not None:
        continuation = dataclasses.replace(continuation, **{k: v for k, v in overrides.items() if k in names})
    elif names & set(overrides):
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in sorted(names & set(overrides)))
        raise SystemExit(f"{flags}: only the uptrain study pre-trains a Llama to continue; {study.name} does not")
    return settings, continuation
