"""Each kind of study trained end to end by the one runner on a tiny setting (the bundled text sample, a few steps of
a tiny model; nothing from ../shared is read), resumed without training again, and runs shared between studies."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks.common import REPO_ROOT
from benchmarks.studies import catalogue, cli, runner
from benchmarks.studies.seed_statistics import paired_difference
from benchmarks.studies.store import RunStore

TINY_DATA = ["--sample-chars", "30000", "--vocab-size", "300", "--val-fraction", "0.1", "--val-tokens", "256",
             "--threads", "1"]
TINY_MODEL = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--eval-every", "2"]
#: The uptrain study at its smallest: one continuation seed of a 2-layer Llama pre-trained on 256 tokens.
TINY_UPTRAIN = ["run", "uptrain", *TINY_DATA, "--seq-len", "32", "--batch-size", "4", "--hidden-size", "32",
                "--layers", "2", "--heads", "2", "--pretrain-tokens", "256", "--tokens", "128", "--eval-every", "2",
                "--seeds", "0"]


@pytest.fixture
def where(tmp_path, monkeypatch):
    """A store and a results folder of the test's own; tokenizers and checkpoints cached in its own temp folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return ["--store", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]


@pytest.fixture
def trained(monkeypatch):
    """The (study cell, arm) of every run trained from scratch in this test, in order."""
    names = []
    real = runner.train_from_scratch

    def recording(run, data, device):
        names.append(run.label)
        return real(run, data, device)

    monkeypatch.setattr(runner, "train_from_scratch", recording)
    return names


def records(where: list[str]) -> list[dict]:
    store = RunStore(where[1])
    return [store.record(json.loads(path.read_text())["identity"]) for path in store.folder.glob("*.json")]


def stored(where: list[str]) -> dict:
    """Every stored run from scratch by (seq_len, arm variant, kv heads, seed)."""
    found = {}
    for record in records(where):
        identity = record["identity"]
        model = identity.get("model", {})
        found[(identity["data"]["seq_len"], model.get("variant"), model.get("kv_heads"), identity["seed"])] = record
    return found


def test_pretrain_study_end_to_end_then_resumed_without_training(where, trained):
    argv = ["run", "pretrain", *TINY_DATA, *TINY_MODEL, "--seq-len", "32", "--batch-size", "4", "--tokens", "512",
            "--seeds", "0", "1", *where]
    cli.main(argv)
    runs = stored(where)
    assert sorted(runs) == sorted((32, v, 2, s) for v in ("llama", "identity", "learnable_plus", "svformer")
                                  for s in (0, 1))
    assert all(len(r["result"]["curve"]) == 3 and r["result"]["curve"][-1][0] == 512 for r in runs.values())
    assert runs[32, "llama", 2, 0]["result"]["curve"][0] != runs[32, "llama", 2, 1]["result"]["curve"][0]
    provenance = runs[32, "llama", 2, 0]["provenance"]
    assert "torch threads: 1" in provenance["environment"] and "first 30,000 characters" in provenance["data"]
    assert provenance["command"].startswith("python -m benchmarks.studies run pretrain --sample-chars 30000")
    out = where[3]
    table = open(f"{out}/pretrain.md").read()
    assert all(f"| `{v}` |" in table for v in ("llama", "identity", "learnable_plus", "svformer"))
    assert "Regenerate: `python -m benchmarks.studies run pretrain --sample-chars 30000" in table
    finals = {v: [runs[32, v, 2, s]["result"]["final_val_loss"] for s in (0, 1)] for v in ("llama", "identity")}
    delta = paired_difference(finals["identity"], finals["llama"])  # the table's Δ, recomputed from the store
    assert "| `identity` | " in table and f"{delta.mean:+.4f} ± {delta.std:.4f}" in table
    assert len(trained) == 8
    cli.main(argv)  # resumed: every run is stored
    assert len(trained) == 8


HOLDER = """
import json, sys, time
from pathlib import Path
from benchmarks.studies.store import RunStore
store, record, others = RunStore(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
with store.claim(record["identity"]) as claimed:
    print(claimed, flush=True)
    deadline = time.monotonic() + 120
    while len(list(store.folder.glob("*.json"))) < others and time.monotonic() < deadline:
        time.sleep(0.1)  # "training" until the other process has trained every other run
    store.put(record["identity"], record["result"], record["provenance"])
"""


