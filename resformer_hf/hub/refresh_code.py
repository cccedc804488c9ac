"""`resformer-convert --refresh-code`: give a saved ResFormer folder this plugin's remote code, all or nothing.

Everything is checked before anything is written: `config.json` parses, is a ResFormer config that `ResFormerConfig`
accepts and that describes the weights beside it, its `auto_map` is well-formed, and every target is a regular file.
Then `file_transaction.replace_files` writes all files or none: a refused or failed refresh leaves the folder
byte-identical (no staging file survives), and a run killed midway is undone and completed by the next run.
`config.json` changes only in its `auto_map` value: the rest of its text (key order, non-ASCII, number spelling) is
kept as written.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers.dynamic_module_utils import custom_object_save

from ..errors import UserInputError
from ..registration import full_auto_map
from ..remote_code.configuration_resformer import ResFormerConfig
from ..remote_code.loading import check_value_projections
from ..remote_code.modeling_resformer import ResFormerForCausalLM, ResFormerModel
from .file_transaction import folder_lock, replace_files

# Modules that import nothing of their own are renamed into place first, the entry points (config, modeling) last.
_ENTRY_MODULES = ("configuration_resformer.py", "modeling_resformer.py")
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads")
_HEADS = ("lm_head.", "score.", "qa_outputs.")  # task heads: not part of the base model the config describes


def refresh_remote_code(directory: str | os.PathLike) -> list[str]:
    """Replace the remote code a ResFormer folder ships (and its `auto_map`) with this plugin's, in place.

    For folders published by an older plugin: their code may not know the transformers release a user runs (5.24
    renamed the cache argument), and `trust_remote_code=True` without the plugin runs whatever the folder holds.
    Only the `.py` files the model's code consists of and `config.json`'s `auto_map` change. Raises
    `UserInputError` (naming the file and the problem) with the folder unchanged if anything would fail. Returns
    the names of the files written.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise UserInputError(f"{directory} is not a folder: pass the folder of a saved ResFormer model.")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UserInputError(f"{directory} is not writable: no file can be replaced there; nothing was changed.")
    with folder_lock(directory) as put_back:
        if put_back is not None:
            warnings.warn(f"{directory}: an interrupted --refresh-code was undone before this run (originals put "
                          f"back: {', '.join(put_back) or 'none'}; its staging files removed)", stacklevel=2)
        config_path = directory / "config.json"
        text, config = _read_config(directory, config_path)
        _check_auto_map(config_path, config.get("auto_map"))
        _check_describes_the_weights(directory, config_path, _accepted_config(config_path, config))
        new_config = _with_auto_map(text, {**(config.get("auto_map") or {}), **full_auto_map()})
        with tempfile.TemporaryDirectory() as fresh:
            custom_object_save(ResFormerForCausalLM, fresh)
            code = sorted(Path(fresh).glob("*.py"), key=lambda path: (path.name in _ENTRY_MODULES, path.name))
            contents = {directory / path.name: path.read_bytes() for path in code}
        contents[config_path] = new_config.encode("utf-8")
        _check_targets(contents)
        replace_files(directory, contents)
    # An older release's module today's code does not import (value_mixing.py): never deleted, but said.
    unused = sorted(path.name for path in directory.glob("*.py") if path not in contents)
    if unused:
        warnings.warn(f"{directory}: left as they were: {', '.join(unused)} (the refreshed code does not import them; "
                      "delete them if nothing else needs them)", stacklevel=2)
    return [target.name for target in contents]


def _read_config(directory: Path, config_path: Path) -> tuple[str, dict[str, Any]]:
    if not config_path.is_file():
        raise UserInputError(f"{directory} has no config.json: pass the folder of a saved ResFormer model.")
    try:
        text = config_path.read_bytes().decode("utf-8")
        config = json.loads(text)
    except (UnicodeDecodeError, ValueError) as error:
        raise UserInputError(f"{config_path} is not valid JSON ({error}); nothing was changed.") from error
    except RecursionError:
        raise UserInputError(
            f"{config_path} is nested too deeply to be a model config; nothing was changed."
        ) from None
    if not isinstance(config, dict) or config.get("model_type") != ResFormerConfig.model_type:
        found = config.get("model_type") if isinstance(config, dict) else None
        raise UserInputError(
            f"{config_path} has model_type {found!r}, not {ResFormerConfig.model_type!r}: only ResFormer folders "
            "ship this plugin's code; nothing was changed."
        )
    return text, config


def _check_auto_map(config_path: Path, auto_map: Any) -> None:
    """`auto_map` is absent, null or maps class names to "module.Class" (a [slow, fast] pair for tokenizers)."""
    def reference(value: Any) -> bool:
        return isinstance(value, str) and "." in value

    def well_formed(value: Any) -> bool:
        return reference(value) or (
            isinstance(value, list) and len(value) == 2 and all(item is None or reference(item) for item in value)
        )

    if auto_map is None:
        return
    if not isinstance(auto_map, Mapping):
        raise UserInputError(
            f"{config_path}: auto_map must be an object mapping Auto classes to \"module.Class\", got "
            f"{type(auto_map).__name__} {_short(auto_map)}; fix or remove it, nothing was changed."
        )
    for key, value in auto_map.items():
        if not well_formed(value):
            raise UserInputError(
                f"{config_path}: auto_map[{key!r}] must be \"module.Class\", got {_short(value)}; fix or remove it, "
                "nothing was changed."
            )


