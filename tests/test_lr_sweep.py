"""The learning-rate sweep (issue 28): its arithmetic against hand-computed numbers, the second corpus, and the
script end to end on a tiny setting (the bundled text sample, a few steps of a tiny model)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_lr_sweep  # noqa: E402
import lr_sweep_report  # noqa: E402
import second_corpus  # noqa: E402
from lr_sweep_report import Cell, best_learning_rates, instability, tuned_comparison  # noqa: E402


def run(final: float, curve=None) -> dict:
    curve = curve or [(0, 7.0), (100, 5.0), (200, final)]
    return {"curve": curve, "final_val_loss": final}


def test_best_learning_rate_is_the_lowest_mean_among_complete_cells():
    table = {
        "llama": {1e-3: Cell({0: run(4.6), 1: run(4.4)}),  # mean 4.5
                  3e-3: Cell({0: run(4.3), 1: run(4.5)}),  # mean 4.4: best
                  6e-3: Cell({0: run(4.0)})},  # lower, but seed 1 is missing: not eligible
        "svformer": {1e-3: Cell({}), 3e-3: Cell({0: run(4.5)}), 6e-3: Cell({0: run(4.2), 1: run(4.4)})},
        "identity": {1e-3: Cell({0: run(4.0)}), 3e-3: Cell({}), 6e-3: Cell({})},
    }
    assert best_learning_rates(table, [0, 1]) == {"llama": 3e-3, "svformer": 6e-3, "identity": None}


def test_tuned_comparison_pairs_each_arm_at_its_best_lr_with_llama_at_llamas():
    llama_curve = {0: [(0, 7.0), (100, 5.0), (200, 4.3)], 1: [(0, 7.0), (100, 5.0), (200, 4.5)]}
    table = {
        "llama": {3e-3: Cell({s: run(c[-1][1], c) for s, c in llama_curve.items()})},
        # seed 0 reaches Llama's 4.3 halfway between 100 and 200 tokens (5.0 → 3.6); seed 1 reaches 4.5 at 150
        "svformer": {3e-3: Cell({0: run(3.6, [(0, 7.0), (100, 5.0), (200, 3.6)]),
                                 1: run(4.0, [(0, 7.0), (100, 5.0), (200, 4.0)])})},
    }
    result = tuned_comparison(table, {"llama": 3e-3, "svformer": 3e-3}, [0, 1])["svformer"]
    assert result.delta.differences == pytest.approx([3.6 - 4.3, 4.0 - 4.5])
    assert result.fewer_tokens.mean == pytest.approx(1 - (100 + 100 * 0.7 / 1.4 + 100 + 100 * 0.5 / 1.0) / 2 / 200)
    assert result.not_reached == 0


def test_instability_flags_spikes_and_divergence():
    healthy = run(4.0, [(0, 7.0), (1e6, 5.0), (2e6, 5.04), (3e6, 4.0)])  # +0.04: evaluation noise, not a spike
    spiky = run(4.0, [(0, 7.0), (1e6, 5.0), (2e6, 5.2), (3e6, 4.0)])
    diverged = run(7.5, [(0, 7.0), (1e6, 5.0), (2e6, 7.5)])
    assert not instability(healthy)
    assert instability(spiky).spikes == [2.0] and instability(spiky).describe() == "spike at 2.00M tokens"
    assert instability(diverged).diverged and instability(diverged).describe() == "diverged"
    assert instability(run(float("nan"), [(0, 7.0), (1e6, float("nan"))])).diverged


def test_second_corpus_is_the_standard_librarys_code_without_tests(tmp_path, monkeypatch):
    monkeypatch.setattr(second_corpus, "CORPORA_DIR", tmp_path)
    folder = second_corpus.build()
    texts = sorted(folder.glob("*.txt"))
    assert folder.parent == tmp_path and len(texts) > 100
    assert "PSF License" in (folder / "PROVENANCE.md").read_text()  # not a *.txt: never read as training text
    joined = (folder / "json.txt").read_text()
    assert "# ---- json/__init__.py" in joined and "def dumps(" in joined
    assert not any("/test_" in line or "/tests/" in line for t in texts for line in t.read_text().splitlines()
                   if line.startswith("# ---- "))
    assert not (folder / "encodings.txt").exists() and not (folder / "test.txt").exists()
    before = {p.name: p.read_bytes() for p in texts}
    assert second_corpus.build() == folder  # built once; a second call keeps it as it is
    assert {p.name: p.read_bytes() for p in sorted(folder.glob("*.txt"))} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind


def test_a_second_corpus_build_that_loses_the_race_keeps_the_winners_folder(tmp_path, monkeypatch):
    """Two studies starting together both build the corpus: the second to finish keeps the first one's folder."""
    monkeypatch.setattr(second_corpus, "CORPORA_DIR", tmp_path)
    real_sources = second_corpus.library_sources

    def racing_sources(stdlib):  # the other process completes the folder while this one is staging
        monkeypatch.setattr(second_corpus, "library_sources", real_sources)
        second_corpus.build()
        return real_sources(stdlib)

    monkeypatch.setattr(second_corpus, "library_sources", racing_sources)
    winner = second_corpus.default_folder()
    folder = second_corpus.build()
    assert folder == winner and (folder / "PROVENANCE.md").is_file() and len(list(folder.glob("*.txt"))) > 100
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # this run's staging copy is gone