@contextlib.contextmanager
def held_by_another_process(store: str, record: dict, others: int):
    """Another process claims `record`'s run in `store` and stores it once `others` runs are stored beside it."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, store, json.dumps(record), str(others)], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert holder.stdout.readline().strip() == "True"
        yield
        assert holder.wait(timeout=60) == 0
    finally:
        holder.kill()


def test_processes_side_by_side_share_the_runs_out(where, tmp_path, monkeypatch, capsys):
    """The run another process is training is left to it: this one trains the others, then reads that run from the
    store once the other process stored it. Nothing is trained twice."""
    argv = ["run", "pretrain", *TINY_DATA, *TINY_MODEL, "--seq-len", "32", "--batch-size", "4", "--tokens", "256",
            "--seeds", "0"]
    identities, real = [], runner.train_from_scratch

    def recording(run, data, device):
        identities.append(run.identity)
        return real(run, data, device)

    monkeypatch.setattr(runner, "train_from_scratch", recording)
    cli.main([*argv, "--store", str(tmp_path / "alone"), "--out", str(tmp_path / "alone-out")])
    held = RunStore(tmp_path / "alone").record(identities[0])  # the first run this process would train
    with held_by_another_process(where[1], held, len(identities) - 1):
        identities.clear()
        cli.main([*argv, *where])
    assert len(identities) == 3 and held["identity"] not in identities
    assert "another process is training it; back to it at the end" in capsys.readouterr().out
    assert RunStore(where[1]).record(held["identity"]) == held
    assert "**Incomplete**" not in open(f"{where[3]}/pretrain.md").read()


def test_uptrain_continuations_are_shared_out_between_processes_too(where, tmp_path, monkeypatch, capsys):
    """Two uptrain processes side by side (two study chains sharing `uptrain_long`) split the continuations as the
    from-scratch runs are split: the one another process holds is not trained here, but read from the store."""
    from benchmarks.studies import uptrain

    argv = [*TINY_UPTRAIN, "--arms", "llama", "learnable-preserve"]
    continued, real = [], uptrain.continue_arm

    def recording(run, data, checkpoint, device):
        continued.append(run.identity)
        return real(run, data, checkpoint, device)

    monkeypatch.setattr(uptrain, "continue_arm", recording)
    cli.main([*argv, "--store", str(tmp_path / "alone"), "--out", str(tmp_path / "alone-out")])
    # the first continuation this process would train, held until the pre-training and the other continuation are
    # stored: this process has been refused it by then, whatever the machine's load
    held = RunStore(tmp_path / "alone").record(continued[0])
    with held_by_another_process(where[1], held, 2):
        continued.clear()
        cli.main([*argv, *where])
    assert len(continued) == 1 and held["identity"] not in continued
    assert "another process is training it; back to it at the end" in capsys.readouterr().out
    assert RunStore(where[1]).record(held["identity"]) == held


def test_context_length_study_shares_its_runs_with_the_pretrain_study(where, trained):
    """Context 32 with 128 tokens per step is the pre-training study's context 32 with batch 4: the same runs, one
    file each, trained once — whichever study asks first."""
    common = [*TINY_DATA, *TINY_MODEL, "--tokens", "512", "--seeds", "0", "1", *where]
    cli.main(["run", "context_length", "--contexts", "16", "32", "--tokens-per-step", "128", *common])
    assert len(trained) == 2 * 4 * 2
    runs = stored(where)
    assert {key[0] for key in runs} == {16, 32} and len(runs) == 16
    assert all(r["identity"]["budget"]["batch_size"] == 128 // key[0] for key, r in runs.items())
    table = open(f"{where[3]}/context_length.md").read()
    assert all(f"| {c} | `{a}` | 2 |" in table for c in (16, 32) for a in ("llama", "svformer"))
    # the report covers the whole study: its declared seed 2, and context 128 (512 and 1024 cannot take 128 tokens
    # per step), are missing
    assert "**Incomplete**: context(s) 128, 16, 32 do not have all 3 seeds yet" in table
    cli.main(["run", "pretrain", "--seq-len", "32", "--batch-size", "4", *common])
    assert len(trained) == 16  # nothing trained: every run was the context study's
    assert "| `learnable_plus` |" in open(f"{where[3]}/pretrain.md").read()


def test_param_efficiency_study_end_to_end(where):
    cli.main(["run", "param_efficiency", *TINY_DATA, "--seq-len", "32", "--batch-size", "4", "--sizes", "16x1",
              "32x2", "48x2", "64x3", "--tokens", "256", "--eval-every", "2", *where])  # the declared seeds, 0 and 1
    runs = {(r["identity"]["model"]["hidden_size"], r["identity"]["model"]["variant"]): r["result"]
            for r in stored(where).values() if r["identity"]["seed"] == 0}
    assert len(stored(where)) == 4 * 2 * 2
    sizes = [runs[h, "llama"]["non_embedding_parameters"] for h in (16, 32, 48, 64)]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4
    table = open(f"{where[3]}/param_efficiency.md").read()
    assert "| log-linear |" in table and "| 16x1 | " in table


def test_svformer_gqa_study_end_to_end(where):
    """SVFormer with 5 kv heads and Llama with 3 hold exactly the same cache at 5 layers, measured."""
    cli.main(["run", "svformer_gqa", *TINY_DATA, "--seq-len", "32", "--batch-size", "4", "--hidden-size", "60",
              "--tokens", "256", "--eval-every", "2", *where])
    runs = stored(where)
    cache = {(variant, kv): r["result"]["cache_bytes_per_token"] for (_, variant, kv, _), r in runs.items()}
    head = 60 // 15 * 4  # one head-vector of one token in fp32
    assert cache["llama", 3] == cache["svformer", 5] == 2 * 5 * 3 * head
    assert cache["llama", 15] == 5 * cache["llama", 3]
    assert "| `svformer` | 5 |" in open(f"{where[3]}/svformer_gqa.md").read()


def test_uptrain_study_end_to_end(where):
    """Preserve conversions start exactly at the Llama's loss, the paper init does not; learnable_plus preserve gets
    zero logit gradient; a larger λ learning rate moves the λ further."""
    arms = ["llama", "learnable-preserve", "learnable_plus-preserve", "learnable_plus-paper",
            "learnable_plus-preserve-lambda-lr30"]
    cli.main(["run", "uptrain", *TINY_DATA, "--seq-len", "32", "--batch-size", "4", "--hidden-size", "32",
              "--layers", "3", "--heads", "2", "--pretrain-tokens", "512", "--tokens", "384", "--eval-every", "1",
              "--seeds", "0", *where])
    found = records(where)
    (pretrain,) = [r for r in found if r["identity"]["kind"] == "pretrain"]
    runs = {r["identity"]["arm"]["variant"] + "-" + str(r["identity"]["arm"]["init"])
            + ("-lr30" if r["identity"]["arm"]["lambda_lr_scale"] == 30 else ""): r["result"]
            for r in found if r["identity"]["kind"] == "continue"}
    assert len(runs) == len(arms)
    start = {name: run["curve"][0][1] for name, run in runs.items()}
    assert start["llama-None"] == pytest.approx(pretrain["result"]["final_val_loss"], abs=1e-6)
    for name in ("learnable-preserve", "learnable_plus-preserve", "learnable_plus-preserve-lr30"):
        assert start[name] == pytest.approx(start["llama-None"], abs=1e-5)
    assert abs(start["learnable_plus-paper"] - start["llama-None"]) > 1e-3
    gradients = runs["learnable_plus-preserve"]["initial_lambda_gradients"]
    assert gradients["lambda_logits"] == 0.0 and gradients["lambda_scale_offset"] > 0

    def moved(name):
        probes = runs[name]["probes"]
        return max(abs(a - b) for row0, row1 in zip(probes[0]["table"], probes[-1]["table"])
                   for a, b in zip(row0, row1))

    assert moved("learnable_plus-preserve-lr30") > 5 * moved("learnable_plus-preserve")
    table = open(f"{where[3]}/uptrain.md").read()
    assert all(f"| `{arm}` |" in table for arm in arms)


def test_a_llama_pretrained_again_to_the_same_curve_keeps_its_record(where, tmp_path):
    """The pre-trained Llama's folder lives in the temp directory: when it is gone and a continuation is missing, the
    Llama is trained again; reproducing the stored curve, it leaves the stored record (its day, its timings) as is."""
    command = [*TINY_UPTRAIN, "--arms", "llama", *where]
    cli.main(command)
    files = {json.loads(path.read_text())["identity"]["kind"]: path for path in Path(where[1]).glob("*.json")}
    pretrain_record = files["pretrain"].read_bytes()
    shutil.rmtree(next((tmp_path / "tmp").glob("resformer-bench-uptrain-*")))
    files["continue"].unlink()
    cli.main(command)
    assert files["continue"].is_file()  # trained again, from the Llama trained again
    assert next((tmp_path / "tmp").glob("resformer-bench-uptrain-*/pretrained-*/llama/config.json"))
    assert files["pretrain"].read_bytes() == pretrain_record


def test_paired_report_over_every_seed_with_each_seeds_lambdas(where, tmp_path):
    """The ten-seed study's report on two tiny corpora: Δ per corpus as recomputed from the stored runs, and the λ
    learnable_plus ended at, seed by seed."""
    from resformer_hf.text import sample_text

    corpora = []
    for index, (start, stop) in enumerate(((0, 30000), (30000, 60000))):
        folder = tmp_path / f"corpus{index}"
        folder.mkdir()
        (folder / "text.txt").write_text(sample_text(stop)[start:])
        corpora.append(str(folder))
    settings = [*TINY_DATA[2:], *TINY_MODEL, "--seq-len", "32", "--batch-size", "4", "--tokens", "256", "--corpora",
                *corpora, *where]
    cli.main(["run", "tuned_seeds", *settings, "--seeds", "0", "1", "12"])  # seed 12: beyond the declared 0-9
    table = open(f"{where[3]}/tuned_seeds.md").read()
    cli.main(["report", "tuned_seeds", *settings])  # every stored seed, 12 too, without being told
    assert open(f"{where[3]}/tuned_seeds.md").read() == table
    for corpus in corpora:
        finals = {(r["identity"]["model"]["variant"], r["identity"]["seed"]): r["result"]["final_val_loss"]
                  for r in records(where) if r["identity"]["data"]["corpus"].endswith(corpus.rsplit("/", 1)[1])}
        d = paired_difference([finals["learnable_plus", s] for s in (0, 1, 12)],
                              [finals["llama", s] for s in (0, 1, 12)])
        assert f"| `{corpus}` | `learnable_plus` | 3 | " in table and d.describe() in table
        assert f"{d.negative}/3 seeds lower; {d.verdict()}" in table
        head_to_head = paired_difference([finals["svformer", s] for s in (0, 1, 12)],
                                         [finals["learnable_plus", s] for s in (0, 1, 12)])
        row = f"| `{corpus}` | `svformer` | {head_to_head.describe()} | {head_to_head.negative}/3 seeds lower"
        assert row in table
    assert "Head to head with `learnable_plus`" in table
    assert table.count("λ_first/λ_self per layer") == 2 and "correlation over seeds" in table
    assert "`svformer`: fixed λ" in table and "**Incomplete**" in table  # 3 of the declared 10 seeds
    assert math.isfinite(float(table.split("| 12 | ")[1].split(" | ")[0]))


def test_gated_study_reuses_the_tuned_runs_and_reports_where_the_gates_ended(where, tmp_path, trained):
    """The gated comparison asks for the same Llama and learnable_plus runs as `tuned_seeds` (trained once), writes a
    page saying what is missing before its own arm has run, then the mix its gates gave the validation tokens per
    layer, as stored by each run and summarised over the seeds."""
    from resformer_hf.text import sample_text

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "text.txt").write_text(sample_text(30000))
    settings = [*TINY_DATA[2:], *TINY_MODEL, "--seq-len", "32", "--batch-size", "4", "--tokens", "256", "--corpora",
                str(folder), "--seeds", "0", "1", *where]
    cli.main(["run", "tuned_seeds", "--arms", "llama", "learnable_plus", *settings])
    cli.main(["report", "gated", *settings])
    assert "not trained yet" in open(f"{where[3]}/gated.md").read()
    cli.main(["run", "gated", *settings])
    assert [label.split(" ")[0] for label in trained] == [
        "llama/seed0", "learnable_plus/seed0", "llama/seed1", "learnable_plus/seed1", "gated/seed0", "gated/seed1"]
    table = open(f"{where[3]}/gated.md").read()
    assert f"| `{folder}` | `gated` | 2 | " in table and "λ_first/λ_self per layer" in table
    gates = [r["result"]["value_gate_statistics"] for r in sorted(records(where), key=lambda r: r["identity"]["seed"])
             if r["identity"]["model"]["variant"] == "gated"]
    assert len(gates) == 2 and all(sorted(g) == ["1"] for g in gates)  # 2 layers: layer 1 is gated
    assert all(e["min"] <= e["mean"] <= e["max"] and e["std"] >= 0 for g in gates for e in g.values())
    means = [g["1"]["mean"] for g in gates]
    assert f"| 1 | {paired_mean(means)} | " in table and ", ".join(f"{m:.3f}" for m in means) in table
    assert all("value_gate_statistics" not in r["result"] for r in records(where)
               if r["identity"]["model"]["variant"] != "gated")


def paired_mean(values: list[float]) -> str:
    """`mean ± sample std` as the gated report prints the mean mix over seeds."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return f"{mean:.3f} ± {std:.3f}"


