"""Upgrade a Llama-layout checkpoint (Llama, Mistral without sliding window, Qwen2) to a ResFormer checkpoint.

ResFormer keeps Llama's parameter names, so conversion is a streamed copy of the weights plus the new λ tensors
(`model.value_residual.*`, stored as offsets from the config's initial values; see `value_residual.py`). The default
`init="preserve"` picks initial λ that make the converted model compute exactly what the source computed, so it can be
fine-tuned from where the source stands.

Never loses data: the source is only read, output goes to a temporary directory beside DST that is renamed into place
when complete, and every problem a user can cause is a `ConversionError` with a one-line message saying what to do.
This module is not copied for `trust_remote_code`, so it may use safetensors, huggingface_hub and tqdm.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm
from transformers.dynamic_module_utils import custom_object_save
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.utils import logging

from .configuration_resformer import (
    DEFAULT_CONVERSION_VARIANT,
    VARIANTS,
    ResFormerConfig,
    convertible_variants,
    output_preserving_variants,
)
from .registration import full_auto_map

logger = logging.get_logger(__name__)

#: Variants `convert_llama_checkpoint` can produce from a Llama (the ones whose weights a Llama fully determines).
CONVERTIBLE_VARIANTS = convertible_variants()
#: Variants with an initial λ setting that reproduces the source model exactly.
FUNCTION_PRESERVING_VARIANTS = output_preserving_variants()
DEFAULT_VARIANT = DEFAULT_CONVERSION_VARIANT
INITS = ("preserve", "paper")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
PICKLE_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"

#: Files copied unchanged from SRC: tokenizer, generation defaults and the base model's license terms.
COPIED_FILE_PATTERNS = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "LICENSE*",
    "NOTICE*",
    "USE_POLICY.md",
)

_PROBE_SHAPE = (2, 16)


class ConversionError(ValueError):
    """A problem with the user's input or environment; the message is one line that says what to do."""


@dataclass
class ConversionReport:
    """What a conversion did, for printing and for callers that chain steps (quickstart, tests)."""

    dst: Path
    src: str
    variant: str
    init: str
    source_model_type: str
    num_tensors: int
    num_shards: int
    total_bytes: int
    dtype: str
    added_tensors: list[str] = field(default_factory=list)
    dropped_tensors: list[str] = field(default_factory=list)
    copied_files: list[str] = field(default_factory=list)
    max_abs_logit_diff: float | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        """A few human-readable lines, as the CLI prints them."""
        lines = [
            f"Converted {self.src} ({self.source_model_type}) -> {self.dst}",
            f"  variant={self.variant} init={self.init} dtype={self.dtype}: {self.num_tensors} tensors in "
            f"{self.num_shards} shard(s), {self.total_bytes / 2**20:.1f} MiB, {self.seconds:.1f} s",
        ]
        if self.added_tensors:
            lines.append(f"  added {len(self.added_tensors)} tensor(s): {_short_list(self.added_tensors)}")
        if self.dropped_tensors:
            lines.append(f"  dropped {len(self.dropped_tensors)} tensor(s): {_short_list(self.dropped_tensors)}")
        if self.max_abs_logit_diff is not None:
            lines.append(f"  max |Δ logits| vs the source on a {_PROBE_SHAPE[0]}x{_PROBE_SHAPE[1]} probe batch: "
                         f"{self.max_abs_logit_diff:.3g}")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


# ---- public entry point ------------------------------------------------------------------------------------------


