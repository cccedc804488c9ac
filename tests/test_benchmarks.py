"""The pre-training studies' arithmetic against hand-computed numbers, and each study script end to end on a tiny
setting (the bundled text sample, a few steps of a tiny model; nothing from ../shared is read)."""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_baselines  # noqa: E402
import bench_context_length  # noqa: E402
import bench_cost  # noqa: E402
import bench_decode  # noqa: E402
import bench_param_efficiency  # noqa: E402
import bench_pretrain  # noqa: E402
import bench_svformer_gqa  # noqa: E402
import bench_uptrain  # noqa: E402

import common  # noqa: E402
import study_cli  # noqa: E402
import study_training  # noqa: E402
from common import REPO_ROOT  # noqa: E402
from run_store import RunStore, portable_config, portable_path  # noqa: E402
from study_data import batch_order  # noqa: E402
from study_statistics import (  # noqa: E402
    fit_log_linear,
    fit_power_law,
    paired_difference,
    parameter_saving,
    spread,
    tokens_to_reach,
)

# ---- tokens_to_reach -----------------------------------------------------------------------------------------------

CURVE = [(0, 6.0), (100, 5.0), (200, 4.0), (300, 4.5), (400, 3.0)]


@pytest.mark.parametrize(
    "target, expected",
    [
        (4.5, 150.0),  # halfway between the evaluations at 100 (5.0) and 200 (4.0)
        (5.0, 100.0),  # exactly an evaluation
        (4.0, 200.0),
        (3.6, 360.0),  # first reached after the bump: 300 + 100·(4.5 − 3.6)/(4.5 − 3.0)
        (6.5, 0.0),  # already below at the start
        (2.9, None),  # never reached
    ],
)
def test_tokens_to_reach(target, expected):
    assert tokens_to_reach(CURVE, target) == (None if expected is None else pytest.approx(expected))


# ---- seed statistics -----------------------------------------------------------------------------------------------


def test_spread_is_mean_and_sample_std():
    s = spread([1.0, 2.0, 4.0])
    assert (s.mean, s.n) == (pytest.approx(7 / 3), 3)
    assert s.std == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
    assert spread([5.0]).std == 0.0


def test_paired_difference_beyond_noise():
    d = paired_difference([1.0, 2.0, 3.0], [1.5, 2.4, 3.6])  # differences −0.5, −0.4, −0.6
    assert d.differences == pytest.approx([-0.5, -0.4, -0.6])
    assert (d.mean, d.std) == (pytest.approx(-0.5), pytest.approx(0.1))
    half = 4.302652729911275 * 0.1 / math.sqrt(3)  # t(0.975, 2 dof) · std / √n
    assert (d.low, d.high) == (pytest.approx(-0.5 - half), pytest.approx(-0.5 + half))
    assert d.negative == 3 and d.significant and d.verdict() == "lower, beyond seed noise"


def test_paired_difference_within_noise():
    d = paired_difference([1.0, 2.3, 3.0], [1.5, 2.0, 3.1])  # differences −0.5, +0.3, −0.1: mean −0.1, std 0.4
    half = 4.302652729911275 * 0.4 / math.sqrt(3)
    assert (d.low, d.high) == (pytest.approx(-0.1 - half), pytest.approx(-0.1 + half))
    assert d.negative == 2 and not d.significant and d.verdict() == "within seed noise"
    with pytest.raises(ValueError, match="equally long"):
        paired_difference([1.0], [1.0, 2.0])


def _run(curve, **extra):
    return {"curve": curve, "final_val_loss": curve[-1][1], "train_seconds": 10.0, "attention_entropy": [1.0],
            "token_similarity": [0.1, 0.2], "lambdas": [[0.0, 1.0]], "non_embedding_parameters": 1000, **extra}


