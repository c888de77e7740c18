"""Handing freed memory back to the system.

Loading a model allocates and frees a buffer for nearly every tensor it reads, casts or converts, between the
tensors it keeps. glibc's allocator keeps the pages of those freed buffers: they go on counting as the process's
memory until something reuses them (0.4-1 GiB after loading SDXL, varying from run to run).
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
    except (OSError, TypeError):  # no C library to open this way (Windows)
        return None


def return_free_heap() -> bool:
    """Give the free pages of the C heap back to the system (glibc's `malloc_trim`); False where the C library
    has no such call. Costs milliseconds; nothing that is in use moves."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