def convert_llama_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    variant: str = DEFAULT_VARIANT,
    init: str = "preserve",
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    verify: bool = False,
    progress: bool = True,
) -> ConversionReport:
    """Write a ResFormer checkpoint at `dst` made from the Llama-layout causal LM at `src` (directory or Hub id).

    `init="preserve"` (only for the learnable variants) starts λ where the output equals the source's;
    `init="paper"` starts from the paper's values, so outputs change until the model is fine-tuned. `verify` loads
    both models and measures max |Δ logits| on a probe batch; that measurement is also made whenever outputs are
    expected to change (`init="paper"`, `svformer`), memory allowing. Raises `ConversionError` on bad input.
    """
    started = time.perf_counter()
    _check_options(variant, init)
    target_dtype = _resolve_dtype(dtype)
    src_dir, base_model = _resolve_source(src, allow_pickle=allow_pickle)
    dst_dir = Path(dst).expanduser().absolute()
    _check_destination(src_dir, dst_dir, overwrite=overwrite)

    source_config = _read_source_config(src_dir)
    config = build_resformer_config(source_config, variant=variant, init=init, dtype=target_dtype)
    shards = _find_source_shards(src_dir, allow_pickle=allow_pickle)
    target = _meta_model(config)
    plan = _plan_conversion(shards, target, source_config["model_type"], target_dtype)

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
    with _staging_directory(dst_dir) as staging:
        report.total_bytes = _write_weights(plan, staging, progress=progress)
        _save_config(target, staging)
        report.copied_files = _copy_side_files(src_dir, staging)
        _write_card(staging, config, base_model=base_model, init=init)
        outputs_change = init != "preserve"
        if verify or outputs_change:
            report.max_abs_logit_diff = _measure_divergence(
                src_dir, staging, report, strict=not outputs_change, required=verify
            )
        _commit(staging, dst_dir)
    report.notes.extend(_change_notes(config, variant, init, report.max_abs_logit_diff))
    for note in report.notes:
        logger.warning(note)
    report.seconds = time.perf_counter() - started
    return report


# ---- options, source and destination -----------------------------------------------------------------------------


