"""Trackers (tensorboard, wandb), the metrics logged each optimizer step, and the timestep-binned loss."""
from __future__ import annotations

import collections
import logging
import os
import resource
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from library.config import Config, read_toml
from library.monitoring.events import EventLog

logger = logging.getLogger(__name__)

DEFAULT_TRACKER_NAME = "network_train"
TRACKERS = ("tensorboard", "wandb")
AVERAGE_WINDOW = 500  # loss/average covers the last epoch's steps, at most this many


def tracker_names(config: Config) -> list[str]:
    """kohya: `log_with` picks the trackers; a logging_dir without log_with means tensorboard."""
    log_with = config.log_with or ("tensorboard" if config.logging_dir else None)
    if log_with is None:
        return []
    return list(TRACKERS) if log_with == "all" else [log_with]


def run_logging_dir(config: Config, started_at: float) -> Path:
    """kohya's layout: logging_dir / <log_prefix><start time>; tensorboard adds a folder per tracker name."""
    base = Path(config.logging_dir) if config.logging_dir else Path(config.output_dir) / "logs"
    return base / f"{config.log_prefix or ''}{time.strftime('%Y%m%d%H%M%S', time.localtime(started_at))}"


class Trackers:
    """The run's trackers (main process only; empty elsewhere).

    A tracker that fails to start is left out; one that fails to log is reported once and kept, so a passing
    network hiccup costs a few points of a curve, never the run.
    """

    def __init__(self, trackers: dict[str, Any] | None = None):
        self._trackers = dict(trackers or {})
        self._failures: collections.Counter = collections.Counter()
        self.events: EventLog | None = None  # the run's event stream (main process), see open_events

    def open_events(self, output_dir: Path, output_name: str) -> None:
        """Start the event stream in output_dir (docs/events.md) with its "start" line."""
        self.events = EventLog(output_dir)
        self.events.start(output_name)

    def plan(self, total_steps: int, step: int, epochs: int, batches_per_epoch: int) -> None:
        if self.events is not None:
            self.events.plan(total_steps, step, epochs, batches_per_epoch)

    def event(self, name: str, **fields: Any) -> None:
        """One event of the stream (samples written, a file saved, the end of the run)."""
        if self.events is not None:
            self.events.write(name, **fields)

    def start(self, config: Config, started_at: float) -> None:
        from accelerate.tracking import TensorBoardTracker, WandBTracker

        names = tracker_names(config)
        if not names:
            return
        logging_dir = run_logging_dir(config, started_at)
        init_kwargs = read_toml(config.log_tracker_config) if config.log_tracker_config else {}
        project = config.log_tracker_name or DEFAULT_TRACKER_NAME
        run_config = config.for_trackers() if config.log_config else None
        for name in names:
            kwargs = dict(init_kwargs.get(name, {}))
            try:
                if name == "tensorboard":
                    logging_dir.mkdir(parents=True, exist_ok=True)
                    tracker = TensorBoardTracker(project, logging_dir, **kwargs)
                else:
                    if config.wandb_api_key:
                        # The environment, not wandb.login: login writes the key to ~/.netrc.
                        os.environ["WANDB_API_KEY"] = config.wandb_api_key
                    if config.wandb_run_name:
                        kwargs.setdefault("name", config.wandb_run_name)
                    logging_dir.mkdir(parents=True, exist_ok=True)
                    kwargs.setdefault("dir", str(logging_dir))
                    tracker = WandBTracker(project, **kwargs)
                tracker.start()
                if run_config is not None:
                    tracker.store_init_configuration(run_config)
            except Exception as e:  # noqa: BLE001 (any tracker failure must leave training running)
                logger.warning("tracker %s could not start and is left out: %s: %s", name, type(e).__name__, e)
                continue
            self._trackers[name] = tracker
            logger.info("logging to %s%s", name, f" in {logging_dir}" if name == "tensorboard" else "")

    def __bool__(self) -> bool:
        return bool(self._trackers)

    def log(self, values: dict[str, float], step: int) -> None:
        if self.events is not None:
            self.events.metrics(values, step)
        self._each(lambda tracker: tracker.log(values, step=step))

    def log_images(self, images: dict[str, np.ndarray], step: int) -> None:
        """One HWC uint8 image per name."""
        def log(tracker: Any) -> None:
            if tracker.name == "tensorboard":
                tracker.log_images({k: v[None] for k, v in images.items()}, step=step, dataformats="NHWC")
            else:
                tracker.log_images({k: [v] for k, v in images.items()}, step=step)
        self._each(log)

    def finish(self) -> None:
        self._each(lambda tracker: tracker.finish())
        for name, count in self._failures.items():
            logger.warning("tracker %s failed %d time(s) during the run", name, count)
        self._trackers.clear()
        if self.events is not None:
            self.events.close()

    def _each(self, call: Callable[[Any], None]) -> None:
        for name, tracker in self._trackers.items():
            try:
                call(tracker)
            except Exception as e:  # noqa: BLE001
                if not self._failures[name]:
                    logger.warning("tracker %s failed (reported once; training goes on): %s: %s", name,
                                   type(e).__name__, e)
                self._failures[name] += 1


