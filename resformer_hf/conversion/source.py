"""The conversion's source: a local directory or a Hub id, its `config.json`, its weight files and side files.

Everything here only reads SRC. Weight files are found through the index the way transformers finds them, with two
rules a downloaded checkpoint cannot bend: every file the index names is a plain file name inside SRC, and a
safetensors index names only safetensors files (pickles are read only with `allow_pickle`, from a pickle index or a
single `pytorch_model.bin`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path, PurePosixPath, PureWindowsPath

from .report import ConversionError, short_list

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

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_source(src: str | os.PathLike, *, allow_pickle: bool) -> tuple[Path, str]:
    """(local directory, name for the model card): a directory is used as is, a repo id is fetched to the HF cache."""
    if not os.fspath(src).strip():
        raise ConversionError("SRC is empty (an unset shell variable?); pass a checkpoint directory or a Hub repo id.")
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


def read_source_config(src_dir: Path) -> dict:
    """`config.json` as a dict with a string `model_type` (its fields are checked by `config.check_source_config`)."""
    path = src_dir / "config.json"
    if not path.is_file():
        raise ConversionError(f"{src_dir} has no config.json; pass the directory written by save_pretrained.")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        message = f"{path} is not valid JSON ({error}); restore it from the original checkpoint."
        raise ConversionError(message) from error
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConversionError(f"{path} has no model_type string; it is not a transformers model config.")
    return config


def _index_shards(index_path: Path, suffix: str) -> list[str]:
    """The shard file names an index names, in order, each a plain name ending in `suffix`."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{index_path} is not valid JSON ({error}); restore it.") from error
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in weight_map.items()
    ):
        raise ConversionError(
            f"{index_path.name}: weight_map must map tensor names to shard file names (a JSON object of strings); "
            "restore the index."
        )
    names = list(dict.fromkeys(weight_map.values()))
    for name in names:
        plain = PurePosixPath(name).name == name and PureWindowsPath(name).name == name and name not in ("", ".", "..")
        if not plain:
            raise ConversionError(
                f"{index_path.name} names the shard {name!r}, which is not a file name inside SRC; refusing to read "
                "files outside the checkpoint. Restore the index."
            )
        if not name.endswith(suffix):
            raise ConversionError(
                f"{index_path.name} names the shard {name!r}, which is not a {suffix} file; this index may only name "
                f"{suffix} shards. Restore the index."
            )
    return names


def find_source_shards(src_dir: Path, *, allow_pickle: bool) -> list[Path]:
    """The weight files of SRC, in order; the index may name only existing files inside SRC of its own format."""
    for index_name, single_name, suffix in (
        (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, ".safetensors"),
        (PICKLE_WEIGHTS_INDEX_NAME, PICKLE_WEIGHTS_NAME, ".bin"),
    ):
        index_path, single_path = src_dir / index_name, src_dir / single_name
        if not index_path.is_file() and not single_path.is_file():
            continue
        if suffix == ".bin" and not allow_pickle:
            raise ConversionError(
                f"{src_dir} holds only pickle weights ({index_name if index_path.is_file() else single_name}), which "
                "can run code when loaded; pass allow_pickle=True (--allow-pickle) if you trust them (they are then "
                "loaded with weights_only=True)."
            )
        if not index_path.is_file():
            return [single_path]
        names = _index_shards(index_path, suffix)
        missing = [name for name in names if not (src_dir / name).is_file()]
        if missing:
            raise ConversionError(
                f"shard(s) named in {index_name} are missing from {src_dir}: {short_list(missing)}; download them "
                "again."
            )
        return [src_dir / name for name in names]
    raise ConversionError(f"{src_dir} has no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}; nothing to convert.")


def output_shard_name(source: Path, count: int) -> str:
    """The safetensors name an output shard gets: the source's, or the pickle name turned into safetensors."""
    if source.suffix == ".safetensors":
        return source.name
    if count == 1:
        return SAFE_WEIGHTS_NAME
    return source.name.replace("pytorch_model", "model").removesuffix(".bin") + ".safetensors"


def copy_side_files(src_dir: Path, destination: Path) -> list[str]:
    """Copy the tokenizer, generation defaults and licence files of SRC; returns their names."""
    copied = []
    for pattern in COPIED_FILE_PATTERNS:
        for path in sorted(src_dir.glob(pattern)):
            if path.is_file() and path.name not in copied:
                shutil.copyfile(path, destination / path.name)
                copied.append(path.name)
    return copied


__all__ = [
    "COPIED_FILE_PATTERNS",
    "copy_side_files",
    "find_source_shards",
    "output_shard_name",
    "read_source_config",
    "resolve_source",
]
