"""Streaming weights I/O: tensor headers without reading data, and safetensors files written one tensor at a time.

Generic (imports nothing from `resformer_hf`), so memory holds one tensor rather than one shard whatever the model's
size. Pickle (`.bin`) files are opened only when the caller passes `allow_pickle=True`, and then with
`weights_only=True`; every other file is opened as safetensors, which cannot run code.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

#: safetensors' dtype names; tensors of any other dtype are refused by name.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
PICKLE_SUFFIX = ".bin"


class WeightsFileError(ValueError):
    """A weights file that cannot be read as asked; the message names the file and says why."""


@dataclass(frozen=True)
class TensorInfo:
    """What a header says about one tensor, plus the file it lives in."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    path: Path

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _StateDictView:
    """The part of `safe_open`'s interface used here, for a state dict loaded from a pickle."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def keys(self) -> list[str]:
        return list(self.state)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.state[name].contiguous()

    def get_slice(self, name: str) -> torch.Tensor:
        return self.state[name]


@contextmanager
def open_weights(path: Path, *, allow_pickle: bool = False) -> Iterator[_StateDictView | safe_open]:
    """A read-only view (`keys`, `get_slice`, `get_tensor`) of one weights file: a safetensors file memory-mapped,
    or, only when `allow_pickle` and the name ends in `.bin`, a pickle loaded with `weights_only=True`."""
    if path.suffix == PICKLE_SUFFIX and allow_pickle:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # torch raises many types for damaged or hostile pickles
            raise WeightsFileError(f"{path.name} cannot be loaded with weights_only=True ({error}).") from error
        if not isinstance(state, dict) or not all(
            isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in state.items()
        ):
            raise WeightsFileError(f"{path.name} does not hold a state dict (tensor names mapped to tensors).")
        yield _StateDictView(state)
        return
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as error:
        raise WeightsFileError(
            f"{path.name} is not a readable safetensors file ({error}); it is truncated or corrupted, download it "
            "again."
        ) from error
    with handle as view:
        yield view


def tensor_info(view, path: Path, name: str) -> TensorInfo:
    """Shape and dtype from the header only (no tensor data is read from a safetensors file)."""
    header = view.get_slice(name)
    if isinstance(header, torch.Tensor):
        shape, dtype, dtype_name = tuple(header.shape), header.dtype, str(header.dtype)
    else:
        dtype_name = header.get_dtype()
        shape, dtype = tuple(header.get_shape()), SAFETENSORS_DTYPES.get(dtype_name)
    if dtype not in DTYPE_NAMES:
        raise WeightsFileError(f"{path.name}: tensor {name} has dtype {dtype_name}, which cannot be converted; only "
                               "float, int and bool tensors are supported.")
    return TensorInfo(shape, dtype, path)


def read_inventory(paths: Iterable[Path], *, allow_pickle: bool = False) -> dict[str, TensorInfo]:
    """Every tensor of every file, from the headers, in file order; a name in two files is an error."""
    inventory: dict[str, TensorInfo] = {}
    for path in paths:
        with open_weights(path, allow_pickle=allow_pickle) as view:
            for name in view.keys():
                if name in inventory:
                    raise WeightsFileError(
                        f"tensor {name} appears in both {inventory[name].path.name} and {path.name}; the index or the "
                        "files are inconsistent."
                    )
                inventory[name] = tensor_info(view, path, name)
    return inventory


def storage_order(layout: Mapping[str, TensorInfo]) -> list[str]:
    """The order `safetensors.torch.save_file` stores tensors in: largest dtype first, so each is aligned."""
    return sorted(layout, key=lambda name: -layout[name].dtype.itemsize)


def write_file(
    path: Path,
    layout: Mapping[str, TensorInfo],
    read: Callable[[str], torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write one safetensors file tensor by tensor, so memory holds one tensor rather than the whole file.

    `layout` gives each output tensor's shape and dtype (the header is written first from it); `read(name)` returns
    the tensor, called once per name in `storage_order`. The bytes are what `save_file` writes: an 8-byte
    little-endian header length, the JSON header padded with spaces to 8 bytes, the tensors back to back. The file is
    re-opened with `safe_open` afterwards as a check.
    """
    if sys.byteorder != "little":
        raise WeightsFileError("safetensors files are little-endian; write them on a little-endian machine.")
    order = storage_order(layout)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name in order:
        info = layout[name]
        header[name] = {"dtype": DTYPE_NAMES[info.dtype], "shape": list(info.shape),
                        "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header_bytes)))
        handle.write(header_bytes)
        for name in order:
            tensor = read(name)
            if tuple(tensor.shape) != layout[name].shape or tensor.dtype != layout[name].dtype:
                raise WeightsFileError(f"{path.name}: tensor {name} is {tuple(tensor.shape)} {tensor.dtype}, but the "
                                       f"header says {layout[name].shape} {layout[name].dtype}.")
            handle.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor  # drop the last reference (and any source mapping) before the next tensor is read
    with safe_open(str(path), framework="pt") as written:  # raises if header and data disagree
        if set(written.keys()) != set(order):
            raise WeightsFileError(f"{path.name} was written with the wrong tensors.")


__all__ = [
    "DTYPE_NAMES",
    "SAFETENSORS_DTYPES",
    "TensorInfo",
    "WeightsFileError",
    "open_weights",
    "read_inventory",
    "storage_order",
    "tensor_info",
    "write_file",
]
