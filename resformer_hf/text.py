"""The one text pipeline: bundled sample, byte-level BPE tokenizer, token stream and fixed-size blocks.

The quickstart, the fine-tuning example, the benchmarks and the tests all train on text prepared here, so a tokenizer
or a block means the same thing everywhere (the `run_clm` recipe: documents joined with EOS, cut into equal blocks
whose labels are their inputs; the model shifts labels itself). Nothing here reads files beside the repository:
callers pass text explicitly, and the default text is the public-domain sample shipped in the package.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable, Sequence

import torch

#: The tokenizer's special tokens, in id order: 0 pads, 1 begins and 2 ends a document.
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)

SAMPLE_NAME = "sample_en.txt"
SAMPLE_DESCRIPTION = (
    "bundled public-domain sample (Austen, Pride and Prejudice ch. 1-20; Shakespeare, Hamlet acts I-III)"
)


def sample_text(max_chars: int | None = None) -> str:
    """The bundled English sample (313 KB; credits in `resformer_hf/data/README.md`), optionally its first chars."""
    text = importlib.resources.files(__package__).joinpath("data", SAMPLE_NAME).read_text(encoding="utf-8")
    return text if max_chars is None else text[:max_chars]


def split_documents(texts: Sequence[str], validation_fraction: float) -> tuple[list[str], list[str]]:
    """(training, validation) texts: the last `validation_fraction` of every document, cut at a line break, is held
    out, so validation text is never seen in training and every document is represented in both."""
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction={validation_fraction} must be between 0 and 1.")
    train, validation = [], []
    for text in texts:
        cut = text.rfind("\n", 0, int(len(text) * (1 - validation_fraction))) + 1
        train.append(text[:cut])
        validation.append(text[cut:])
    return train, validation


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE with `SPECIAL_TOKENS`, trained on `texts`, as a `PreTrainedTokenizerFast`.

    Byte-level with the full 256-byte alphabet, so any UTF-8 text encodes without unknown tokens; it saves as
    `tokenizer.json` and loads back with `AutoTokenizer`. Training is deterministic for the same texts.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(SPECIAL_TOKENS) + len(alphabet)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE; use at least {minimum}.")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet, show_progress=False
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN
    )


def token_stream(tokenizer, texts: Iterable[str]) -> torch.Tensor:
    """Every text tokenized without special tokens and followed by EOS, as one int64 stream."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.extend(eos)
    return torch.tensor(ids, dtype=torch.long)


def pack_blocks(stream: torch.Tensor, block_size: int) -> torch.Tensor:
    """Non-overlapping [N, block_size] blocks of a token stream; the incomplete tail is dropped."""
    if block_size < 2:
        raise ValueError(f"block_size={block_size} must be at least 2 (a block predicts its next tokens).")
    count = stream.numel() // block_size
    return stream[: count * block_size].view(count, block_size)


def block_dataset(tokenizer, texts: Iterable[str], block_size: int):
    """`pack_blocks(token_stream(...))` as a `datasets.Dataset` with `input_ids` and `labels`, ready for `Trainer`."""
    from datasets import Dataset

    blocks = pack_blocks(token_stream(tokenizer, texts), block_size).tolist()
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SAMPLE_DESCRIPTION",
    "SPECIAL_TOKENS",
    "block_dataset",
    "pack_blocks",
    "sample_text",
    "split_documents",
    "token_stream",
    "train_tokenizer",
]
