"""Reading a transformer family's diffusers folder offline: which family a folder holds (its transformer's class
name) and each subfolder through its class's `from_pretrained`, with one message for a folder that is not whole or
cannot be read; and the Components a transformer family's loaders (folder or files) return."""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from library.config import UserError
from library.families.family import Components, Family
from library.families.loading import LoadRequest, empty_model


def _class_name(config: Path) -> str | None:
    try:
        return json.loads(config.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None


def transformer_class(path: Path) -> str | None:
    """The `_class_name` of a diffusers folder's transformer/config.json, or None."""
    return _class_name(path / "transformer" / "config.json")


def pipeline_class(path: Path) -> str | None:
    """The pipeline a diffusers folder's model_index.json names, or None."""
    return _class_name(path / "model_index.json")


def read_folder(path: Path, model: str, parts: Mapping[str, tuple[Any, torch.dtype | None]],
                empty: Sequence[str] = ()) -> dict[str, Any]:
    """Each subfolder named in `parts` through its class's from_pretrained, local files only: models in their dtype,
    tokenizers and schedulers with None. Those named in `empty` are built from their config on the meta device,
    their weights not read (loading.empty_model). A missing subfolder, or one that cannot be read, is a UserError
    naming `model`."""
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
            if name in empty:
                loaded[name] = empty_model(cls, path, name, dtype)
                continue
            loaded[name] = cls.from_pretrained(path, subfolder=name, **options)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot load the {model} model: {e}") from None
    return loaded


def load_folder(request: LoadRequest, model: str, classes: Mapping[str, Any],
                family: Callable[[Any, list[Any]], Family], vae_view: Callable[[Any], Any] | None = None) -> Components:
    """A transformer family's diffusers folder at request.path, each subfolder of `classes` read by its class
    (read_folder): the VAE in request.vae_dtype, tokenizers and the scheduler as they are, the other models in
    request.weight_dtype. Its text encoders and tokenizers are the subfolders named text_encoder... and
    tokenizer..., in the order of `classes`; `family(transformer, text_encoders)` is the loaded model's family."""

    def dtype(name: str) -> torch.dtype | None:
        if name == "vae":
            return request.vae_dtype
        return None if name.startswith("tokenizer") or name == "scheduler" else request.weight_dtype

    parts = read_folder(request.path, model, {name: (cls, dtype(name)) for name, cls in classes.items()},
                        empty=[name for name in classes if request.skips(name)])
    encoders = [parts[name] for name in classes if name.startswith("text_encoder")]
    return transformer_components(parts["transformer"], parts["vae"], encoders,
                                  [parts[name] for name in classes if name.startswith("tokenizer")],
                                  parts["scheduler"], family(parts["transformer"], encoders), vae_view)


def transformer_components(transformer: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                           scheduler: Any, family: Family, vae_view: Callable[[Any], Any] | None = None) -> Components:
    """The Components of a transformer family (no v-prediction), its models in eval mode; `vae_view` wraps the
    VAE afterwards for the loop (Qwen-Image's)."""
    for module in (transformer, vae, *text_encoders):
        module.eval()
    return Components(denoiser=transformer, vae=vae if vae_view is None else vae_view(vae),
                      text_encoders=list(text_encoders), tokenizers=list(tokenizers), noise_scheduler=scheduler,
                      v_prediction=False, family=family)
