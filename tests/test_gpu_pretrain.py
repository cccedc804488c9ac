"""The prepared pre-training comparison (`python -m benchmarks.gpu --parts pretrain`, issue 48) rehearsed at toy size
on the CPU: its corpus is deduplicated, split and digested by content; its arms start from the same weights and see
the same batches; a run stopped at a checkpoint and continued ends exactly where an uninterrupted run ends; and its
records become a report and store entries."""

from __future__ import annotations

import gzip
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu import pretrain, pretrain_data
from benchmarks.gpu.pretrain_report import collect, store_runs
from benchmarks.gpu.report import write_report
from benchmarks.records import read_records
from benchmarks.studies.store import RunStore

REPO = Path(__file__).resolve().parent.parent
ARMS = ["llama", "learnable_plus", "svformer", "llama@1"]
SEED0 = ["llama@0", "learnable_plus@0", "svformer@0"]


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_corpus_is_one_file_per_content_and_its_digest_names_contents_not_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(pretrain_data, "MAX_FILE_BYTES", 100)
    one = tmp_path / "one"
    write(one / "a" / "x.py", b"print(1)\n")
    write(one / "b" / "copy.py", b"print(1)\n")
    target = write(one / "c" / "z.py", b"def f():\n    return 2\n")
    (one / "link.py").symlink_to(target)
    write(one / "latin1.py", "café = 1\n".encode("latin-1"))
    write(one / "big.py", b"x = 1\n" * 40)
    write(one / "notes.txt", b"not python\n")
    sources, left_out = pretrain_data.collect([one])
    assert sorted(s.text for s in sources) == ["def f():\n    return 2\n", "print(1)\n"]
    assert [s.sha for s in sources] == sorted(s.sha for s in sources)
    assert left_out == {"duplicates": 1, "links": 1, "too_large": 1, "not_utf8": 1}

    other = tmp_path / "other"  # the same contents under other names and folders: the same corpus
    write(other / "renamed.py", b"def f():\n    return 2\n")
    write(other / "deep" / "er" / "p.py", b"print(1)\n")
    again, _ = pretrain_data.collect([other])
    assert pretrain_data.corpus_digest(again, 0.5) == pretrain_data.corpus_digest(sources, 0.5)
    assert pretrain_data.corpus_digest(sources, 1.0) != pretrain_data.corpus_digest(sources, 0.0)
    assert [s.held_out(0.0) for s in sources] == [False, False]
    assert [s.held_out(1.0) for s in sources] == [True, True]


def test_installation_roots_are_walked_once():
    roots = pretrain_data.installation_roots()
    assert roots and all(root.is_dir() for root in roots)
    assert not any(other in root.parents for root in roots for other in roots)


@pytest.mark.parametrize("text, message", [("llama", None), ("learnable_plus@3", None),
                                           ("resnet", "unknown model 'resnet'"), ("llama@x", "whole-number seed")])
def test_arms_are_variant_at_seed(text, message):
    if message is None:
        variant, seed = pretrain.parse_arm(text)
        assert f"{variant}@{seed}" in (text, f"{text}@0")
        return
    with pytest.raises(SystemExit, match=message):
        pretrain.parse_arm(text)


def test_the_paper_scale_is_the_papers_smallest_model_on_100m_tokens():
    budget = pretrain.PAPER.budget()
    assert budget.tokens >= 100_000_000 and budget.steps * budget.tokens_per_step == budget.tokens
    size = pretrain.PAPER.size
    per_layer = 4 * size.hidden_size**2 + 3 * size.hidden_size * size.intermediate
    parameters = size.layers * per_layer + pretrain.PAPER.vocab_size * size.hidden_size  # tied embeddings
    assert 80e6 <= parameters <= 84e6


def test_a_continued_run_extends_its_curves_and_a_fresh_start_replaces_them():
    def run(*points, resumed=False):
        setup = {"part": "pretrain", "name": "setup", "size": "s", "budget": "b",
                 "arms": {"llama@0": {"seed": 0, "parameters": 1}}}
        evals = [{"part": "pretrain", "name": "eval/llama@0", "tokens": t, "val_loss": loss} for t, loss in points]
        return [setup, *([{"part": "pretrain", "name": "resumed", "step": 1}] if resumed else []), *evals]

    first = run((0, 9.0), (10, 8.0), (20, 7.0))
    arms, _, _ = collect([first, run((20, 7.0), (30, 6.0), resumed=True)])
    assert arms["llama@0"].points == [(0, 9.0), (10, 8.0), (20, 7.0), (30, 6.0)]
    arms, _, _ = collect([first, run((0, 9.0), (10, 8.5))])
    assert arms["llama@0"].points == [(0, 9.0), (10, 8.5)]
    with pytest.raises(SystemExit, match="different models or budgets"):
        collect([first, [{**first[0], "budget": "other"}]])


