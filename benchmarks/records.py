"""The records of a timed run (the GPU run, the serving capacity run) and how it keeps to its time: the first record
is the environment, every result is one JSON line, written and flushed to disk the moment it is measured (a run
killed at its time limit still leaves everything it measured), and every part of the run has a share of one
deadline, so a slow part cannot starve the ones after it. The report writers read the lines back (`read_records`)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers

import resformer_hf


class Recorder:
    """Appends one JSON object per result to `path` (JSON Lines) and prints a one-line summary of it."""

    def __init__(self, path: Path, started: float):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.started = started

    def write(self, part: str, name: str, **fields) -> dict:
        record = {"part": part, "name": name, "at_s": round(time.monotonic() - self.started, 1), **fields}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, default=str) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        shown = {key: value for key, value in fields.items() if key not in ("traceback", "detail")}
        print(f"[{record['at_s']:6.1f}s] {part}/{name}: {json.dumps(shown, default=str)[:300]}", flush=True)
        return record

    def done(self, schedule: Schedule) -> None:
        """The run's last line: it finished, in this many seconds (a run stopped before has none)."""
        self.write("run", "done", ok=None, elapsed_s=round(schedule.elapsed(), 1))

    @contextmanager
    def guarded(self, part: str, name: str) -> Iterator[None]:
        """Record an exception of the block as a failed result of `part/name` and carry on with the next one: a
        variant that crashes on CUDA must not cost the measurements of every other."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 (anything a model or engine raises is a result to report)
            self.write(part, name, ok=False, error=f"{type(error).__name__}: {error}"[:500],
                       traceback="".join(traceback.format_exception(error))[-3000:])


def read_records(path: Path) -> list[dict]:
    """Every complete line of a results file (a line cut short by a kill is skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class Schedule:
    """One deadline for the whole run, shared out between its parts in proportion to `shares`.

    A part may start a job while its own share lasts; time a part leaves unused passes to the parts after it.
    """

    def __init__(self, seconds: float, shares: dict[str, float], clock: Callable[[], float] = time.monotonic):
        self.clock, self.started = clock, clock()
        self.deadline = self.started + seconds
        self.shares = dict(shares)
        self.part_deadline = self.deadline

    def begin(self, part: str) -> None:
        """Start `part`: its deadline is its share of the time left, among the parts not yet begun."""
        remaining = sum(self.shares.values())
        share = self.shares.pop(part, 0.0)
        left = max(0.0, self.deadline - self.clock())
        self.part_deadline = self.clock() + (left * share / remaining if remaining else left)

    def split(self, index: int, count: int) -> None:
        """Narrow the current part to piece `index` of `count` equal pieces of what is left of it (call with index
        0, 1, ... in turn), so that a later piece is not starved by an earlier one."""
        if index == 0:
            self._part_end = self.part_deadline
        now = self.clock()
        self.part_deadline = now + max(0.0, self._part_end - now) / (count - index)

    def allows(self, estimate_s: float = 0.0) -> bool:
        """Whether a job expected to take `estimate_s` fits in the current part's share (and the whole run)."""
        now = self.clock()
        return now + estimate_s <= min(self.part_deadline, self.deadline)

    def elapsed(self) -> float:
        return self.clock() - self.started


def commit() -> str | None:
    """The checkout's commit, with `+changes` where tracked files differ from it (None outside a git checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+changes" if dirty else "")


def environment(device: torch.device) -> dict:
    """What a run's first record says of where it ran: device, versions, commit, date."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "CPU")
    return dict(device=name, torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
                resformer_hf=resformer_hf.__version__, commit=commit(), python=platform.python_version(),
                date=time.strftime("%Y-%m-%d"), cpus=os.cpu_count())


def open_run(path: Path, smoke: bool, seconds: float, shares: dict[str, float],
             **fields) -> tuple[torch.device, Recorder, Schedule]:
    """The device a run measures on (the CPU for `smoke`, else a CUDA GPU, or exit saying so), its recorder, whose
    first line is the environment and `fields`, and the schedule sharing its `seconds` between its parts."""
    device = torch.device("cpu" if smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: this run needs one (use --smoke to rehearse it on the CPU)")
    recorder = Recorder(path, time.monotonic())
    recorder.write("run", "environment", ok=None, smoke=smoke, **fields, seconds=seconds, **environment(device))
    return device, recorder, Schedule(seconds, shares)


def environment_of(records: list[dict]) -> dict:
    """A run's environment record (empty where the run has none)."""
    return next((r for r in records if r.get("part") == "run" and r.get("name") == "environment"), {})


def describe_environment(environment: dict) -> str:
    """One line saying where and with what a run's numbers were measured, from its environment record."""
    return (f"Measured {environment.get('date')} on {environment.get('device')} (torch {environment.get('torch')}, "
            f"CUDA {environment.get('cuda')}), transformers {environment.get('transformers')}, resformer-hf "
            f"{environment.get('resformer_hf')}.")


def child_result(args: list[str], failure: str, **env: str) -> dict:
    """Run `python ARGS` in a fresh process (the repository importable, `env` added to its environment) for a
    measurement that must not share this one's memory, and return the JSON object its last line of output holds;
    exit with `failure` and the child's error output if it fails."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                            env={**os.environ, **env, "PYTHONPATH": path})
    if result.returncode != 0:
        raise SystemExit(f"{failure}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
