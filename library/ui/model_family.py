"""The family of the model the editor names, as the trainer's registry tells it (a folder's transformer class, a
file's marker keys: a small read, no weights), so that the editor can offer that family's options."""
from __future__ import annotations

from pathlib import Path

from library.families.registry import ENTRIES, entry_for

FAMILIES: tuple[str, ...] = tuple(entry.name for entry in ENTRIES)  # the editor's filter, in the registry's order


def model_family(path: Path) -> str | None:
    """The registry's name of the family whose folder or file `path` is; None when no family recognises it (the
    trainer's own check then says what it is)."""
    if not path.exists():
        return None
    try:
        entry = entry_for(path)
        recognised = entry.is_file(path) if path.is_file() else entry.is_folder(path)
    except (OSError, ValueError):
        return None
    if entry.reads_unrecognised and path.is_file():
        return None  # any file nobody else claims goes to that entry: not a sign of its family
    return entry.name if recognised else None
