"""Atomic, durable file writes: every file a user keeps is written beside its name and renamed over it.

A run killed mid-write leaves the old file (or none) plus a temporary named like `.<name>.<8 hex>.tmp`, or
`.tmp<6 letters or digits>` where safetensors (0.8+) itself writes through a temporary file; `STALE_TEMPORARY`
matches those names so that the next run can remove them.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterator

TMP_DIR_PREFIX = ".tmp-"  # a folder written under this name is renamed when complete
STALE_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{8}\.tmp|\.tmp[0-9A-Za-z]{6}")


def temporary_path(path: str | os.PathLike) -> Path:
    """A fresh name beside `path` for writing it before the rename (matches STALE_TEMPORARY)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


def write_atomically(path: str | os.PathLike, write: Callable[[Path], None], durable: bool = True) -> None:
    """Call `write(tmp)` to create the file and rename it to `path`; nothing is left on failure. `durable` also
    syncs the file and the rename to disk (a cache that can be rebuilt skips that)."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


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


def replace_dir(new: Path, target: Path) -> None:
    """Put `new` at `target`; an existing target is moved aside first and removed after the rename."""
    old = None
    if target.exists():
        old = target.with_name(TMP_DIR_PREFIX + "old-" + target.name)
        remove_path(old)
        os.replace(target, old)
    os.replace(new, target)
    fsync_dir(target.parent)
    if old is not None:
        remove_path(old)


@contextlib.contextmanager
def staged_dir(target: Path) -> Iterator[Path]:
    """A fresh folder beside `target` to write into. When the block ends without an error it replaces `target`
    (replace_dir); otherwise it is removed. Readers see the old folder or the new one, never a half-written one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir rather than mkdtemp: mkdtemp's 0700 mode would survive the rename.
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_path(path: Path) -> None:
    """Remove a file or a folder tree; what is already gone is fine. A folder is first renamed under
    TMP_DIR_PREFIX, so that no reader (a resume looking for the latest state, the web UI) ever sees it half
    removed, and a run killed during the removal leaves a temporary the next run clears."""
    if path.is_dir():
        if not path.name.startswith(TMP_DIR_PREFIX):
            doomed = path.with_name(f"{TMP_DIR_PREFIX}del-{uuid.uuid4().hex[:8]}-{path.name}")
            try:
                os.replace(path, doomed)
                path = doomed
            except OSError:
                pass  # a read-only or foreign parent: remove in place
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
