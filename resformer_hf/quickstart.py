"""`resformer-quickstart`: the whole workflow in one offline command, on a small model, in about a minute on a CPU.

Builds (or takes `--model`) a Llama checkpoint, converts it with `convert_llama_checkpoint`, fine-tunes it with the
stock `transformers.Trainer` on a bundled public-domain English sample (or `--data` files / a `--dataset`), generates
a sample, and writes a Hub-ready folder (weights, remote code, tokenizer, model card); `--push-to-hub` uploads it.
User errors print one line and exit with status 2, never a traceback (`--debug` shows it).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .configuration_resformer import DEFAULT_VARIANT, convertible_variants, output_preserving_variants
from .text import SAMPLE_DESCRIPTION, sample_text, train_tokenizer

PROG = "resformer-quickstart"
#: Size of the Llama built when no `--model` is given: small enough to train a visible amount in a minute on 2 cores.
SMALL_LLAMA = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2)
VARIANTS = convertible_variants()
PRESERVING_VARIANTS = output_preserving_variants()


class QuickstartError(Exception):
    """A problem the user can fix; printed as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + error
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Convert a small Llama to ResFormer, fine-tune it with the transformers Trainer, generate a "
        "sample and write a Hub-ready folder with a model card. Runs offline on built-in defaults.",
    )
    source = parser.add_argument_group("model and data")
    source.add_argument("--model", help="Llama-layout checkpoint (directory or Hub id) to convert; default: build a "
                        "small random Llama (4 layers, hidden 128) with a tokenizer trained on the data")
    source.add_argument("--tokenizer", help="tokenizer directory or Hub id; default: the --model's own, else a BPE "
                        "trained on the data")
    data = source.add_mutually_exclusive_group()
    data.add_argument("--data", nargs="+", metavar="FILE", help="UTF-8 text files to train on (default: the bundled "
                      "English sample)")
    data.add_argument("--dataset", help="a `datasets` name (Hub or local script/folder) with a text column")
    source.add_argument("--dataset-config", help="configuration name of --dataset")
    source.add_argument("--text-column", default="text", help="column of --dataset holding the text (default: text)")
    method = parser.add_argument_group("conversion and training")
    method.add_argument("--variant", choices=VARIANTS, default=DEFAULT_VARIANT,
                        help=f"value-residual variant (default: {DEFAULT_VARIANT}, as ResFormerConfig)")
    method.add_argument("--init", choices=("preserve", "paper"), default=None,
                        help="λ initialisation of the conversion (default: preserve when converting a --model with a "
                        "learnable variant, so training starts from its outputs; else paper, the paper's values)")
    method.add_argument("--steps", type=_positive_int, default=100, help="training steps (default: 100)")
    method.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per step (default: 8)")
    method.add_argument("--block-size", type=_positive_int, default=128, help="tokens per sequence (default: 128)")
    method.add_argument("--learning-rate", type=_positive_float, default=2e-3,
                        help="peak learning rate (default: 2e-3)")
    method.add_argument("--vocab-size", type=_positive_int, default=2000,
                        help="size of the BPE trained when no tokenizer is available (default: 2000)")
    method.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    out = parser.add_argument_group("output")
    out.add_argument("--output", default="resformer-quickstart", help="Hub-ready output folder (default: "
                     "./resformer-quickstart)")
    out.add_argument("--overwrite", action="store_true", help="replace a non-empty --output folder")
    out.add_argument("--prompt", default="It is a truth universally acknowledged", help="prompt of the sample")
    out.add_argument("--max-new-tokens", type=_positive_int, default=40, help="length of the sample (default: 40)")
    out.add_argument("--push-to-hub", metavar="REPO", help="also upload the folder to this Hub repo (needs network "
                     "and a token: `hf auth login`)")
    out.add_argument("--private", action="store_true", help="create the --push-to-hub repo as private")
    out.add_argument("--debug", action="store_true", help="show full tracebacks")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a positive number")
    return value


# ---- steps ---------------------------------------------------------------------------------------------------------


def _announce(step: int, total: int, text: str) -> None:
    print(f"[{step}/{total}] {text}", flush=True)


