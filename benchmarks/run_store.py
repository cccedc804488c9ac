"""A resumable store of a study's finished runs (one JSON file, safe for several processes), and the
repository-relative paths it records so results name no machine's layout."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from common import REPO_ROOT

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one study process per store there
    fcntl = None


def portable_path(path: str | os.PathLike) -> str:
    """`path` relative to the repository (e.g. `../shared/data/corpus`): what results files record, since an absolute
    path names one machine's layout."""
    return os.path.relpath(Path(path).resolve(), REPO_ROOT)


def portable_config(config: dict) -> dict:
    """A study config with its corpus folder as a repository-relative path (stores written with an absolute path
    still match the settings they were trained with)."""
    if config.get("corpus_dir") is not None and os.path.isabs(config["corpus_dir"]):
        config = {**config, "corpus_dir": portable_path(config["corpus_dir"])}
    return config


class RunStore:
    """Finished runs of a study in one JSON file, written after every run so an interrupted study resumes.

    Runs are kept only while the study's settings (`config`) are unchanged: a changed flag starts over, so a table
    never mixes runs trained differently. Several processes may share a store (e.g. one per seed, to use every core):
    each save merges the runs other processes saved meanwhile under a lock, and a run another process finished is
    skipped, so none is lost or trained twice on purpose. A store that is replaced (other settings, or `fresh`) is
    first copied aside, never lost.
    """

    def __init__(self, path: Path, config: dict, *, fresh: bool = False):
        self.path = Path(path)
        self.config = portable_config(json.loads(json.dumps(config)))  # as JSON round-trips it: exact comparisons
        self.runs: dict[str, dict] = {}
        self.meta: dict = {}
        self.retrained: set[str] = set()  #: `fresh`: saved runs this process trains again (not merged back)
        if not self.path.is_file():
            return
        saved = json.loads(self.path.read_text())
        same_settings = self._same_settings(saved)
        if same_settings and not fresh:
            self.runs = saved.get("runs", {})
            self.meta = saved.get("meta", {})
            return
        if same_settings:
            self.retrained = set(saved.get("runs", {}))
        with self._locked():
            kept = self._free_name(f"{self.path.stem}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.copy2(self.path, kept)
        reason = "--fresh" if same_settings else "saved with other settings"
        print(f"{self.path}: {reason}, starting over (the saved runs are kept in {kept})", flush=True)

    def _free_name(self, stem: str) -> Path:
        """`<stem>.json` beside the store, or `<stem>-2.json`, ...: the first name nothing has."""
        names = (f"{stem}{'' if n == 1 else f'-{n}'}{self.path.suffix}" for n in range(1, 10**6))
        return next(path for path in map(self.path.with_name, names) if not path.exists())

    def __contains__(self, key: str) -> bool:
        return key in self.runs

    def __getitem__(self, key: str) -> dict:
        return self.runs[key]

    def put(self, key: str, result: dict) -> None:
        self.runs[key] = result
        self.save()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on `<store>.lock` (POSIX; elsewhere concurrent studies are not supported)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as handle:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    def _same_settings(self, saved: dict) -> bool:
        return portable_config(saved.get("config") or {}) == self.config

    def _merge_saved(self) -> None:
        """Add the runs another process saved with the same settings (this process's own runs win)."""
        if not self.path.is_file():
            return
        saved = json.loads(self.path.read_text())
        if self._same_settings(saved):
            others = {key: run for key, run in saved.get("runs", {}).items() if key not in self.retrained}
            self.runs = {**others, **self.runs}
            self.meta = {**saved.get("meta", {}), **self.meta}

    def save(self) -> None:
        with self._locked():
            self._merge_saved()
            payload = {"config": self.config, "meta": self.meta, "runs": self.runs}
            staging = self.path.with_name(self.path.name + ".tmp")
            staging.write_text(json.dumps(payload, indent=1))
            os.replace(staging, self.path)

    def run(self, key: str, job: Callable[..., dict], *args) -> dict:
        """The stored result of `key`, or `job(*args)`'s, stored before returning."""
        with self._locked():
            self._merge_saved()  # another process may have finished it meanwhile
        if key in self.runs:
            print(f"{key}: done, skipped", flush=True)
        else:
            print(f"training {key}", flush=True)
            self.put(key, job(*args))
        return self.runs[key]