def test_seed_summary_hand_computed(tmp_path):
    store = RunStore(tmp_path / "s.json", {})
    store.put("llama/seed0", _run([(0, 6.0), (100, 5.0), (200, 4.0)]))
    store.put("llama/seed1", _run([(0, 6.0), (100, 5.0), (200, 4.2)]))
    store.put("identity/seed0", _run([(0, 6.0), (100, 4.5), (200, 3.8)]))  # reaches 4.0 at 100 + 100·0.5/0.7
    store.put("identity/seed1", _run([(0, 6.0), (100, 4.2), (200, 4.05)]))  # reaches 4.2 at 100
    summary = bench_pretrain.summarize(store, ["llama", "identity"], [0, 1])
    identity = summary["variants"]["identity"]
    fewer = [1 - (100 + 100 * 0.5 / 0.7) / 200, 0.5]
    assert identity["fewer_tokens"].mean == pytest.approx(sum(fewer) / 2)
    assert identity["fewer_tokens"].std == pytest.approx(abs(fewer[1] - fewer[0]) / math.sqrt(2))
    delta = identity["delta"]  # per seed: −0.2 and −0.15
    assert (delta.mean, delta.std) == (pytest.approx(-0.175), pytest.approx(0.05 / math.sqrt(2)))
    assert not delta.significant  # 2 seeds: t(0.975, 1) = 12.7 makes the interval [−0.49, +0.14]
    assert delta.low == pytest.approx(-0.175 - 12.706204736174698 * 0.05 / 2)


# ---- loss-vs-size fits ---------------------------------------------------------------------------------------------

SIZES = [1e4, 3e4, 1e5, 3e5, 1e6]


def test_log_linear_fit_and_parameter_saving():
    llama = fit_log_linear(SIZES, [5.0 - 0.2 * math.log(n) for n in SIZES])
    resformer = fit_log_linear(SIZES, [4.95 - 0.2 * math.log(n) for n in SIZES])
    assert (llama.alpha, llama.beta) == (pytest.approx(5.0), pytest.approx(0.2))
    assert llama.parameters_for(float(llama.loss(2e5))) == pytest.approx(2e5)
    # Equal slopes: N_res / N = exp(−Δα / β) = exp(−0.05 / 0.2) at every size.
    assert parameter_saving(llama, resformer, 1e6) == pytest.approx(1 - math.exp(-0.25))
    with pytest.raises(ValueError, match="two model sizes"):
        fit_log_linear([1e4, 1e4], [3.0, 3.1])


def test_power_law_fit_recovers_known_curve():
    losses = [0.5 * (n / 1e6) ** -0.3 + 3.0 for n in SIZES]
    fit = fit_power_law(SIZES, losses)
    assert (fit.a, fit.b, fit.c) == (pytest.approx(0.5, rel=1e-3), pytest.approx(0.3, rel=1e-3),
                                     pytest.approx(3.0, abs=1e-3))
    assert fit.parameters_for(0.5 * 0.25 ** -0.3 + 3.0) == pytest.approx(2.5e5, rel=1e-3)
    assert fit_power_law(SIZES[:3], losses[:3]) is None  # 3 sizes cannot pin down 3 parameters and a residual


def test_parameter_efficiency_analysis_hand_computed(tmp_path):
    """Per-seed and pooled log-linear fits of runs lying on known lines give the hand-computed saving."""
    store = RunStore(tmp_path / "p.json", {})
    sizes = {"a": 1e4, "b": 1e5, "c": 1e6}
    for seed, shift in ((0, 0.0), (1, 0.03)):
        for name, n in sizes.items():
            for variant, alpha in (("llama", 5.0), ("learnable_plus", 4.9)):
                loss = alpha + shift - 0.25 * math.log(n)
                store.put(f"{variant}/{name}/seed{seed}", {"final_val_loss": loss, "non_embedding_parameters": n})
    analysis = bench_param_efficiency.analyse(store, "learnable_plus", list(sizes), [0, 1])
    expected = 1 - math.exp(-0.1 / 0.25)
    fits = analysis["fits"]["log-linear"]
    assert parameter_saving(fits["llama"], fits["learnable_plus"], analysis["largest"]) == pytest.approx(expected)
    assert analysis["per_seed_saving"]["log-linear"] == pytest.approx([expected, expected])
    assert "power law" not in analysis["fits"]  # three sizes: not identifiable, so not reported
    assert [row["delta"].mean for row in analysis["rows"]] == pytest.approx([-0.1] * 3)