class TimestepLoss:
    """Running mean of the training loss in timestep bins, over the whole run; survives resume via the state."""

    def __init__(self, min_timestep: int, max_timestep: int, bins: int):
        span = max_timestep - min_timestep
        self.edges = [min_timestep + span * i // bins for i in range(bins + 1)]
        self.sums = [0.0] * bins
        self.counts = [0] * bins

    @property
    def names(self) -> list[str]:
        return [f"loss/timestep/{lo}-{hi - 1}" for lo, hi in zip(self.edges, self.edges[1:], strict=False)]

    def totals(self, losses: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """This process's (sum, count) per bin for per-sample `losses` at `timesteps`, to be summed over ranks."""
        bins = torch.bucketize(timesteps.cpu(), torch.tensor(self.edges[1:-1]), right=True)
        n = len(self.sums)
        sums = torch.zeros(n, dtype=torch.float64).index_add_(0, bins, losses.detach().cpu().double())
        counts = torch.bincount(bins, minlength=n).double()
        return torch.cat([sums, counts])

    def add(self, totals: torch.Tensor) -> None:
        n = len(self.sums)
        for i, (s, c) in enumerate(zip(totals[:n].tolist(), totals[n:].tolist(), strict=True)):
            self.sums[i] += s
            self.counts[i] += round(c)

    def means(self) -> dict[str, float]:
        return {name: s / c for name, s, c in zip(self.names, self.sums, self.counts, strict=True) if c}

    def bins(self) -> list[tuple[int, int, float]]:
        """(first, last timestep, mean) of the bins that have samples."""
        spans = zip(self.edges, self.edges[1:], strict=False)
        return [(lo, hi - 1, s / c) for (lo, hi), s, c in zip(spans, self.sums, self.counts, strict=True) if c]

    def state_dict(self) -> dict[str, Any]:
        return {"edges": self.edges, "sums": self.sums, "counts": self.counts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("edges") != self.edges:
            logger.warning("the timestep bins changed since the state was saved; the binned loss starts afresh")
            return
        self.sums, self.counts = list(state["sums"]), list(state["counts"])


class StepMetrics:
    """What is logged at each optimizer step, and what of it must survive a resume."""

    def __init__(self, timestep_loss: TimestepLoss, steps_per_epoch: int):
        self.timestep_loss = timestep_loss
        self.recent: collections.deque[float] = collections.deque(maxlen=min(steps_per_epoch, AVERAGE_WINDOW))
        # The batches of the step being accumulated: per-sample losses (weighted), timesteps, the prior_reg mask
        # (None when the batch has none) and the unweighted losses.
        self.batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]] = []

    def add_batch(self, losses: torch.Tensor, timesteps: torch.Tensor, prior: torch.Tensor | None,
                  unweighted: torch.Tensor) -> None:
        self.batches.append((losses.detach(), timesteps, prior, unweighted.detach()))

    def totals(self, mean_loss: torch.Tensor) -> torch.Tensor:
        """This process's share of the step, to be summed over the processes (one collective): its mean loss, its
        sample count, its prior_reg samples' unweighted loss sum and count, and the timestep bins' sums and counts
        of the other samples (prior_reg samples, a difference of two predictions, are no fit of the data). Starts
        the next step's batches."""
        losses, timesteps, unweighted = (torch.cat([batch[i] for batch in self.batches]).cpu() for i in (0, 1, 3))
        prior = torch.cat([torch.zeros(len(batch[0]), dtype=torch.bool) if batch[2] is None else batch[2].cpu()
                           for batch in self.batches])
        self.batches.clear()
        kept = unweighted[prior].double()
        return torch.cat([mean_loss.detach().double().cpu().view(1),
                          torch.tensor([float(len(losses)), kept.sum().item(), float(len(kept))], dtype=torch.float64),
                          self.timestep_loss.totals(losses[~prior], timesteps[~prior])])

    def step(self, totals: torch.Tensor, processes: int, lrs: dict[str, float], seconds: float,
             device: torch.device) -> dict[str, float]:
        """The step's values from `totals` summed over `processes`; loss/prior_reg (the mean of the step's prior_reg
        samples' losses) only when the step had any."""
        loss = totals[0].item() / processes
        samples, prior_sum, prior_count = totals[1:4].tolist()
        self.timestep_loss.add(totals[4:])
        self.recent.append(loss)
        values = {"loss/current": loss, "loss/average": sum(self.recent) / len(self.recent)}
        if prior_count:
            values["loss/prior_reg"] = prior_sum / prior_count
        values.update({f"lr/{name}": lr for name, lr in lrs.items()})
        values.update(self.timestep_loss.means())
        values["throughput/s_per_step"] = seconds
        values["throughput/samples_per_s"] = samples / seconds if seconds > 0 else 0.0
        values.update(peak_memory(device))
        return values

    def state_dict(self) -> dict[str, Any]:
        return {"timestep_loss": self.timestep_loss.state_dict(), "recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "timestep_loss" in state:
            self.timestep_loss.load_state_dict(state["timestep_loss"])
        self.recent.extend(state.get("recent", []))


def lr_names(param_groups: list[dict[str, Any]]) -> list[str]:
    """kohya's metric names for the optimizer's groups: lr/unet, lr/textencoder."""
    known = {"unet": "unet", "text_encoder": "textencoder"}
    return [known.get(group.get("name"), group.get("name") or f"group{i}") for i, group in
            enumerate(param_groups)]


def peak_memory(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    # Linux reports kilobytes.
    return {"memory/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
