"""Checks that run before the model loads (the output folder, the lock on it), and the free-space estimate.

A problem found here costs seconds; found at the first save, it costs the whole run.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from library.config import UserError
from library.core.run_files import LOCK_FILE

try:
    import fcntl
except ImportError:  # Windows: no flock; runs there are not protected from each other
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)


class OutputLock:
    """An exclusive lock on output_dir for the length of a run, so that two runs never write (or clean up) the
    same folder. It is an flock on `output_dir/train.lock`: the kernel drops it when the holder dies however it
    dies, so a lock file left by a killed run is simply taken over; the file names the holder for the message."""

    def __init__(self, output_dir: Path):
        self.path = output_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        if fcntl is None:
            logger.warning("output_dir %s: this platform has no flock; a second run on the same folder is not "
                           "detected", self.path.parent)
            return
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise UserError(f"output_dir: cannot write in {self.path.parent} ({e.strerror}); "
                                "choose a folder this user can write to") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(os.pread(fd, 4096, 0))
                os.close(fd)
                raise UserError(f"output_dir: {self.path.parent} is in use by another run ({holder}); wait for it "
                                "to finish, stop it, or choose another output_dir") from None
            # The holder before us may have removed the file between our open and flock: then we locked a file
            # nobody else can see, and must try again on the one that is there now.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = os.pread(fd, 4096, 0)
        if previous.strip():
            logger.warning("output_dir %s: taking over the lock of a run that is no longer running (%s)",
                           self.path.parent, _describe(previous))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                  "command": sys.argv}).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        # Removed while still held, so that a run waiting on it retries on a fresh file (see acquire).
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def _describe(raw: bytes) -> str:
    try:
        holder = json.loads(raw.decode())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
        return f"process {holder['pid']} on {holder['host']}, started {started}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no details"


def prepare_output_dir(output_dir: Path) -> OutputLock:
    """Create output_dir and lock it; raise UserError when it cannot be created or written, or is in use."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"output_dir: cannot create {output_dir} ({e.strerror}); choose a folder this user can "
                        "write to") from None
    lock = OutputLock(output_dir)
    lock.acquire()
    return lock


def check_free_space(output_dir: Path, lora_bytes: int, saves_state: bool) -> None:
    """Refuse to start when output_dir cannot hold one LoRA file and, when states are saved, one state dir: the
    adapter plus AdamW's two moments (an estimate; other optimizers keep less)."""
    needed = lora_bytes * (4 if saves_state else 1) + (1 << 20)  # RNG states, JSON, file headers
    _need(output_dir, needed, f"one LoRA file{' and one state save' if saves_state else ''}")


def check_free_space_for_resume(output_dir: Path, state_dir: Path) -> None:
    """Before the model loads: the state being resumed tells exactly what one more state save takes."""
    state_bytes = sum(p.stat().st_size for p in state_dir.rglob("*") if p.is_file())
    _need(output_dir, state_bytes + (1 << 20), f"one state save like {state_dir.name}")


def _need(output_dir: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(output_dir).free
    if free < needed:
        raise UserError(f"output_dir: {output_dir} has {_size(free)} free; {what} needs about {_size(needed)}; "
                        "free some space or choose another output_dir")


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