def _accepted_config(config_path: Path, config: dict[str, Any]) -> ResFormerConfig:
    """The config as `ResFormerConfig` reads it, with positive integer sizes (transformers 5.19 checks no types)."""
    for name in _SIZES:
        value = config.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserInputError(
                f"{config_path}: {name}={_short(value)} must be a positive integer; nothing was changed."
            )
    fields = {key: value for key, value in config.items() if key != "auto_map"}
    try:
        return ResFormerConfig.from_dict(fields)
    except Exception as error:  # ValueError, TypeError, transformers' strict-dataclass errors
        raise UserInputError(
            f"{config_path} is not a valid ResFormer config ({_short(error, 300)}); nothing was changed."
        ) from None


def _check_describes_the_weights(directory: Path, config_path: Path, config: ResFormerConfig) -> None:
    """The safetensors weights beside the config load into the model it describes: same tensor shapes, and the
    value projections of its variant (`loading.check_value_projections`, what `from_pretrained` refuses)."""
    shapes = _checkpoint_shapes(directory)
    if not shapes:
        return  # no safetensors weights (a config-only folder, or pickled weights): nothing to compare
    try:
        with torch.device("meta"):
            expected = {key: tuple(tensor.shape) for key, tensor in ResFormerModel(config).state_dict().items()}
    except Exception as error:
        raise UserInputError(
            f"{config_path} describes no buildable model ({_short(error, 300)}); nothing was changed."
        ) from None
    missing = [key for key in expected if key not in shapes]
    unexpected = [key for key in shapes if key not in expected]
    if len(missing) == len(expected):
        raise UserInputError(
            f"{config_path}: the weights in {directory} share no tensor with the model it describes; nothing was "
            "changed."
        )
    wrong = [key for key in expected if key in shapes and shapes[key] != expected[key]]
    if wrong:
        raise UserInputError(
            f"{config_path} does not describe the weights beside it: {wrong[0]} has shape {list(shapes[wrong[0]])}, "
            f"the config gives {list(expected[wrong[0]])}; nothing was changed."
        )
    try:
        check_value_projections(config, missing, unexpected)
    except ValueError as error:
        raise UserInputError(f"{config_path}: {error} Nothing was changed.") from None


def _checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of the folder's safetensors weights (headers only), keys as the base model names them."""
    index = directory / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        else:
            files = ["model.safetensors"] if (directory / "model.safetensors").is_file() else []
        shapes = {}
        for name in files:
            with safe_open(directory / name, framework="pt") as weights:
                for key in weights.keys():
                    if not key.startswith(_HEADS):
                        base_key = key.removeprefix(f"{ResFormerModel.base_model_prefix}.")
                        shapes[base_key] = tuple(weights.get_slice(key).get_shape())
        return shapes
    except Exception as error:
        raise UserInputError(
            f"{directory}: its safetensors weights cannot be read ({_short(error, 200)}); nothing was changed."
        ) from None


def _with_auto_map(text: str, auto_map: dict[str, Any]) -> str:
    """`text` (a JSON object) with its top-level `auto_map` value replaced, or the member appended; nothing else
    changes. The new value is indented (one step per level) like the object's first member."""
    members, closing = _top_level_members(text)
    indent = _indent_before(text, next(iter(members.values()))[0]) if members else "  "
    value = json.dumps(auto_map, indent=indent, ensure_ascii=False).replace("\n", "\n" + indent)
    if "auto_map" in members:
        start, end = members["auto_map"][1:]
        return text[:start] + value + text[end:]
    member = f'"auto_map": {value}'
    if not members:
        return text[:closing] + f"\n{indent}{member}\n" + text[closing:]
    last_end = max(end for _, _, end in members.values())
    return text[:last_end] + f",\n{indent}{member}" + text[last_end:]


_SPACE = re.compile(r"[ \t\n\r]*")


def _top_level_members(text: str) -> tuple[dict[str, tuple[int, int, int]], int]:
    """{key: (key start, value start, value end)} of a JSON object's members, and the index of its closing brace."""
    decoder = json.JSONDecoder()
    position = _SPACE.match(text, 0).end() + 1  # past "{"
    members: dict[str, tuple[int, int, int]] = {}
    position = _SPACE.match(text, position).end()
    while text[position] != "}":
        key_start = position
        key, position = json.decoder.scanstring(text, position + 1)
        position = _SPACE.match(text, _SPACE.match(text, position).end() + 1).end()  # past ":"
        _, end = decoder.raw_decode(text, position)
        members[key] = (key_start, position, end)
        position = _SPACE.match(text, end).end()
        if text[position] == ",":
            position = _SPACE.match(text, position + 1).end()
    return members, position


def _indent_before(text: str, position: int) -> str:
    line_start = text.rfind("\n", 0, position) + 1
    return text[line_start:position] if text[line_start:position].isspace() else "  "


def _check_targets(contents: Mapping[Path, bytes]) -> None:
    for target in contents:
        if target.is_symlink() or (target.exists() and not target.is_file()):
            raise UserInputError(
                f"{target} is not a regular file, so it cannot be replaced; move it away first. Nothing was changed."
            )


def _short(value: Any, limit: int = 80) -> str:
    text = " ".join(str(value if isinstance(value, BaseException) else repr(value)).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["refresh_remote_code"]
