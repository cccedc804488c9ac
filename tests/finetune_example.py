"""The Trainer example: fine-tune a tiny ResFormer on English text with the stock `transformers.Trainer`.

Tokenised text grouped into fixed-size blocks (the `run_clm` recipe) in a `datasets.Dataset`, trained unchanged by
`Trainer`. `tests/test_trainer.py` and `tests/test_peft.py` import the pieces; `tests/test_accelerate.py` runs this
file as a script, single-process and data-parallel, and compares the per-step losses:

    accelerate launch --num_processes 2 --cpu tests/finetune_example.py --output-dir OUT --max-steps 6

The script writes `OUT/losses.json` (training loss of every step, averaged over processes) from rank 0.
Text: the shared Austen corpus when present, else a short built-in public-domain passage.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import datasets  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

import resformer_hf  # noqa: E402  (registers "resformer")

CORPUS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "corpus" / "austen.txt"
FALLBACK_TEXT = """\
It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.
However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth is
so well fixed in the minds of the surrounding families, that he is considered the rightful property of some one or
other of their daughters.
"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is let at last?"
Mr. Bennet replied that he had not.
"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."
Mr. Bennet made no answer.
"Do you not want to know who has taken it?" cried his wife impatiently.
"You want to tell me, and I have no objection to hearing it."
This was invitation enough.
"""
VOCAB_SIZE = 256
BLOCK_SIZE = 32
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]


def english_text(max_chars: int = 40_000) -> str:
    """A fixed English sample: the start of the shared Austen corpus, or the built-in passage repeated."""
    if CORPUS.is_file():
        return CORPUS.read_text(encoding="utf-8")[:max_chars]
    return (FALLBACK_TEXT * (max_chars // len(FALLBACK_TEXT) + 1))[:max_chars]


def build_tokenizer(text: str, vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `text`: small enough for a tiny model, a real subword tokenizer all the same."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tokenizer.train_from_iterator(text.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def block_dataset(tokenizer: PreTrainedTokenizerFast, text: str, block_size: int = BLOCK_SIZE) -> datasets.Dataset:
    """Tokenise the lines, concatenate them and cut fixed-size blocks whose labels are their inputs (`run_clm`)."""
    lines = datasets.Dataset.from_dict({"text": [line for line in text.splitlines() if line.strip()]})
    tokenized = lines.map(lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=["text"])

    def group_texts(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        ids = [token for line in batch["input_ids"] for token in line]
        usable = len(ids) // block_size * block_size
        blocks = [ids[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks], "labels": blocks}

    return tokenized.map(group_texts, batched=True, batch_size=1000, remove_columns=tokenized.column_names)


def tiny_model(vocab_size: int = VOCAB_SIZE, seed: int = 0, **overrides) -> resformer_hf.ResFormerForCausalLM:
    """A 3-layer GQA ResFormer (learnable_plus unless overridden), initialised from `seed`."""
    config = resformer_hf.ResFormerConfig(
        **{
            "vocab_size": vocab_size,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2 * BLOCK_SIZE,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            **overrides,
        }
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def training_arguments(output_dir: str | Path, **overrides) -> TrainingArguments:
    """Deterministic CPU arguments; a constant learning rate so a short run is a prefix of a longer one."""
    return TrainingArguments(
        **{
            "output_dir": str(output_dir),
            "per_device_train_batch_size": 4,
            "learning_rate": 3e-3,
            "lr_scheduler_type": "constant",
            "max_steps": 12,
            "logging_steps": 1,
            "save_strategy": "no",
            "report_to": "none",
            "use_cpu": True,
            "seed": 0,
            "disable_tqdm": True,
            "dataloader_num_workers": 0,
            **overrides,
        }
    )


def step_losses(trainer: Trainer) -> list[float]:
    """The training loss of every logged step, in order."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    args = parser.parse_args(argv)

    text = english_text()
    tokenizer = build_tokenizer(text)
    trainer = Trainer(
        model=tiny_model(len(tokenizer)),
        args=training_arguments(args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size),
        train_dataset=block_dataset(tokenizer, text),
        data_collator=default_data_collator,
    )
    trainer.train()
    if trainer.is_world_process_zero():
        result = {
            "world_size": trainer.args.world_size,
            "losses": step_losses(trainer),
            "lambdas": trainer.model.value_residual_lambdas().tolist(),
        }
        Path(args.output_dir, "losses.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
