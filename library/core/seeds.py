"""Seeds derived from (run seed, keys): every draw that must survive a resume comes from these, never from the
global random stream's history."""
from __future__ import annotations

import hashlib
from typing import Any

import torch


def derive_seed(seed: int, *keys: Any) -> int:
    """A 64-bit seed that depends only on the run seed and the keys (epoch, batch, purpose, ...)."""
    digest = hashlib.blake2b(repr((seed,) + keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def torch_seed(seed: int, *keys: Any) -> int:
    """derive_seed within the range torch.manual_seed accepts."""
    return derive_seed(seed, *keys) & ((1 << 63) - 1)


def step_generator(seed: int, *keys: Any) -> torch.Generator:
    """A CPU generator seeded from the run seed and keys (for example epoch and batch position)."""
    return torch.Generator(device="cpu").manual_seed(torch_seed(seed, *keys))
