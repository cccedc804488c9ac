"""The pre-training studies, as data: each study is a declaration in `catalogue.py` (arms, settings, seeds, grid,
report), one runner trains what it needs (`python -m benchmarks.studies run NAME`), and every run lives once in one
store (`benchmarks/results/runs/`, a file per run named by everything that determines it), so a run trained for one
study serves every study that asks for the same run.

    spec.py        what a declaration holds          catalogue.py   the declarations
    plan.py        declaration → runs and identities store.py       the run store
    runner.py      trains missing runs (uptrain.py)  results.py     stored runs as a report reads them
    reports/       one renderer per kind of report   cli.py         the command line (run, report, list, migrate)
    data.py, corpora.py, training.py, seed_statistics.py: data, the training loop and the statistics every study shares
    migrate.py     the per-study stores of before → the store (re-runnable)
"""