# ---- data order and the run store ----------------------------------------------------------------------------------


def test_batch_order_is_seeded_and_covers_every_sequence_per_epoch():
    order = batch_order(10, 4, 5, seed=3)  # 20 draws = 2 epochs of 10
    assert order.shape == (5, 4)
    assert sorted(order.flatten()[:10].tolist()) == list(range(10))
    assert sorted(order.flatten()[10:].tolist()) == list(range(10))
    assert torch.equal(order, batch_order(10, 4, 5, seed=3))
    assert not torch.equal(order, batch_order(10, 4, 5, seed=4))


def test_run_store_resumes_only_with_the_same_settings(tmp_path):
    path = tmp_path / "runs.json"
    store = RunStore(path, {"lr": 1e-3})
    calls = []
    store.run("a", lambda x: calls.append(x) or {"loss": x}, 1.5)
    store.run("a", lambda x: calls.append(x) or {"loss": x}, 2.5)  # already there: not run again
    assert calls == [1.5] and RunStore(path, {"lr": 1e-3})["a"] == {"loss": 1.5}
    assert "a" not in RunStore(path, {"lr": 2e-3})  # other settings start over
    assert "a" not in RunStore(path, {"lr": 1e-3}, fresh=True)


def test_run_store_shared_by_two_processes_loses_no_run(tmp_path):
    """Two stores on one file, as two study processes (one per seed) hold them: each save merges the other's runs,
    and a run the other finished is not trained again."""
    path = tmp_path / "runs.json"
    first, second = RunStore(path, {"lr": 1e-3}), RunStore(path, {"lr": 1e-3})
    first.put("llama/seed0", {"loss": 4.0})
    second.put("llama/seed1", {"loss": 4.1})  # second never saw seed0 in memory
    first.put("identity/seed0", {"loss": 3.9})
    assert set(json.loads(path.read_text())["runs"]) == {"llama/seed0", "llama/seed1", "identity/seed0"}
    trained = []
    second.run("identity/seed0", lambda: trained.append(1) or {"loss": 0.0})
    assert trained == [] and second["identity/seed0"] == {"loss": 3.9}


def test_run_store_keeps_a_replaced_store_aside(tmp_path):
    """Other settings or --fresh start over, but the runs saved before are copied aside first, byte for byte; a fresh
    store does not merge the runs it is retraining back from the file."""
    path = tmp_path / "runs.json"
    RunStore(path, {"lr": 1e-3}).put("a", {"loss": 1.5})
    before = path.read_bytes()
    fresh = RunStore(path, {"lr": 1e-3}, fresh=True)
    fresh.put("b", {"loss": 2.0})
    assert set(json.loads(path.read_text())["runs"]) == {"b"}
    other = RunStore(path, {"lr": 2e-3})
    other.put("c", {"loss": 3.0})
    kept = {json.dumps(sorted(json.loads(k.read_text())["runs"])): k for k in tmp_path.glob("runs.replaced-*.json")}
    assert sorted(kept) == ['["a"]', '["b"]']  # both replaced stores, even within one second
    assert kept['["a"]'].read_bytes() == before
    assert set(json.loads(path.read_text())["runs"]) == {"c"}


# ---- each study end to end, tiny -----------------------------------------------------------------------------------

TINY_DATA = ["--sample-chars", "30000", "--vocab-size", "300", "--val-fraction", "0.1", "--val-tokens", "256",
             "--seq-len", "32", "--batch-size", "4", "--threads", "1"]


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The studies cache tokenizers and checkpoints in the temp directory: keep the test's in its own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return tmp_path


