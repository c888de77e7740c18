"""The registered families, and what is done by looping over them: telling a base model's family from its folder
or file (library.families.loading loads it), the tiny builders, the network modules that train each family, and
the options each family reads, which importing this module adds to the schema (library.config.options).

Adding a family adds one line to ENTRIES; nothing here names a family. It imports no model code (entries name
their loaders as Refs), so the configuration can be read before torch and diffusers are imported.
"""
from __future__ import annotations

from pathlib import Path

from library.config.options import add_family_options
from library.families.chroma.entry import ENTRY as CHROMA
from library.families.entry import FamilyEntry, TinyModel
from library.families.flux.entry import ENTRY as FLUX
from library.families.flux2.entry import ENTRY as FLUX2
from library.families.qwen_image.entry import ENTRY as QWEN_IMAGE
from library.families.sd.entry import ENTRY as SD
from library.families.sd3.entry import ENTRY as SD3
from library.families.wan.entry import ENTRY as WAN
from library.families.z_image.entry import ENTRY as Z_IMAGE

ENTRIES: tuple[FamilyEntry, ...] = (SD, FLUX, CHROMA, SD3, Z_IMAGE, QWEN_IMAGE, FLUX2, WAN)


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


def file_options() -> tuple[str, ...]:
    """The options that name a separate file some family's single file is loaded with, in entry order."""
    return tuple(dict.fromkeys(name for entry in ENTRIES
                               for name in (*entry.file_options, *entry.optional_file_options)))


for _entry in ENTRIES:  # the schema gets each family's options and network modules once, here
    add_family_options(_entry.name, _entry.options, _entry.network_modules)
