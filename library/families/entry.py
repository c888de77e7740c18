"""A family's declarative entry in the registry: how to recognise its folder and its single file, how to load each,
its tiny builders, the network modules that train it, the options it reads besides everyone's, and where its
example config and docs page are.

Each family package exposes one `ENTRY`; `library.families.registry` lists them in one line and loops over them,
so no other module asks which families exist.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from library.config.option_types import Option


@dataclass(frozen=True)
class Ref:
    """A function named by its module and name, imported when first called. Entries name their loaders and
    builders this way so that the registry, and the options it adds to the schema, load without torch, diffusers
    or transformers: the trainer reads its configuration before those are imported (train_network.py hides the
    packages a run does not use from them)."""
    module: str
    name: str

    def resolve(self) -> Callable[..., Any]:
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)


@dataclass(frozen=True)
class FramesRule:
    """The clip lengths a video family takes, 1 + step * n frames (Wan: 4n+1, its VAE's 4x temporal compression),
    and the frame rate it was trained at: a video dataset's source_fps is resampled to it, as musubi-tuner does."""
    step: int
    fps: float

    def takes(self, frames: int) -> bool:
        return frames >= 1 and (frames - 1) % self.step == 0

    def round_down(self, frames: int) -> int:
        """The longest length it takes of at most `frames` (musubi-tuner's (n - 1) // step * step + 1)."""
        return (frames - 1) // self.step * self.step + 1


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
    load_folder: Callable[..., Any]  # LoadRequest -> Components (library.families.loading)
    is_file: Callable[[Path], bool]
    load_file: Callable[..., Any]
    tiny: tuple[TinyModel, ...]
    network_modules: tuple[str, ...]  # kohya / musubi-tuner network_module names that train this family
    options: tuple[Option, ...] = ()  # the options only some families read (library.families.shared.options)
    file_options: tuple[str, ...] = ()  # those of `options` that name the separate files its single file takes
    # those of `options` that name a separate file only some of its single files take (Wan 2.1 I2V's clip): passed to
    # its loader, which names a missing or needless one; not a file every single file is loaded with
    optional_file_options: tuple[str, ...] = ()
    more_configs: tuple[str, ...] = ()  # example configs under configs/ besides <name>_lora.toml
    reads_unrecognised: bool = False
    main_config: str = ""  # its example config under configs/, when not named <name>_lora.toml
    # A video family's clip lengths, the same object as its Family's frames_rule, here so that the data can be
    # checked and cut before the model is loaded (--dataset_check, and a run's data before its model). None: images.
    frames_rule: FramesRule | None = None
    # Its single-file loader quantizes an int8 / nf4 denoiser layer by layer as it reads it (shared.separate_files.
    # assign_streamed): the load never holds the whole denoiser unquantized, as the memory estimate counts it.
    quantizes_while_reading: bool = False
    # Its single-file loader honours LoadRequest.skip (the denoiser or the text encoders left on the meta device), so
    # a run by phase reads the text encoders' files without the denoiser's, and then the denoiser's alone.
    files_read_by_part: bool = False
    # (model path, Config) -> problems found from the model's config files or tensor names alone, before the data or
    # any weight is read (Wan: a task that contradicts the model)
    check_before_load: Callable[[Path, Any], list[str]] | None = None

    @property
    def configs(self) -> tuple[str, ...]:
        """The example configs under configs/ that train this family."""
        return (self.main_config or f"{self.name}_lora.toml", *self.more_configs)

    @property
    def docs(self) -> str:
        """Its page, relative to the repository root."""
        return f"docs/families/{self.name}.md"
