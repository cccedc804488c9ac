"""Where the GPU run's results go and how it keeps to its time: every result is one JSON line, written and flushed to
disk the moment it is measured (a run killed at its time limit still leaves everything it measured), and every part
of the run has a share of one deadline, so a slow part cannot starve the ones after it."""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch


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


@dataclass(frozen=True)
class Plan:
    """What a part runs on and which models it covers: `smoke` runs toy sizes on the CPU with a few models, and
    `variants` (a rerun that fills in what an earlier run skipped) narrows every part to them and the Llama control."""

    device: torch.device
    smoke: bool = False
    variants: tuple[str, ...] = ()
    pretrain: object = None  #: the `pretrain` part's options (`pretrain.Options`; None: its defaults)

    def pick(self, priority: list[str], smoke_subset: list[str]) -> list[str]:
        """`priority` in order, narrowed to the smoke subset or to `variants` (the first entry, the control, stays)."""
        if self.variants:
            return [priority[0], *[name for name in priority[1:] if name in self.variants]]
        return [name for name in priority if name in smoke_subset] if self.smoke else list(priority)
