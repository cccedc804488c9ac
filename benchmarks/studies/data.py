"""A study's data: the corpus, its tokenizer (trained on the training split only), the packed training and validation
blocks, and the seeded batch order every model of a seed sees. Tokenizer and token streams are cached on disk, so a
resumed study skips them."""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from resformer_hf.text import pack_blocks, split_documents, token_stream, train_tokenizer


def read_corpus(corpus_dir: Path) -> list[str]:
    """Every `*.txt` document of the corpus folder, in name order."""
    files = sorted(Path(corpus_dir).glob("*.txt"))
    if not files:
        raise SystemExit(f"no *.txt files in {corpus_dir}; pass --corpus-dir pointing at plain-text files.")
    return [path.read_text(encoding="utf-8") for path in files]


@dataclass
class Data:
    """A tokenizer and the packed [N, seq_len] training and validation blocks every model of a study sees."""

    tokenizer: object
    train: torch.Tensor
    val: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)


def cached_tokenizer(train_texts: list[str], vocab_size: int, cache: Path | None):
    """The text pipeline's byte-level BPE, trained on the training split only; cached so resumed runs skip it."""
    from transformers import AutoTokenizer

    if cache is not None and (cache / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cache)
    tokenizer = train_tokenizer(train_texts, vocab_size)
    if cache is not None:
        tokenizer.save_pretrained(cache)
    return tokenizer


def _cached_streams(tokenizer, train_texts: list[str], val_texts: list[str], cache: Path | None) -> dict:
    """Both splits as token streams, saved beside the cached tokenizer (tokenizing a corpus takes a CPU-minute)."""
    path = cache / "streams.pt" if cache is not None else None
    if path is not None and path.is_file():
        return torch.load(path)
    streams = {"train": token_stream(tokenizer, train_texts), "val": token_stream(tokenizer, val_texts)}
    if path is not None:
        torch.save(streams, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    return streams


def prepare_data(texts: Sequence[str], *, vocab_size: int, val_fraction: float, seq_len: int, val_tokens: int,
                 cache: bool = True) -> Data:
    """Split every document (held-out tail), train the tokenizer on the training split, pack both splits in blocks.

    Validation keeps `val_tokens` worth of evenly spaced blocks of the held-out tails (all of them if fewer), so an
    evaluation is cheap and always scores the same windows.
    """
    train_texts, val_texts = split_documents(texts, val_fraction)
    digest = hashlib.sha1("\0".join([str(vocab_size), *train_texts, "\1", *val_texts]).encode()).hexdigest()
    folder = Path(tempfile.gettempdir()) / f"resformer-bench-data-{digest[:12]}" if cache else None
    tokenizer = cached_tokenizer(train_texts, vocab_size, folder)
    streams = _cached_streams(tokenizer, train_texts, val_texts, folder)
    train, val = pack_blocks(streams["train"], seq_len), pack_blocks(streams["val"], seq_len)
    if len(train) == 0 or len(val) == 0:
        raise SystemExit(f"the text is too short for --seq-len {seq_len}: no complete training or validation block.")
    if val_tokens and len(val) * seq_len > val_tokens:
        keep = max(1, val_tokens // seq_len)
        val = val[torch.linspace(0, len(val) - 1, keep).round().long()]
    return Data(tokenizer, train, val)


def batch_order(num_sequences: int, batch_size: int, steps: int, seed: int) -> torch.Tensor:
    """[steps, batch_size] sequence indices: a seeded shuffle per epoch, identical for every model given the seed."""
    generator = torch.Generator().manual_seed(seed)
    needed = steps * batch_size
    epochs = math.ceil(needed / num_sequences)
    order = torch.cat([torch.randperm(num_sequences, generator=generator) for _ in range(epochs)])
    return order[:needed].view(steps, batch_size)
