"""Writes the documents of the lm-eval tasks in this folder from the bundled sample (`resformer_hf/data/sample_en.txt`)
by `python tests/lm_eval_tasks/make_docs.py`. Deterministic; the written files are committed, so the tasks need no
network and no generation step. 24 sentences of at least 12 words, each the source of one generation document (the
first 8 words, to be continued with the next 4) and one multiple-choice document (the first 6 words; the true next 3
words, and the next 3 words of two other sentences)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from resformer_hf.text import sample_text

HERE = Path(__file__).resolve().parent
DOCS = 24


def sentences() -> list[list[str]]:
    text = " ".join(sample_text()[20_000:120_000].split())
    chosen = []
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        words = sentence.replace('"', "").replace("_", "").split()
        if len(words) >= 12 and all(word.isascii() for word in words):
            chosen.append(words)
    return chosen[::max(1, len(chosen) // DOCS)][:DOCS]


def main() -> None:
    chosen = sentences()
    assert len(chosen) == DOCS, len(chosen)
    with open(HERE / "toy_generation.jsonl", "w") as out:
        for words in chosen:
            out.write(json.dumps({"prompt": " ".join(words[:8]), "target": " " + " ".join(words[8:12])}) + "\n")
    with open(HERE / "toy_choice.jsonl", "w") as out:
        for index, words in enumerate(chosen):
            others = [chosen[(index + shift) % DOCS] for shift in (7, 13)]
            choices = [" " + " ".join(source[6:9]) for source in [words, *others]]
            out.write(json.dumps({"text": " ".join(words[:6]), "choices": choices, "gold": 0}) + "\n")


if __name__ == "__main__":
    main()
