"""The registered families, and what is done by looping over them: telling a base model's family from its folder
or file and loading it, the tiny builders, and the network modules that train each family.

Adding a family adds one line to ENTRIES; nothing here names a family.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from library.config import UserError
from library.core.memory import return_free_heap
from library.families.chroma.entry import ENTRY as CHROMA
from library.families.entry import FILE_OPTIONS, FamilyEntry, LoadRequest, TinyModel
from library.families.family import Components
from library.families.flux.entry import ENTRY as FLUX
from library.families.qwen_image.entry import ENTRY as QWEN_IMAGE
from library.families.sd.entry import ENTRY as SD
from library.families.sd.single_file import file_tokenizer
from library.families.sd3.entry import ENTRY as SD3
from library.families.z_image.entry import ENTRY as Z_IMAGE

logger = logging.getLogger(__name__)

ENTRIES: tuple[FamilyEntry, ...] = (SD, FLUX, CHROMA, SD3, Z_IMAGE, QWEN_IMAGE)


def entry_for(path: str | Path) -> FamilyEntry:
    """The entry whose folder or file `path` is. Detectors are exclusive; what none recognises goes to the entry
    that reads unrecognised files and folders (its reader says what they are)."""
    path = Path(path)
    recognises = (lambda entry: entry.is_file(path)) if path.is_file() else (lambda entry: entry.is_folder(path))
    found = [entry for entry in ENTRIES if not entry.reads_unrecognised and recognises(entry)]
    if len(found) > 1:
        raise RuntimeError(f"{path}: recognised by several families ({', '.join(e.name for e in found)}); their "
                           "detectors must be exclusive")
    if found:
        return found[0]
    return next(entry for entry in ENTRIES if entry.reads_unrecognised)


def load_components(model_path: str | Path, v2: bool = False, v_parameterization: bool = False,
                    weight_dtype: torch.dtype = torch.float32,
                    vae_dtype: torch.dtype = torch.float32, model_config: str | Path | None = None,
                    allow_pickle_checkpoints: bool = False, **files: str | None) -> Components:
    """Load the denoiser, VAE, text encoders, tokenizers and noise schedule of a local diffusers folder or single
    file, of whichever registered family it is. `files` are the separate files a single transformer file is
    loaded with (FILE_OPTIONS: clip_l, clip_g, t5xxl, ae, text_encoder); `model_config` describes a single file's
    widths.

    Weights are loaded straight into their training dtype (casting afterwards makes diffusers warn and doubles
    the peak memory of the load), and the heap pages the load freed go back to the system.
    """
    unknown = sorted(set(files) - set(FILE_OPTIONS))
    if unknown:
        raise TypeError(f"load_components: unknown file options {unknown}")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    path = Path(model_path)
    request = LoadRequest(path=path, weight_dtype=weight_dtype, vae_dtype=vae_dtype,
                          model_config=None if model_config is None else str(model_config), files=files, v2=v2,
                          v_parameterization=v_parameterization, allow_pickle_checkpoints=allow_pickle_checkpoints)
    try:
        entry = entry_for(path)
        _check_file_options(entry, request)
        return entry.load_file(request) if path.is_file() else entry.load_folder(request)
    finally:
        return_free_heap()  # the read and converted copies of the weights: 0.4-1 GiB for SDXL


def _check_file_options(entry: FamilyEntry, request: LoadRequest) -> None:
    """A separate file the family's files are not loaded with is a mistake, not something to ignore."""
    takes = entry.file_options if request.path.is_file() else ()
    extra = [name for name in FILE_OPTIONS if request.file(name) and name not in takes]
    if not extra:
        return
    readers = [f"{e.title} ({', '.join(o for o in e.file_options)})" for e in ENTRIES if e.file_options]
    what = f"a {entry.title} file" if request.path.is_file() else "a folder, which brings its own parts"
    raise UserError(f"{', '.join(extra)}: not read for {request.path} ({what}); separate files go with a "
                    f"transformer file: {'; '.join(readers)}")


def tiny_models() -> dict[str, TinyModel]:
    """Every registered tiny builder by its --family name."""
    return {tiny.name: tiny for entry in ENTRIES for tiny in entry.tiny}


def network_modules() -> dict[str, tuple[str, ...]]:
    """network_module name -> the families it trains."""
    modules: dict[str, list[str]] = {}
    for entry in ENTRIES:
        for module in entry.network_modules:
            modules.setdefault(module, []).append(entry.name)
    return {module: tuple(names) for module, names in modules.items()}


def caption_tokenizer(model: str | Path | None, model_config: str | Path | None = None) -> Any:
    """The model's (first) CLIP tokenizer, loaded without the model (for --dataset_check): its tokenizer/ folder,
    or for a single .safetensors file the shipped (or model_config) tokenizer of the architecture its keys show.
    None when neither can be had."""
    if model is None:
        return None
    try:
        from transformers import CLIPTokenizer

        if Path(model, "tokenizer").is_dir():
            tokenizer = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer", local_files_only=True)
        elif Path(model).is_file() and Path(model).suffix.lower() == ".safetensors":
            tokenizer = file_tokenizer(Path(model), model_config)
        else:
            return None
    except Exception as e:  # noqa: BLE001 - the report still works without token counts
        logger.info("no tokenizer for the dataset check (%s); captions are not tokenized", e)
        return None
    # transformers 5 returns an empty tokenizer instead of failing when the vocabulary files are missing.
    return tokenizer if len(tokenizer) > 256 and tokenizer.model_max_length < 100_000 else None
