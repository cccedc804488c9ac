"""The quickstart's steps as plain functions: text, tokenizer, a small Llama, blocks, Trainer fine-tuning, a sample.

Each takes typed arguments (no argparse), so a notebook can run the same steps; problems a user can fix are
`QuickstartError`s with a one-line message. Text preparation is `resformer_hf.text`, the package's one pipeline.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserInputError, first_line
from ..text import SAMPLE_DESCRIPTION, block_dataset, sample_text

#: Size of the Llama built when no model is given: small enough to train a visible amount in a minute on 2 cores.
SMALL_LLAMA = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2)


class QuickstartError(UserInputError):
    """A problem the user can fix; printed as one line."""


@dataclass
class TrainingText:
    texts: list[str]
    description: str  # for the printout and the card
    hub_datasets: list[str]  # Hub dataset ids for the card's metadata


def _dataset_texts(name: str, config_name: str | None, column: str) -> TrainingText:
    try:
        import datasets
    except ImportError:
        raise QuickstartError("--dataset needs the `datasets` package: pip install datasets") from None
    try:
        table = datasets.load_dataset(name, config_name, split="train")
    except Exception as error:  # offline, unknown name, bad config: all "cannot load" to the user
        raise QuickstartError(
            f"cannot load dataset {name!r} ({type(error).__name__}: {first_line(error)}); check the name and your "
            "connection (HF_HUB_OFFLINE), or pass text files with --data"
        ) from error
    if column not in table.column_names:
        raise QuickstartError(
            f"dataset {name!r} has no column {column!r}; its columns are {', '.join(table.column_names)} "
            "(use --text-column)"
        )
    texts = [text for text in table[column] if isinstance(text, str) and text.strip()]
    return TrainingText(texts, f"dataset {name}", [name] if not os.path.exists(name) else [])


def _file_texts(files: Sequence[str | os.PathLike]) -> TrainingText:
    texts = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise QuickstartError(f"--data file {name} does not exist or is not a file")
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise QuickstartError(f"--data file {name} is not UTF-8 text") from None
        except OSError as error:
            raise QuickstartError(f"--data file {name} cannot be read ({error.strerror or error})") from None
    return TrainingText(texts, "text files " + ", ".join(Path(name).name for name in files), [])


def load_texts(
    *,
    data_files: Sequence[str | os.PathLike] | None = None,
    dataset: str | None = None,
    dataset_config: str | None = None,
    text_column: str = "text",
) -> TrainingText:
    """The training text: a `datasets` dataset, text files, or (neither given) the bundled English sample."""
    if dataset:
        found = _dataset_texts(dataset, dataset_config, text_column)
    elif data_files:
        found = _file_texts(data_files)
    else:
        return TrainingText([sample_text()], SAMPLE_DESCRIPTION, [])
    if not any(text.strip() for text in found.texts):
        raise QuickstartError(f"the {found.description} hold no text; give files or a dataset with text in them")
    return found


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as error:
        raise QuickstartError(
            f"cannot load a tokenizer from {name!r} ({type(error).__name__}: {first_line(error)}); pass a tokenizer "
            "directory with --tokenizer"
        ) from error


def check_model_reachable(name: str) -> None:
    """Fail before any work when a model is neither a checkpoint directory nor fetchable from the Hub."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise QuickstartError(f"--model {name} has no config.json; pass a transformers checkpoint directory")
        return
    if path.exists():
        raise QuickstartError(f"--model {name} is a file; pass the checkpoint directory that holds config.json")
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(name, "config.json")
    except Exception as error:  # not a repo id, offline, unknown, gated
        raise QuickstartError(
            f"--model {name} is not a local directory and could not be fetched from the Hub ({type(error).__name__}); "
            "check the path or repo id and your connection (HF_HUB_OFFLINE)"
        ) from error


def build_small_llama(tokenizer, directory: Path, block_size: int, seed: int) -> Path:
    """A randomly initialised Llama sized for the demo, saved (safetensors) with its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max(256, block_size),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **SMALL_LLAMA,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def group_into_blocks(texts: list[str], tokenizer, block_size: int):
    """The text pipeline's blocks (`resformer_hf.text.block_dataset`), refusing data too short to train on."""
    blocks = block_dataset(tokenizer, texts, block_size)
    if len(blocks) < 4:
        raise QuickstartError(
            f"the data has fewer than 4 blocks of {block_size} tokens; give more text or a smaller --block-size"
        )
    return blocks


def check_model_fits(config: dict, tokenizer, block_size: int) -> None:
    """The tokenizer's ids and the block length must fit the model (its `config.json` as a dict)."""
    if len(tokenizer) > config["vocab_size"]:
        raise QuickstartError(
            f"the tokenizer has {len(tokenizer)} tokens but the model only {config['vocab_size']}; pass the model's "
            "own tokenizer with --tokenizer"
        )
    if block_size > config.get("max_position_embeddings", block_size):
        raise QuickstartError(
            f"--block-size {block_size} exceeds the model's max_position_embeddings "
            f"({config['max_position_embeddings']}); pass a smaller --block-size"
        )


@dataclass
class TrainingResult:
    model: object
    eval_loss_before: float
    eval_loss_after: float
    first_train_loss: float
    last_train_loss: float
    train_blocks: int
    eval_blocks: int
    seconds: float


def fine_tune(
    model_dir: Path, blocks, *, steps: int, batch_size: int, learning_rate: float, seed: int, work_dir: Path
) -> TrainingResult:
    """The stock Trainer on the converted checkpoint; 5 % of the blocks (at least one) are held out for eval."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    split = blocks.train_test_split(test_size=max(1, len(blocks) // 20), seed=seed, shuffle=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    training_args = TrainingArguments(
        output_dir=str(work_dir / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 10),
        weight_decay=0.01,
        logging_steps=max(1, steps // 6),
        save_strategy="no",
        report_to=[],
        seed=seed,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=split["train"], eval_dataset=split["test"])
    started = time.perf_counter()
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return TrainingResult(
        model=trainer.model,
        eval_loss_before=before,
        eval_loss_after=after,
        first_train_loss=losses[0] if losses else float("nan"),
        last_train_loss=losses[-1] if losses else float("nan"),
        train_blocks=len(split["train"]),
        eval_blocks=len(split["test"]),
        seconds=time.perf_counter() - started,
    )


#: How the quickstart's model samples: its sample, and the generation_config.json of the folder it writes.
SAMPLING = {"do_sample": True, "top_k": 40, "temperature": 0.8, "top_p": 1.0}


def generate_sample(model, tokenizer, prompt: str, max_new_tokens: int, seed: int) -> str:
    import torch

    torch.manual_seed(seed)
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    pad = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    with torch.no_grad():
        output = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                                max_new_tokens=max_new_tokens, **SAMPLING, pad_token_id=pad)
    return tokenizer.decode(output[0], skip_special_tokens=True)


__all__ = [
    "SAMPLING",
    "SMALL_LLAMA",
    "QuickstartError",
    "TrainingResult",
    "TrainingText",
    "build_small_llama",
    "check_model_fits",
    "check_model_reachable",
    "fine_tune",
    "generate_sample",
    "group_into_blocks",
    "load_texts",
    "load_tokenizer",
]
