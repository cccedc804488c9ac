"""`run_quickstart`: convert, fine-tune, generate and write a Hub-ready folder, from one `QuickstartSettings`.

Every check that can fail on the user's input runs before any work. The folder is written beside `output` and moved
into place only when complete (`conversion.staging`), so an interrupted run leaves nothing, and `overwrite` replaces
a folder only after the new one exists, never one that is or holds the run's own model, tokenizer or data.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..conversion import ConversionError, ConversionReport, convert_llama_checkpoint
from ..conversion.staging import OutputPathError, StagedDirectory, check_output_path
from ..errors import first_line
from ..hub import save_for_hub, upload_folder_to_hub
from ..remote_code.variants import DEFAULT_VARIANT, convertible_variants, output_preserving_variants
from ..text import train_tokenizer
from .steps import (
    SAMPLING,
    QuickstartError,
    TrainingResult,
    build_small_llama,
    check_model_fits,
    check_model_reachable,
    fine_tune,
    generate_sample,
    group_into_blocks,
    load_texts,
    load_tokenizer,
)

DEFAULT_OUTPUT = "resformer-quickstart"


@dataclass
class QuickstartSettings:
    """Everything the quickstart needs; the defaults run offline on the bundled sample in about a minute."""

    model: str | None = None  # checkpoint of a supported base (directory or Hub id); None builds a small random Llama
    tokenizer: str | None = None  # default: the model's own, else a BPE trained on the data
    data_files: Sequence[str] = ()
    dataset: str | None = None
    dataset_config: str | None = None
    text_column: str = "text"
    variant: str = DEFAULT_VARIANT
    init: str | None = None  # default: preserve when converting a given model with a variant that can, else paper
    steps: int = 100
    batch_size: int = 8
    block_size: int = 128
    learning_rate: float = 2e-3
    vocab_size: int = 2000
    seed: int = 0
    output: str = DEFAULT_OUTPUT
    overwrite: bool = False
    prompt: str = "It is a truth universally acknowledged"
    max_new_tokens: int = 40
    push_to_hub: str | None = None
    private: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "block_size", "vocab_size", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise QuickstartError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not math.isfinite(self.learning_rate) or self.learning_rate <= 0:
            raise QuickstartError(f"--learning-rate must be a positive number, got {self.learning_rate!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise QuickstartError(f"--seed must be an integer between 0 and {2**32 - 1}, got {self.seed!r}")
        if self.dataset_config and not self.dataset:
            raise QuickstartError("--dataset-config needs --dataset")
        if self.dataset and self.data_files:
            raise QuickstartError("pass either --data or --dataset, not both")
        if self.variant not in convertible_variants():
            raise QuickstartError(f"--variant {self.variant!r} cannot be made from a Llama; use one of "
                                  f"{', '.join(convertible_variants())}")
        if self.init not in (None, "preserve", "paper"):
            raise QuickstartError(f"--init {self.init!r} is not known; use preserve or paper")
        preserving = output_preserving_variants()
        if self.init == "preserve" and self.variant not in preserving:
            raise QuickstartError(f"--init preserve cannot preserve the source's outputs with --variant "
                                  f"{self.variant}; use --init paper or a variant that can ({', '.join(preserving)})")

    @property
    def resolved_init(self) -> str:
        if self.init:
            return self.init
        return "preserve" if self.model and self.variant in output_preserving_variants() else "paper"

    def inputs(self) -> dict[str, str]:
        """The paths this run reads, which the output must not be or hold."""
        named = {"--model": self.model, "--tokenizer": self.tokenizer, "--dataset": self.dataset}
        named.update({f"--data {name}": name for name in self.data_files})
        return {label: path for label, path in named.items() if path}


@dataclass
class QuickstartOutcome:
    output: Path
    conversion: ConversionReport
    training: TrainingResult
    sample: str
    commit: object = None
    seconds: float = 0.0
    lambdas: list = field(default_factory=list)


def _check_output(settings: QuickstartSettings) -> Path:
    try:
        return check_output_path(settings.output, label="--output", replace=settings.overwrite,
                                 replace_hint="pass --overwrite", inputs=settings.inputs())
    except OutputPathError as error:
        raise QuickstartError(str(error)) from error


def _prepare(settings: QuickstartSettings, say: Callable[[str], None]):
    """(training text, tokenizer, blocks)."""
    found = load_texts(data_files=settings.data_files, dataset=settings.dataset,
                       dataset_config=settings.dataset_config, text_column=settings.text_column)
    if settings.tokenizer or settings.model:
        tokenizer = load_tokenizer(settings.tokenizer or settings.model)
    else:
        tokenizer = train_tokenizer(found.texts, settings.vocab_size)
        say(f"    trained a byte-level BPE tokenizer with {len(tokenizer)} tokens on the data")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    blocks = group_into_blocks(found.texts, tokenizer, settings.block_size)
    say(f"    {found.description}: {len(blocks)} blocks of {settings.block_size} tokens")
    return found, tokenizer, blocks


def _convert(settings: QuickstartSettings, tokenizer, work: Path, say: Callable[[str], None]) -> ConversionReport:
    init = settings.resolved_init
    if settings.model:
        source = settings.model
        say(f"[2/{_total(settings)}] Converting {settings.model} to ResFormer ({settings.variant}, init={init})")
    else:
        source = build_small_llama(tokenizer, work / "llama", settings.block_size, settings.seed)
        say(f"[2/{_total(settings)}] Built a small random Llama; converting it to ResFormer ({settings.variant}, "
            f"init={init})")
    try:
        report = convert_llama_checkpoint(source, work / "resformer", variant=settings.variant, init=init,
                                          verify=True, progress=True)
    except ConversionError as error:
        raise QuickstartError(str(error)) from error
    if report.max_abs_logit_diff is not None:
        expected = "exact, as init=preserve promises" if init == "preserve" else f"init={init} changes outputs"
        say(f"    max |Δ logits| converted vs source: {report.max_abs_logit_diff:.3g} ({expected})")
    check_model_fits(json.loads((report.dst / "config.json").read_text()), tokenizer, settings.block_size)
    return report


def _training_facts(settings: QuickstartSettings, description: str, result: TrainingResult) -> dict:
    return {
        "data": description,
        "steps": settings.steps,
        "batch size × block size": f"{settings.batch_size} × {settings.block_size} tokens",
        "tokens seen": settings.steps * settings.batch_size * settings.block_size,
        "peak learning rate (cosine, AdamW, weight decay 0.01)": settings.learning_rate,
        "train loss, first → last logged": f"{result.first_train_loss:.3f} → {result.last_train_loss:.3f}",
        "held-out loss before → after": f"{result.eval_loss_before:.3f} → {result.eval_loss_after:.3f}",
        "held-out blocks": result.eval_blocks,
        "trained with": "transformers.Trainer via `resformer-quickstart`",
    }


def _write_folder(settings: QuickstartSettings, output: Path, model, tokenizer, card_training: dict,
                  hub_datasets: list[str]) -> None:
    """The Hub-ready folder, staged beside `output` and moved into place when complete."""
    model.generation_config.update(**SAMPLING)  # the folder samples as the quickstart's sample was drawn
    with StagedDirectory(output) as staged:
        save_for_hub(model, staged.path, tokenizer=tokenizer, base_model=settings.model, init=settings.resolved_init,
                     datasets=hub_datasets or None, training=card_training,
                     license=None if settings.model else "apache-2.0", model_id=settings.push_to_hub)
        try:
            staged.commit(replace=settings.overwrite)
        except OutputPathError as error:
            raise QuickstartError(str(error)) from error


def _upload(settings: QuickstartSettings, output: Path):
    try:
        return upload_folder_to_hub(output, settings.push_to_hub, private=settings.private or None)
    except Exception as error:  # offline, no token, no permission: tell the user what to fix
        raise QuickstartError(
            f"upload to {settings.push_to_hub} failed ({type(error).__name__}: {first_line(error)}); the folder "
            f"{output} is complete: check `hf auth login` and your connection, then run `hf upload "
            f"{settings.push_to_hub} {output}`"
        ) from error


def _total(settings: QuickstartSettings) -> int:
    return 6 if settings.push_to_hub else 5


def run_quickstart(settings: QuickstartSettings, *, say: Callable[[str], None] = print) -> QuickstartOutcome:
    """Run the whole workflow; `say` receives the progress lines. Raises `QuickstartError` on bad input."""
    started, total = time.perf_counter(), _total(settings)
    output = _check_output(settings)
    if settings.model:
        check_model_reachable(settings.model)
    say(f"[1/{total}] Loading text and tokenizer")
    found, tokenizer, blocks = _prepare(settings, say)
    with tempfile.TemporaryDirectory(prefix="resformer-quickstart-") as scratch:
        report = _convert(settings, tokenizer, Path(scratch), say)
        say(f"[3/{total}] Fine-tuning with transformers.Trainer for {settings.steps} steps")
        result = fine_tune(report.dst, blocks, steps=settings.steps, batch_size=settings.batch_size,
                           learning_rate=settings.learning_rate, seed=settings.seed, work_dir=Path(scratch))
        say(f"    held-out loss {result.eval_loss_before:.3f} -> {result.eval_loss_after:.3f} "
            f"({result.seconds:.0f} s)")
    say(f"[4/{total}] Generating a sample")
    sample = generate_sample(result.model, tokenizer, settings.prompt, settings.max_new_tokens, settings.seed)
    say(f"    {sample!r}")
    say(f"[5/{total}] Writing the Hub-ready folder {output}")
    _write_folder(settings, output, result.model, tokenizer, _training_facts(settings, found.description, result),
                  found.hub_datasets)
    outcome = QuickstartOutcome(output, report, result, sample, lambdas=result.model.value_residual_lambdas().tolist())
    if settings.push_to_hub:
        say(f"[6/{total}] Uploading to https://huggingface.co/{settings.push_to_hub}")
        outcome.commit = _upload(settings, output)
        say(f"    {outcome.commit}")
    outcome.seconds = time.perf_counter() - started
    _say_summary(settings, found.description, outcome, say)
    return outcome


def _say_summary(settings: QuickstartSettings, description: str, outcome: QuickstartOutcome,
                 say: Callable[[str], None]) -> None:
    result, output = outcome.training, outcome.output
    what = f"converted {settings.model}" if settings.model else "built a random small Llama and converted it"
    say("")
    say(f"Done in {outcome.seconds:.0f} s. What happened:")
    say(f"  model     {what} -> ResFormer {settings.variant} (init={settings.resolved_init})")
    say("  λ         (λ_first, λ_self) per layer after training: "
        + ", ".join(f"({first:.2f}, {own:.2f})" for first, own in outcome.lambdas))
    say(f"  training  {settings.steps} steps on {description}; held-out loss {result.eval_loss_before:.3f} -> "
        f"{result.eval_loss_after:.3f}")
    say(f"  output    {output}  ({', '.join(sorted(path.name for path in output.iterdir()))})")
    say(f"  load it   AutoModelForCausalLM.from_pretrained({str(output)!r}, trust_remote_code=True)")
    if not settings.push_to_hub:
        say(f"  publish   hf upload <your-name>/<repo> {output}   (or rerun with --push-to-hub REPO)")


__all__ = ["DEFAULT_OUTPUT", "QuickstartOutcome", "QuickstartSettings", "run_quickstart"]
