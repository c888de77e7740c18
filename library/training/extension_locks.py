"""Build locks of torch's compiled extensions (DeepSpeed's cpu_adam and its other ops), checked before a run waits.

torch builds or loads an op under `<extensions root>/<op>/lock`: the builder creates the file exclusively, keeps it
open, and removes it when done; every other process polls until the file is gone. A run killed while it builds or
loads (the first ZeRO-offload run, or any start-up) leaves the file behind, and every later run then waits forever
at 0 % CPU without a word. Before DeepSpeed starts, each lock is looked at: one that a live process holds open is a
real build (the run waits for it, and says so); one that no process holds, when every process could be looked at,
is removed; otherwise the run stops naming the file.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def extensions_root() -> Path:
    """The folder torch builds extensions in (torch.utils.cpp_extension's `_get_build_directory` without a name)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def lock_holders(lock: Path, proc: Path = Path("/proc")) -> tuple[list[int], bool]:
    """(ids of the processes that have `lock` open, whether every process could be looked at).

    Linux only: elsewhere (no /proc) nothing can be proven and the second value is False.
    """
    if not proc.is_dir():
        return [], False
    try:
        target = lock.resolve()
        entries = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return [], False
    holders: list[int] = []
    complete = True
    for entry in entries:
        try:
            descriptors = list((entry / "fd").iterdir())
        except FileNotFoundError:
            continue  # the process ended meanwhile
        except OSError:
            complete = False  # another user's process: its open files cannot be seen
            continue
        for descriptor in descriptors:
            try:
                if Path(os.readlink(descriptor)) == target:
                    holders.append(int(entry.name))
                    break
            except OSError:
                continue
    return holders, complete


def check_extension_locks(root: Path | None = None, remove: bool = True) -> list[str]:
    """Look at every extension's build lock under `root` (default: torch's extensions root); return problems.

    A lock held open by a live process is logged (that process is building; the run waits for it). A lock no
    process holds, when every process could be looked at, is removed if `remove` (logged); otherwise it is a
    problem naming the file and saying when it is safe to remove.
    """
    root = extensions_root() if root is None else root
    problems: list[str] = []
    for lock in sorted(root.glob("*/lock")) if root.is_dir() else []:
        op = lock.parent.name
        try:
            before = lock.stat()
        except FileNotFoundError:
            continue  # its builder finished meanwhile
        holders, complete = lock_holders(lock)
        if holders:
            logger.info("torch extension %s is being built or loaded by process %s (%s); this run waits for it",
                        op, ", ".join(map(str, holders)), lock)
            continue
        if complete and remove:
            try:
                same = lock.stat()
                if (same.st_ino, same.st_mtime_ns) == (before.st_ino, before.st_mtime_ns):
                    lock.unlink()
                    logger.warning("removed %s: a stale build lock of torch extension %s, left by a run that stopped "
                                   "while building or loading it (no process holds it open)", lock, op)
            except FileNotFoundError:
                pass
            continue
        problems.append(
            f"{lock}: a build lock of torch extension {op} (DeepSpeed's op) that no process this run can see holds; "
            f"DeepSpeed would wait on it forever. A run that stopped while building {op} leaves it behind: it is "
            f"safe to remove (rm \"{lock}\") when no other run, on this machine or one sharing this folder, is "
            "building it")
    return problems
