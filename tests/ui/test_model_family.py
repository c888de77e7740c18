"""The editor's family filter: the families options name are the registry's, and the UI's cheap folder check (no
torch) tells each family's diffusers folder as the registry's own detectors do."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

from library.config.option_types import FAMILIES
from library.config.options import OPTIONS
from library.families.registry import ENTRIES, entry_for
from library.ui.model_family import folder_family

REPO = Path(__file__).resolve().parents[2]


def test_the_families_are_the_registrys_and_every_one_has_options():
    assert FAMILIES == tuple(entry.name for entry in ENTRIES)
    assert {family for option in OPTIONS.values() for family in option.families} == set(FAMILIES)


def test_a_folder_is_told_the_family_the_registry_tells(tmp_path):
    for entry in ENTRIES:
        folder = tmp_path / entry.name
        if entry.name == "sd":
            (folder / "unet").mkdir(parents=True)
        else:
            (folder / "transformer").mkdir(parents=True)
            name = importlib.import_module(f"library.families.{entry.name}.family").TRANSFORMER_CLASS
            (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": name}))
        assert entry_for(folder).name == entry.name and folder_family(folder) == entry.name
    for model in ("digits-base", "digits-flux", "digits-z-image"):
        assert folder_family(REPO / "models" / model) == entry_for(REPO / "models" / model).name
    assert folder_family(tmp_path) is None and folder_family(tmp_path / "missing") is None
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert folder_family(tmp_path / "model.safetensors") is None  # a single file: not cheap to tell
