"""musubi-tuner's `exclude_patterns` / `include_patterns` network_args: which of a family's LoRA targets a run
trains.

As musubi's networks/lora.py create_modules reads them: each pattern is matched in full (re.fullmatch) against a
layer's original module name (musubi's, e.g. Wan's `blocks.3.cross_attn.k`, FLUX.2's `double_blocks.0.img_attn.qkv`),
the family's own exclude pattern is one more exclude pattern, and a layer is left out when an exclude pattern matches
and no include pattern does. So include patterns only bring layers back: `exclude_patterns=[r'.*']` with
`include_patterns=[r'.*cross_attn.*']` trains the cross-attention alone.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

Candidate = tuple[str, str, bool]  # (module path in our model, original name, left out by the family's default)


def selected(candidates: Iterable[Candidate], net: Any, family: str) -> list[str]:
    """The module paths of `candidates` that a run with `net`'s patterns trains; ValueError when none is left."""
    candidates = list(candidates)
    exclude = [re.compile(pattern) for pattern in net.exclude_patterns]
    include = [re.compile(pattern) for pattern in net.include_patterns]
    paths = []
    for path, original, default_excluded in candidates:
        excluded = default_excluded or any(pattern.fullmatch(original) for pattern in exclude)
        if not excluded or any(pattern.fullmatch(original) for pattern in include):
            paths.append(path)
    if not paths:
        raise ValueError(f"network_args exclude_patterns / include_patterns leave no {family} layer to train (they "
                         "are matched in full against the original module names, e.g. "
                         f"{_example(candidates)})")
    return paths


def _example(candidates: list[Candidate]) -> str:
    names = [original for _, original, _ in candidates][:2]
    return " and ".join(repr(name) for name in names) or "none"
