"""Packages some tests need but must not install into the test environment (an older transformers; the transformers
sdist whose tests/ holds the common model test mixins), fetched with pip once into a cache directory.

The cache is `$RESFORMER_TEST_CACHE`, by default `~/.cache/resformer-hf-tests`; each entry is complete or absent
(fetched into a temporary directory, renamed into place). When pip cannot fetch a package, callers go through
`unavailable`: a skip naming what is missing outside CI, a failure in CI (`CI` set), so that the tests a download
guards (thousands of mixin subtests, the cross-release checks) never vanish from CI unnoticed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest

CACHE_DIR = Path(os.environ.get("RESFORMER_TEST_CACHE", Path.home() / ".cache" / "resformer-hf-tests"))


class FetchError(RuntimeError):
    """pip could not fetch a package (offline, index unreachable): the message says what and why."""


def _pip(*args: str, timeout: int) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as error:
        raise FetchError(f"`pip {' '.join(args)}` took over {timeout} s") from error
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
        raise FetchError(f"`pip {' '.join(args)}` failed: {lines[-1] if lines else result.returncode}")


def cached(name: str, fill: Callable[[Path], None]) -> Path:
    """`CACHE_DIR/name`, filled by `fill(directory)` the first time; a failed fill leaves nothing behind."""
    target = CACHE_DIR / name
    if target.is_dir():
        return target
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE_DIR))
    try:
        fill(staging)
        try:
            staging.rename(target)
        except OSError:  # another process filled it first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def pip_target(name: str, *requirements: str, timeout: int = 600) -> Path:
    """A directory holding `requirements` installed without their dependencies (`pip install --target`), to put
    first on a subprocess's `PYTHONPATH`."""
    return cached(name, lambda directory: _pip("install", "--quiet", "--no-deps", "--target", str(directory),
                                               *requirements, timeout=timeout))


def pip_sdist(name: str, requirement: str, timeout: int = 600) -> Path:
    """A directory holding the source distribution (`.tar.gz`) of `requirement`."""
    return cached(name, lambda directory: _pip("download", "--quiet", "--no-deps", "--no-binary", ":all:",
                                               "--dest", str(directory), requirement, timeout=timeout))


def in_ci() -> bool:
    """Whether this run is CI's: `CI` set to anything but empty, 0 or false (CI services set it; so does `.ci/run`)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def unavailable(what: str, error: FetchError) -> NoReturn:
    """`what` could not be fetched: fail in CI (a download CI needs must not become a silent skip), skip elsewhere
    with the reason. Usable at module level."""
    if in_ci():
        pytest.fail(f"{what}: {error} (CI is set, so a failed download fails instead of skipping)", pytrace=False)
    pytest.skip(f"{what}: {error} (skipped because CI is unset; in CI this fails)", allow_module_level=True)


__all__ = ["CACHE_DIR", "FetchError", "cached", "in_ci", "pip_sdist", "pip_target", "unavailable"]
