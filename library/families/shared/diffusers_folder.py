"""Reading a transformer family's diffusers folder offline: which family a folder holds (its transformer's class
name) and each subfolder through its class's `from_pretrained`, with one message for a folder that is not whole or
cannot be read."""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from library.config import UserError


def transformer_class(path: Path) -> str | None:
    """The `_class_name` of a diffusers folder's transformer/config.json, or None."""
    try:
        return json.loads((path / "transformer" / "config.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None


def read_folder(path: Path, model: str, parts: Mapping[str, tuple[Any, torch.dtype | None]]) -> dict[str, Any]:
    """Each subfolder named in `parts` through its class's from_pretrained, local files only: models in their dtype,
    tokenizers and schedulers with None. A missing subfolder, or one that cannot be read, is a UserError naming
    `model`."""
    from diffusers import ModelMixin

    missing = [name for name in parts if not (path / name).is_dir()]
    if missing:
        raise UserError(f"{path}: not a {model} diffusers folder; missing {', '.join(missing)}/")
    loaded = {}
    try:
        for name, (cls, dtype) in parts.items():
            options: dict[str, Any] = {"local_files_only": True}
            if dtype is not None:  # diffusers' models take torch_dtype, transformers' dtype
                options["torch_dtype" if issubclass(cls, ModelMixin) else "dtype"] = dtype
            loaded[name] = cls.from_pretrained(path, subfolder=name, **options)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot load the {model} model: {e}") from None
    return loaded
