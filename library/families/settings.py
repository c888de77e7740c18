"""The few typed values a family reads from a run, built once from the Config.

A family declares them as a frozen dataclass (its `settings_type`) whose field names are the config's option names;
a field typed as another dataclass is a group of options filled the same way (FlowOptions, NoiseOptions, ...).
Two fields are read differently: a field typed NetworkArgs holds the run's parsed network_args, and `user_set` holds
the options the user set explicitly, with their values (for the notes and errors about options that do not apply).
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from types import MappingProxyType
from typing import Any, Mapping, TypeVar

from library.config import Config
from library.config.network_args import NetworkArgs, network_args_of

USER_SET = "user_set"

S = TypeVar("S")


@dataclasses.dataclass(frozen=True)
class FamilySettings:
    """What every family's settings are: nothing, unless the family reads options (its subclass names them)."""


def settings_from(cls: type[S], config: Config) -> S:
    """`cls` (a frozen dataclass of option names) with the values of `config`."""
    types = _field_types(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = types[field.name]
        if field.name == USER_SET:
            values[field.name] = user_set(config)
        elif kind is NetworkArgs:
            values[field.name] = network_args_of(config)
        elif isinstance(kind, type) and dataclasses.is_dataclass(kind):
            values[field.name] = settings_from(kind, config)
        else:
            try:
                values[field.name] = getattr(config, field.name)
            except AttributeError:
                raise AttributeError(f"{cls.__name__}.{field.name}: the config has no option of that name") from None
    return cls(**values)


def user_set(config: Config) -> Mapping[str, Any]:
    """The options the user set (in the TOML or on the command line), with their values."""
    return MappingProxyType({name: value for name, value in config.as_dict().items() if config.is_set(name)})


def value_of(settings: Any, name: str) -> Any:
    """The option `name` in `settings` or in one of its groups (nested settings)."""
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if field.name == name:
            return value
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            try:
                return value_of(value, name)
            except AttributeError:
                pass
    raise AttributeError(f"{type(settings).__name__} has no option {name!r}")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    # The modules use `from __future__ import annotations`: the fields' types are strings until resolved.
    return typing.get_type_hints(cls)
