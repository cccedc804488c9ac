"""The per-study stores of before (`results/pretrain.json`, `results/lr_sweep/lr0.003.json`, ...) into the one store,
without training anything: each old run gets the identity the study declaring it now gives it.

The only code that reads the old layout. Re-runnable and idempotent: a run already in the store with the same
numbers is left as it is, so running it again after old-style processes added runs copies just those. Copies one
study made of another's runs (their `adopted_from`) are the same run: the original is migrated, with the environment
it was measured in, and the copy only where the original is gone. Old files are read, never changed or removed.

    python -m benchmarks.studies migrate                                  # benchmarks/results/*.json, */*.json
    python -m benchmarks.studies migrate --source ../main/benchmarks/results
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from benchmarks.common import REPO_ROOT
from benchmarks.studies import catalogue, plan
from benchmarks.studies.spec import Continuation, Settings, Study
from benchmarks.studies.store import RunStore

#: Where each study kept its runs: a glob under the results folder and the study, by name.
OLD_STORES = (
    ("pretrain.json", "pretrain"),
    ("context_length/ctx*.json", "context_length"),
    ("lr_sweep/lr*.json", "lr_sweep"),
    ("second_corpus/lr*.json", "second_corpus"),
    ("baselines/ctx*.json", "baselines"),
    ("param_efficiency.json", "param_efficiency"),
    ("svformer_gqa.json", "svformer_gqa"),
    ("uptrain.json", "uptrain"),
)
#: A store itself, not a copy kept aside (`*.replaced-<time>.json`) nor a lock or staging file.
STORE_FILE = re.compile(r"(pretrain|param_efficiency|svformer_gqa|uptrain|ctx\d+|lr[0-9.e+-]+)\.json")
SETTING_FIELDS = ("sample_chars", "val_fraction", "val_tokens", "vocab_size", "hidden_size", "layers", "heads",
                  "intermediate_size", "head_dim", "tokens", "seq_len", "batch_size", "lr", "warmup", "weight_decay",
                  "eval_every")


def old_settings(study: Study, config: dict) -> Settings:
    """The settings an old store's runs were trained with (its `config`), as the study's declaration spells them."""
    fields = {name: config[name] for name in SETTING_FIELDS if name in config}
    corpus = str((REPO_ROOT / config["corpus_dir"]).resolve()) if config.get("corpus_dir") else study.settings.corpus
    return dataclasses.replace(study.settings, **fields, corpus=corpus, tokens_per_step=None)


def old_runs(study: Study, config: dict, runs: dict) -> list[tuple[str, dict, dict]]:
    """(old key, identity, result) of every run of one old store; runs no declared arm describes are left out."""
    settings, device = old_settings(study, config), config.get("device", "cpu")
    declared = {arm.name for arm in study.arms}
    undeclared = sorted(key for key in runs if key != plan.PRETRAIN and key.split("/")[0] not in declared)
    if undeclared:
        print(f"{study.name}: left out (no such arm declared): {', '.join(undeclared)}")
    runs = {key: result for key, result in runs.items() if key not in undeclared}
    found = []
    if study.continuation is not None:
        names = {f.name for f in dataclasses.fields(Continuation)}
        continuation = Continuation(**{name: config[name] for name in names if name in config})
        for key, result in runs.items():
            name, seed = ("llama", continuation.pretrain_seed) if key == plan.PRETRAIN else key.rsplit("/seed", 1)
            start, identity = plan.uptrain_identities(settings, continuation, study.arm(name), int(seed), device)
            found.append((key, start if key == plan.PRETRAIN else identity, result))
        return found
    for key, result in runs.items():
        parts = key.split("/")
        here = settings.at("size", parts[1]) if len(parts) == 3 else settings  # param_efficiency: ARM/SIZE/seedN
        arm = study.arm(parts[0])
        identity = plan.scratch_identity(here, arm.model, arm.size(here), int(parts[-1].removeprefix("seed")), device)
        found.append((key, identity, result))
    return found


def migrate(source: Path, store: RunStore) -> dict[str, int]:
    """Copy every run of the old stores under `source` into `store`; returns counts (added, already there, ...)."""
    if not Path(source).is_dir():
        raise SystemExit(f"--source {source}: no such folder; give the results folder that holds the old stores")
    entries = []
    for pattern, name in OLD_STORES:
        study = catalogue.study(name)
        for path in sorted(Path(source).glob(pattern)):
            if not STORE_FILE.fullmatch(path.name):
                continue
            try:
                saved = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as error:  # e.g. copied while a process was writing it: copy it again
                raise SystemExit(f"{path} is not valid JSON ({error}); nothing was migrated from it") from None
            meta = saved.get("meta", {})
            provenance = {"environment": meta.get("environment"), "data": meta.get("data"),
                          "command": meta.get("command"), "migrated_from": path.relative_to(source).as_posix()}
            for key, identity, result in old_runs(study, saved.get("config") or {}, saved.get("runs", {})):
                result = {field: value for field, value in result.items() if field != "adopted_from"}
                copy = "adopted_from" in saved["runs"][key]
                entries.append((copy, f"{provenance['migrated_from']}: {key}", identity, result, provenance))
    counts = {"added": 0, "already there": 0, "differ (stored one kept)": 0}
    differing = []
    for _copy, where, identity, result, provenance in sorted(entries, key=lambda entry: entry[0]):  # originals first
        existing = store.record(identity)
        if existing is None:
            store.put(identity, result, provenance)
            counts["added"] += 1
        elif existing["result"] == json.loads(json.dumps(result)):
            counts["already there"] += 1
        else:
            counts["differ (stored one kept)"] += 1
            differing.append(where)
    print(f"{len(entries)} old runs under {source}: " + ", ".join(f"{n} {what}" for what, n in counts.items()))
    if differing:
        raise SystemExit("these old runs have the identity of a stored run but other numbers (the stored ones are "
                         "kept; move a stored file aside to take the old one instead):\n  " + "\n  ".join(differing))
    return counts
