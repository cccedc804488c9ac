"""`python -m benchmarks.studies run|report|list|migrate`: the one command line of every study.

    python -m benchmarks.studies list                                   # the studies, and how many runs are stored
    nice -n 19 python -m benchmarks.studies run pretrain --threads 1    # train what is missing, then write the report
    nice -n 19 python -m benchmarks.studies run lr_sweep --threads 1 --lrs 6e-3 --seeds 2   # a part, side by side
    nice -n 19 python -m benchmarks.studies run tuned_seeds --threads 1 &  # twice: the two share the runs out
    python -m benchmarks.studies report context_length                  # rewrite the report from the stored runs
    python -m benchmarks.studies run pretrain --device cuda             # on a GPU (float32; runs stored as cuda runs)
    python -m benchmarks.studies migrate                                # the per-study stores of before → the store

The flags under "overrides of the declared settings" replace the study's declared values (`catalogue.py`); a changed
value makes other runs, stored beside the declared ones. `--seeds`, `--arms` and a grid flag (`--contexts`, `--lrs`,
`--sizes`, `--corpora`) choose what this process trains; the report always covers the whole study (its declared seeds,
arms and grid, plus the ones given), so processes that split a study write the same report.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from benchmarks.common import RESULTS_DIR
from benchmarks.studies import catalogue, plan
from benchmarks.studies.results import collect
from benchmarks.studies.spec import CORPUS_FIELDS, Study
from benchmarks.studies.store import DEFAULT_STORE, RunStore, portable_path

#: Overrides of the declared settings: flag → type (dest is the `Settings` / `Continuation` field).
SETTING_FLAGS = {
    "corpus-dir": str, "sample-chars": int, "val-fraction": float, "val-tokens": int, "vocab-size": int,
    "hidden-size": int, "layers": int, "heads": int, "intermediate-size": int, "head-dim": int,
    "tokens": int, "seq-len": int, "batch-size": int, "tokens-per-step": int, "lr": float, "warmup": float,
    "weight-decay": float, "eval-every": int,
    "pretrain-tokens": int, "pretrain-lr": float, "pretrain-seed": int, "continue-fraction": float,
}
#: Grid flags: each chooses the cells of a study whose grid has that flag.
GRID_FLAGS = {"contexts": int, "lrs": float, "sizes": str, "corpora": str}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("run", "train the runs the store lacks, then write the report"),
                            ("report", "write the report from the stored runs")):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("study", help=f"one of: {', '.join(catalogue.STUDIES)}")
        sub.add_argument("--seeds", type=int, nargs="+", help="seeds to train (default: the declared ones)")
        sub.add_argument("--arms", nargs="+", help="arms to train (default: every declared arm)")
        sub.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda (float32)")
        sub.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
        sub.add_argument("--store", type=Path, default=DEFAULT_STORE, help="the run store (default results/runs)")
        sub.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the report goes (default results/)")
        if name == "run":
            sub.add_argument("--fresh", action="store_true",
                             help="train the study's runs again (the stored ones are moved to <store>/replaced/)")
            sub.add_argument("--work-dir", type=Path, default=None,
                             help="uptrain: where checkpoints go (default: a folder in the temp directory)")
        group = sub.add_argument_group("overrides of the declared settings")
        for flag, kind in SETTING_FLAGS.items():
            group.add_argument(f"--{flag}", type=kind, default=None)
        for flag, kind in GRID_FLAGS.items():
            group.add_argument(f"--{flag}", type=kind, nargs="+", default=None, help="the grid's cells")
    commands.add_parser("list", help="the studies and how many of their runs the store holds").add_argument(
        "--store", type=Path, default=DEFAULT_STORE)
    migrate = commands.add_parser("migrate", help="copy the runs of the per-study stores of before into the store")
    migrate.add_argument("--source", type=Path, default=RESULTS_DIR,
                         help="the results folder holding the old stores (pretrain.json, lr_sweep/lr*.json, ...)")
    migrate.add_argument("--store", type=Path, default=DEFAULT_STORE)
    return parser.parse_args(argv)


def overrides_of(args: argparse.Namespace) -> dict:
    given = {flag.replace("-", "_"): getattr(args, flag.replace("-", "_")) for flag in SETTING_FLAGS}
    given = {k: v for k, v in given.items() if v is not None}
    if "corpus_dir" in given:  # absolute now: a run's identity must not depend on the working directory
        given["corpus"] = str(Path(given.pop("corpus_dir")).resolve())
    for name in ("lr", "pretrain_lr"):
        if name in given and (not math.isfinite(given[name]) or given[name] <= 0):
            raise SystemExit(f"--{name.replace('_', '-')} must be a positive number (got {given[name]})")
    if any(not math.isfinite(lr) or lr <= 0 for lr in args.lrs or ()):
        raise SystemExit(f"--lrs must be positive numbers (got {args.lrs})")
    return given


def command_line(args: argparse.Namespace, study: Study, seeds: list[int]) -> str:
    """The command that trains what the report shows, as the report quotes it (paths repository-relative): the
    whole study, so processes that split it by seeds, arms or cells quote the same one; the report's seeds (`seeds`)
    and cells beyond the declared ones are part of it."""
    words = ["python -m benchmarks.studies run", study.name]
    for flag in SETTING_FLAGS:
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            words += [f"--{flag}", portable_path(value) if flag == "corpus-dir" else f"{value:g}"
                      if isinstance(value, float) else str(value)]
    if study.grid is not None and set(getattr(args, study.grid.flag) or ()) - set(study.grid.values):
        cells = dict.fromkeys([*study.grid.values, *getattr(args, study.grid.flag)])
        words += [f"--{study.grid.flag}", *(f"{v:g}" if isinstance(v, float) else str(v) for v in cells)]
    if set(seeds) - set(study.seeds):
        words += ["--seeds", *map(str, seeds)]
    if args.device != "cpu":
        words += ["--device", args.device]
    return " ".join(words)


def grid_values(study: Study, args: argparse.Namespace) -> tuple[tuple | None, tuple | None]:
    """(the cells to train, the cells to report): the given ones, and the declared ones with the given added (the
    report leaves out a declared cell the given settings make impossible)."""
    for flag in GRID_FLAGS:
        if getattr(args, flag) is not None and (study.grid is None or study.grid.flag != flag):
            raise SystemExit(f"--{flag}: study {study.name} has no such grid"
                             + (f" (its grid is --{study.grid.flag})" if study.grid else ""))
    if study.grid is None:
        return None, None
    given = tuple(getattr(args, study.grid.flag) or ())
    return (given or study.grid.values), tuple(dict.fromkeys([*study.grid.values, *given]))


def tuned_lrs(study: Study, overrides: dict, store: RunStore, device: str) -> dict[str, set]:
    """Each arm's best learning rate in the study it is tuned on (its declared seeds and arms, these overrides but
    its own corpus)."""
    from benchmarks.studies.reports.tuned import best_learning_rates, cells

    source = catalogue.study(study.tuned_from)
    settings, _ = plan.with_overrides(source, {k: v for k, v in overrides.items() if k not in CORPUS_FIELDS})
    seeds, arms = list(source.seeds), [arm.name for arm in source.arms]
    runs = plan.plan(source, settings, seeds, arms, plan.cells(source, settings), device)
    results = collect(source, runs, store, None, seeds, arms, "", Path())
    best = best_learning_rates(cells(results.cells, arms, seeds), seeds)
    untuned = [arm for arm, lr in best.items() if lr is None]
    if untuned:
        raise SystemExit(f"{study.name} trains each arm at its best learning rate in {source.name}: "
                         f"{', '.join(untuned)} has no learning rate with all seeds {seeds} finished there yet; "
                         f"finish that study first (python -m benchmarks.studies run {source.name}).")
    return {arm: {lr} for arm, lr in best.items()}


def invocation(argv: list[str]) -> str:
    """This process's command, as each run it trains records it (paths repository-relative)."""
    words = [portable_path(word) if Path(word).is_absolute() and Path(word).exists() else word for word in argv]
    return " ".join(["python -m benchmarks.studies", *words])


