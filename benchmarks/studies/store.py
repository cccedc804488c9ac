"""The one store of finished runs, shared by every study: a file per run in `benchmarks/results/runs/`, named by the
digest of everything that determines the run (its identity: data, model, budget, seed, device, code version).

A study asks for the runs its declaration implies; whichever study trained a run first, every other that asks for the
same identity reads it instead of training it again. Several processes may fill the store side by side, given the same
study or different parts of it: a process claims a run before training it (a lock that dies with the process), so the
others train other runs meanwhile; each run is written whole under its own name, and the first one stored is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not on POSIX: no claims, processes side by side may train a run twice (the first is kept)
    fcntl = None

from benchmarks.common import REPO_ROOT, RESULTS_DIR

DEFAULT_STORE = RESULTS_DIR / "runs"


def portable_path(path: str | os.PathLike) -> str:
    """`path` relative to the repository (e.g. `../shared/data/corpus`): what results record, since an absolute path
    names one machine's layout."""
    return os.path.relpath(Path(path).resolve(), REPO_ROOT)


def digest(identity: dict) -> str:
    """The run's name in the store: a hash of its identity in canonical JSON (key order and spacing do not count)."""
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class RunStore:
    """Finished runs by identity: `{"identity": ..., "result": ..., "provenance": ...}` in `<digest>.json`."""

    def __init__(self, folder: str | os.PathLike = DEFAULT_STORE):
        self.folder = Path(folder)

    def path(self, identity: dict) -> Path:
        return self.folder / f"{digest(identity)}.json"

    def record(self, identity: dict) -> dict | None:
        """The stored record of the run, or None when it has not been trained."""
        path = self.path(identity)
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as error:
            raise SystemExit(f"{path} is not valid JSON ({error}); move it aside and rerun to train the run "
                             "again.") from None
        if record.get("identity") != json.loads(json.dumps(identity)):
            raise SystemExit(f"{path} holds another run than its name says (edited by hand?); move it aside.")
        return record

    def seeds_like(self, identity: dict) -> set[int]:
        """The seeds of every stored run whose identity is this one's but for the seed."""
        rest = json.loads(json.dumps({k: v for k, v in identity.items() if k != "seed"}))
        seeds = set()
        for path in self.folder.glob("*.json"):
            stored = json.loads(path.read_text(encoding="utf-8")).get("identity", {})
            if "seed" in stored and {k: v for k, v in stored.items() if k != "seed"} == rest:
                seeds.add(stored["seed"])
        return seeds

    @contextmanager
    def claim(self, identity: dict, *, wait: bool = False) -> Iterator[bool]:
        """Hold the run while training it: yields False when another live process holds it (`wait`: block until it
        lets go, then True). The hold is an advisory lock on `.<digest>.training`, so it ends with the process however
        that ends (a killed run is trained again by the next process that asks, which removes the file the killed one
        left). Check the store again once it yields True: the holder may have stored the run meanwhile."""
        if fcntl is None:
            yield True
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f".{digest(identity)}.training"
        while True:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(descriptor)
                yield False
                return
            if _names(path, descriptor):
                break
            os.close(descriptor)  # the holder we waited for removed this file: lock the one at `path` now
        try:
            os.ftruncate(descriptor, 0)
            os.write(descriptor, f"{os.getpid()}\n".encode())  # who holds it, for a person looking
            yield True
        finally:
            path.unlink(missing_ok=True)  # before letting go: a process waiting on this file sees it gone, opens anew
            os.close(descriptor)

    def __contains__(self, identity: dict) -> bool:
        return self.path(identity).is_file()

    def put(self, identity: dict, result: dict, provenance: dict, *, replace: bool = False) -> bool:
        """Store a finished run; False when another process stored it first (its record is kept). `replace` (a
        deliberate retraining) first moves the stored record into `replaced/`, never deleting it."""
        path = self.path(identity)
        self.folder.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
        staging.write_text(json.dumps({"identity": identity, "result": result, "provenance": provenance}, indent=1),
                           encoding="utf-8")
        try:
            if replace and path.exists():
                aside = self.folder / "replaced"
                aside.mkdir(exist_ok=True)
                os.replace(path, aside / f"{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json")
            try:
                os.link(staging, path)  # atomic, and refuses to overwrite: the first finished run is kept
            except FileExistsError:
                return False
            except OSError:  # no hard links on this file system
                if path.exists():
                    return False
                os.replace(staging, path)
            return True
        finally:
            staging.unlink(missing_ok=True)


def _names(path: Path, descriptor: int) -> bool:
    """Whether `path` still names the open file `descriptor` (not removed or replaced since it was opened)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(descriptor)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