@pytest.mark.slow
def test_baselines_study_shares_the_context_studys_runs_and_measures_cache_bytes(where, trained):
    """Llama's, ResFormer's and SVFormer's runs come from the context-length study at the same settings; the cache
    column is the measured bytes (4 layers: SVFormer 5/8, GQA and CLA2 1/2, SVFormer × CLA2 3/8 of Llama's)."""
    model = [*TINY_DATA, "--hidden-size", "32", "--layers", "4", "--heads", "2", "--eval-every", "2", "--tokens",
             "128", "--seeds", "0", *where]
    cli.main(["run", "context_length", "--contexts", "32", "--tokens-per-step", "128", "--arms", "llama",
              "learnable_plus", "svformer", *model])
    cli.main(["run", "baselines", "--seq-len", "32", "--batch-size", "4", "--arms", "llama", "neutreno", *model])
    partial = open(f"{where[3]}/baselines.md").read()
    assert "| `neutreno` |" in partial and "| `denseformer` |" not in partial and "**Incomplete**" in partial
    cli.main(["run", "baselines", "--seq-len", "32", "--batch-size", "4", *model])
    assert sorted(label.split("/")[0] for label in trained) == sorted(
        ["llama", "learnable_plus", "svformer", "neutreno", "denseformer", "gqa", "cla2", "svformer_cla2"])
    table = open(f"{where[3]}/baselines.md").read()
    for arm, ratio in {"llama": "1.0000", "svformer": "0.6250", "gqa": "0.5000", "cla2": "0.5000",
                       "svformer_cla2": "0.3750"}.items():
        assert f"| `{arm}` | " in table and f" | {1024 * float(ratio):,.0f} | {ratio} | 1 |" in table
    declared = catalogue.study("baselines")
    missing = len(declared.arms) * (len(declared.seeds) - 1)  # every arm's seeds but seed 0
    assert f"**Incomplete**: {missing} run(s) not finished yet (llama/seed1, llama/seed2, " in table


