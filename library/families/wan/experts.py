"""Wan 2.2 A14B's two experts, trained as musubi-tuner's wan_train_network.py trains them in one run: one LoRA on one
transformer whose frozen base weights are the low-noise expert's below `timestep_boundary` and the high-noise
expert's at and above it (swap_high_low_weights), so one LoRA file serves both; each batch goes to one expert
(get_noisy_model_input_and_timesteps: the first draw picks the expert, then each item is drawn again, up to 100
times, until it falls on that expert's side; if one never does, the batch is drawn afresh as for one model).
With `offload_inactive_dit` the expert not in use is kept in CPU memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from library.config import UserError
from library.families.flow_matching import NUM_TRAIN_TIMESTEPS
from library.families.shared.musubi_flow import MusubiFlowObjective, MusubiSettings, musubi_sigmas
from library.families.shared.separate_files import reading
from library.families.wan.weights import transformer_state_dict

DEFAULT_BOUNDARY = 0.875  # musubi's t2v-A14B boundary (i2v-A14B: 0.9)
MAX_DRAWS = 100  # musubi's num_max_calls


@dataclass(frozen=True)
class WanSettings(MusubiSettings):
    """What Wan reads besides musubi's image families: its task, the experts' options, and the options it refuses."""
    task: str | None
    timestep_boundary: float | None
    offload_inactive_dit: bool
    blocks_to_swap: int | None
    clip: str | None
    dit_high_noise: str | None


def boundary_of(settings: WanSettings, default: float | None) -> float:
    """timestep_boundary in [0, 1] (musubi divides a value over 1 by 1000), else the model's, else 0.875."""
    boundary = settings.timestep_boundary
    if boundary is None:
        return default if default is not None else DEFAULT_BOUNDARY
    return boundary / 1000.0 if boundary > 1 else boundary


def expert_sigmas(objective: MusubiFlowObjective, boundary: float, batch_size: int, generator: torch.Generator,
                  latent_size: tuple[int, int]) -> torch.Tensor:
    """musubi's high-low draw: one draw picks the expert (timestep / 1000 >= boundary: high noise), then each item is
    drawn until it falls on that side; sigmas in [0, 1]."""
    def draw(count: int) -> torch.Tensor:
        return musubi_sigmas(objective.options, count, generator, latent_size, objective.min_timestep,
                             objective.max_timestep)

    def is_high(sigma: torch.Tensor) -> bool:
        return float(sigma[0] * NUM_TRAIN_TIMESTEPS) / NUM_TRAIN_TIMESTEPS >= boundary

    high = is_high(draw(1))
    chosen = []
    for _ in range(batch_size):
        for _ in range(MAX_DRAWS):
            sigma = draw(1)
            if is_high(sigma) == high:
                chosen.append(sigma)
                break
    if len(chosen) < batch_size:
        return draw(batch_size)
    return torch.cat(chosen)


@dataclass(frozen=True)
class WanObjective(MusubiFlowObjective):
    """musubi's flow objective; with both experts (`boundary` set) each batch's timesteps fall on one expert's side."""
    boundary: float | None = None

    def sample_timesteps(self, batch_size: int, generator: torch.Generator, device: torch.device | str,
                         latent_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
        if self.boundary is None:
            return super().sample_timesteps(batch_size, generator, device, latent_size)
        sigmas = expert_sigmas(self, self.boundary, batch_size, generator, latent_size)
        return (sigmas * NUM_TRAIN_TIMESTEPS).to(device)


class ExpertSwitch:
    """The expert not in use, as the transformer's base weights by parameter name, swapped in when a batch's
    timesteps ask for it. `high` is None for a single transformer; the low-noise expert is active at the start."""

    def __init__(self, high: dict[str, torch.Tensor] | None, default_boundary: float | None = None,
                 pending: Path | None = None):
        self.pending = pending  # a high-noise expert's file, read once the low-noise transformer is loaded
        self.default_boundary = default_boundary
        self.boundary = default_boundary if default_boundary is not None else DEFAULT_BOUNDARY
        self.offload = False
        self.high_active = False
        self._inactive = high

    @property
    def high(self) -> dict[str, torch.Tensor] | None:
        return self._inactive if not self.high_active else None

    @high.setter
    def high(self, state: dict[str, torch.Tensor] | None) -> None:
        self._inactive, self.high_active = state, False

    @classmethod
    def of(cls, high_transformer: torch.nn.Module, default_boundary: float | None = None) -> ExpertSwitch:
        state = {name: tensor.detach() for name, tensor in high_transformer.state_dict().items()}
        return cls(state, default_boundary)

    def configure(self, boundary: float, offload: bool) -> None:
        self.boundary, self.offload = boundary, offload

    def is_high(self, timesteps: torch.Tensor) -> bool:
        """Whether a batch's timesteps (1000 * sigma; one side of the boundary) ask for the high-noise expert."""
        high = self.high_items(timesteps)
        return high is not None and bool(high.reshape(-1)[0])

    def high_items(self, timesteps: torch.Tensor) -> torch.Tensor | None:
        """Per item: whether its timestep asks for the high-noise expert; None for one transformer."""
        if self._inactive is None and not self.high_active:
            return None
        return (timesteps.detach().float().cpu() / NUM_TRAIN_TIMESTEPS >= self.boundary).reshape(-1)

    def activate(self, transformer: torch.nn.Module, high: bool) -> None:
        """Make `transformer`'s base weights the high-noise (or low-noise) expert's; the LoRA stays."""
        if self._inactive is None or high == self.high_active:
            return
        outgoing = {}
        for name, incoming in self._inactive.items():
            tensor = _base_tensor(transformer, name)
            outgoing[name] = tensor.data.to("cpu") if self.offload else tensor.data
            tensor.data = incoming.to(device=tensor.device, dtype=tensor.dtype)
        self._inactive = outgoing
        self.high_active = high


def _base_tensor(model: torch.nn.Module, name: str) -> Any:
    """The parameter or buffer `name` of the plain transformer, also once peft has put its Linear behind
    `base_layer`."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf not in dict(module.named_parameters(recurse=False)) and leaf not in dict(module.named_buffers(
            recurse=False)):
        module = module.get_submodule("base_layer")
    return getattr(module, leaf)


def high_noise_weights(path: Path, low: torch.nn.Module) -> dict[str, torch.Tensor]:
    """dit_high_noise's weights (in their stored dtype; cast when swapped in) for `low`, the loaded low-noise
    transformer; a file of other weights or shapes is refused."""
    with reading(path, "the Wan high-noise expert"):
        state = transformer_state_dict(path, None)
    mine = low.state_dict()
    if state.keys() != mine.keys() or any(state[k].shape != mine[k].shape for k in mine):
        raise UserError(f"dit_high_noise {path}: not the high-noise expert of the model's transformer (other weights "
                        "or shapes)")
    return state
