"""The resolved config as a TOML file (--output_config), tables by topic; `--config` reads it back unchanged."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Protocol

import toml

from library.config.options import GROUPS, OPTIONS, Option
from library.core.atomic import write_atomically


class Resolved(Protocol):
    """What write_config needs of a Config (library.config.parse's, which imports this module)."""

    def as_dict(self) -> dict[str, Any]: ...


class _Encoder(toml.TomlEncoder):
    # toml 0.10.2 writes a backslash followed by "x" (C:\xyz) as an escape and DEL as "x7f", so such strings would
    # not read back; every other value type is written by toml itself.
    def __init__(self) -> None:
        super().__init__()
        self.dump_funcs[str] = _toml_str


def _toml_str(text: str) -> str:
    # A JSON string is a TOML basic string, except that TOML wants DEL escaped too.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(option: Option, value: Any) -> Any:
    if option.is_size:
        return f"{value[0]},{value[1]}"
    return list(value) if isinstance(value, tuple) else value


def config_toml(values: Mapping[str, Any]) -> str:
    """The resolved options grouped by topic, without secrets and the command-line-only options."""
    tables: dict[str, dict[str, Any]] = {}
    for group in GROUPS:
        table = {
            o.name: _toml_value(o, values[o.name]) for o in OPTIONS.values()
            if o.group == group and not o.secret and o.name not in ("config_file", "output_config")
            and values.get(o.name) is not None
        }
        if table:
            tables[group] = table
    return toml.dumps(tables, encoder=_Encoder())


def write_config(config: Resolved, path: str | os.PathLike) -> None:
    """Write the resolved config as TOML, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = config_toml(config.as_dict())
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
