"""What a run does when the world interrupts it: SIGTERM / SIGINT, a non-finite loss, a failed save."""
from __future__ import annotations

import errno
import logging
import signal
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Iterable, Iterator, Sequence

import torch
from safetensors import SafetensorError

from library.config import UserError
from library.training.state import find_latest_state

logger = logging.getLogger(__name__)

EXIT_STATUS = {signal.SIGTERM: 143, signal.SIGINT: 130}  # 128 + the signal, as a shell reports it


class Interrupted(BaseException):
    """The run was stopped by a signal; `message` is the one line to print, `status` the exit status.

    A BaseException like KeyboardInterrupt, so that no `except Exception` on the way up swallows it."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.message = message

    @property
    def status(self) -> int:
        return EXIT_STATUS.get(signal.Signals(self.signum), 128 + self.signum)


class Preemption:
    """SIGTERM / SIGINT handlers for the length of the step loop. The first signal only sets `signum`: the loop
    finishes the optimizer step under way, saves and stops. A second one stops at once (without a save)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "Preemption":
        if OutsideSteps.received is not None:  # stopped before the steps, and the exception was swallowed
            raise OutsideSteps.interrupted(OutsideSteps.received)
        for signum in EXIT_STATUS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise Interrupted(signum, f"stopped by a second {signal.Signals(signum).name} without saving")
        self.signum = signum
        logger.warning("%s received: finishing this step, then saving and stopping (send it again to stop at once)",
                       signal.Signals(signum).name)


def agree(accelerator, bad: bool, signum: int | None,
          requested: Sequence[bool] = ()) -> tuple[bool, int | None, tuple[bool, ...]]:
    """What every process must act on together at this step: whether any one saw a non-finite value, the signal any
    one of them received, and each request (library.training.requests) any one of them found. One collective for
    all, only with several processes (else a process that stops, samples or saves alone leaves the others waiting
    for it forever)."""
    if accelerator.num_processes == 1:
        return bad, signum, tuple(requested)
    signals = list(EXIT_STATUS)
    flags = torch.tensor([float(bad)] + [float(signum == s) for s in signals] + [float(r) for r in requested],
                         device=accelerator.device)
    counts = accelerator.reduce(flags, reduction="sum").tolist()
    told = counts[1:1 + len(signals)]
    return (bool(counts[0]), next((int(s) for s, count in zip(signals, told, strict=True) if count), None),
            tuple(count > 0 for count in counts[1 + len(signals):]))


class OutsideSteps:
    """SIGTERM / SIGINT handlers for a run outside its step loop (start-up, loading, caching, the final save): stop
    with one line, by raising Interrupted wherever the run is.

    Each signal is also recorded, and Preemption refuses to start the step loop after one: a library that catches
    every exception while it loads cannot make a stopped run go on training."""

    received: int | None = None  # the signal seen since the handlers were installed

    def __enter__(self) -> "OutsideSteps":
        OutsideSteps.received = None
        self._previous = {signum: signal.signal(signum, self._handle) for signum in EXIT_STATUS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        OutsideSteps.received = None

    @staticmethod
    def interrupted(signum: int) -> Interrupted:
        return Interrupted(signum, f"stopped by {signal.Signals(signum).name} outside the training steps; the files "
                                   "already saved are kept")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        OutsideSteps.received = signum
        raise self.interrupted(signum)


# --- non-finite values ----------------------------------------------------------------------------------------

def non_finite(losses: Iterable[torch.Tensor], parameters: Iterable[torch.nn.Parameter], check_gradients: bool) -> bool:
    """Whether the step's losses, or (when `check_gradients`) the trained parameters' gradients, hold NaN/inf.
    One device sync per optimizer step; the adapter's gradients are small."""
    values = [torch.stack([loss.detach().float() for loss in losses]).isfinite().all()]
    if check_gradients:
        grads = [p.grad for p in parameters if p.grad is not None]
        if grads:
            values.append(torch.stack([g.detach().float().norm() for g in grads]).isfinite().all())
    return not bool(torch.stack(values).all().item())


def non_finite_error(step: int, loss: float, lrs: Iterable[float], output_dir: Path) -> UserError:
    return UserError([
        f"the loss or the gradients became NaN/inf at step {step + 1} (loss {loss:g}, learning rate "
        f"{', '.join(f'{lr:g}' for lr in lrs)}); stopped before the optimizer step, nothing was written for it",
        kept(output_dir),
        "hint: lower learning_rate, set max_grad_norm (e.g. 1.0), use mixed_precision bf16 or no instead of fp16, "
        "or check the images of the last batches; resume from the kept state with --resume latest",
    ])


def kept(output_dir: Path, unfinished: Path | None = None) -> str:
    """What a stopped run leaves to continue from: the newest complete state and the newest LoRA file."""
    state = find_latest_state(output_dir)
    loras = sorted((p for p in output_dir.glob("*.safetensors") if p != unfinished), key=lambda p: p.stat().st_mtime)
    return (f"kept: {'the state ' + str(state) if state else 'no state'}, "
            f"{'the LoRA ' + str(loras[-1]) if loras else 'no LoRA file'} (earlier files are untouched)")


# --- failed saves ---------------------------------------------------------------------------------------------

def disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(error, SafetensorError) and "os error 28" in str(error)


@contextmanager
def reported_save(target: Path, output_dir: Path) -> Iterator[None]:
    """Turn an environmental fault while writing `target` (full disk, read-only or vanished folder) into one
    message naming the file and what was kept."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        raise save_failed(e, target, output_dir) from e


def save_failed(error: BaseException, target: Path, output_dir: Path) -> UserError:
    """A message for a save that an environmental fault stopped: which file, why, and what is still there."""
    where = getattr(error, "filename", None) or target
    reason = "the disk is full" if disk_full(error) else f"{type(error).__name__}: {error}"
    return UserError([
        f"could not write {where}: {reason}; the run stopped and {target.name} was not written",
        kept(output_dir, target),
        "free some space (or choose another output_dir) and resume with --resume latest"
        if disk_full(error) else "fix the cause and resume with --resume latest",
    ])


def outcome(error: BaseException) -> dict[str, str]:
    """The final status of a run that ended with `error`, for the event stream: stopped by a signal, or failed."""
    if isinstance(error, (Interrupted, KeyboardInterrupt)):
        return {"status": "stopped", "message": getattr(error, "message", "stopped by SIGINT")}
    if isinstance(error, UserError):
        return {"status": "failed", "message": "\n".join(error.problems)}
    return {"status": "failed", "message": f"{type(error).__name__}: {error}"}
