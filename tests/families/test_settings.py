"""A family's settings: the few typed options it reads, built from a parsed config by their names."""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

import pytest

from library.config import parse_config
from library.families import registry
from library.families.family import Family
from library.families.settings import FamilySettings, settings_from, value_of
from tests.helpers.runs import given_config


@dataclasses.dataclass(frozen=True)
class Group:
    loss_type: str
    huber_c: float


@dataclasses.dataclass(frozen=True)
class Example(FamilySettings):
    user_set: Mapping[str, Any]
    resolution: tuple[int, int]
    noise_offset: float | None
    group: Group


def test_settings_are_filled_by_option_name_with_groups_and_what_the_user_set():
    config, _ = parse_config(["--pretrained_model_name_or_path", ".", "--train_data_dir", ".", "--output_dir", ".",
                              "--resolution", "64", "--huber_c", "0.2", "--noise_offset", "0.05"])
    settings = settings_from(Example, config)
    assert settings.resolution == (64, 64) and settings.noise_offset == 0.05
    assert settings.group == Group(loss_type="l2", huber_c=0.2)
    assert dict(settings.user_set) == {"pretrained_model_name_or_path": ".", "train_data_dir": ".",
                                       "output_dir": ".", "resolution": (64, 64), "huber_c": 0.2,
                                       "noise_offset": 0.05}
    with pytest.raises(TypeError):
        settings.user_set["seed"] = 1  # read-only, as the Config is
    assert value_of(settings, "huber_c") == 0.2 and value_of(settings, "noise_offset") == 0.05


def test_a_field_the_schema_lacks_is_named():
    @dataclasses.dataclass(frozen=True)
    class Misspelt(FamilySettings):
        noise_ofset: float | None

    with pytest.raises(AttributeError, match="Misspelt.noise_ofset"):
        settings_from(Misspelt, given_config())


def family_classes() -> dict[str, list[type[Family]]]:
    """Each registered family's Family classes, found in its package."""
    found: dict[str, list[type[Family]]] = {}
    for entry in registry.ENTRIES:
        package = importlib.import_module(f"library.families.{entry.name}")
        for module in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
            importlib.import_module(module.name)
        found[entry.name] = [cls for cls in subclasses(Family) if cls.__module__.startswith(f"{package.__name__}.")]
    return found


def subclasses(cls: type) -> set[type]:
    return {sub for direct in cls.__subclasses__() for sub in (direct, *subclasses(direct))}


def test_every_family_reads_only_options_of_the_schema():
    config = given_config()
    classes = family_classes()
    assert all(classes.values()), classes
    for family in {cls for found in classes.values() for cls in found} | subclasses(Family):
        settings = settings_from(family.settings_type, config)
        assert isinstance(settings, FamilySettings)
        for name, _ in getattr(family, "refused_options", ()):
            value_of(settings, name)  # a musubi family refuses only options its settings hold
