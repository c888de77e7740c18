"""Durable renames: what every atomic save (LoRA file, state dir, cache entry) needs after os.replace."""
from __future__ import annotations

import os


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename inside `directory` durable; silently skipped where the platform cannot fsync a folder."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
