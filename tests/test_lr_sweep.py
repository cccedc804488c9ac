"""The learning-rate sweep (issue 28): its arithmetic against hand-computed numbers, the second corpus, and a sweep
and a study tuned on it end to end on a tiny setting (the bundled text sample, a few steps of a tiny model)."""

from __future__ import annotations

import dataclasses
import json
import tempfile

import pytest

from benchmarks.studies import catalogue, cli, runner
from benchmarks.studies import corpora as second_corpus
from benchmarks.studies.reports.tuned import Cell, best_learning_rates, instability, tuned_comparison
from benchmarks.studies.spec import Settings
from benchmarks.studies.store import portable_path


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


TINY = Settings(sample_chars=30000, vocab_size=300, val_fraction=0.1, val_tokens=256, seq_len=32, batch_size=4,
                hidden_size=32, layers=2, heads=2, tokens=512, eval_every=2)


@pytest.fixture
def tiny_studies(tmp_path, monkeypatch):
    """A tiny sweep (two learning rates, two arms, two seeds) and a study tuned on it on another (tiny) corpus,
    declared beside the real ones: studies are data."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    code = tmp_path / "code"
    code.mkdir()
    (code / "corpora.txt").write_text(open(second_corpus.__file__).read() * 8)  # some Python source
    sweep = catalogue.study("lr_sweep")
    arms = tuple(arm for arm in sweep.arms if arm.name in ("llama", "identity"))
    grid = dataclasses.replace(sweep.grid, values=(1e-3, 1e-2))
    tiny_sweep = dataclasses.replace(sweep, name="tiny_sweep", arms=arms, settings=TINY, seeds=(0, 1), grid=grid)
    tiny_code = dataclasses.replace(tiny_sweep, name="tiny_code", tuned_from="tiny_sweep",
                                    settings=dataclasses.replace(TINY, sample_chars=None, corpus=str(code)))
    monkeypatch.setitem(catalogue.STUDIES, "tiny_sweep", tiny_sweep)
    monkeypatch.setitem(catalogue.STUDIES, "tiny_code", tiny_code)
    return ["--store", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--threads", "1"]


@pytest.mark.slow
def test_sweep_and_a_study_tuned_on_it_end_to_end_and_resumed(tiny_studies, tmp_path, monkeypatch):
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="tiny_code trains each arm at its best learning rate in tiny_sweep: llama, "
                                         "identity has no learning rate with all seeds"):
        cli.main(["run", "tiny_code", *tiny_studies])
    cli.main(["run", "tiny_sweep", *tiny_studies])
    records = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*.json")]
    assert sorted((r["identity"]["budget"]["lr"], r["identity"]["model"]["variant"], r["identity"]["seed"])
                  for r in records) == sorted((lr, a, s) for lr in (1e-3, 1e-2) for a in ("llama", "identity")
                                              for s in (0, 1))
    assert all(len(r["result"]["train_curve"]) == 2 for r in records)
    table = (out / "tiny_sweep.md").read_text()
    assert "Incomplete" not in table and (out / "tiny_sweep.png").stat().st_size > 0
    finals = {lr: sum(r["result"]["final_val_loss"] for r in records if r["identity"]["budget"]["lr"] == lr
                      and r["identity"]["model"]["variant"] == "llama") for lr in (1e-3, 1e-2)}
    best = min(finals, key=finals.get)
    assert "| `llama` | " in table and f"| {best:g} |" in table

    train_from_scratch = runner.train_from_scratch
    monkeypatch.setattr(runner, "train_from_scratch", lambda *a: pytest.fail("a stored run was trained again"))
    cli.main(["run", "tiny_sweep", *tiny_studies])  # resumed: every run is stored
    # A process that trained one learning rate, one arm and one seed (processes side by side) reports the whole study.
    cli.main(["run", "tiny_sweep", "--lrs", "1e-2", "--arms", "identity", "--seeds", "1", *tiny_studies])
    assert (out / "tiny_sweep.md").read_text() == table

    trained = []
    real = train_from_scratch
    monkeypatch.setattr(runner, "train_from_scratch", lambda run, *rest: trained.append(
        (run.arm.name, run.settings.lr, run.identity["data"]["corpus"])) or real(run, *rest))
    cli.main(["run", "tiny_code", *tiny_studies])
    sweep_best = {arm: min((1e-3, 1e-2), key=lambda lr, arm=arm: sum(
        r["result"]["final_val_loss"] for r in records
        if r["identity"]["budget"]["lr"] == lr and r["identity"]["model"]["variant"] == arm)) for arm in
        ("llama", "identity")}
    code = portable_path(tmp_path / "code")  # on its own corpus, each arm at its best lr in the sweep
    assert sorted(trained) == sorted((arm, sweep_best[arm], code) for arm in sweep_best for _ in (0, 1))
    report = (out / "tiny_code.md").read_text()
    assert "Each arm trains only at its best learning rate in `tiny_sweep.md`" in report
    assert "Incomplete" not in report and "| `identity` |" in report


def test_sweep_flag_errors(tmp_path):
    with pytest.raises(SystemExit, match="--lrs must be positive"):
        cli.main(["run", "lr_sweep", "--lrs", "0", "--store", str(tmp_path)])
