"""The documentation's generated result blocks (README.md, docs/*.md: `<!-- name:begin -->` ... `<!-- name:end -->`,
through `benchmarks/common.py:rewrite_readme_block`) say what the committed results files say.

Each block is rebuilt here from the markdown tables of its results file, as the block's own text describes it (the
worst of the sequence lengths or batch sizes per size, SVFormer's rows), and compared cell by cell at the block's
precision; the command a block quotes is the one its results file records. A results file regenerated without the
README (or a README edited by hand) fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def readme_block(name: str) -> str:
    """The block's text, from the one page (README.md or docs/*.md) that holds it."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    texts = [text for text in (page.read_text(encoding="utf-8") for page in pages) if begin in text]
    assert len(texts) == 1, (name, len(texts))
    (text,) = texts
    assert text.count(begin) == 1 and text.count(end) == 1, name
    return text.split(begin)[1].split(end)[0]


def tables(text: str) -> dict[str, list[dict[str, str]]]:
    """Every markdown table in `text` as rows of {column: cell}, keyed by the last `## ` heading above it."""
    found: dict[str, list[dict[str, str]]] = {}
    heading, header = "", None
    for line in text.splitlines():
        if line.startswith("## "):
            heading, header = line[3:].strip(), None
        elif line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if header is None:  # a repeated column name gets " #2", " #3", ...
                header = [name if cells[:i].count(name) == 0 else f"{name} #{cells[:i].count(name) + 1}"
                          for i, name in enumerate(cells)]
                found.setdefault(heading, [])
            elif not set("".join(cells)) <= set("-: "):
                found[heading].append(dict(zip(header, cells)))
        else:
            header = None
    return found


def number(cell: str) -> float:
    """The leading number of a cell such as `**1.023** (1.007–1.065)` or `+21, 1.0068`."""
    return float(re.match(r"[*\s]*([+-]?\d+(?:\.\d+)?)", cell).group(1))


def decimals(cell: str) -> int:
    match = re.match(r"[*\s]*[+-]?\d+(?:\.(\d+))?", cell)
    return len(match.group(1) or "")


def assert_cell(readme_cell: str, expected: float, where: str) -> None:
    places = decimals(readme_cell)
    assert round(number(readme_cell), places) == round(expected, places), (where, readme_cell, expected)


def quoted_command(text: str) -> str:
    return re.search(r"`(python -m benchmarks\.\w+\.bench_\w+[^`]*)`", text).group(1)


def by_variant(rows: list[dict[str, str]]) -> dict[str, dict[str, str]]:
    return {row["variant"]: row for row in rows}


def test_the_cost_block_is_the_worst_of_cost_md_per_size():
    block, results = readme_block("cost"), (RESULTS / "cost.md").read_text(encoding="utf-8")
    assert quoted_command(block) == quoted_command(results)
    (readme_rows,) = tables(block).values()
    sections = tables(results)
    columns = {"step": "train step time", "prefill": "prefill time", "decode": "eager decode time",
               "memory": "training memory"}
    checked = 0
    for row in readme_rows:
        for column, cell in row.items():
            match = re.fullmatch(r"(step|prefill|decode|memory) (\d+)×(\d+)", column)
            if match:
                kind, hidden, layers = match.groups()
                per_length = [by_variant(rows)[row["variant"]][columns[kind]] for heading, rows in sections.items()
                              if heading.startswith(f"hidden {hidden}, {layers} layers, sequence")]
                assert len(per_length) >= 1, column
                assert_cell(cell, max(number(value) for value in per_length), (row["variant"], column))
                checked += 1
            elif column.startswith("compiled "):
                (compiled,) = [rows for heading, rows in sections.items() if heading.startswith("torch.compile")]
                source = {"compiled step": "compiled train step", "compiled decode": "compiled decode step"}[column]
                assert_cell(cell, number(by_variant(compiled)[row["variant"]][source]), (row["variant"], column))
                checked += 1
    assert checked == len(readme_rows) * 14, checked


def test_the_decode_block_is_the_worst_of_decode_md_per_size():
    block, results = readme_block("decode"), (RESULTS / "decode.md").read_text(encoding="utf-8")
    assert quoted_command(block) == quoted_command(results)
    (readme_rows,) = tables(block).values()
    sections = tables(results)
    sources = {"eager decode": "eager decode", "compiled decode": "compiled decode", "generate": "generate"}
    checked = 0
    for row in readme_rows:
        for column, cell in row.items():
            match = re.fullmatch(r"(eager decode|compiled decode|generate|ops) (\d+)×(\d+)", column)
            if not match:
                continue
            kind, hidden, layers = match.groups()
            batches = {heading: by_variant(rows)[row["variant"]] for heading, rows in sections.items()
                       if heading.startswith(f"hidden {hidden}, {layers} layers, batch")}
            if kind == "ops":  # exact, counted at batch 1
                assert cell == batches[f"hidden {hidden}, {layers} layers, batch 1"]["ops per decode step"], row
            else:
                assert_cell(cell, max(number(values[sources[kind]]) for values in batches.values()),
                            (row["variant"], column))
            checked += 1
    assert checked == len(readme_rows) * 4, checked


def test_the_svformer_cache_block_is_svformer_md():
    block, results = readme_block("svformer-cache"), (RESULTS / "svformer_cache.md").read_text(encoding="utf-8")
    assert quoted_command(block) == quoted_command(results)
    (readme_rows,) = tables(block).values()
    (result_rows,) = tables(results).values()
    svformer = {row["context"]: row for row in result_rows if row["model"] == "svformer"}
    assert [row["context"] for row in readme_rows] == list(svformer)
    sources = ["cache / Llama", "peak / Llama", "/ Llama", "/ Llama #2"]  # the two throughput ratios, in order
    for row in readme_rows:
        readme_cells = list(row.values())[1:]
        assert len(readme_cells) == len(sources), row
        for readme_cell, source in zip(readme_cells, sources):
            assert_cell(readme_cell, number(svformer[row["context"]][source]), (row["context"], source))
        assert number(readme_cells[0]) == 0.5625  # (L + 1) / (2L) at L = 8, exact


@pytest.mark.parametrize("name", ["cost", "decode", "svformer-cache"])
def test_every_generated_block_names_a_results_file_that_exists(name):
    links = re.findall(r"benchmarks/results/[\w.*]+", readme_block(name))
    assert links and all(list(RESULTS.parent.glob(link.removeprefix("benchmarks/"))) for link in links), links


def test_each_results_row_is_a_headline_with_a_number_and_a_link():
    """README's results table stays scannable (issue 68: a cell had over 100 words): each row's headline is at most
    two sentences and 40 words and holds a number, its study cell at most 10 words, and it links the page with the
    detail."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    table = text.split("\n## Results\n")[1].split("\n## ")[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("|")][2:]
    assert len(rows) >= 10, rows
    for study, headline, details in rows:
        sentences = len(re.findall(r"[.!?](?=\s|$)", headline))
        assert 1 <= sentences <= 2 and len(headline.split()) <= 40, (study, sentences, len(headline.split()))
        assert re.search(r"\d", headline) and len(study.split()) <= 10, study
        assert re.search(r"\[[^\]]+\]\([^)]+\)", details), study
