"""`convert_llama_checkpoint`: the steps of a conversion, in the order that keeps every promise.

1. Check the options, the paths and `config.json`'s fields; read the weight headers; bound the config's sizes by
   what the weights hold. Nothing has been built or written yet.
2. Build the target on the meta device and plan every tensor against it; refuse anything that does not fit.
3. Write into a staging directory beside DST, finish it as a Hub folder, verify, and commit it in one rename that
   refuses a DST that gained files meanwhile (unless `overwrite`). Any failure or interruption removes the staging
   directory; SRC is only ever read.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from transformers.utils import logging

from ..hub import finish_hub_folder
from ..remote_code.variants import DEFAULT_CONVERSION_VARIANT
from .config import (
    build_resformer_config,
    check_options,
    check_sizes_against_weights,
    check_source_config,
    resolve_dtype,
)
from .plan import meta_model, plan_conversion
from .report import ConversionError, ConversionReport, short_list
from .safetensors_io import WeightsFileError, read_inventory
from .source import copy_side_files, find_source_shards, read_source_config, resolve_source
from .staging import OutputPathError, StagedDirectory, check_output_path
from .verify import change_notes, measure_divergence, refuse_non_finite_weights
from .writing import write_weights

logger = logging.get_logger(__name__)


def _destination(dst: str | os.PathLike, src_dir: Path, *, overwrite: bool) -> Path:
    try:
        return check_output_path(dst, label="DST", replace=overwrite, inputs={"SRC": src_dir},
                                 replace_hint="pass overwrite=True (--overwrite)")
    except OutputPathError as error:
        raise ConversionError(str(error)) from error


def _stale_notes(staged: StagedDirectory) -> list[str]:
    notes = []
    if staged.removed_stale:
        notes.append(f"removed {len(staged.removed_stale)} unfinished output(s) of killed conversions: "
                     f"{short_list([path.name for path in staged.removed_stale])}.")
    if staged.left_stale:
        notes.append(f"left alone {short_list([str(path) for path in staged.left_stale])}: unfinished or set-aside "
                     "output of another run that may still be going; delete it once no conversion is running.")
    return notes


def convert_llama_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    variant: str = DEFAULT_CONVERSION_VARIANT,
    init: str = "preserve",
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    verify: bool = False,
    progress: bool = True,
    value_embeddings: str | list[int] | None = None,
) -> ConversionReport:
    """Write a ResFormer checkpoint at `dst` made from the causal LM at `src` (directory or Hub id) of a base in
    `bases.py`.

    `init="preserve"` (only for the learnable variants) starts λ where the output equals the source's;
    `init="paper"` starts from the paper's values, so outputs change until the model is fine-tuned. `verify` loads
    both models and measures max |Δ logits| on a probe batch, and fails on any NaN or infinity; that measurement is
    also made whenever outputs are expected to change (`init="paper"`, `svformer`), memory allowing. `overwrite`
    allows replacing a non-empty `dst` once the new output is complete. `value_embeddings` (a layout name or layer
    indices, `ResFormerConfig.value_embeddings`) adds value-embedding tables and gates, written as zeros: the outputs
    stay the source's, and the tables get gradient at the first step. Raises `ConversionError` on bad input.
    """
    started = time.perf_counter()
    check_options(variant, init)
    target_dtype = resolve_dtype(dtype)
    src_dir, base_model = resolve_source(src, allow_pickle=allow_pickle)
    dst_dir = _destination(dst, src_dir, overwrite=overwrite)

    source_config = read_source_config(src_dir)
    check_source_config(source_config)
    shards = find_source_shards(src_dir, allow_pickle=allow_pickle)
    try:
        inventory = read_inventory(shards, allow_pickle=allow_pickle)
    except WeightsFileError as error:
        raise ConversionError(str(error)) from error
    check_sizes_against_weights(source_config, inventory)  # before anything is built from those sizes
    config = build_resformer_config(source_config, variant=variant, init=init, dtype=target_dtype,
                                    value_embeddings=value_embeddings)
    target = meta_model(config)
    plan = plan_conversion(shards, inventory, target, source_config["model_type"], target_dtype)

    report = ConversionReport(
        dst=dst_dir,
        src=str(src),
        variant=variant,
        init=init,
        source_model_type=source_config["model_type"],
        num_tensors=plan.num_tensors,
        num_shards=len(plan.shards),
        total_bytes=0,
        dtype=str(config.dtype).removeprefix("torch."),
        added_tensors=plan.added,
        dropped_tensors=plan.dropped,
    )
    with StagedDirectory(dst_dir) as staged:
        report.notes.extend(_stale_notes(staged))
        try:
            written = write_weights(plan, staged.path, allow_pickle=allow_pickle, check_finite=verify,
                                    progress=progress)
        except WeightsFileError as error:
            raise ConversionError(str(error)) from error
        report.total_bytes = written.total_bytes
        if verify:
            refuse_non_finite_weights(written.non_finite)
        report.copied_files = copy_side_files(src_dir, staged.path)
        finish_hub_folder(staged.path, target.config, base_model=base_model, init=init)
        outputs_change = init != "preserve"
        if verify or outputs_change:
            report.max_abs_logit_diff = measure_divergence(
                src_dir, staged.path, report, strict=not outputs_change, required=verify
            )
        try:
            staged.commit(replace=overwrite)
        except OutputPathError as error:
            raise ConversionError(str(error)) from error
    report.notes.extend(change_notes(config, variant, init, report.max_abs_logit_diff))
    for note in report.notes:
        logger.warning(note)
    report.seconds = time.perf_counter() - started
    return report


__all__ = ["convert_llama_checkpoint"]