def _check_options(variant: str, init: str) -> None:
    if variant not in CONVERTIBLE_VARIANTS:
        raise ConversionError(
            f"variant {variant!r} cannot be made from a Llama checkpoint; use one of {', '.join(CONVERTIBLE_VARIANTS)}."
        )
    if init not in INITS:
        raise ConversionError(f"init {init!r} is not known; use 'preserve' or 'paper'.")
    if init == "preserve" and variant not in FUNCTION_PRESERVING_VARIANTS:
        raise ConversionError(
            f"variant {variant!r} cannot preserve the source's outputs ({VARIANTS[variant].why_not_preserving}); pass "
            "init='paper' (--init paper) to accept changed outputs that need fine-tuning, or use a variant that can "
            f"({', '.join(FUNCTION_PRESERVING_VARIANTS)})."
        )


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)} or leave it unset.")
    return DTYPES[name]


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _resolve_source(src: str | os.PathLike, *, allow_pickle: bool) -> tuple[Path, str]:
    """(local directory, name for the model card): a directory is used as is, a repo id is fetched to the HF cache."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path.absolute(), str(src)
    if path.exists():
        raise ConversionError(f"SRC {src} is a file; pass the directory that holds config.json and the weights.")
    if not _REPO_ID.match(str(src)):
        raise ConversionError(f"SRC {src} does not exist; pass a checkpoint directory or a Hub repo id (owner/name).")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", *COPIED_FILE_PATTERNS] + (["*.bin"] if allow_pickle else [])
    try:
        return Path(snapshot_download(str(src), allow_patterns=patterns)), str(src)
    except Exception as error:  # offline, unknown repo, gated, network: all mean "not fetchable" to the user
        raise ConversionError(
            f"SRC {src} is not a local directory and could not be fetched from the Hub ({type(error).__name__}); "
            "check the repo id and your connection (HF_HUB_OFFLINE), or download it and pass the directory."
        ) from error


def _check_destination(src_dir: Path, dst_dir: Path, *, overwrite: bool) -> None:
    src_real, dst_real = src_dir.resolve(), dst_dir.resolve()
    if dst_real == src_real or src_real in dst_real.parents:
        raise ConversionError(f"DST {dst_dir} is inside SRC {src_dir}; choose a destination outside the source.")
    if dst_real in src_real.parents:
        raise ConversionError(f"SRC {src_dir} is inside DST {dst_dir}; replacing DST would delete the source.")
    if dst_dir.exists() and not dst_dir.is_dir():
        raise ConversionError(f"DST {dst_dir} is a file; choose a directory path.")
    if dst_dir.is_dir() and any(dst_dir.iterdir()) and not overwrite:
        raise ConversionError(f"DST {dst_dir} exists and is not empty; pass overwrite=True (--overwrite) to replace it.")
    if not dst_dir.parent.is_dir():
        raise ConversionError(f"the parent directory of DST, {dst_dir.parent}, does not exist; create it first.")


def _read_source_config(src_dir: Path) -> dict:
    path = src_dir / "config.json"
    if not path.is_file():
        raise ConversionError(f"{src_dir} has no config.json; pass the directory written by save_pretrained.")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{path} is not valid JSON ({error}); restore it from the original checkpoint.") from error
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConversionError(f"{path} has no model_type; it is not a transformers model config.")
    return config


# ---- configuration -----------------------------------------------------------------------------------------------


def build_resformer_config(
    source_config: dict, *, variant: str, init: str, dtype: torch.dtype | None = None
) -> ResFormerConfig:
    """The ResFormer config for a Llama-layout source config (a `config.json` dict), or a `ConversionError` that
    names the feature the ResFormer model does not implement."""
    from transformers import AutoConfig

    model_type = source_config.get("model_type")
    if model_type == "resformer":
        raise ConversionError("SRC is already a ResFormer checkpoint; nothing to convert.")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(
            f"model_type {model_type!r} is not supported: only Llama-layout decoders convert "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})."
        )
    architectures = source_config.get("architectures") or []
    if any(not name.endswith("ForCausalLM") for name in architectures):
        raise ConversionError(
            f"architectures {architectures} is not a causal LM; only *ForCausalLM checkpoints convert."
        )
    if source_config.get("quantization_config"):
        method = source_config["quantization_config"].get("quant_method", "unknown")
        raise ConversionError(
            f"quantized checkpoints are not supported (quantization_config: {method}); convert the unquantized weights."
        )
    fields = {k: v for k, v in source_config.items() if k not in ("model_type", "transformers_version", "auto_map")}
    try:
        parsed = AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"config.json does not parse as a {model_type} config: {error}") from error

    rope = parsed.rope_parameters or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else None
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        raise ConversionError(f"rope_parameters {rope} are not implemented by Llama's rotary embedding.")
    window = getattr(parsed, "sliding_window", None)
    layer_types = getattr(parsed, "layer_types", None) or []
    uses_window = window is not None and (model_type == "mistral" or "sliding_attention" in layer_types)
    if uses_window and window < parsed.max_position_embeddings:
        raise ConversionError(
            f"sliding_window={window} < max_position_embeddings={parsed.max_position_embeddings}: sliding-window "
            "attention is not implemented by ResFormer (only full attention, or a window covering the whole context)."
        )
    other_layer_types = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other_layer_types:
        raise ConversionError(f"layer_types {other_layer_types} are not implemented by ResFormer.")

    kwargs = parsed.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "_name_or_path", "sliding_window",
                "use_sliding_window", "max_window_layers", "layer_types"):
        kwargs.pop(key, None)
    if model_type == "qwen2":
        # Qwen2 has q/k/v biases and no o_proj bias; Llama's flag adds all four, so o_proj gets an exact zero bias.
        kwargs["attention_bias"] = True
    if dtype is not None:
        kwargs["dtype"] = str(dtype).removeprefix("torch.")
    kwargs.update(_lambda_fields(variant, init))
    try:
        config = ResFormerConfig(**kwargs)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"the source config cannot become a ResFormer config: {error}") from error
    config.architectures = ["ResFormerForCausalLM"]
    return config


def _lambda_fields(variant: str, init: str) -> dict:
    """Config fields that set the initial λ: the exact-Llama point for `preserve`, the paper's defaults otherwise."""
    fields: dict = {"value_residual": variant}
    if init == "preserve":
        fields.update(VARIANTS[variant].preserving_fields)
    return fields