def run_or_report(args: argparse.Namespace, argv: list[str]) -> Path | None:
    study = catalogue.study(args.study)
    overrides = overrides_of(args)
    settings, continuation = plan.with_overrides(study, overrides)
    declared_arms = [arm.name for arm in study.arms]
    for name in args.arms or ():
        study.arm(name)  # an unknown arm is an error that lists the declared ones
    seeds = sorted({*study.seeds, *(args.seeds or ())})
    train_cells, report_cells = grid_values(study, args)
    store, device = RunStore(args.store), plan.device_kind(args.device)
    if args.command == "run":
        from benchmarks.studies import runner, uptrain

        command = invocation(argv)
        torch_device = runner.open_device(args.device, args.threads)
        only = tuned_lrs(study, overrides, store, device) if study.tuned_from else None
        arms = [arm for arm in declared_arms if not args.arms or arm in args.arms]
        if study.continuation is not None and study.baseline not in arms:
            raise SystemExit(f"--arms must include {study.baseline!r}: every difference is to the continued source")
        runs = plan.plan(study, settings, list(args.seeds or study.seeds), arms,
                         plan.cells(study, settings, train_cells), device, continuation, only)
        if study.continuation is not None:
            uptrain.train_missing_continuations(runs, store, torch_device, command, fresh=args.fresh,
                                                work_dir=args.work_dir)
        else:
            runner.train_missing(runs, store, torch_device, command, fresh=args.fresh)
    report = plan.cells(study, settings, report_cells, possible_only=True)  # the declared cells these overrides allow
    if study.stored_seeds:  # every seed the store holds of the baseline's runs
        for run in plan.plan(study, settings, seeds[:1], [study.baseline], report, device, continuation):
            seeds = sorted({*seeds, *store.seeds_like(run.identity)})
    runs = plan.plan(study, settings, seeds, declared_arms, report, device, continuation)
    command = command_line(args, study, seeds)
    from benchmarks.studies.reports import render

    path = render(collect(study, runs, store, continuation, seeds, declared_arms, command, args.out))
    if path:
        print(f"wrote {path}")
    return path


def list_studies(store: RunStore) -> None:
    for study in catalogue.STUDIES.values():
        settings, continuation = plan.with_overrides(study, {})
        arms = [arm.name for arm in study.arms]
        only = None
        if study.tuned_from:
            try:
                only = tuned_lrs(study, {}, store, "cpu")
            except SystemExit:  # the study it is tuned on is not finished: count every cell
                pass
        runs = plan.plan(study, settings, list(study.seeds), arms, plan.cells(study, settings), "cpu", continuation,
                         only)
        stored = sum(run.identity in store for run in runs)
        grid = f", {study.grid.flag} {' '.join(map(str, study.grid.values))}" if study.grid else ""
        print(f"{study.name}: {study.question}\n    {len(arms)} arms × {len(study.seeds)} seeds{grid}; "
              f"{stored} of {len(runs)} runs stored; report {study.report}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.command == "list":
        list_studies(RunStore(args.store))
    elif args.command == "migrate":
        from benchmarks.studies.migrate import migrate

        migrate(args.source, RunStore(args.store))
    else:
        run_or_report(args, argv)

