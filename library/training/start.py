"""Where a run starts: kohya's initial_step / initial_epoch / skip_until_initial_step, or a resumed state."""
from __future__ import annotations

import logging
import warnings
from typing import Any

from library.config import Config, UserError

logger = logging.getLogger(__name__)


def initial_position(config: Config, steps_per_epoch: int, gradient_accumulation_steps: int,
                     total_steps: int) -> tuple[int, int, int] | None:
    """(global step, epoch, batches into the epoch per process) a fresh run starts at, or None for step 0.

    initial_step wins over initial_epoch, whose step is (epoch - 1) x steps per epoch (kohya's). The epoch is the one
    the step falls in. With skip_until_initial_step the data starts where a run from step 0 would be at that step;
    without it, at the beginning of that epoch (kohya starts its data afresh there too).
    """
    if config.initial_step is not None:
        step = config.initial_step
    elif config.initial_epoch is not None:
        step = (config.initial_epoch - 1) * steps_per_epoch
    else:
        return None
    if step == 0:
        return None
    if step >= total_steps:
        given = (f"initial_step {step}" if config.initial_step is not None
                 else f"initial_epoch {config.initial_epoch} (step {step})")
        raise UserError(f"{given} is not before the end of the run at step {total_steps} (max_train_steps / "
                        "max_train_epochs): nothing would be trained")
    epoch = step // steps_per_epoch
    batch = (step - epoch * steps_per_epoch) * gradient_accumulation_steps if config.skip_until_initial_step else 0
    return step, epoch, batch


def fast_forward(lr_scheduler: Any, steps: int) -> None:
    """Put a freshly built schedule at `steps` by stepping it, so that any scheduler class gets there its own way."""
    with warnings.catch_warnings():
        # "lr_scheduler.step() before optimizer.step()": no optimizer step belongs to the skipped steps.
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            lr_scheduler.step()


def resume_note(config: Config, resumed_step: int) -> str | None:
    """With resume the state's position wins; sd-scripts instead lets initial_step / initial_epoch override the
    state's step (its schedule still continues from the state's)."""
    if config.initial_step is None and config.initial_epoch is None:
        return None
    given = (f"initial_step {config.initial_step}" if config.initial_step is not None
             else f"initial_epoch {config.initial_epoch}")
    return (f"{given} is not used when resuming: the state records where its run stood (step {resumed_step}) and "
            "training continues exactly from there (sd-scripts would take the given step instead)")
