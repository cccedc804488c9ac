"""Check the built distributions against the source they came from (.ci/wheel).

Given the source tree and two `dist/` folders, each with one sdist and one wheel (one built straight from the tree, one
by `python -m build`, whose wheel is built from its sdist):
- the wheel built from the sdist equals the one built from the tree, file for file and byte for byte, so the sdist is
  complete; the two sdists hold the same files;
- the wheel holds every file of the package in the tree (code and package data) and nothing else, and LICENSE (the
  tree's, byte for byte) in its dist-info, declared in METADATA;
- the sdist holds LICENSE, README.md, CHANGELOG.md, CITATION.cff, the build files and the package, and no tests.
"""

from __future__ import annotations

import argparse
import tarfile
import zipfile
from pathlib import Path

PACKAGE = "resformer_hf"
#: Files beside the package that the sdist must carry (LICENSE through setup.cfg's `license_files`, the rest by default
#: or through MANIFEST.in).
SDIST_TOP_LEVEL = {"LICENSE", "README.md", "CHANGELOG.md", "CITATION.cff", "setup.cfg", "pyproject.toml", "PKG-INFO",
                   "MANIFEST.in"}


def one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"{folder} should hold one {pattern}, holds {[path.name for path in found]}"
    return found[0]


def wheel_files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist() if not name.endswith("/")}


def sdist_files(sdist: Path) -> dict[str, bytes]:
    """The sdist's files, named without its top folder (`resformer_hf-0.1.0/`)."""
    with tarfile.open(sdist) as archive:
        return {member.name.split("/", 1)[1]: archive.extractfile(member).read()
                for member in archive.getmembers() if member.isfile()}


def package_files(source: Path) -> set[str]:
    """Every file of the package in the source tree (bytecode caches aside)."""
    return {path.relative_to(source).as_posix() for path in (source / PACKAGE).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts}


def check(source: Path, from_tree: Path, from_sdist: Path) -> str:
    wheel, rebuilt = one(from_tree, "*.whl"), one(from_sdist, "*.whl")
    assert wheel.name == rebuilt.name, (wheel.name, rebuilt.name)
    files, rebuilt_files = wheel_files(wheel), wheel_files(rebuilt)
    differ = sorted(name for name in files.keys() | rebuilt_files.keys() if files.get(name) != rebuilt_files.get(name))
    assert not differ, f"the wheel built from the sdist differs from the one built from the tree in {differ}"

    dist_info = next(name.split("/")[0] for name in files if name.split("/")[0].endswith(".dist-info"))
    shipped = {name for name in files if not name.startswith(f"{dist_info}/")}
    expected = package_files(source)
    assert shipped == expected, (f"the wheel lacks {sorted(expected - shipped)}; "
                                 f"it holds files the package does not have: {sorted(shipped - expected)}")
    licence = (source / "LICENSE").read_bytes()
    assert files.get(f"{dist_info}/licenses/LICENSE") == licence, f"{wheel.name}: no LICENSE (or another one)"
    metadata = files[f"{dist_info}/METADATA"].decode("utf-8").split("\n\n", 1)[0].splitlines()
    assert {"License-Expression: Apache-2.0", "License-File: LICENSE"} <= set(metadata), metadata

    sdist, other_sdist = one(from_tree, "*.tar.gz"), one(from_sdist, "*.tar.gz")
    carried = sdist_files(sdist)
    assert carried.keys() == sdist_files(other_sdist).keys(), "the two sdists hold different files"
    assert carried.get("LICENSE") == licence, f"{sdist.name}: no LICENSE (or another one)"
    missing = (SDIST_TOP_LEVEL | expected) - carried.keys()
    assert not missing, f"{sdist.name} lacks {sorted(missing)}"
    assert not [name for name in carried if name.startswith("tests/")], f"{sdist.name} carries tests"
    return (f"{wheel.name}: {len(files)} files, the same from the tree and from the sdist, LICENSE in {dist_info}; "
            f"{sdist.name}: {len(carried)} files, LICENSE, CHANGELOG.md, CITATION.cff")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the source tree both builds came from")
    parser.add_argument("from_tree", type=Path, help="sdist and wheel built straight from the tree")
    parser.add_argument("from_sdist", type=Path, help="`python -m build`'s dist/: the sdist and a wheel built from it")
    args = parser.parse_args()
    print(check(args.source, args.from_tree, args.from_sdist))


if __name__ == "__main__":
    main()
