"""Validation loss: held-out images evaluated at fixed timesteps with fixed noise.

Each validation image is evaluated once per round, on one process (image i on process i mod N), at every
validation timestep in a single batch with the same noise; the per-timestep sums are then added over the
processes, so the mean counts every image exactly once whatever the process count. Nothing here touches the
training path: the generators are keyed by (validation seed, image), and the global RNG and the model's
train/eval modes are restored afterwards.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch

from library.core.seeds import step_generator

# (one collated item, its generator, the timesteps) -> per-timestep losses
LossFn = Callable[[dict[str, Any], torch.Generator, torch.Tensor], torch.Tensor]


def should_validate(step: int, epoch_ended: bool, epoch: int, every_n_steps: int | None,
                    every_n_epochs: int | None) -> bool:
    """After optimizer step `step`; `epoch` is the number of completed epochs when `epoch_ended`."""
    if every_n_steps and step % every_n_steps == 0:
        return True
    if epoch_ended:
        if every_n_epochs:
            return epoch % every_n_epochs == 0
        return not every_n_steps
    return False


@contextlib.contextmanager
def evaluating(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Eval mode and no grad; afterwards every submodule's mode and the global RNG states are as they were."""
    modes = [(m, m.training) for module in modules for m in module.modules()]
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        for module in modules:
            module.eval()
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def validation_loss(dataset: torch.utils.data.Dataset, collate: Callable[[list[dict[str, Any]]], dict[str, Any]],
                    loss_fn: LossFn, timesteps: Sequence[int], seed: int, device: torch.device,
                    process_index: int, num_processes: int,
                    reduce_sum: Callable[[torch.Tensor], torch.Tensor], limit: int | None = None) -> dict[int, float]:
    """Mean loss over the dataset (its first `limit` items, kohya's max_validation_steps) at each timestep."""
    t = torch.tensor(list(timesteps), dtype=torch.long, device=device)
    totals = torch.zeros(len(timesteps) + 1, dtype=torch.float64, device=device)
    for index in range(process_index, min(len(dataset), limit or len(dataset)), num_processes):
        batch = collate([dataset[(0, index)]])
        losses = loss_fn(batch, step_generator(seed, "validation", index), t)
        totals[:-1] += losses.detach().double()
        totals[-1] += 1
    totals = reduce_sum(totals)
    count = totals[-1].item()
    return {step: (totals[i].item() / count) for i, step in enumerate(timesteps)} if count else {}


def validation_metrics(losses: dict[int, float]) -> dict[str, float]:
    values = {f"loss/validation/t{t}": v for t, v in losses.items()}
    if losses:
        values["loss/validation/mean"] = sum(losses.values()) / len(losses)
    return values