def test_uptrain_long_gives_the_trained_llama_tables_that_start_at_its_loss(where):
    """Issue 56: the Llama given value-embedding tables (zero), with and without λ, starts at the Llama's loss and
    the tables train: the continuations end elsewhere than the Llama's."""
    cli.main(["run", "uptrain_long", *TINY_DATA, "--seq-len", "32", "--batch-size", "4", "--hidden-size", "32",
              "--layers", "3", "--heads", "2", "--pretrain-tokens", "512", "--tokens", "384", "--eval-every", "1",
              "--seeds", "0", *where])
    runs = {(r["identity"]["arm"]["variant"], r["identity"]["arm"].get("value_embeddings")): r["result"]
            for r in records(where) if r["identity"]["kind"] == "continue"}
    assert set(runs) == {("llama", None), ("learnable", None), ("none", "alternating"),
                         ("learnable", "alternating")}
    start = {arm: run["curve"][0][1] for arm, run in runs.items()}
    end = {arm: run["curve"][-1][1] for arm, run in runs.items()}
    for arm in runs:
        assert start[arm] == pytest.approx(start[("llama", None)], abs=1e-5), arm
    assert abs(end[("none", "alternating")] - end[("llama", None)]) > 1e-5
    assert "| `value_embeddings` |" in open(f"{where[3]}/uptrain_long.md").read()


