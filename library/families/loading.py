"""Loading a base model of whichever registered family it is, and what loaders take (LoadRequest)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from library.config import Config, UserError
from library.core.memory import return_free_heap
from library.families.entry import FamilyEntry
from library.families.family import Components
from library.families.registry import ENTRIES, entry_for, file_options
from library.families.sd.single_file import file_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadRequest:
    """What loading a base model needs, as values: the path, the dtypes, the separate files, which variant the user
    says the weights are (model_version, for the families whose files do not tell) and SD's options."""
    path: Path
    weight_dtype: torch.dtype = torch.float32
    vae_dtype: torch.dtype = torch.float32
    model_config: str | None = None  # a diffusers folder describing a single file's widths
    files: Mapping[str, str | None] = field(default_factory=dict)  # registry.file_options() -> path or None
    model_version: str | None = None
    v2: bool = False
    v_parameterization: bool = False
    allow_pickle_checkpoints: bool = False
    # The parts not read ("denoiser", "text", "vae"): a loader that honours it (a transformer family's diffusers
    # folder, FLUX.1's and Qwen-Image's files: `reads_by_part`) builds them from their config on the meta device,
    # so that a run by phase reads the text encoders without the denoiser and then the denoiser alone. Other loaders
    # read every part.
    skip: frozenset[str] = frozenset()

    def skips(self, folder: str) -> bool:
        """Whether the diffusers subfolder `folder` (transformer, text_encoder_2, vae ...) is one not read."""
        part = "denoiser" if folder in ("transformer", "unet") else "text" if folder.startswith("text_encoder") \
            else "vae" if folder == "vae" else None
        return part in self.skip

    def file(self, name: str) -> str | None:
        return self.files.get(name)

    def required_files(self, names: tuple[str, ...], family: str, what: str) -> list[str]:
        """The separate files `names` that a `family` transformer file is loaded with; a UserError names the missing
        ones (`what` says which files they are)."""
        files = [self.file(name) for name in names]
        missing = [name for name, file in zip(names, files, strict=True) if not file]
        if missing:
            raise UserError(f"{self.path} is a {family} transformer file: it needs {' and '.join(missing)} ({what})")
        return [str(file) for file in files]


def load_components(model_path: str | Path, v2: bool = False, v_parameterization: bool = False,
                    weight_dtype: torch.dtype = torch.float32,
                    vae_dtype: torch.dtype = torch.float32, model_config: str | Path | None = None,
                    allow_pickle_checkpoints: bool = False, model_version: str | None = None,
                    skip: frozenset[str] = frozenset(), **files: str | None) -> Components:
    """Load the denoiser, VAE, text encoders, tokenizers and noise schedule of a local diffusers folder or single
    file, of whichever registered family it is. `files` are the separate files a single transformer file is
    loaded with (registry.file_options(): clip_l, t5xxl, ae ...); `model_config` describes a single file's
    widths; `model_version` is the variant the user says the weights are (the family checks it); `skip` names the
    parts not read (LoadRequest.skip; only where `reads_by_part`).

    Weights are loaded straight into their training dtype (casting afterwards makes diffusers warn and doubles
    the peak memory of the load), and the heap pages the load freed go back to the system.
    """
    unknown = sorted(set(files) - set(file_options()))
    if unknown:
        raise TypeError(f"load_components: unknown file options {unknown}")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    path = Path(model_path)
    request = LoadRequest(path=path, weight_dtype=weight_dtype, vae_dtype=vae_dtype,
                          model_config=None if model_config is None else str(model_config), files=files,
                          model_version=model_version, v2=v2, v_parameterization=v_parameterization,
                          allow_pickle_checkpoints=allow_pickle_checkpoints, skip=frozenset(skip))
    try:
        entry = entry_for(path)
        _check_file_options(entry, request)
        _check_model_version(entry, request)
        return entry.load_file(request) if path.is_file() else entry.load_folder(request)
    finally:
        return_free_heap()  # the read and converted copies of the weights: 0.4-1 GiB for SDXL


