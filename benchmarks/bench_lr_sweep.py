"""Is the gain real after tuning? Every arm at its own best learning rate, with seeds.

The context-length study trained every arm at one learning rate (3e-3). Here each arm (Llama, `identity`,
`learnable_plus`, `svformer`) trains at several learning rates on the context-length study's model and budget
(context 512, 2048 tokens per AdamW step, 1.2M tokens, the same schedule), three seeds each, with the same initial
weights and batch order across arms within a seed. The report takes each arm's best learning rate (lowest mean final
validation loss) and compares it, paired by seed, with Llama at *Llama's* best learning rate — so no arm gains from
a learning rate that happens to suit it and not the baseline.

    nice -n 19 python benchmarks/bench_lr_sweep.py --threads 1                   # every lr, in turn
    nice -n 19 python benchmarks/bench_lr_sweep.py --threads 1 --lrs 6e-3        # one lr per process, side by side
    python benchmarks/bench_lr_sweep.py --report-only                            # table and plot only
    nice -n 19 python benchmarks/bench_lr_sweep.py --threads 1 --second-corpus   # each arm at its best lr on code

`--second-corpus` trains every arm only at its best learning rate from the sweep (`--tuned-from`, default
`lr_sweep`) on the CPython standard library's sources (`second_corpus.py`), into `results/second_corpus/`, and
writes `second_corpus.md` in the same format.

Each learning rate keeps its finished runs in its own store (`results/lr_sweep/lr<lr>.json`), written after every
run, so an interrupted sweep resumes. Runs at 3e-3 that the context-length study already trained with identical
settings are taken from `results/context_length/ctx512.json` instead of being trained again.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

from bench_pretrain import run_one
from lr_sweep_report import best_learning_rates, cells, write_report

from common import BASELINE, RESULTS_DIR, add_device_args
from run_store import RunStore, portable_config
from study_cli import add_study_args, command_line, open_study, prepare_training, seeds_from_args

ARMS = [BASELINE, "identity", "learnable_plus", "svformer"]
LEARNING_RATES = [1e-3, 3e-3, 6e-3]
NAME = "lr_sweep"
SECOND_CORPUS = "second_corpus"
SCRIPT = "bench_lr_sweep.py"
#: The context-length study's store at the sweep's context: its runs are the sweep's 3e-3 runs when settings match.
CONTEXT_STUDY_STORE = RESULTS_DIR / "context_length" / "ctx512.json"


def lr_args(args: argparse.Namespace, lr: float) -> argparse.Namespace:
    """The sweep's flags for one learning rate."""
    one = copy.copy(args)
    one.lr = lr
    one.out = args.out / args.study
    return one


def store_name(lr: float) -> str:
    return f"lr{lr:g}"


def open_lr(args: argparse.Namespace, lr: float) -> tuple[argparse.Namespace, RunStore]:
    one = lr_args(args, lr)
    return one, open_study(one, store_name(lr), "kv_heads")


def adopt_runs(store: RunStore, source: Path, arms: list[str]) -> list[str]:
    """Copy the runs another study trained with exactly this store's settings (same config dict)."""
    if not source.is_file():
        return []
    saved = json.loads(source.read_text())
    if portable_config(saved.get("config") or {}) != store.config:
        return []
    adopted = [key for key in saved.get("runs", {}) if key not in store and key.split("/")[0] in arms]
    for key in adopted:
        store.runs[key] = dict(saved["runs"][key], adopted_from=f"{source.parent.name}/{source.name}")
    if adopted:
        store.meta.setdefault("adopted", {}).update({key: source.name for key in adopted})
        for field in ("size", "environment", "data", "budget"):
            store.meta.setdefault(field, saved.get("meta", {}).get(field))
        store.save()
    return adopted


def assigned_learning_rates(args: argparse.Namespace, seeds: list[int]) -> dict[str, list[float]]:
    """Per arm, the learning rates it trains at: every `--lrs`, or with `--tuned-from` its best one there."""
    if not args.tuned_from:
        return {arm: list(args.lrs) for arm in args.arms}
    source = argparse.Namespace(**{**vars(args), "study": args.tuned_from, "corpus_dir": args.tuned_corpus_dir})
    stores = {lr: open_lr(source, lr)[1] for lr in args.lrs}
    best = best_learning_rates(cells(stores, args.arms, seeds), seeds)
    untuned = [arm for arm, lr in best.items() if lr is None]
    if untuned:
        raise SystemExit(f"--tuned-from {args.tuned_from}: {', '.join(untuned)} has no learning rate with all seeds "
                         f"{seeds} finished yet; finish that study first.")
    return {arm: [lr] for arm, lr in best.items()}