def test_arms_sharing_a_conversion_wait_for_one_another_instead_of_converting_twice(tmp_path, monkeypatch):
    """λ alone and λ with tables continue the same `learnable-preserve` folder; two processes (here, threads)
    asking for it at once make it once, and neither converts into a folder the other is writing."""
    import threading
    import time

    from benchmarks.studies import uptrain
    from benchmarks.studies.spec import ContinuedArm

    conversions = []

    def slow_converter(source, destination, **options):
        conversions.append(destination)
        time.sleep(0.5)  # the other thread asks meanwhile
        destination.mkdir()
        (destination / "config.json").write_text("{}")
        return type("Report", (), {"summary": lambda self: "converted"})()

    monkeypatch.setattr(uptrain, "convert_llama_checkpoint", slow_converter)
    llama = tmp_path / "pretrained" / "llama"
    llama.mkdir(parents=True)
    arms = [ContinuedArm("learnable-preserve", "learnable", "preserve"),
            ContinuedArm("learnable-preserve+ve", "learnable", "preserve", value_embeddings="alternating")]
    folders = []
    threads = [threading.Thread(target=lambda arm=arm: folders.append(uptrain.converted(arm, llama))) for arm in arms]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert folders == [tmp_path / "pretrained" / "learnable-preserve"] * 2
    assert len(conversions) == 1
