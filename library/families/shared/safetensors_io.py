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
    from safetensors import SafetensorError

    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            base = 8 + size
            out: dict[str, torch.Tensor] = {}
            for key, entry in header.items():
                if key == "__metadata__" or not key.startswith(prefix):
                    continue
                stored = _SAFETENSORS_DTYPES.get(entry["dtype"])
                if stored is None:  # other rare dtypes: safetensors' own reader
                    out.update(_read_mapped(path, [key], dtype))
                    continue
                start, end = entry["data_offsets"]
                f.seek(base + start)
                raw = torch.empty(end - start, dtype=torch.uint8)  # not zero-filled, unlike a bytearray
                if f.readinto(raw.numpy()) != end - start:
                    raise OSError(f"{key}: the file ends inside its data")
                # Under library.memory.precision.reading, the base's matrices are read in their storage dtype.
                low = read_dtype(path, key, stored, entry["shape"])
                out[key] = _cast(raw.view(stored).reshape(entry["shape"]), low or dtype)
            return out
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({e})") from None


def _read_mapped(path: Path, keys: list[str], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {k: _cast(f.get_tensor(k), dtype) for k in keys}


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