def _forbid_training(monkeypatch, module):
    def refuse(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(module, "train", refuse)


def test_seeds_study_end_to_end(private_tmp, monkeypatch):
    out = private_tmp / "out"
    argv = TINY_DATA + ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--tokens", "512", "--eval-every",
                        "2", "--seeds", "0", "1", "--out", str(out)]
    bench_pretrain.main(argv)
    runs = json.loads((out / "pretrain.json").read_text())["runs"]
    assert sorted(runs) == sorted(f"{v}/seed{s}" for v in bench_pretrain.DEFAULT_VARIANTS for s in (0, 1))
    assert all(len(r["curve"]) == 3 and r["curve"][0][0] == 0 and r["curve"][-1][0] == 512 for r in runs.values())
    assert runs["llama/seed0"]["curve"][0] != runs["llama/seed1"]["curve"][0]  # another seed, another init
    table = (out / "pretrain.md").read_text()
    assert all(f"| `{v}` |" in table for v in bench_pretrain.DEFAULT_VARIANTS)
    assert (out / "pretrain.png").stat().st_size > 0 and (out / "pretrain_analysis.png").stat().st_size > 0
    _forbid_training(monkeypatch, bench_pretrain)
    bench_pretrain.main(argv)  # resumed: every run is already saved


def test_context_length_study_end_to_end_and_resumed(private_tmp, monkeypatch):
    out = private_tmp / "out"
    data = [a for a in TINY_DATA if a not in ("--seq-len", "32", "--batch-size", "4")]
    argv = data + ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--tokens", "512", "--eval-every", "2",
                   "--contexts", "16", "32", "--tokens-per-step", "64", "--seeds", "0", "1", "--out", str(out)]
    bench_context_length.main(argv)
    for context, batch in ((16, 4), (32, 2)):
        store = json.loads((out / "context_length" / f"ctx{context}.json").read_text())
        assert (store["config"]["seq_len"], store["config"]["batch_size"]) == (context, batch)
        assert sorted(store["runs"]) == sorted(f"{a}/seed{s}" for a in bench_context_length.ARMS for s in (0, 1))
        assert all(r["curve"][-1][0] == 512 for r in store["runs"].values())  # same tokens at every context
        assert not Path(store["config"]["corpus_dir"]).is_absolute()
    table = (out / "context_length.md").read_text()
    assert all(f"| {c} | `{a}` | 2 |" in table for c in (16, 32) for a in bench_context_length.ARMS)
    assert "Incomplete" not in table and (out / "context_length.png").stat().st_size > 0
    monkeypatch.setattr(bench_context_length, "run_one", lambda *a: (_ for _ in ()).throw(AssertionError("rerun")))
    bench_context_length.main(argv)  # resumed: every run is already saved


def test_results_record_repository_relative_paths():
    assert portable_path(REPO_ROOT / "benchmarks") == "benchmarks"
    config = portable_config({"corpus_dir": str(REPO_ROOT.parent / "shared" / "corpus")})
    assert config["corpus_dir"] == "../shared/corpus"
    assert study_cli.command_line("x.py", ["--corpus-dir", str(REPO_ROOT / "README.md")]) == (
        "python benchmarks/x.py --corpus-dir README.md")
    for path in (Path(bench_pretrain.__file__).parent / "results").glob("*.md"):
        assert str(REPO_ROOT) not in path.read_text(), path