# ---- planning: which tensors go where ----------------------------------------------------------------------------


@dataclass
class _TensorPlan:
    source: str | None  # name in the source shard; None for a tensor the converter adds (zeros)
    shape: tuple[int, ...]
    dtype: torch.dtype  # as written

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class _ShardPlan:
    source: Path
    output_name: str
    tensors: dict[str, _TensorPlan]  # output name -> plan, in source order


@dataclass
class _Plan:
    shards: list[_ShardPlan]
    added: list[str]
    dropped: list[str]

    @property
    def num_tensors(self) -> int:
        return sum(len(shard.tensors) for shard in self.shards)


def _find_source_shards(src_dir: Path, *, allow_pickle: bool) -> list[Path]:
    """The weight files of SRC, in order; checks the index names only files that exist."""
    for index_name, single_name, is_pickle in (
        (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, False),
        (PICKLE_WEIGHTS_INDEX_NAME, PICKLE_WEIGHTS_NAME, True),
    ):
        index_path, single_path = src_dir / index_name, src_dir / single_name
        if not index_path.is_file() and not single_path.is_file():
            continue
        if is_pickle and not allow_pickle:
            raise ConversionError(
                f"{src_dir} holds only pickle weights ({index_name if index_path.is_file() else single_name}), which "
                "can run code when loaded; pass allow_pickle=True (--allow-pickle) if you trust them (they are then "
                "loaded with weights_only=True)."
            )
        if not index_path.is_file():
            return [single_path]
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ConversionError(f"{index_path} is not a valid weight index ({error!r}); restore it.") from error
        names = list(dict.fromkeys(weight_map.values()))
        missing = [name for name in names if not (src_dir / name).is_file()]
        if missing:
            raise ConversionError(
                f"shard(s) named in {index_name} are missing from {src_dir}: {_short_list(missing)}; download them again."
            )
        return [src_dir / name for name in names]
    raise ConversionError(f"{src_dir} has no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}; nothing to convert.")


def _output_shard_name(source: Path, count: int) -> str:
    if source.suffix == ".safetensors":
        return source.name
    if count == 1:
        return SAFE_WEIGHTS_NAME
    return source.name.replace("pytorch_model", "model").removesuffix(".bin") + ".safetensors"


@contextmanager
def _open_shard(path: Path) -> Iterator[dict[str, torch.Tensor] | safe_open]:
    """A mapping-like view of one shard: safetensors are memory-mapped, pickles loaded with weights_only=True."""
    if path.suffix == ".bin":
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # torch raises many types for damaged or hostile pickles
            raise ConversionError(f"{path.name} cannot be loaded with weights_only=True ({error}).") from error
        yield _DictShard(state)
        return
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as error:
        raise ConversionError(
            f"{path.name} is not a readable safetensors file ({error}); it is truncated or corrupted, download it again."
        ) from error
    with handle as shard:
        yield shard


class _DictShard:
    """Gives a loaded state dict the small part of `safe_open`'s interface the converter uses."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def keys(self) -> list[str]:
        return list(self.state)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.state[name].contiguous()

    def get_slice(self, name: str) -> torch.Tensor:
        return self.state[name]

    def metadata(self) -> dict[str, str]:
        return {}


#: safetensors' dtype names; the streaming writer needs them, and refuses anything else by name.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


def _tensor_info(shard, path: Path, name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype from the header only (nothing is read for safetensors)."""
    view = shard.get_slice(name)
    if isinstance(view, torch.Tensor):
        shape, dtype = tuple(view.shape), view.dtype
    else:
        shape, dtype = tuple(view.get_shape()), _SAFETENSORS_DTYPES.get(view.get_dtype())
    if dtype not in _SAFETENSORS_NAMES:
        raise ConversionError(f"{path.name}: tensor {name} has dtype {dtype or view.get_dtype()}, which cannot be "
                              "converted; only float, int and bool tensors are supported.")
    return shape, dtype


