"""Optimizer and learning-rate scheduler factories."""
from __future__ import annotations

import ast
import logging
from typing import Any, Iterable, Sequence

import torch
from diffusers.optimization import get_scheduler

from library.config import UserError

logger = logging.getLogger(__name__)


def parse_key_values(entries: Sequence[str]) -> dict[str, Any]:
    """kohya's `key=value` strings; values are Python literals ("betas=(0.9,0.99)") or plain strings."""
    parsed: dict[str, Any] = {}
    for entry in entries:
        key, _, text = entry.partition("=")
        try:
            parsed[key.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            parsed[key.strip()] = text.strip()
    return parsed


def build_optimizer(name: str, param_groups: Iterable[dict[str, Any]], learning_rate: float,
                    optimizer_args: Sequence[str]) -> torch.optim.Optimizer:
    """AdamW over the given parameter groups (each may carry its own "lr")."""
    kwargs = parse_key_values(optimizer_args)
    if name.lower() != "adamw":
        raise UserError(f"optimizer_type {name!r} is not supported; use AdamW")
    try:
        return torch.optim.AdamW(list(param_groups), lr=learning_rate, **kwargs)
    except (TypeError, ValueError) as e:
        raise UserError(f"optimizer_args {list(optimizer_args)} do not fit AdamW: {e}") from None


def warmup_steps(lr_warmup_steps: float, total_steps: int) -> int:
    """A count, or a fraction of the total steps when below 1 (kohya's convention)."""
    if 0 < lr_warmup_steps < 1:
        return int(lr_warmup_steps * total_steps)
    return int(lr_warmup_steps)


def build_lr_scheduler(name: str, optimizer: torch.optim.Optimizer, total_steps: int, lr_warmup_steps: float,
                       num_cycles: int, power: float) -> torch.optim.lr_scheduler.LRScheduler:
    """The schedule is a function of the optimizer step (global step), stepped once per optimizer step."""
    warmup = warmup_steps(lr_warmup_steps, total_steps)
    if name == "constant" and warmup:
        logger.warning("lr_warmup_steps is ignored by the constant scheduler; use constant_with_warmup")
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                         num_cycles=num_cycles, power=power)
