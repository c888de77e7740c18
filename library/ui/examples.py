"""The shipped example configs (configs/*.toml) the editor starts a new config from, each with the line saying what
it is for, and a family's recommended settings: those of the example config its registry entry names."""
from __future__ import annotations

import re
from pathlib import Path

from library.config.options import OPTIONS
from library.families.registry import ENTRIES
from library.ui import schema

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECOMMENDED = ("learning_rate", "resolution", "network_module", "mixed_precision")  # what a family's defaults set
_SENTENCE_END = re.compile(r"\.(\s|$)")


def examples() -> list[tuple[str, str]]:
    """(file name, what it is for) for each shipped example config."""
    return [(path.name, description(path)) for path in sorted(CONFIGS.glob("*.toml"))]


def description(path: Path) -> str:
    """The first sentence of the comment a config opens with (up to a full stop, or a colon ending a line)."""
    words: list[str] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return ""
    for line in lines:
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        end = _SENTENCE_END.search(text)
        if end:
            words.append(text[:end.start() + 1])
            break
        words.append(text.rstrip(":"))
        if text.endswith(":"):
            break
    line = " ".join(w for w in words if w)
    return line if len(line) <= 200 else line[:199] + "…"


def example_path(name: str) -> Path | None:
    """A shipped example by its file name; None for any other name."""
    return next((path for path in CONFIGS.glob("*.toml") if path.name == name), None)


def family_defaults(family: str) -> tuple[str, dict[str, str]]:
    """(the example config, its recommended settings as the form shows them) of a registered family."""
    entry = next((e for e in ENTRIES if e.name == family), None)
    path = CONFIGS / entry.configs[0] if entry is not None else None
    if path is None or not path.is_file():
        return "", {}
    state, _ = schema.from_file(path)
    return path.name, {name: state.values[name] for name in RECOMMENDED if name in state.values and name in OPTIONS}


def example_family(name: str) -> str:
    """The family whose registry entry names the example config ("" when none does)."""
    return next((entry.name for entry in ENTRIES if name in entry.configs), "")
