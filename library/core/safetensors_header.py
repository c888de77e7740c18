"""A safetensors file's header, read without loading any tensor: its metadata (ss_*, modelspec.*) and each
tensor's dtype, shape and data offsets."""
from __future__ import annotations

import json
import os
from typing import Any

MAX_HEADER_BYTES = 100 * 2**20  # far above any real header; a larger length field means the file is not one


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """(metadata, tensors): the header's `__metadata__` and every tensor's entry by name. Raises OSError when the
    file cannot be read and ValueError when it is not a safetensors file."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: a header of {size} bytes; not a safetensors file")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object; not a safetensors file")
    metadata = header.pop("__metadata__", None) or {}
    return metadata, header
