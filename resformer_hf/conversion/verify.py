"""Verification: the converted model against its source on a probe batch, before the output is committed.

NaN and infinity never pass: a non-finite difference, non-finite converted logits or (with `--verify`) a weight
holding NaN or infinity fail verification, and the output is discarded.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..remote_code.configuration_resformer import ResFormerConfig
from .report import PROBE_SHAPE, ConversionError, ConversionReport, short_list


def probe_input_ids(vocab_size: int) -> torch.Tensor:
    """The fixed probe batch used to compare logits: seeded random token ids, shape `PROBE_SHAPE`."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, PROBE_SHAPE, generator=generator)


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def refuse_non_finite_weights(names: list[str]) -> None:
    """`--verify` fails when any written weight holds NaN or infinity."""
    if names:
        raise ConversionError(
            f"verification failed: {len(names)} tensor(s) hold NaN or infinity, e.g. {short_list(names)}; the output "
            "was discarded. Check the source checkpoint."
        )


def _probe_logits(src_dir: Path, out_dir: Path) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """(source logits, converted logits, converted dtype) on the probe batch, both models in the stored dtype."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        converted = AutoModelForCausalLM.from_pretrained(out_dir, dtype="auto").eval()
        # The source in the converted dtype, so that a --dtype change is not counted as a conversion error.
        source = AutoModelForCausalLM.from_pretrained(src_dir, dtype=converted.dtype).eval()
        ids = probe_input_ids(converted.config.vocab_size)
        with torch.no_grad():
            return source(input_ids=ids).logits.float(), converted(input_ids=ids).logits.float(), converted.dtype
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def measure_divergence(
    src_dir: Path, out_dir: Path, report: ConversionReport, *, strict: bool, required: bool
) -> float | None:
    """Max |Δ logits| between source and converted model on the probe batch. `strict` (function-preserving
    conversions) turns a mismatch into an error so a wrong output is never committed; `required` (`--verify`) turns
    any failure to measure, and non-finite converted logits, into errors."""
    needed = 2 * report.total_bytes * 1.2
    available = _available_memory()
    if available is not None and needed > available:
        if required:
            raise ConversionError(
                f"verify needs about {needed / 2**30:.1f} GiB to load both models, {available / 2**30:.1f} GiB are "
                "available; free memory, or convert without verify (the output is then not compared)."
            )
        report.notes.append(
            f"logits not compared: loading both models needs about {needed / 2**30:.1f} GiB, "
            f"{available / 2**30:.1f} GiB available."
        )
        return None
    try:
        expected, actual, dtype = _probe_logits(src_dir, out_dir)
    except Exception as error:
        if required or strict:
            raise ConversionError(f"verification could not load or run the models ({error}).") from error
        report.notes.append(f"logits not compared: {error}")
        return None
    diff = float((expected - actual).abs().max())
    if (required or strict) and not torch.isfinite(actual).all():
        raise ConversionError(
            "verification failed: the converted model's logits contain NaN or infinity on the probe batch; the output "
            "was discarded. Check the source checkpoint for NaN or infinite weights."
        )
    if strict:
        scale = max(1.0, float(expected.abs().max()))
        tolerance = (1e-4 if dtype == torch.float32 else 1e-2) * scale
        same_tokens = bool(torch.equal(expected.argmax(-1), actual.argmax(-1)))
        if not math.isfinite(diff) or diff > tolerance or not same_tokens:
            raise ConversionError(
                f"verification failed: max |Δ logits| = {diff:.3g} (tolerance {tolerance:.3g}), same argmax tokens: "
                f"{same_tokens}; the output was discarded. Please report this with the source config."
            )
    return diff


def change_notes(config: ResFormerConfig, variant: str, init: str, diff: float | None) -> list[str]:
    """What the user must know when the converted model does not compute what the source computed."""
    measured = f" (measured max |Δ logits| = {diff:.3g} on a probe batch)" if diff is not None else ""
    dropped = config.layers_without_value_projection
    if dropped:
        return [
            f"{variant} drops v_proj of layers {dropped[0]}..{dropped[-1]}: outputs differ from the source"
            f"{measured}; the model needs uptraining before use."
        ]
    if init == "paper":
        first, own = config.value_residual_lambda_first_resolved, config.value_residual_lambda_self_resolved
        start = f"λ_first={first}, λ_self={own}" if first is not None else (
            f"λ_scale={config.value_residual_lambda_scale_resolved}, λ_self={own}"
        )
        return [f"init='paper' starts from the paper's {start}: outputs differ from the source{measured}; fine-tune "
                "before use."]
    return []


__all__ = ["change_notes", "measure_divergence", "probe_input_ids", "refuse_non_finite_weights"]