def train_all(args: argparse.Namespace, argv, seeds: list[int]) -> None:
    """Train every missing (lr, seed, arm): seed-major, so an interrupted sweep has whole seeds to report."""
    plan = []
    assigned = assigned_learning_rates(args, seeds)
    for lr in args.lrs:
        arms = [arm for arm in args.arms if lr in assigned[arm]]
        if not arms:
            continue
        one, store = open_lr(args, lr)
        if args.reuse:
            adopted = adopt_runs(store, CONTEXT_STUDY_STORE, args.arms)
            if adopted:
                print(f"lr {lr:g}: {len(adopted)} runs taken from {CONTEXT_STUDY_STORE.name} (identical settings)",
                      flush=True)
        missing = [(seed, arm) for seed in seeds for arm in arms if f"{arm}/seed{seed}" not in store]
        if missing:
            plan.append((lr, one, store, missing))
    total = sum(len(missing) for *_, missing in plan)
    done, started = 0, time.monotonic()
    for _lr, one, store, missing in plan:
        device, data = prepare_training(store, one, SCRIPT, argv)
        store.meta["command"] = command_line(SCRIPT, argv)
        for seed, arm in missing:
            store.run(f"{arm}/seed{seed}", run_one, arm, seed, one, data, device)
            done += 1
            elapsed = time.monotonic() - started
            print(f"[{done}/{total} runs] elapsed {elapsed / 60:.0f} min, "
                  f"ETA {elapsed / done * (total - done) / 60:.0f} min", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(parser)
    add_study_args(parser, tokens=1_200_000)
    parser.set_defaults(seq_len=512, batch_size=4)
    parser.add_argument("--lrs", type=float, nargs="+", default=LEARNING_RATES, help="peak learning rates to sweep")
    parser.add_argument("--arms", nargs="+", default=ARMS, help="'llama' and value_residual variants")
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (multi-head attention)")
    parser.add_argument("--analysis-sequences", type=int, default=8, help="validation blocks for entropy/similarity")
    parser.add_argument("--no-reuse", dest="reuse", action="store_false",
                        help="train lr 3e-3 even where the context-length study has identical runs")
    parser.add_argument("--study", default=NAME, help="name of the results (store folder, report); default lr_sweep")
    parser.add_argument("--tuned-from", default=None, metavar="STUDY",
                        help="train each arm only at its best learning rate in STUDY's results (e.g. lr_sweep)")
    parser.add_argument("--second-corpus", action="store_true",
                        help="the second corpus (CPython's standard library, second_corpus.py) with each arm at its "
                        "best lr from lr_sweep: --study second_corpus --tuned-from lr_sweep --corpus-dir <built>")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    args = parser.parse_args(argv)
    args.tuned_corpus_dir = args.corpus_dir  # the corpus the --tuned-from study trained on
    if args.second_corpus:
        from second_corpus import build

        args.study, args.tuned_from = SECOND_CORPUS, args.tuned_from or NAME
        args.corpus_dir = build()
    if any(not math.isfinite(lr) or lr <= 0 for lr in args.lrs):
        parser.error(f"--lrs must be positive numbers (got {args.lrs})")
    return args


def whole_study(args: argparse.Namespace, seeds: list[int]) -> tuple[argparse.Namespace, list[int]]:
    """What the report covers, whatever part of the study this process trained (one learning rate, some seeds or arms,
    as when processes run side by side): every learning rate, arm and seed its stores hold, and this process's."""
    lrs, arms, held = [], list(args.arms), set(seeds)
    for lr in sorted(set(LEARNING_RATES) | set(args.lrs)):
        runs = open_lr(args, lr)[1].runs
        if lr in args.lrs or runs:
            lrs.append(lr)
        for key in runs:
            arm, seed = key.rsplit("/seed", 1)
            arms.append(arm)
            held.add(int(seed))
    ordered = [arm for arm in [BASELINE, *ARMS] if arm in arms] + [arm for arm in arms if arm not in ARMS]
    return argparse.Namespace(**{**vars(args), "lrs": lrs, "arms": list(dict.fromkeys(ordered))}), sorted(held)


def main(argv=None) -> None:
    args = parse_args(argv)
    seeds = seeds_from_args(args)
    if not args.report_only:
        train_all(args, argv, seeds)
    path = write_report(*whole_study(args, seeds))
    if path:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
