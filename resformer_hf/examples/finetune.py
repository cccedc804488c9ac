"""Fine-tune a small ResFormer with the stock `transformers.Trainer`: nothing ResFormer-specific in the training code.

Text from the package's bundled public-domain sample goes through the one text pipeline (`resformer_hf.text`: a
byte-level BPE and fixed-size blocks whose labels are their inputs) into a `datasets.Dataset` that `Trainer` trains
unchanged. Run it on one process or data-parallel:

    python -m resformer_hf.examples.finetune --output-dir out
    accelerate launch --multi_gpu --num_processes 2 -m resformer_hf.examples.finetune --output-dir out --batch-size 2

Rank 0 writes `OUT/losses.json`: the training loss of every step (averaged over processes), the world size and the
learned λ per layer.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

import resformer_hf
from resformer_hf.text import block_dataset, sample_text, train_tokenizer

VOCAB_SIZE = 320
BLOCK_SIZE = 32
TEXT_CHARS = 40_000


def build_model(vocab_size: int = VOCAB_SIZE, seed: int = 0, **overrides) -> resformer_hf.ResFormerForCausalLM:
    """A 3-layer GQA ResFormer (`learnable_plus` unless overridden), initialised from `seed`."""
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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    args = parser.parse_args(argv)

    text = sample_text(TEXT_CHARS)
    tokenizer = train_tokenizer([text], VOCAB_SIZE)
    trainer = Trainer(
        model=build_model(len(tokenizer)),
        args=training_arguments(
            args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size
        ),
        train_dataset=block_dataset(tokenizer, [text], BLOCK_SIZE),
        data_collator=default_data_collator,
    )
    trainer.train()
    if trainer.is_world_process_zero():
        result = {
            "world_size": trainer.args.world_size,
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "lambdas": trainer.model.value_residual_lambdas().tolist(),
        }
        Path(args.output_dir, "losses.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
