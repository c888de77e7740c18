"""The editor's family filter: the registry's families, and the family of a model as the registry tells it."""
from __future__ import annotations

import json
from pathlib import Path

from library.config.options import OPTIONS
from library.families.registry import ENTRIES
from library.ui.model_family import FAMILIES, model_family

REPO = Path(__file__).resolve().parents[2]


def test_the_families_are_the_registrys_and_options_name_only_them():
    assert FAMILIES == tuple(entry.name for entry in ENTRIES)
    assert {family for option in OPTIONS.values() for family in option.families} <= set(FAMILIES)


def test_a_model_is_told_its_family_and_anything_else_none(tmp_path):
    assert model_family(REPO / "models" / "digits-base") == "sd"
    assert model_family(REPO / "models" / "digits-flux") == "flux"
    assert model_family(REPO / "models" / "digits-z-image") == "z_image"
    assert model_family(tmp_path) is None and model_family(tmp_path / "missing") is None
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "SomeNewTransformer"}))
    assert model_family(tmp_path) is None  # a transformer no family trains
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert model_family(tmp_path / "model.safetensors") is None  # no family's marker keys
