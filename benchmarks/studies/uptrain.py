"""The uptrain study's runs: one source model (a Llama, or another base the converter takes, built with transformers'
own class) pre-trained on part of the training blocks and saved, converted with the real converter
(`resformer_hf.convert_llama_checkpoint`) into each arm, and every arm — the source too — continued on the blocks the
pre-training never saw. Checkpoints live in a work folder (default: the temp directory, named after the pre-training
run) and are made only while a continuation still needs them.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from resformer_hf import ResFormerForCausalLM, convert_llama_checkpoint

from benchmarks.common import BASELINE
from benchmarks.studies.data import Data, batch_order
from benchmarks.studies.plan import PlannedRun
from benchmarks.studies.runner import load_data, provenance, share_out
from benchmarks.studies.spec import ContinuedArm
from benchmarks.studies.store import RunStore, digest
from benchmarks.studies.training import Budget, ModelSize, lambda_parameters, seeded_model, train


def split_blocks(data: Data, continue_fraction: float, seed: int) -> tuple[Data, Data]:
    """(pre-training, continuation) data: a seeded random partition of the training blocks, so the continuation
    trains on text the Llama never saw, from the same distribution; validation is shared."""
    permutation = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(seed))
    cut = int(len(permutation) * (1 - continue_fraction))
    return (Data(data.tokenizer, data.train[permutation[:cut]], data.val),
            Data(data.tokenizer, data.train[permutation[cut:]], data.val))


def source_model(shape: dict, data: Data, seq_len: int, seed: int, device):
    """The seeded source of the identity's model shape: a Llama (`seeded_model`), or transformers' own class of the
    source's `model_type` with its extra config fields (`Continuation.source`)."""
    size = ModelSize(shape["hidden_size"], shape["layers"], shape["heads"], None, shape["intermediate_size"])
    if shape["variant"] == BASELINE:
        return seeded_model(BASELINE, size, data, seq_len, seed, device)
    config = AutoConfig.for_model(shape["variant"], **size.fields(data, seq_len), **shape.get("source_fields", {}))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(device)


def pretrain_llama(run: PlannedRun, store: RunStore, data: Data, work_dir: Path, device, command: str,
                   description: str) -> Path:
    """The pre-trained source's folder under `work_dir`, named after the stored run's validation curve (a source
    trained again never meets conversions of an earlier one); trained, saved and stored first when missing. A source
    trained again (its folder lost with the temp directory) that reproduces the stored curve leaves the record as it
    is: the continuations stored from it still describe this source, and their reports keep the day it was measured.
    The folder is called `llama` whatever the source's architecture (older work folders keep their names)."""
    record = store.record(run.identity)
    if record is not None and (checkpoint_folder(work_dir, record["result"]) / "llama" / "config.json").is_file():
        return checkpoint_folder(work_dir, record["result"]) / "llama"
    budget = Budget(**run.identity["budget"], seq_len=run.settings.seq_len)
    print(f"pre-training the {run.identity['model']['variant']} source", flush=True)
    model = source_model(run.identity["model"], data, run.settings.seq_len, run.seed, device)
    order = batch_order(len(data.train), budget.batch_size, budget.steps, run.seed)
    result = train(model, data, budget, order, device, label=f"{run.identity['model']['variant']} pre-training")
    result["budget"] = budget.describe()
    checkpoint = checkpoint_folder(work_dir, result) / "llama"
    model.save_pretrained(checkpoint)  # before the record: a stored pre-training run has its Llama on disk
    if record is not None and checkpoint_folder(work_dir, record["result"]) == checkpoint.parent:  # the same curve
        print("pre-trained again: the stored validation curve, reproduced exactly; its record is kept", flush=True)
        return checkpoint
    # the continuations start from this one
    store.put(run.identity, result, provenance(device, description, command), replace=record is not None)
    return checkpoint


def checkpoint_folder(work_dir: Path, result: dict) -> Path:
    curve = hashlib.sha1(json.dumps(result["curve"]).encode()).hexdigest()[:10]
    return work_dir / f"pretrained-{curve}"