def smoke(out: Path, work: Path, *extra: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--smoke", "--parts", "pretrain", "--out", str(out),
                          "--work", str(work), "--arms", *ARMS, *extra], cwd=REPO, capture_output=True, text=True,
                         timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    records = read_records(out / "gpu.jsonl")
    assert not [r for r in records if "error" in r]
    return records


def named(records: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in records if r["part"] == "pretrain"}


@pytest.mark.slow
def test_smoke_run_pairs_its_arms_resumes_exactly_stores_and_reports(tmp_path):
    first = smoke(tmp_path / "first", tmp_path / "work", "--pause-after", "10")
    resumed = smoke(tmp_path / "resumed", tmp_path / "work")
    fresh = smoke(tmp_path / "fresh", tmp_path / "other-work")
    first_, resumed_, fresh_ = named(first), named(resumed), named(fresh)

    # the data: built twice from scratch, the same files, split, tokenizer and manifest
    for key in ("corpus_digest", "tokenizer_digest", "train_tokens_read", "val_tokens_scored"):
        assert first_["data"][key] == fresh_["data"][key]
    assert first_["data"]["held_out_files"] > 0 and first_["data"]["train_files_read"] > 0
    manifests = [(tmp_path / run / "corpus-files.tsv.gz").read_bytes() for run in ("first", "fresh")]
    assert manifests[0] == manifests[1]
    lines = gzip.decompress(manifests[0]).decode().splitlines()
    assert len(lines) == 1 + first_["data"]["files"]
    assert sum(line.split("\t")[3] == "1" for line in lines[1:]) == first_["data"]["train_files_read"]

    # the arms of a seed: the same initial weights (where they share parameters) and the same batches
    arms = fresh_["setup"]["arms"]
    assert {arms[key]["shared_init_digest"] for key in SEED0} == {arms["llama@0"]["shared_init_digest"]}
    assert {arms[key]["order_digest"] for key in SEED0} == {arms["llama@0"]["order_digest"]}
    assert arms["llama@1"]["shared_init_digest"] != arms["llama@0"]["shared_init_digest"]
    assert arms["llama@1"]["order_digest"] != arms["llama@0"]["order_digest"]
    assert arms["svformer@0"]["parameters"] < arms["llama@0"]["parameters"] < arms["learnable_plus@0"]["parameters"]

    # stopped after 10 steps with a checkpoint, continued from it: the curves of a run never stopped, to the bit
    assert first_["paused"]["step"] == 10 and not any(name.startswith("final/") for name in first_)
    assert resumed_["resumed"]["step"] == 10
    for key in [*SEED0, "llama@1"]:
        final = resumed_[f"final/{key}"]
        assert final["curve"] == fresh_[f"final/{key}"]["curve"]
        assert final["train_curve"] == fresh_[f"final/{key}"]["train_curve"]
        losses = [loss for _, loss in final["curve"]]
        assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0] - 0.3
        assert final["curve"][-1][0] == fresh_["setup"]["steps"] * fresh_["setup"]["tokens_per_step"]
        assert final["tokens_per_s"] > 0 and final["identity"]["device"] == "cpu"
    assert not list((tmp_path / "work").glob("run-*.pt"))  # the checkpoint goes once the run has finished

    # the store: each finished arm once, under the identity it recorded
    paths = [tmp_path / "first" / "gpu.jsonl", tmp_path / "resumed" / "gpu.jsonl"]
    store = RunStore(tmp_path / "runs")
    stored = store_runs(paths, store)
    assert len(stored) == 4 and store_runs(paths, store) == []
    for key in [*SEED0, "llama@1"]:
        record = store.record(resumed_[f"final/{key}"]["identity"])
        assert record["result"]["final_val_loss"] == resumed_[f"final/{key}"]["final_val_loss"]
        assert record["identity"]["data"]["corpus_digest"] == first_["data"]["corpus_digest"]
        assert "resumed/gpu.jsonl" in record["provenance"]["records"]

    # the report: the stopped run alone, then with its continuation
    page = write_report(paths[0], out=tmp_path / "stopped.md").read_text()
    assert "| learnable_plus@0 |" in page and "(stopped at" in page and "Llama unfinished" in page
    page = write_report(*paths, out=tmp_path / "gpu.md").read_text()
    section = page[page.index("## Pre-training at the paper's smallest scale"):]
    assert section.count("(finished)") == 4 and "Seed noise: the Llama seeds end at" in section
    assert (tmp_path / "gpu_pretrain.png").stat().st_size > 10_000