# The entries whose diffusers folders are read through shared.diffusers_folder.load_folder alone, which honours
# LoadRequest.skip. Wan's reads its second expert apart. Files: FamilyEntry.files_read_by_part.
_READ_BY_PART = ("flux", "flux2", "qwen_image", "chroma", "sd3", "z_image")


def reads_by_part(model_path: str | Path | None) -> bool:
    """Whether the model's loader reads only the parts asked (LoadRequest.skip): a diffusers folder of a
    transformer family whose folder loader honours it, or a file of one whose file loader does
    (FamilyEntry.files_read_by_part)."""
    if model_path is None or not Path(model_path).exists():
        return False
    path = Path(model_path)
    try:
        entry = entry_for(path)
    except UserError:
        return False
    return entry.name in _READ_BY_PART if path.is_dir() else entry.files_read_by_part


def empty_model(cls: Any, path: Path, subfolder: str, dtype: torch.dtype | None) -> Any:
    """A diffusers or transformers model of `cls` built from `path`/`subfolder`'s config on the meta device: its
    modules and config as loaded, no weight read or allocated."""
    from diffusers import ModelMixin

    with torch.device("meta"):
        if issubclass(cls, ModelMixin):
            model = cls.from_config(cls.load_config(path, subfolder=subfolder, local_files_only=True))
        else:
            from transformers import AutoConfig

            model = cls._from_config(AutoConfig.from_pretrained(path, subfolder=subfolder, local_files_only=True))
    # Module.to: diffusers' own warns about fp32-kept modules, which a model without weights does not have yet.
    return model if dtype is None else torch.nn.Module.to(model, dtype)


def _check_file_options(entry: FamilyEntry, request: LoadRequest) -> None:
    """A separate file the family's files are not loaded with is a mistake, not something to ignore."""
    takes = (*entry.file_options, *entry.optional_file_options) if request.path.is_file() else ()
    extra = [name for name in file_options() if request.file(name) and name not in takes]
    if not extra:
        return
    readers = [f"{e.title} ({', '.join((*e.file_options, *e.optional_file_options))})" for e in ENTRIES
               if e.file_options]
    what = f"a {entry.title} file" if request.path.is_file() else "a folder, which brings its own parts"
    raise UserError(f"{', '.join(extra)}: not read for {request.path} ({what}); separate files go with a "
                    f"transformer file: {'; '.join(readers)}")


def _check_model_version(entry: FamilyEntry, request: LoadRequest) -> None:
    """model_version for a family that has no variants to tell is a mistake, not something to ignore."""
    if request.model_version is None or any(option.name == "model_version" for option in entry.options):
        return
    readers = [e.title for e in ENTRIES if any(option.name == "model_version" for option in e.options)]
    raise UserError(f"model_version {request.model_version!r}: not read for {request.path} (a {entry.title} model); "
                    f"it tells the variant of {', '.join(readers)} weights; remove it")


def musubi_autoencoder(config: Config) -> Config:
    """musubi-tuner names a transformer file's autoencoder file `vae` (kohya: `ae`, keeping `vae` for a replacement
    VAE). For a transformer file whose family takes `ae`, a `vae` without `ae` is musubi's: the config with it read
    as `ae`. Any other config is returned as it is."""
    path = config.pretrained_model_name_or_path
    if (config.vae is None or config.ae is not None or path is None or not Path(path).is_file()
            or "ae" not in entry_for(path).file_options):
        return config
    logger.info("vae %s: the autoencoder file of %s (musubi-tuner's --vae), read as ae", config.vae, path)
    values = {**config.as_dict(), "ae": config.vae, "vae": None}
    explicit = {name for name in values if config.is_set(name)} - {"vae"} | {"ae"}
    return Config(values, explicit)


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