def load_texts(args: argparse.Namespace) -> tuple[list[str], str, list[str]]:
    """(texts, description, Hub dataset ids for the card)."""
    if args.dataset:
        try:
            import datasets
        except ImportError:
            raise QuickstartError("--dataset needs the `datasets` package: pip install datasets") from None
        try:
            table = datasets.load_dataset(args.dataset, args.dataset_config, split="train")
        except Exception as error:  # offline, unknown name, bad config: all "cannot load" to the user
            raise QuickstartError(
                f"cannot load dataset {args.dataset!r} ({type(error).__name__}: {_first_line(error)}); check the "
                "name and your connection (HF_HUB_OFFLINE), or pass text files with --data"
            ) from error
        if args.text_column not in table.column_names:
            raise QuickstartError(
                f"dataset {args.dataset!r} has no column {args.text_column!r}; its columns are "
                f"{', '.join(table.column_names)} (use --text-column)"
            )
        texts = [text for text in table[args.text_column] if isinstance(text, str) and text.strip()]
        return texts, f"dataset {args.dataset}", [args.dataset] if not os.path.exists(args.dataset) else []
    if args.data:
        texts = []
        for name in args.data:
            path = Path(name)
            if not path.is_file():
                raise QuickstartError(f"--data file {name} does not exist or is not a file")
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except UnicodeDecodeError:
                raise QuickstartError(f"--data file {name} is not UTF-8 text") from None
        return texts, "text files " + ", ".join(Path(name).name for name in args.data), []
    return [sample_text()], SAMPLE_DESCRIPTION, []


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as error:
        raise QuickstartError(
            f"cannot load a tokenizer from {name!r} ({type(error).__name__}: {_first_line(error)}); pass a tokenizer "
            "directory with --tokenizer"
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
    from .text import block_dataset

    blocks = block_dataset(tokenizer, texts, block_size)
    if len(blocks) < 4:
        raise QuickstartError(
            f"the data has fewer than 4 blocks of {block_size} tokens; give more text or a smaller --block-size"
        )
    return blocks


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


def fine_tune(model_dir: Path, blocks, args: argparse.Namespace, work_dir: Path) -> TrainingResult:
    """The stock Trainer on the converted checkpoint; 5 % of the blocks (at least one) are held out for eval."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    split = blocks.train_test_split(test_size=max(1, len(blocks) // 20), seed=args.seed, shuffle=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    training_args = TrainingArguments(
        output_dir=str(work_dir / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 10),
        weight_decay=0.01,
        logging_steps=max(1, args.steps // 6),
        save_strategy="no",
        report_to=[],
        seed=args.seed,
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


def generate_sample(model, tokenizer, prompt: str, max_new_tokens: int, seed: int) -> str:
    import torch

    torch.manual_seed(seed)
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    with torch.no_grad():
        output = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                                max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                                pad_token_id=tokenizer.eos_token_id if tokenizer.pad_token_id is None
                                else tokenizer.pad_token_id)
    return tokenizer.decode(output[0], skip_special_tokens=True)


# ---- the command ---------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from .conversion import ConversionError, convert_llama_checkpoint
    from .hub import save_for_hub, upload_folder_to_hub

    init = args.init or ("preserve" if args.model and args.variant in PRESERVING_VARIANTS else "paper")
    output = Path(args.output).expanduser().absolute()
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not args.overwrite:
        raise QuickstartError(f"--output {output} exists and is not empty; pass --overwrite or choose another folder")
    total = 6 if args.push_to_hub else 5
    started = time.perf_counter()

    if args.model:
        _check_model_reachable(args.model)
    _announce(1, total, "Loading text and tokenizer")
    texts, data_description, hub_datasets = load_texts(args)
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    elif args.model:
        tokenizer = load_tokenizer(args.model)
    else:
        tokenizer = train_tokenizer(texts, args.vocab_size)
        print(f"    trained a byte-level BPE tokenizer with {len(tokenizer)} tokens on the data")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    blocks = group_into_blocks(texts, tokenizer, args.block_size)
    print(f"    {data_description}: {len(blocks)} blocks of {args.block_size} tokens")

    with tempfile.TemporaryDirectory(prefix="resformer-quickstart-") as scratch:
        work = Path(scratch)
        if args.model:
            source, base_model = args.model, args.model
            _announce(2, total, f"Converting {args.model} to ResFormer ({args.variant}, init={init})")
        else:
            source, base_model = build_small_llama(tokenizer, work / "llama", args.block_size, args.seed), None
            _announce(2, total, f"Built a small random Llama; converting it to ResFormer ({args.variant}, init={init})")
        try:
            report = convert_llama_checkpoint(source, work / "resformer", variant=args.variant, init=init,
                                              verify=True, progress=True)
        except ConversionError as error:
            raise QuickstartError(str(error)) from error
        if report.max_abs_logit_diff is not None:
            expected = "exact, as init=preserve promises" if init == "preserve" else f"init={init} changes outputs"
            print(f"    max |Δ logits| converted vs source: {report.max_abs_logit_diff:.3g} ({expected})")
        model_config = json.loads((Path(report.dst) / "config.json").read_text())
        if len(tokenizer) > model_config["vocab_size"]:
            raise QuickstartError(
                f"the tokenizer has {len(tokenizer)} tokens but the model only {model_config['vocab_size']}; pass the "
                "model's own tokenizer with --tokenizer"
            )
        if args.block_size > model_config.get("max_position_embeddings", args.block_size):
            raise QuickstartError(
                f"--block-size {args.block_size} exceeds the model's max_position_embeddings "
                f"({model_config['max_position_embeddings']}); pass a smaller --block-size"
            )

        _announce(3, total, f"Fine-tuning with transformers.Trainer for {args.steps} steps")
        result = fine_tune(report.dst, blocks, args, work)
        print(f"    held-out loss {result.eval_loss_before:.3f} -> {result.eval_loss_after:.3f} "
              f"({result.seconds:.0f} s)")

    _announce(4, total, "Generating a sample")
    sample = generate_sample(result.model, tokenizer, args.prompt, args.max_new_tokens, args.seed)
    print(f"    {sample!r}")

    _announce(5, total, f"Writing the Hub-ready folder {output}")
    if output.exists() and args.overwrite:
        shutil.rmtree(output) if output.is_dir() else output.unlink()
    lambdas = result.model.value_residual_lambdas()
    training = {
        "data": data_description,
        "steps": args.steps,
        "batch size × block size": f"{args.batch_size} × {args.block_size} tokens",
        "tokens seen": args.steps * args.batch_size * args.block_size,
        "peak learning rate (cosine, AdamW, weight decay 0.01)": args.learning_rate,
        "train loss, first → last logged": f"{result.first_train_loss:.3f} → {result.last_train_loss:.3f}",
        "held-out loss before → after": f"{result.eval_loss_before:.3f} → {result.eval_loss_after:.3f}",
        "held-out blocks": result.eval_blocks,
        "trained with": "transformers.Trainer via `resformer-quickstart`",
    }
    save_for_hub(
        result.model,
        output,
        tokenizer=tokenizer,
        base_model=base_model,
        init=init,
        datasets=hub_datasets or None,
        training=training,
        license=None if args.model else "apache-2.0",
        model_id=args.push_to_hub,
    )

    if args.push_to_hub:
        _announce(6, total, f"Uploading to https://huggingface.co/{args.push_to_hub}")
        try:
            commit = upload_folder_to_hub(output, args.push_to_hub, private=args.private or None)
        except Exception as error:  # offline, no token, no permission: tell the user what to fix
            raise QuickstartError(
                f"upload to {args.push_to_hub} failed ({type(error).__name__}: {_first_line(error)}); the folder "
                f"{output} is complete: check `hf auth login` and your connection, then run `hf upload "
                f"{args.push_to_hub} {output}`"
            ) from error
        print(f"    {commit}")

    print()
    print(f"Done in {time.perf_counter() - started:.0f} s. What happened:")
    print(f"  model     {'converted ' + args.model if args.model else 'built a random small Llama and converted it'}"
          f" -> ResFormer {args.variant} (init={init})")
    print(f"  λ         (λ_first, λ_self) per layer after training: "
          + ", ".join(f"({first:.2f}, {own:.2f})" for first, own in lambdas.tolist()))
    print(f"  training  {args.steps} steps on {data_description}; held-out loss {result.eval_loss_before:.3f} -> "
          f"{result.eval_loss_after:.3f}")
    print(f"  output    {output}  ({', '.join(sorted(path.name for path in output.iterdir()))})")
    print(f"  load it   AutoModelForCausalLM.from_pretrained({str(output)!r}, trust_remote_code=True)")
    if not args.push_to_hub:
        print(f"  publish   hf upload <your-name>/<repo> {output}   (or rerun with --push-to-hub REPO)")
    return 0


def _check_model_reachable(name: str) -> None:
    """Fail before any work when `--model` is neither a checkpoint directory nor fetchable from the Hub."""
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


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.dataset_config and not args.dataset:
        build_parser().error("--dataset-config needs --dataset")
    if args.init == "preserve" and args.variant not in PRESERVING_VARIANTS:
        build_parser().error(
            f"--init preserve cannot preserve the source's outputs with --variant {args.variant}; use --init paper "
            f"or a variant that can ({', '.join(PRESERVING_VARIANTS)})"
        )
    if not args.debug:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        logging.getLogger("datasets").setLevel(logging.ERROR)
    try:
        return run(args)
    except QuickstartError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except OSError as error:  # disk full, permissions: the environment, not a bug
        if args.debug:
            raise
        print(f"{PROG}: error: {error.strerror or error} ({error.filename or 'file system'})", file=sys.stderr)
        return 1
    except Exception as error:
        if args.debug:
            raise
        print(f"{PROG}: error: unexpected {type(error).__name__}: {_first_line(error)} (rerun with --debug for "
              "the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