def converted(arm: ContinuedArm, llama: Path, source: str = BASELINE) -> Path:
    """The arm's converted checkpoint, made once (beside the source) with the real converter. Arms share conversions
    (λ alone and λ with tables both continue `learnable-preserve`), so a process beside this one may be making it:
    the lock makes this one wait for that folder instead of converting into it too. A Llama's own weights load as a
    ResFormer without value residual as they are (`load_arm`); another base's (`source`, its model type) are
    converted to one (`none`)."""
    if arm.variant == BASELINE or (arm.variant == "none" and source == BASELINE):
        return llama
    destination = llama.parent / f"{arm.variant}-{arm.init}"
    with FileLock(llama.parent / f".{destination.name}.converting"):
        if not (destination / "config.json").is_file():
            report = convert_llama_checkpoint(llama, destination, variant=arm.variant, init=arm.init,
                                              verify=arm.init == "preserve", progress=False)
            print(report.summary(), flush=True)
    return destination


def load_arm(arm: ContinuedArm, checkpoint: Path, device):
    if arm.variant == BASELINE:  # the source itself: a Llama, or transformers' class of its model type
        return AutoModelForCausalLM.from_pretrained(checkpoint).to(device)
    tables = {"value_embeddings": arm.value_embeddings} if arm.value_embeddings else {}  # loaded at zero
    none = {"value_residual": "none"} if arm.variant == "none" else {}
    return ResFormerForCausalLM.from_pretrained(checkpoint, **arm.lambda_overrides, **tables, **none).to(device)


def lambda_state(model) -> dict | None:
    """Effective (λ_first, λ_self) per layer and the raw λ parameters (offsets from the config's initial values)."""
    if not hasattr(model, "value_residual_lambdas"):
        return None
    raw = {name: param.detach().cpu().float().reshape(-1).tolist()
           for name, param in model.base_model.value_residual.named_parameters()}
    return {"table": model.value_residual_lambdas().tolist(), "raw": raw}


def initial_gradients(model, data: Data, batch_size: int, device) -> dict:
    """max |∂loss/∂p| of every λ parameter on the first continuation batch, at the converted starting point."""
    if not lambda_parameters(model):
        return {}
    model.train()
    batch = data.train[:batch_size].to(device)
    model.zero_grad(set_to_none=True)
    model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
    gradients = {name: float(p.grad.abs().max()) if p.grad is not None else 0.0
                 for name, p in model.base_model.value_residual.named_parameters()}
    model.zero_grad(set_to_none=True)
    return gradients


def continue_arm(run: PlannedRun, data: Data, checkpoint: Path, device) -> dict:
    model = load_arm(run.arm, checkpoint, device)
    budget = run.settings.budget()
    gradients = initial_gradients(model, data, budget.batch_size, device)
    order = batch_order(len(data.train), budget.batch_size, budget.steps, run.seed)
    result = train(model, data, budget, order, device, label=run.label, probe=lambda_state,
                   lambda_lr_scale=run.arm.lambda_lr_scale)
    result["initial_lambda_gradients"] = gradients
    return result


def lambda_summary(probes: list[dict]) -> tuple[float, float, float, float, float]:
    """(λ_first start, end, λ_self start, end: means over receiving layers; largest |Δλ| of any layer)."""
    start, end = np.array(probes[0]["table"])[1:], np.array(probes[-1]["table"])[1:]
    return start[:, 0].mean(), end[:, 0].mean(), start[:, 1].mean(), end[:, 1].mean(), np.abs(end - start).max()


def train_missing_continuations(runs: list[PlannedRun], store: RunStore, device, command: str, *, fresh: bool = False,
                                work_dir: Path | None = None) -> int:
    """Pre-train the Llama when a missing continuation needs it, then continue every missing arm (`fresh`: every
    planned continuation again, from the stored pre-training's Llama)."""
    start, continuations = runs[0], runs[1:]
    todo = [run for run in continuations if fresh or run.identity not in store]
    if not todo:
        return 0
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per run would drown the training log
    whole, description = load_data(start.settings)
    split = start.identity["split"]
    pre, cont = split_blocks(whole, split["continue_fraction"], split["seed"])
    folder = Path(work_dir or Path(tempfile.gettempdir()) / f"resformer-bench-uptrain-{digest(start.identity)}")
    with store.claim(start.identity, wait=True):  # a process beside this one pre-training it: wait for its Llama
        llama = pretrain_llama(start, store, pre, folder, device, command, description)

    def train(run: PlannedRun) -> tuple[dict, dict]:
        result = continue_arm(run, cont, converted(run.arm, llama, start.identity["model"]["variant"]), device)
        return result, provenance(device, description, command)

    return share_out(todo, store, train, fresh=fresh)
