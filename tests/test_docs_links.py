"""Every relative link in README.md and docs/ leads somewhere: the file exists and, for `page.md#anchor`, the page
has a heading with that anchor (GitHub's rule: lower case, punctuation dropped, spaces to hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+)$", re.M)


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: `## Publishing to the Hub` -> `publishing-to-the-hub`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(heading) for heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8")))}


def relative_links(page: Path) -> list[str]:
    """Link targets outside code blocks that are neither absolute URLs nor e-mail addresses."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return [target for target in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif fragment and destination.suffix == ".md" and fragment not in anchors(destination):
            broken.append(f"{target}: {destination.name} has no heading #{fragment}")
    return broken


@pytest.mark.parametrize("page", DOCUMENTS, ids=lambda page: page.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    assert not broken_links(page), broken_links(page)


def test_readme_links_every_docs_page():
    """The README is the front door: a page it does not link is a page nobody finds."""
    linked = {(REPO / target.partition("#")[0]).resolve() for target in relative_links(REPO / "README.md")}
    assert not [page.name for page in DOCUMENTS[1:] if page.resolve() not in linked]


def test_the_checks_catch_a_broken_file_link_and_a_broken_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Serving with vLLM\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#serving-with-vllm) [gone](missing.md) [bad](other.md#serving) [self](#nope)\n"
                    "```python\n[not a link](nowhere.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file", "other.md#serving: other.md has no heading #serving",
                                  "#nope: page.md has no heading #nope"]
    assert anchor("## The paper's variants".lstrip("# ")) == "the-papers-variants"
    assert anchor("FSDP2 with torch's `fully_shard`") == "fsdp2-with-torchs-fully_shard"