def _meta_model(config: ResFormerConfig):
    """The target model on the meta device: its state dict is the contract the output must meet (no memory used)."""
    from .modeling_resformer import ResFormerForCausalLM

    with torch.device("meta"):
        return ResFormerForCausalLM(config)


def _expected_state(model) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor `model.save_pretrained` would write."""
    state = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


_ROTARY_BUFFER = re.compile(r"\.rotary_emb\.inv_freq$")
_V_PROJ = re.compile(r"^model\.layers\.(\d+)\.self_attn\.v_proj\.")
_O_PROJ_BIAS = re.compile(r"^model\.layers\.(\d+)\.self_attn\.o_proj\.bias$")


def _plan_conversion(shards: list[Path], model, model_type: str, dtype: torch.dtype | None) -> _Plan:
    """Check every source tensor's name and shape against the ResFormer model (headers only) and decide where each
    output tensor goes; nothing is written until the whole source has been checked."""
    config = model.config
    expected = _expected_state(model)
    plans, seen, dropped = [], {}, []
    for path in shards:
        plan = _ShardPlan(path, _output_shard_name(path, len(shards)), {})
        with _open_shard(path) as shard:
            for name in shard.keys():
                if name in seen:
                    raise ConversionError(f"tensor {name} appears in both {seen[name]} and {path.name}; fix the index.")
                seen[name] = path.name
                shape, source_dtype = _tensor_info(shard, path, name)
                match = _V_PROJ.match(name)
                if _ROTARY_BUFFER.search(name) or (config.tie_word_embeddings and name == "lm_head.weight"):
                    dropped.append(name)  # recomputed from the config / tied to the embeddings on load
                elif match and int(match.group(1)) in config.layers_without_value_projection:
                    dropped.append(name)  # SVFormer layers n >= 1 attend over layer 0's values
                elif name not in expected:
                    raise ConversionError(
                        f"{path.name} has tensor {name}, which a {model_type} checkpoint converted to ResFormer cannot "
                        "hold; only Llama-layout weights convert."
                    )
                elif shape != expected[name][0]:
                    raise ConversionError(
                        f"{name} has shape {list(shape)} but config.json implies {list(expected[name][0])}; the "
                        "weights do not match the config."
                    )
                else:
                    cast = dtype is not None and source_dtype.is_floating_point
                    plan.tensors[name] = _TensorPlan(name, shape, dtype if cast else source_dtype)
        plans.append(plan)

    added = []
    missing = [name for name in expected if name not in seen]
    for name in missing:
        if name.startswith("model.value_residual."):
            target = plans[-1]  # λ offsets are zero: the config holds the initial values
        elif model_type == "qwen2" and _O_PROJ_BIAS.match(name):
            target = next(p for p in plans if name.removesuffix("bias") + "weight" in p.tensors)
            expected[name] = (expected[name][0], target.tensors[name.removesuffix("bias") + "weight"].dtype)
        else:
            raise ConversionError(
                f"the checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {_short_list(missing)}; it is "
                "incomplete or does not match config.json."
            )
        shape, expected_dtype = expected[name]  # λ: float32, as the model keeps them (_keep_in_fp32_modules)
        target.tensors[name] = _TensorPlan(None, shape, expected_dtype)
        added.append(name)
    return _Plan(plans, added, dropped)


# ---- writing -----------------------------------------------------------------------------------------------------


def _write_weights(plan: _Plan, staging: Path, *, progress: bool) -> int:
    """Write the output shards one at a time into `staging`, with the index when sharded; returns the bytes of
    tensor data written."""
    total_source = sum(shard.source.stat().st_size for shard in plan.shards)
    weight_map: dict[str, str] = {}
    total_bytes = total_parameters = 0
    bar = tqdm(total=total_source, unit="B", unit_scale=True, unit_divisor=1024, desc="resformer-convert",
               disable=not progress)
    try:
        for number, shard_plan in enumerate(plan.shards, start=1):
            bar.set_postfix_str(f"shard {number}/{len(plan.shards)}")
            _write_shard(shard_plan, staging / shard_plan.output_name)
            for name, tensor in shard_plan.tensors.items():
                weight_map[name] = shard_plan.output_name
                total_bytes += tensor.nbytes
                total_parameters += math.prod(tensor.shape)
            bar.update(shard_plan.source.stat().st_size)
    finally:
        bar.close()
    if len(plan.shards) > 1:
        index = {
            "metadata": {"total_size": total_bytes, "total_parameters": total_parameters},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (staging / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return total_bytes


def _write_shard(shard_plan: _ShardPlan, path: Path) -> None:
    """Write one safetensors file tensor by tensor, so memory holds one tensor rather than one shard.

    safetensors' `save_file` needs every tensor of a file at once, and a `safe_open` mapping keeps each page it has
    read resident until it is closed; so the header (known from the plan) is written first and each tensor is then
    read through its own short-lived `safe_open` and appended. Layout as `save_file` makes it: 8-byte little-endian
    header length, JSON header padded with spaces to 8 bytes, tensors largest dtype first (every tensor aligned to its
    dtype). The file is re-opened with `safe_open` afterwards as a check.
    """
    if sys.byteorder != "little":
        raise ConversionError("safetensors files are little-endian; run the conversion on a little-endian machine.")
    order = sorted(shard_plan.tensors, key=lambda name: -shard_plan.tensors[name].dtype.itemsize)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        tensor_plan = shard_plan.tensors[name]
        header[name] = {"dtype": _SAFETENSORS_NAMES[tensor_plan.dtype], "shape": list(tensor_plan.shape),
                        "data_offsets": [offset, offset + tensor_plan.nbytes]}
        offset += tensor_plan.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header_bytes)))
        handle.write(header_bytes)
        for name, tensor in _read_tensors(shard_plan, order):
            handle.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            del tensor  # drops the last reference to the source mapping before the next tensor is read
    with safe_open(str(path), framework="pt") as written:  # raises if header and data disagree
        if set(written.keys()) != set(order):
            raise RuntimeError(f"{path.name} was written with the wrong tensors")


def _read_tensors(shard_plan: _ShardPlan, order: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The output tensors of one shard, cast as planned and checked against the plan."""
    pickled = shard_plan.source.suffix == ".bin"
    with _open_shard(shard_plan.source) if pickled else contextlib.nullcontext() as loaded:
        for name in order:
            tensor_plan = shard_plan.tensors[name]
            if tensor_plan.source is None:
                tensor = torch.zeros(tensor_plan.shape, dtype=tensor_plan.dtype)
            elif pickled:
                tensor = loaded.get_tensor(tensor_plan.source)
            else:
                with _open_shard(shard_plan.source) as shard:  # one mapping per tensor: released once written
                    try:
                        tensor = shard.get_tensor(tensor_plan.source)
                    except SafetensorError as error:
                        raise ConversionError(f"{shard_plan.source.name}: tensor {tensor_plan.source} cannot be read "
                                              f"({error}); the file is corrupted.") from error
            tensor = tensor.to(tensor_plan.dtype).contiguous()
            if tuple(tensor.shape) != tensor_plan.shape:
                raise ConversionError(f"{shard_plan.source.name}: tensor {tensor_plan.source} changed shape while "
                                      "converting; is another program writing SRC?")
            yield name, tensor
            del tensor  # so that at most one source mapping is alive


