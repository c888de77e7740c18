"""Learning-rate schedules by kohya's names (lr_scheduler, lr_scheduler_type, lr_scheduler_args)."""
from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from diffusers import optimization as diffusers_schedules
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from library.config import UserError
from library.training.optim import _find_class, _innermost, is_schedule_free, parse_key_values

logger = logging.getLogger(__name__)


def steps_of(value: float, total_steps: int) -> int:
    """A count, or a fraction of the total steps when below 1 (kohya's convention)."""
    if 0 < value < 1:
        return int(value * total_steps)
    return int(value)


def warmup_steps(lr_warmup_steps: float, total_steps: int) -> int:
    """lr_warmup_steps as a step count."""
    return steps_of(lr_warmup_steps, total_steps)


@dataclass(frozen=True)
class Schedule:
    """A schedule's settings, in optimizer steps."""
    total: int
    warmup: int
    decay: int
    num_cycles: int
    power: float
    min_lr_ratio: float | None
    timescale: int | None


class AdafactorLR(LRScheduler):
    """Reports the learning rate Adafactor (relative_step=True) chose at its last step; it schedules itself.

    Unlike transformers' AdafactorSchedule it does not need the gradients to still be there, so it can be stepped
    after zero_grad.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, initial_lr: float):
        self.initial_lr = initial_lr
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        optimizer = self.optimizer
        lrs = []
        for group in optimizer.param_groups:
            state = optimizer.state.get(group["params"][0])
            # A tensor when scale_parameter is on; loggers and checkpoints want a number.
            lrs.append(float(optimizer._get_lr(group, state)) if state else self.initial_lr)
        return lrs


def _adafactor_schedule(optimizer: torch.optim.Optimizer, s: Schedule, kwargs: dict[str, Any]) -> LRScheduler:
    initial = next((g["lr"] for g in optimizer.param_groups if isinstance(g.get("lr"), float)), 0.0)
    return AdafactorLR(optimizer, kwargs.pop("initial_lr", initial), **kwargs)


def _transformers() -> Any:
    # transformers.optimization imports bitsandbytes when it is installed (about a second): only when needed.
    from transformers import optimization

    return optimization


SCHEDULES: dict[str, Callable[[torch.optim.Optimizer, Schedule, dict[str, Any]], LRScheduler]] = {
    "constant": lambda opt, s, kw: diffusers_schedules.get_constant_schedule(opt, **kw),
    "constant_with_warmup": lambda opt, s, kw: diffusers_schedules.get_constant_schedule_with_warmup(
        opt, s.warmup, **kw),
    "linear": lambda opt, s, kw: diffusers_schedules.get_linear_schedule_with_warmup(opt, s.warmup, s.total, **kw),
    "cosine": lambda opt, s, kw: diffusers_schedules.get_cosine_schedule_with_warmup(opt, s.warmup, s.total, **kw),
    "cosine_with_restarts": lambda opt, s, kw: diffusers_schedules.get_cosine_with_hard_restarts_schedule_with_warmup(
        opt, s.warmup, s.total, num_cycles=s.num_cycles, **kw),
    "polynomial": lambda opt, s, kw: diffusers_schedules.get_polynomial_decay_schedule_with_warmup(
        opt, s.warmup, s.total, power=s.power, **kw),
    "piecewise_constant": lambda opt, s, kw: diffusers_schedules.get_piecewise_constant_schedule(opt, **kw),
    "inverse_sqrt": lambda opt, s, kw: _transformers().get_inverse_sqrt_schedule(
        opt, s.warmup, timescale=s.timescale, **kw),
    # kohya passes num_cycles / 2: the default of 1 is one half-wave, from the initial lr down to the minimum.
    "cosine_with_min_lr": lambda opt, s, kw: _transformers().get_cosine_with_min_lr_schedule_with_warmup(
        opt, s.warmup, s.total, num_cycles=s.num_cycles / 2,
        **({"min_lr_rate": s.min_lr_ratio} if s.min_lr_ratio is not None else {}), **kw),
    "warmup_stable_decay": lambda opt, s, kw: _transformers().get_wsd_schedule(
        opt, s.warmup, s.decay, num_stable_steps=s.total - s.warmup - s.decay, num_cycles=s.num_cycles / 2,
        min_lr_ratio=s.min_lr_ratio or 0.0, **kw),
    "adafactor": _adafactor_schedule,
}

# Settings that only some schedules read; kohya ignores them silently elsewhere.
_USED_BY = {"lr_decay_steps": ("warmup_stable_decay",),
            "lr_scheduler_min_lr_ratio": ("cosine_with_min_lr", "warmup_stable_decay"),
            "lr_scheduler_timescale": ("inverse_sqrt",)}


def _is_relative_step_adafactor(optimizer: torch.optim.Optimizer) -> bool:
    inner = _innermost(optimizer)
    return type(inner).__name__ == "Adafactor" and bool(inner.defaults.get("relative_step"))


def build_lr_scheduler(name: str, optimizer: torch.optim.Optimizer, total_steps: int, lr_warmup_steps: float,
                       num_cycles: int, power: float, *, lr_decay_steps: float = 0,
                       min_lr_ratio: float | None = None, timescale: int | None = None,
                       scheduler_type: str | None = None,
                       scheduler_args: Sequence[str] = ()) -> LRScheduler:
    """The schedule is a function of the optimizer step (global step), stepped once per optimizer step.

    Adafactor with relative_step=True always gets the adafactor schedule and a schedule-free optimizer a constant
    one, whatever `name` says, as in kohya.
    """
    kwargs = parse_key_values(scheduler_args)
    warmup = warmup_steps(lr_warmup_steps, total_steps)
    if is_schedule_free(optimizer):
        if name != "constant" or warmup or scheduler_type:
            logger.warning("schedule-free optimizers need no learning-rate schedule: lr_scheduler, lr_warmup_steps "
                           "and lr_scheduler_type are ignored (for a warm-up use optimizer_args warmup_steps=N)")
        return LambdaLR(optimizer, lambda step: 1.0)
    if scheduler_type:
        if name != "constant":
            logger.warning("lr_scheduler %s is ignored: lr_scheduler_type %s is set", name, scheduler_type)
        return _scheduler_class(scheduler_type, optimizer, kwargs, scheduler_args)

    if _is_relative_step_adafactor(optimizer):
        if name != "adafactor":
            logger.info("Adafactor with relative_step=True: using the adafactor schedule instead of %s", name)
        name = "adafactor"
    elif name == "adafactor":
        raise UserError("lr_scheduler adafactor reports the learning rate Adafactor chooses itself: it needs "
                        "optimizer_type Adafactor with relative_step=True (the default)")
    if name == "adafactor" and warmup:
        raise UserError("lr_warmup_steps: Adafactor with relative_step=True schedules itself and takes no warm-up "
                        "from the config; remove lr_warmup_steps, use optimizer_args warmup_init=True for "
                        "Adafactor's own warm-up, or relative_step=False for a learning_rate and lr_scheduler")
    if name == "constant" and warmup:
        logger.warning("lr_warmup_steps is ignored by the constant scheduler; use constant_with_warmup")
    if name not in SCHEDULES:
        close = difflib.get_close_matches(name, list(SCHEDULES), n=1, cutoff=0.6)
        raise UserError(f"lr_scheduler {name!r} is not known" + (f" (did you mean {close[0]!r}?)" if close else ""))
    decay = steps_of(lr_decay_steps, total_steps)
    if name == "warmup_stable_decay" and warmup + decay > total_steps:
        raise UserError(f"warmup_stable_decay: {warmup} warm-up and {decay} decay steps (lr_warmup_steps, "
                        f"lr_decay_steps) are more than the {total_steps} training steps")
    given = {"lr_decay_steps": decay, "lr_scheduler_min_lr_ratio": min_lr_ratio, "lr_scheduler_timescale": timescale}
    for option, schedules in _USED_BY.items():
        if given[option] and name not in schedules:
            logger.warning("%s is ignored by lr_scheduler %s (it is read by %s)", option, name, ", ".join(schedules))

    settings = Schedule(total_steps, warmup, decay, num_cycles, power, min_lr_ratio, timescale)
    try:
        return SCHEDULES[name](optimizer, settings, dict(kwargs))
    except (TypeError, ValueError) as e:
        given_args = f"; lr_scheduler_args: {' '.join(scheduler_args)}" if scheduler_args else ""
        raise UserError(f"lr_scheduler {name}: the settings do not fit ({e}){given_args}") from None


def _scheduler_class(path: str, optimizer: torch.optim.Optimizer, kwargs: dict[str, Any],
                     scheduler_args: Sequence[str]) -> LRScheduler:
    module, _, cls_name = path.rpartition(".")
    cls = _find_class(module or "torch.optim.lr_scheduler", cls_name, None, f"lr_scheduler_type {path}")
    if isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise UserError(f"lr_scheduler_type {path} needs a metric at every step, which the trainer does not give")
    try:
        scheduler = cls(optimizer, **kwargs)
    except (TypeError, ValueError) as e:
        given = " ".join(scheduler_args) or "none"
        raise UserError(f"lr_scheduler_type {path}: the settings do not fit ({e}); lr_scheduler_args: {given}") \
            from None
    # accelerate checkpoints the scheduler with the training state.
    if not all(callable(getattr(scheduler, m, None)) for m in ("step", "state_dict", "load_state_dict")):
        raise UserError(f"lr_scheduler_type {path} is not a learning-rate scheduler (no step / state_dict)")
    logger.info("lr scheduler %s %s", path, kwargs)
    return scheduler
