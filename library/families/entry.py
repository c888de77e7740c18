"""A family's declarative entry in the registry: how to recognise its folder and its single file, how to load each,
its tiny builders, the network modules that train it, and where its example config and docs page are.

Each family package exposes one `ENTRY`; `library.families.registry` lists them in one line and loops over them,
so no other module asks which families exist.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

from library.config import UserError
from library.families.family import Components

# The options that name a family's separate files (kohya's and musubi-tuner's names).
FILE_OPTIONS = ("clip_l", "clip_g", "t5xxl", "ae", "text_encoder")


@dataclass(frozen=True)
class LoadRequest:
    """What loading a base model needs, as values: the path, the dtypes, the separate files and SD's options."""
    path: Path
    weight_dtype: torch.dtype = torch.float32
    vae_dtype: torch.dtype = torch.float32
    model_config: str | None = None  # a diffusers folder describing a single file's widths
    files: Mapping[str, str | None] = field(default_factory=dict)  # FILE_OPTIONS -> path or None
    v2: bool = False
    v_parameterization: bool = False
    allow_pickle_checkpoints: bool = False

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


@dataclass(frozen=True)
class TinyModel:
    """A tiny, untrained model of the family (`python -m library.families.tiny FOLDER --family NAME`).

    `save(folder, seed, overwrite, **shape)` writes a diffusers folder; `shape` names the keyword options it takes
    besides those (with their choices); `save_files(folder, target)` writes the separate files users load."""
    name: str
    save: Callable[..., Path]
    save_files: Callable[[Path, Path], dict[str, Path]] | None = None
    shape: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class FamilyEntry:
    """One family package's registration. `is_folder` / `is_file` must be exclusive between entries, except for
    the one entry that `reads_unrecognised` (the original SD checkpoint layout, whose reader names what any other
    file or folder is)."""
    name: str  # the package name
    title: str  # for messages and docs ("FLUX.1")
    is_folder: Callable[[Path], bool]
    load_folder: Callable[[LoadRequest], Components]
    is_file: Callable[[Path], bool]
    load_file: Callable[[LoadRequest], Components]
    tiny: tuple[TinyModel, ...]
    network_modules: tuple[str, ...]  # kohya / musubi-tuner network_module names that train this family
    file_options: tuple[str, ...] = ()  # the FILE_OPTIONS its single file is loaded with
    more_configs: tuple[str, ...] = ()  # example configs under configs/ besides <name>_lora.toml
    reads_unrecognised: bool = False
    main_config: str = ""  # its example config under configs/, when not named <name>_lora.toml

    @property
    def configs(self) -> tuple[str, ...]:
        """The example configs under configs/ that train this family."""
        return (self.main_config or f"{self.name}_lora.toml", *self.more_configs)

    @property
    def docs(self) -> str:
        """Its page, relative to the repository root."""
        return f"docs/families/{self.name}.md"
