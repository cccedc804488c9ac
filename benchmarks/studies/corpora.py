"""The studies' corpora by name: `english` (the prose of `../shared/data/corpus`) and `python-stdlib`, a second corpus
of another kind, source code, built here.

The CPython standard library's Python sources (without its test suites, IDLE and demos), as shipped with the
interpreter that runs the study: available offline on every machine that runs the benchmarks, ~9 MB (as the prose
corpus), and permissively licensed (PSF License Agreement, version 2; © Python Software Foundation). One
`<top-level module or package>.txt` per module, its files concatenated in path order, so the study's per-file split
(the last 2% of each file held out) holds out a slice of every package.

    python -m benchmarks.studies.corpora          # writes benchmarks/corpora/python<X.Y>-stdlib/, prints the path

The folder name carries the Python minor version, so studies on another Python train on (and store runs under) a
different folder instead of mixing corpora; the exact version is recorded in `PROVENANCE.md` beside the text.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from benchmarks.common import REPO_ROOT

CORPORA_DIR = REPO_ROOT / "benchmarks" / "corpora"
#: The prose corpus beside the repository (Austen and Shakespeare, `../shared/data/corpus`).
ENGLISH = REPO_ROOT.parent / "shared" / "data" / "corpus"
#: Path parts left out: test suites, IDLE, demos, installed packages, bytecode, and two packages that are data rather
#: than code (codec tables in `encodings`, the documentation's English text in `pydoc_data`).
EXCLUDED_PARTS = {"test", "tests", "idle_test", "idlelib", "turtledemo", "lib2to3", "site-packages", "__pycache__",
                  "encodings", "pydoc_data"}
LICENSE = ("CPython standard library sources, Copyright (c) 2001 Python Software Foundation; All Rights Reserved. "
           "Distributed under the PSF License Agreement, version 2 (https://docs.python.org/3/license.html).")


def corpus_folder(corpus: str, *, build_it: bool = False) -> Path:
    """The folder of a corpus named in a study (`english`, `python-stdlib`) or given as a path. `python-stdlib` is
    written on first use when `build_it` (training); naming it (a run's identity, a report) writes nothing."""
    if corpus == "english":
        return ENGLISH
    if corpus == "python-stdlib":
        return build() if build_it else default_folder()
    return Path(corpus)


def default_folder() -> Path:
    return CORPORA_DIR / f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib"


def library_sources(stdlib: Path) -> dict[str, list[Path]]:
    """The standard library's `*.py` files grouped by top-level module, in path order."""
    groups: dict[str, list[Path]] = {}
    for path in sorted(stdlib.rglob("*.py")):
        parts = path.relative_to(stdlib).parts
        if any(part in EXCLUDED_PARTS or part.startswith("test_") for part in parts):
            continue
        groups.setdefault(Path(parts[0]).stem, []).append(path)
    return groups


def build(folder: Path | None = None) -> Path:
    """Write the corpus folder (once: an existing complete folder is kept) and return it."""
    folder = Path(folder or default_folder())
    if (folder / "PROVENANCE.md").is_file():
        return folder
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    total = 0
    for module, paths in library_sources(stdlib).items():
        text = "".join(f"# ---- {path.relative_to(stdlib).as_posix()}\n"
                       f"{path.read_text(encoding='utf-8', errors='replace')}\n" for path in paths)
        (staging / f"{module}.txt").write_text(text, encoding="utf-8")
        total += len(text)
    (staging / "PROVENANCE.md").write_text(
        f"{LICENSE}\nTaken from {platform.python_implementation()} {platform.python_version()} "
        f"({len(list(staging.glob('*.txt')))} modules, {total / 1e6:.1f}M characters) by "
        "benchmarks/studies/corpora.py; test suites, IDLE, demos, encodings and pydoc_data left out.\n")
    try:
        os.replace(staging, folder)  # complete or absent: a killed build leaves only a hidden staging folder
    except OSError:
        if not (folder / "PROVENANCE.md").is_file():
            raise
        shutil.rmtree(staging)  # another process finished the same corpus first: keep its folder, drop this copy
    return folder


if __name__ == "__main__":
    print(build())