def _save_config(model, staging: Path) -> None:
    """config.json, plus what `model.save_pretrained` adds when the package marks its classes for remote code
    (`register_for_auto_class`): the modeling files and `auto_map`, so the output also loads with
    `trust_remote_code=True` — with every Auto class, as folders from `resformer_hf.hub` do."""
    if model.is_remote_code():
        custom_object_save(model, staging, config=model.config)
        model.config.auto_map = {**full_auto_map(), **model.config.auto_map}
    model.config.save_pretrained(staging)


def _copy_side_files(src_dir: Path, staging: Path) -> list[str]:
    copied = []
    for pattern in COPIED_FILE_PATTERNS:
        for path in sorted(src_dir.glob(pattern)):
            if path.is_file() and path.name not in copied:
                shutil.copyfile(path, staging / path.name)
                copied.append(path.name)
    return copied


def _write_card(staging: Path, config: ResFormerConfig, *, base_model: str, init: str) -> None:
    from .model_card import write_model_card

    write_model_card(staging, config, base_model=base_model, init=init)


@contextmanager
def _staging_directory(dst_dir: Path) -> Iterator[Path]:
    """A fresh directory beside DST (same filesystem, so the final rename is atomic), removed on any failure,
    Ctrl-C included. A SIGKILL can leave it behind; its name starts with `.<DST name>.partial-`."""
    staging = Path(tempfile.mkdtemp(prefix=f".{dst_dir.name}.partial-", dir=dst_dir.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _commit(staging: Path, dst_dir: Path) -> None:
    """Move the finished output into place; an existing DST (checked empty or overwrite-approved) is replaced only
    after the new one is complete, and removed only after the rename succeeded."""
    if not dst_dir.exists():
        staging.rename(dst_dir)
        return
    if not any(dst_dir.iterdir()):
        dst_dir.rmdir()
        staging.rename(dst_dir)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{dst_dir.name}.replaced-", dir=dst_dir.parent))
    retired.rmdir()
    dst_dir.rename(retired)
    try:
        staging.rename(dst_dir)
    except BaseException:
        retired.rename(dst_dir)
        raise
    shutil.rmtree(retired, ignore_errors=True)


# ---- verification ------------------------------------------------------------------------------------------------


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def probe_input_ids(vocab_size: int) -> torch.Tensor:
    """The fixed probe batch used to compare logits: seeded random token ids, shape `_PROBE_SHAPE`."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, _PROBE_SHAPE, generator=generator)


def _measure_divergence(
    src_dir: Path, out_dir: Path, report: ConversionReport, *, strict: bool, required: bool
) -> float | None:
    """Max |Δ logits| between source and converted model on the probe batch, both in the stored dtype. `strict`
    (function-preserving conversions) turns a mismatch into an error so a wrong output is never committed."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    needed = 2 * report.total_bytes * 1.2
    available = _available_memory()
    if available is not None and needed > available:
        report.notes.append(
            f"logits not compared: loading both models needs about {needed / 2**30:.1f} GiB, "
            f"{available / 2**30:.1f} GiB available."
        )
        return None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        converted = AutoModelForCausalLM.from_pretrained(out_dir, dtype="auto").eval()
        # The source in the converted dtype, so that a --dtype change is not counted as a conversion error.
        source = AutoModelForCausalLM.from_pretrained(src_dir, dtype=converted.dtype).eval()
        ids = probe_input_ids(converted.config.vocab_size)
        with torch.no_grad():
            expected = source(input_ids=ids).logits.float()
            actual = converted(input_ids=ids).logits.float()
    except Exception as error:
        if required or strict:
            raise ConversionError(f"verification could not load or run the models ({error}).") from error
        report.notes.append(f"logits not compared: {error}")
        return None
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    diff = float((expected - actual).abs().max())
    if strict:
        scale = max(1.0, float(expected.abs().max()))
        tolerance = (1e-4 if converted.dtype == torch.float32 else 1e-2) * scale
        same_tokens = bool(torch.equal(expected.argmax(-1), actual.argmax(-1)))
        if diff > tolerance or not same_tokens:
            raise ConversionError(
                f"verification failed: max |Δ logits| = {diff:.3g} (tolerance {tolerance:.3g}), same argmax tokens: "
                f"{same_tokens}; the output was discarded. Please report this with the source config."
            )
    return diff


def _change_notes(config: ResFormerConfig, variant: str, init: str, diff: float | None) -> list[str]:
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


def _short_list(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


__all__ = [
    "CONVERTIBLE_VARIANTS",
    "ConversionError",
    "ConversionReport",
    "build_resformer_config",
    "convert_llama_checkpoint",
    "probe_input_ids",
]