TINY = ["--sample-chars", "30000", "--vocab-size", "300", "--val-fraction", "0.1", "--val-tokens", "256",
        "--seq-len", "32", "--batch-size", "4", "--threads", "1", "--hidden-size", "32", "--layers", "2",
        "--heads", "2", "--tokens", "512", "--eval-every", "2", "--seeds", "0", "1", "--lrs", "1e-3", "1e-2",
        "--arms", "llama", "identity"]


@pytest.mark.slow
def test_sweep_and_second_corpus_end_to_end_and_resumed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(second_corpus, "CORPORA_DIR", tmp_path / "corpora")
    out = tmp_path / "out"
    argv = TINY + ["--out", str(out)]
    bench_lr_sweep.main(argv)
    stores = {lr: json.loads((out / "lr_sweep" / f"lr{lr}.json").read_text()) for lr in ("0.001", "0.01")}
    for lr, store in stores.items():
        assert store["config"]["lr"] == float(lr)
        assert sorted(store["runs"]) == sorted(f"{a}/seed{s}" for a in ("llama", "identity") for s in (0, 1))
        assert all(len(r["train_curve"]) == 2 for r in store["runs"].values())
    table = (out / "lr_sweep.md").read_text()
    assert "Incomplete" not in table and (out / "lr_sweep.png").stat().st_size > 0
    finals = {lr: [s["runs"][f"llama/seed{i}"]["final_val_loss"] for i in (0, 1)] for lr, s in stores.items()}
    best = min(finals, key=lambda lr: sum(finals[lr]))
    assert "| `llama` | " in table and f"| {float(best):g} |" in table

    monkeypatch.setattr(bench_lr_sweep, "run_one", lambda *a: (_ for _ in ()).throw(AssertionError("rerun")))
    bench_lr_sweep.main(argv)  # resumed: every run is already saved
    # A process that trained one learning rate, one arm and one seed (processes side by side) reports the whole study.
    bench_lr_sweep.main([*argv[:argv.index("--seeds")], "--seeds", "1", "--lrs", "1e-2", "--arms", "identity",
                         "--out", str(out)])
    assert (out / "lr_sweep.md").read_text() == table
    monkeypatch.undo()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(second_corpus, "CORPORA_DIR", tmp_path / "corpora")

    trained = []
    real_run_one = bench_lr_sweep.run_one
    monkeypatch.setattr(bench_lr_sweep, "run_one", lambda arm, seed, one, *rest: (
        trained.append((arm, one.lr)), real_run_one(arm, seed, one, *rest))[1])
    bench_lr_sweep.main(argv + ["--second-corpus"])
    best_lr = lr_sweep_report.best_learning_rates(
        lr_sweep_report.cells({float(lr): bench_lr_sweep.open_lr(bench_lr_sweep.parse_args(argv), float(lr))[1]
                               for lr in stores}, ["llama", "identity"], [0, 1]), [0, 1])
    assert sorted(trained) == sorted((arm, best_lr[arm]) for arm in ("llama", "identity") for _ in (0, 1))
    report = (out / "second_corpus.md").read_text()
    assert "--second-corpus" in report and "Incomplete" not in report and "| `identity` |" in report


def test_second_corpus_needs_a_finished_sweep(tmp_path, monkeypatch):
    monkeypatch.setattr(second_corpus, "CORPORA_DIR", tmp_path / "corpora")
    with pytest.raises(SystemExit, match="has no learning rate with all seeds"):
        bench_lr_sweep.main(TINY + ["--out", str(tmp_path / "out"), "--second-corpus"])


def test_sweep_flag_errors(capsys):
    for argv, message in ((["--lrs", "0"], "positive"),):
        with pytest.raises(SystemExit):
            bench_lr_sweep.parse_args(argv)
        assert message in capsys.readouterr().err
