"""The release files agree with the package: one version (`resformer_hf.__version__`), one licence.

CHANGELOG.md's top entry and CITATION.cff's `version` repeat `__version__` (setup.cfg reads it), so a version bump
that misses one of them fails here. CITATION.cff is checked for the keys the Citation File Format 1.2.0 requires (CI
validates it against the full schema with cffconvert, .ci/wheel), LICENSE for being the Apache-2.0 text verbatim.
"""

from __future__ import annotations

import configparser
import hashlib
import re
from pathlib import Path

import yaml

import resformer_hf

REPO = Path(__file__).resolve().parents[1]
#: sha256 of the Apache License 2.0 as the Apache Software Foundation publishes it (LICENSE-2.0.txt, 11,358 bytes).
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
_ENTRY = re.compile(r"^## \[(?P<version>[^\]]+)\] - (?P<date>\d{4}-\d{2}-\d{2}|Unreleased)$")


def _setup_metadata() -> configparser.SectionProxy:
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    return setup["metadata"]


def test_changelog_top_entry_is_the_package_version():
    headings = [line for line in (REPO / "CHANGELOG.md").read_text(encoding="utf-8").splitlines()
                if line.startswith("## ")]
    assert headings, "CHANGELOG.md has no '## [version] - date' entry"
    top = _ENTRY.match(headings[0])
    assert top, f"CHANGELOG.md's top entry is not '## [X.Y.Z] - YYYY-MM-DD' (or '- Unreleased'): {headings[0]!r}"
    assert top["version"] == resformer_hf.__version__, (
        f"CHANGELOG.md's top entry is {top['version']}, the package is {resformer_hf.__version__}: add an entry"
    )
    versions = [match["version"] for match in map(_ENTRY.match, headings) if match]
    assert len(versions) == len(set(versions)), f"a version appears twice in CHANGELOG.md: {versions}"


def test_citation_is_cff_1_2_with_the_package_version_and_the_paper():
    citation = yaml.safe_load((REPO / "CITATION.cff").read_text(encoding="utf-8"))
    assert isinstance(citation, dict), "CITATION.cff is not a YAML mapping"
    missing = {"cff-version", "message", "title", "authors"} - citation.keys()
    assert not missing, f"CITATION.cff lacks the required keys {sorted(missing)}"
    assert citation["cff-version"] == "1.2.0"
    assert citation["version"] == resformer_hf.__version__, (
        f"CITATION.cff's version is {citation['version']!r}, the package is {resformer_hf.__version__}"
    )
    assert citation["license"] == _setup_metadata()["license_expression"]
    assert citation["authors"] and all(isinstance(author, dict) for author in citation["authors"])
    paper = citation["preferred-citation"]
    assert {"type", "title", "authors"} <= paper.keys(), sorted(paper)
    assert paper["title"] == "Value Residual Learning" and paper["year"] == 2025
    assert paper["authors"][0]["family-names"] == "Zhou"
    assert "2410.17897" in paper["url"]


def test_license_is_the_apache_2_0_text_and_packaged():
    assert hashlib.sha256((REPO / "LICENSE").read_bytes()).hexdigest() == APACHE_2_0_SHA256, (
        "LICENSE is not the Apache License 2.0 text verbatim"
    )
    metadata = _setup_metadata()
    assert metadata["license_expression"] == "Apache-2.0"
    assert metadata["license_files"].split() == ["LICENSE"]
