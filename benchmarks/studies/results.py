"""A study's finished runs as its report reads them: per grid cell, `ARM/seedN` → result, with the settings and how
and where the runs were measured."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from benchmarks.studies.plan import PlannedRun
from benchmarks.studies.spec import Continuation, Settings, Study
from benchmarks.studies.store import RunStore
from benchmarks.studies.training import ModelSize


@dataclass
class CellRuns:
    """One cell's finished runs (`runs`: `ARM/seedN` → result), its settings (`config`) and `meta`: the model size,
    budget, data and environment lines the tables quote."""

    runs: dict[str, dict]
    config: dict
    meta: dict
    settings: Settings | None = None

    def __contains__(self, key: str) -> bool:
        return key in self.runs

    def __getitem__(self, key: str) -> dict:
        return self.runs[key]


@dataclass
class Results:
    """What a report renders: the study, its cells' runs, the seeds and arms it covers, the command that regenerates
    it and the folder it writes to."""

    study: Study
    cells: dict[object, CellRuns]
    seeds: list[int]
    arms: list[str]
    command: str
    out: Path

    @property
    def regenerate(self) -> str:
        """The sentence every report opens with: how to train what it shows, and how to redraw it."""
        return (f"Regenerate: `{self.command}` (resumable; `python -m benchmarks.studies report {self.study.name}` "
                "redraws).")

    def image(self, suffix: str = "") -> Path:
        return self.out / f"{self.study.name}{suffix}.png"

    def write(self, lines: list[str], *images: tuple[str, str]) -> Path:
        """Write `<out>/<study>.md`: `lines`, then each (alt text, file suffix) image of `image(suffix)`."""
        for alt, suffix in images:
            lines = [*lines, "", f"![{alt}]({self.image(suffix).name})"]
        path = self.out / f"{self.study.name}.md"
        path.write_text("\n".join([*lines, ""]))
        return path

    @property
    def only(self) -> CellRuns:
        """The runs of a study without a grid."""
        return self.cells[None]

    def environments(self, cells: list | None = None) -> str:
        """Where the runs were measured: each distinct environment line once (a study filled over days may span
        machines and releases)."""
        chosen = self.cells if cells is None else cells
        return " ".join(sorted({line for c in chosen for line in self.cells[c].meta["environments"]}))


def collect(study: Study, runs: list[PlannedRun], store: RunStore, continuation: Continuation | None,
            seeds: list[int], arms: list[str], command: str, out: Path) -> Results:
    """Read every planned run the store holds, cell by cell."""
    cells: dict[object, CellRuns] = {}
    for run in runs:
        if run.cell not in cells:
            here = run.settings
            size = ModelSize(here.hidden_size, here.layers, here.heads, None, here.intermediate_size)
            meta = {"size": size.describe(), "budget": here.budget().describe(), "environments": []}
            cells[run.cell] = CellRuns({}, cell_config(run, continuation), meta, here)
        record = store.record(run.identity)
        if record is None:
            continue
        cell = cells[run.cell]
        cell.runs[run.key] = record["result"]
        provenance = record.get("provenance", {})
        if provenance.get("data"):
            cell.meta.setdefault("data", provenance["data"])
        if provenance.get("environment") and provenance["environment"] not in cell.meta["environments"]:
            cell.meta["environments"] = sorted([*cell.meta["environments"], provenance["environment"]])
    for cell in cells.values():
        if cell.meta["environments"]:
            cell.meta["environment"] = " ".join(cell.meta["environments"])
    return Results(study, cells, seeds, arms, command, out)


def cell_config(run: PlannedRun, continuation: Continuation | None) -> dict:
    settings = run.settings
    config = dataclasses.asdict(settings) | {"batch_size": settings.batch}
    if continuation is not None:
        config |= dataclasses.asdict(continuation)
    return config