def test_result_blocks_are_found_on_their_page_with_links_made_relative_to_it(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# front\n<!-- other:begin -->\nx\n<!-- other:end -->\n")
    page = tmp_path / "docs" / "results.md"
    page.write_text("# Results\nbefore\n<!-- cost:begin -->\nold\n<!-- cost:end -->\nafter\n")
    text = "See [cost.md](benchmarks/results/cost.md), [paper](https://arxiv.org/abs/2410.17897), [up](#results).\n"
    assert common.rewrite_readme_block("cost", text, root=tmp_path) == page
    assert page.read_text() == (
        "# Results\nbefore\n<!-- cost:begin -->\nSee [cost.md](../benchmarks/results/cost.md), "
        "[paper](https://arxiv.org/abs/2410.17897), [up](#results).\n<!-- cost:end -->\nafter\n"
    )
    common.rewrite_readme_block("other", text, root=tmp_path)  # on the README, paths stay repository-relative
    assert "[cost.md](benchmarks/results/cost.md)" in (tmp_path / "README.md").read_text()
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["README.md", "docs", "results.md"]  # no staging left
    with pytest.raises(SystemExit, match="found: none"):
        common.rewrite_readme_block("decode", text, root=tmp_path)
    (tmp_path / "docs" / "more.md").write_text("<!-- cost:begin -->\n<!-- cost:end -->\n")
    with pytest.raises(SystemExit, match="found: docs/more.md, docs/results.md"):
        common.rewrite_readme_block("cost", text, root=tmp_path)


def test_every_result_block_of_the_documentation_is_on_exactly_one_page():
    for name in ("cost", "decode", "svformer-cache"):
        begin = f"<!-- {name}:begin -->"
        assert sum(page.read_text().count(begin) for page in common.documentation_pages()) == 1, name


def test_param_efficiency_study_end_to_end(private_tmp):
    out = private_tmp / "out"
    sizes = ["--sizes", "16x1", "32x2", "48x2", "64x3", "--head-dim", "16"]
    bench_param_efficiency.main(TINY_DATA + sizes + ["--tokens", "256", "--eval-every", "2", "--seeds", "0",
                                                     "--out", str(out)])
    runs = json.loads((out / "param_efficiency.json").read_text())["runs"]
    assert len(runs) == 4 * 2
    sizes = [runs[f"llama/{z}/seed0"]["non_embedding_parameters"] for z in ("16x1", "32x2", "48x2", "64x3")]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4
    table = (out / "param_efficiency.md").read_text()
    assert "| log-linear |" in table and (out / "param_efficiency.png").stat().st_size > 0


def test_uptrain_study_end_to_end(private_tmp):
    """Preserve conversions start exactly at the Llama's loss, the paper init does not; learnable_plus preserve gets
    zero logit gradient; a larger λ learning rate moves the λ further."""
    out = private_tmp / "out"
    arms = ["llama", "learnable-preserve", "learnable_plus-preserve", "learnable_plus-paper",
            "learnable_plus-preserve-lambda-lr30"]
    bench_uptrain.main(TINY_DATA + ["--hidden-size", "32", "--layers", "3", "--heads", "2", "--pretrain-tokens",
                                    "512", "--tokens", "384", "--eval-every", "1", "--seeds", "0", "--arms",
                                    *arms, "--out", str(out)])
    runs = json.loads((out / "uptrain.json").read_text())["runs"]
    start = {arm: runs[f"{arm}/seed0"]["curve"][0][1] for arm in arms}
    assert start["llama"] == pytest.approx(runs["pretrain"]["final_val_loss"], abs=1e-6)
    for arm in ("learnable-preserve", "learnable_plus-preserve", "learnable_plus-preserve-lambda-lr30"):
        assert start[arm] == pytest.approx(start["llama"], abs=1e-5)
    assert abs(start["learnable_plus-paper"] - start["llama"]) > 1e-3
    gradients = runs["learnable_plus-preserve/seed0"]["initial_lambda_gradients"]
    assert gradients["lambda_logits"] == 0.0 and gradients["lambda_scale_offset"] > 0

    def moved(arm):
        probes = runs[f"{arm}/seed0"]["probes"]
        return max(abs(a - b) for row0, row1 in zip(probes[0]["table"], probes[-1]["table"])
                   for a, b in zip(row0, row1))

    assert moved("learnable_plus-preserve-lambda-lr30") > 5 * moved("learnable_plus-preserve")
    table = (out / "uptrain.md").read_text()
    assert all(f"| `{arm}` |" in table for arm in arms) and (out / "uptrain.png").stat().st_size > 0


@pytest.mark.slow
def test_baselines_study_end_to_end_adopting_the_context_study_and_resumed(private_tmp, monkeypatch):
    """Every arm trains once (Llama's and ResFormer's adopted from a context-study store with the same settings), the
    cache column is the measured bytes (4 layers: SVFormer 5/8, GQA and CLA2 1/2, SVFormer × CLA2 3/8 of Llama's),
    and a rerun trains nothing."""
    argv = TINY_DATA + ["--hidden-size", "32", "--layers", "4", "--heads", "2", "--tokens", "128", "--eval-every",
                        "2", "--seeds", "0"]
    bench_baselines.main(argv + ["--arms", "llama", "learnable_plus", "--out", str(private_tmp / "context")])
    bench_baselines.main(argv + ["--report-only", "--out", str(private_tmp / "context")])  # every arm, two trained
    partial = (private_tmp / "context" / "baselines.md").read_text()
    assert "| `learnable_plus` |" in partial and "| `neutreno` |" not in partial and "**Incomplete**" in partial
    monkeypatch.setattr(bench_baselines, "CONTEXT_STUDY_STORE", private_tmp / "context" / "baselines" / "ctx32.json")
    trained = []
    real_run_one = bench_baselines.run_one
    monkeypatch.setattr(bench_baselines, "run_one", lambda variant, *a: trained.append(variant) or real_run_one(
        variant, *a))
    out = private_tmp / "out"
    bench_baselines.main(argv + ["--out", str(out)])
    assert sorted(trained) == ["denseformer", "llama", "neutreno", "none", "svformer", "svformer"]  # gqa is a llama
    runs = json.loads((out / "baselines" / "ctx32.json").read_text())["runs"]
    assert sorted(runs) == sorted(f"{arm}/seed0" for arm in bench_baselines.ARMS)
    assert {runs[k].get("adopted_from") for k in ("llama/seed0", "learnable_plus/seed0")} == {"baselines/ctx32.json"}
    table = (out / "baselines.md").read_text()
    for arm, ratio in {"llama": "1.0000", "svformer": "0.6250", "gqa": "0.5000", "cla2": "0.5000",
                       "svformer_cla2": "0.3750"}.items():
        assert f"| `{arm}` | {bench_baselines.DESCRIPTIONS[arm]} | {1024 * float(ratio):,.0f} | {ratio} | 1 |" in table
    assert all(f"| `{arm}` |" in table for arm in bench_baselines.QUALITY_ARMS)
    assert "Incomplete" not in table and (out / "baselines.png").stat().st_size > 0
    monkeypatch.setattr(bench_baselines, "run_one", lambda *a: (_ for _ in ()).throw(AssertionError("rerun")))
    bench_baselines.main(argv + ["--out", str(out)])  # resumed: every run is already saved


def test_svformer_gqa_study_end_to_end(private_tmp):
    """SVFormer with 5 kv heads and Llama with 3 hold exactly the same cache at 5 layers, measured."""
    out = private_tmp / "out"
    bench_svformer_gqa.main(TINY_DATA + ["--hidden-size", "60", "--tokens", "256", "--eval-every", "2", "--seeds",
                                         "0", "--out", str(out)])
    runs = json.loads((out / "svformer_gqa.json").read_text())["runs"]
    cache = {arm: runs[f"{arm}/seed0"]["cache_bytes_per_token"] for arm in bench_svformer_gqa.DEFAULT_ARMS}
    head = 60 // 15 * 4  # one head-vector of one token in fp32
    assert cache["llama:3"] == cache["svformer:5"] == 2 * 5 * 3 * head
    assert cache["llama:15"] == 5 * cache["llama:3"]
    assert "| `svformer` | 5 |" in (out / "svformer_gqa.md").read_text()


def test_decode_benchmark_end_to_end(tmp_path):
    """Every row and mode of a tiny eager run is written, with Llama's own op count as the zero of the ops column."""
    out = tmp_path / "out"
    bench_decode.main(["--sizes", "64x2", "--batch-sizes", "1", "2", "--compile-sizes", "--context", "8", "--prompt",
                       "4", "--steps", "2", "--new-tokens", "2", "--repeats", "1", "--rounds", "1", "--variants",
                       "dense", "svformer", "--vocab-size", "64", "--threads", "1", "--out", str(out), "--no-readme"])
    table = (out / "decode.md").read_text()
    assert table.count("| Llama again (noise floor) |") == 2 and table.count("| `svformer` |") == 2
    assert "| variant | eager decode | generate | ops per decode step |" in table
    assert "| Llama again (noise floor) | " in table and "compiled decode" not in table.split("## ")[1]
    ops = {line.split(" | ")[0]: int(line.rstrip(" |").split(" | ")[-1]) for line in table.splitlines()
           if line.startswith("| ") and line.rstrip(" |").split(" | ")[-1].lstrip("+-").isdigit()}
    assert ops["| Llama again (noise floor)"] == 0 and ops["| `svformer`"] < 0 < ops["| `dense`"]
    ratios = [float(cell.strip("* ").split()[0]) for line in table.splitlines() if line.startswith("| ")
              and not line.startswith("| variant") for cell in line.strip(" |").split(" | ")[1:3]
              if cell.strip("* ")[:1].isdigit()]
    assert ratios and all(0 < ratio < 100 for ratio in ratios), ratios  # every timing ratio written and finite


def test_cost_benchmark_end_to_end(tmp_path):
    """A tiny eager run writes every column, decode included; the op census is exact, so its signs are asserted:
    SVFormer drops a value projection per layer (fewer ops), `dense` adds its running sum (more), Llama again is 0."""
    out = tmp_path / "out"
    bench_cost.main(["--sizes", "64x2", "--seq-lens", "16", "--batch-size", "1", "--vocab-size", "64", "--variants",
                     "dense", "svformer", "--repeats", "1", "--rounds", "1", "--round-seconds", "0", "--max-repeats",
                     "1", "--decode-steps", "2", "--no-compile", "--no-instructions", "--threads", "1", "--out",
                     str(out), "--no-readme"])
    table = (out / "cost.md").read_text()
    assert "--rounds 1" in table.splitlines()[1] and "--decode-steps 2" in table.splitlines()[1]  # honest command
    assert "| eager decode time |" in table and "| decode step: aten ops, bytes written |" in table
    rows = {line.split(" | ")[0]: line.split(" | ") for line in table.splitlines() if line.startswith("| `")
            or line.startswith("| Llama again")}
    decode_ops = {name: int(cells[7].split(",")[0]) for name, cells in rows.items()}
    assert decode_ops["| Llama again (noise floor)"] == 0 and decode_ops["| `svformer`"] < 0 < decode_ops["| `dense`"]
    # A second, identical Llama: every exact column is exactly Llama's (memory, bytes written, parameters).
    again = [cell.strip(" |*") for cell in rows["| Llama again (noise floor)"]]
    assert (again[2], again[5:8], again[8]) == ("1.000", ["+0, 1.0000"] * 3, "1.000"), again
    assert all(0 < float(cell.split()[0]) for cell in (again[1], again[3], again[4]))  # timed ratios: positive
    svformer = [cell.strip(" |*") for cell in rows["| `svformer`"]]
    assert float(svformer[2]) < 1 and float(svformer[8]) < 1  # no v_proj in layer 1: less memory, fewer parameters
    assert (out / "cost.png").stat().st_size > 0


def test_study_flags_errors():
    with pytest.raises(SystemExit, match="HIDDENxLAYERS"):
        bench_param_efficiency.parse_size("128", 32)
    with pytest.raises(SystemExit, match="not a multiple"):
        bench_svformer_gqa.parse_args(["--arms", "llama:4"])
    with pytest.raises(SystemExit):
        bench_uptrain.parse_args(["--arms", "learnable-preserve"])  # no Llama to compare with
    assert study_training.ModelSize(128, 6, 4).intermediate == 352


# ---- smoke tests of the remaining benchmark scripts: each on a tiny setting, its numbers' invariants asserted ----


@pytest.mark.slow  # three fresh processes for generate()'s peak memory: ~1 min idle, 3 min on a busy machine
def test_svformer_cache_benchmark_end_to_end(tmp_path):
    """Cache bytes are exact: Llama and learnable_plus hold 2L tensors per token, SVFormer L + 1, so its ratio is
    (L+1)/(2L) to the digit and learnable_plus's 1; every measured ratio of a model to itself is 1."""
    import bench_svformer_cache

    out = tmp_path / "svformer_cache"
    bench_svformer_cache.main(["--hidden", "32", "--layers", "4", "--head-dim", "8", "--vocab-size", "64",
                               "--contexts", "8", "--new-tokens", "3", "--repeats", "1", "--threads", "1",
                               "--output", str(out), "--no-readme"])
    rows = {(cells[0], cells[1]): cells for cells in
            ([cell.strip() for cell in line.strip("|").split("|")]
             for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("| 8 |"))}
    assert set(rows) == {("8", "llama"), ("8", "learnable_plus"), ("8", "svformer")}, rows
    tokens = 8 + 3 - 1  # the last generated token is never cached
    llama_bytes = 2 * 4 * 1 * 4 * tokens * 8 * 4  # K and V × layers × batch × kv heads × tokens × head dim × fp32
    assert float(rows["8", "llama"][2]) == pytest.approx(llama_bytes / 2**20, abs=0.005)
    assert [rows["8", "llama"][i] for i in (3, 5, 7, 9)] == ["1.0000", "1.000", "1.000", "1.000"]
    assert rows["8", "learnable_plus"][3] == "1.0000" and rows["8", "svformer"][3] == f"{5 / 8:.4f}"
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow  # the conversion runs in a fresh process (torch + transformers imports), as the benchmark's does
def test_conversion_benchmark_measures_a_tiny_checkpoint(tmp_path, monkeypatch):
    """The converter writes exactly the source's bytes plus the learnable λ (2 float32 per receiving layer); the
    report states it and the goal lines."""
    import argparse

    import bench_conversion

    size = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64, dtype="bfloat16")
    row = bench_conversion.measure(tmp_path / "work", size, shard_mb=1, repeats=1, seed=0)
    shapes = bench_conversion.tensor_shapes(size)
    source_bytes = sum(math.prod(shape) * 2 for _, shape in shapes)
    assert row["written"] == source_bytes + 2 * (3 - 1) * 4
    assert row["tensors"] == len(shapes) + 2
    assert row["shards"] == 1 and row["largest"] > source_bytes
    assert row["peak"] >= row["after_imports"] > 0 and row["convert_s"] > 0 and row["copy_s"] > 0
    assert not list((tmp_path / "work").iterdir())  # the synthetic checkpoint and its copies are deleted
    monkeypatch.setattr(bench_conversion, "RESULTS_DIR", tmp_path / "results")
    params = sum(math.prod(shape) for _, shape in shapes)
    bench_conversion.write_results([row], size, params, argparse.Namespace(repeats=1), torch.device("cpu"))
    assert "| 1 |" in (tmp_path / "results" / "conversion.md").read_text()


