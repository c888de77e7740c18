"""Reading safetensors files one tensor at a time, each cast to the training dtype as it is read.

`safetensors.torch.load_file` returns the whole file at once, so a file in another dtype than the training one
sits in memory beside its cast copy until the caller drops it; and the pages of a memory-mapped file that a load
touches count as the process's memory until the file is closed. Reading each tensor with plain file reads and
casting it right away keeps one tensor of the file in memory at a time.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from library.config import UserError
from library.memory.precision import read_dtype

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_safetensors(path: Path, prefix: str = "", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file whose keys start with `prefix`, floating ones cast to `dtype` (when given)
    one by one. A memory map instead of these reads put SD1.5's fp16 UNet beside its bf16 copy: 1.7 GB more at the
    peak."""
    with SafetensorsFile(path) as f:
        return {key: f.read(key, dtype) for key in f.keys() if key.startswith(prefix)}


class SafetensorsFile:
    """A safetensors file whose tensors are read one at a time, by name, in any order (a loader that converts and
    quantizes each layer as it is read holds one layer of the file at a time)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._file = self.path.open("rb")
            size = int.from_bytes(self._file.read(8), "little")
            header = json.loads(self._file.read(size))
            self._base = 8 + size
            self._entries = {key: entry for key, entry in header.items() if key != "__metadata__"}
            for entry in self._entries.values():
                entry["data_offsets"], entry["shape"], entry["dtype"]  # noqa: B018 - a malformed header fails here
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            if hasattr(self, "_file"):
                self._file.close()
            raise UserError(f"{path}: not a readable safetensors file ({e})") from None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def keys(self) -> list[str]:
        return list(self._entries)

    def read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `key`, cast to `dtype` when it is floating (under library.memory.precision.reading, the base's
        matrices are read in their storage dtype instead)."""
        from safetensors import SafetensorError

        entry = self._entries[key]
        try:
            stored = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if stored is None:  # other rare dtypes: safetensors' own reader
                return _read_mapped(self.path, [key], dtype)[key]
            start, end = entry["data_offsets"]
            self._file.seek(self._base + start)
            raw = torch.empty(end - start, dtype=torch.uint8)  # not zero-filled, unlike a bytearray
            if self._file.readinto(raw.numpy()) != end - start:
                raise OSError(f"{key}: the file ends inside its data")
            low = read_dtype(self.path, key, stored, entry["shape"])
            return _cast(raw.view(stored).reshape(entry["shape"]), low or dtype)
        except (OSError, ValueError, TypeError, RuntimeError, SafetensorError) as e:
            raise UserError(f"{self.path}: not a readable safetensors file ({e})") from None


def _read_mapped(path: Path, keys: list[str], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {k: _cast(f.get_tensor(k), dtype) for k in keys}


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