def test_vllm_benchmark_end_to_end(tmp_path):
    """Serving throughput and KV bytes per token through vLLM; runs where vLLM is installed (`.ci/serving`). Llama's
    ratio to itself is exactly 1, and the same-size models (a second Llama, learnable_plus) get Llama's KV bytes."""
    pytest.importorskip("vllm", reason="bench_vllm.py needs vLLM (its own virtualenv, see .ci/serving)")
    import bench_vllm

    out = tmp_path / "vllm.md"
    # head size 32 (vLLM's CPU attention has no kernel for 16), a vocabulary a byte-level BPE can have
    bench_vllm.main(["--hidden-size", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab-size", "512",
                     "--batches", "1", "--new-tokens", "4", "--prompt-tokens", "4", "--rounds", "1",
                     "--kv-cache-mib", "8", "--output", str(out)])
    rows = {cells[1]: cells for cells in (line.strip("| ").split(" | ") for line in out.read_text().splitlines()
                                          if line.startswith("| 1 |"))}
    assert set(rows) == set(bench_vllm.MODELS), rows
    assert rows["llama"][4] == "1.000" and rows["llama"][7] == "1.000"
    assert rows["llama_2"][7] == rows["learnable_plus"][7] == "1.000"
    assert all(float(cells[2]) > 0 for cells in rows.values())
