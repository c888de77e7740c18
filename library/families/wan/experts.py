"""Wan 2.2 A14B's two experts, trained as musubi-tuner's wan_train_network.py trains them in one run: one LoRA on one
transformer whose frozen base weights are the low-noise expert's below `timestep_boundary` and the high-noise
expert's at and above it (swap_high_low_weights), so one LoRA file serves both; each batch goes to one expert
(get_noisy_model_input_and_timesteps: the first draw picks the expert, then each item is drawn again, up to 100
times, until it falls on that expert's side; if one never does, the batch is drawn afresh as for one model).
With `offload_inactive_dit` the expert not in use is kept in CPU memory.

With `expert_loras = "separate"` (the default) each expert trains its own LoRA instead: two peft adapters on the one
transformer ("default" for the low-noise expert, "high_noise" for the high-noise one), the active one switched
together with the base weights, so each trains only on its expert's batches and is saved to its own file. Where a
sample runs, each denoiser call takes the expert (and its LoRA) its timestep asks for, as WanPipeline switches its
transformer (high noise) and transformer_2 (low noise) at boundary_ratio.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from library.config import UserError
from library.families.family import LoraAdapter
from library.families.flow_matching import NUM_TRAIN_TIMESTEPS
from library.families.shared.musubi_flow import MusubiFlowObjective, MusubiSettings, musubi_sigmas
from library.families.shared.separate_files import reading
from library.families.wan.weights import transformer_state_dict

DEFAULT_BOUNDARY = 0.875  # musubi's t2v-A14B boundary (i2v-A14B: 0.9)
MAX_DRAWS = 100  # musubi's num_max_calls
LOW_ADAPTER, HIGH_ADAPTER = "default", "high_noise"  # peft's adapter names of the two experts' LoRAs
EXPERT_ADAPTERS = (LoraAdapter(LOW_ADAPTER, "_low_noise", {"ss_expert": "low_noise"}),
                   LoraAdapter(HIGH_ADAPTER, "_high_noise", {"ss_expert": "high_noise"}))


@dataclass(frozen=True)
class WanSettings(MusubiSettings):
    """What Wan reads besides musubi's image families: its task, the experts' options, and the options it refuses."""
    task: str | None
    timestep_boundary: float | None
    offload_inactive_dit: bool
    blocks_to_swap: int | None
    clip: str | None
    dit_high_noise: str | None
    expert_loras: str
    network_weights: str | None


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
    timesteps ask for it. `high` is None for a single transformer; the low-noise expert is active at the start.
    `separate`: each expert has its own LoRA (EXPERT_ADAPTERS), made active with its base weights."""

    def __init__(self, high: dict[str, torch.Tensor] | None, default_boundary: float | None = None,
                 pending: Path | None = None):
        self.pending = pending  # a high-noise expert's file, read once the low-noise transformer is loaded
        self.default_boundary = default_boundary
        self.boundary = default_boundary if default_boundary is not None else DEFAULT_BOUNDARY
        self.offload = False
        self.separate = False
        self.high_active = False
        self._following: set[int] = set()  # the transformers whose calls pick their expert (follow_timesteps)
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

    def configure(self, boundary: float, offload: bool, separate: bool = False) -> None:
        self.boundary, self.offload, self.separate = boundary, offload, separate

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
        """Make `transformer`'s base weights the high-noise (or low-noise) expert's; a shared LoRA stays, one LoRA
        per expert switches with them."""
        if self.separate and use_adapter(transformer, HIGH_ADAPTER if high else LOW_ADAPTER):
            self.follow_timesteps(transformer)
        if self._inactive is None or high == self.high_active:
            return
        outgoing = {}
        for name, incoming in self._inactive.items():
            tensor = _base_tensor(transformer, name)
            outgoing[name] = tensor.data.to("cpu") if self.offload else tensor.data
            tensor.data = incoming.to(device=tensor.device, dtype=tensor.dtype)
        self._inactive = outgoing
        self.high_active = high

    def follow_timesteps(self, transformer: torch.nn.Module) -> None:
        """From now on each call of `transformer` runs on the expert (and LoRA) its `timestep` asks for: a sampling
        pipeline's steps above the boundary on the high-noise one, as WanPipeline does with transformer and
        transformer_2. Training's batches are on one side already, where this changes nothing."""
        if id(transformer) in self._following:
            return
        self._following.add(id(transformer))

        def pick_expert(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if kwargs.get("timestep") is not None:
                self.activate(module, self.is_high(kwargs["timestep"]))
        transformer.register_forward_pre_hook(pick_expert, with_kwargs=True)


def use_adapter(transformer: torch.nn.Module, name: str) -> bool:
    """peft's active adapter of `transformer` made `name` (peft's set_adapter), where both experts' adapters are
    attached; whether they are. Both stay trainable: set_adapter freezes the other, but the optimizer and DDP keep
    one set of trained parameters for the run (the other simply gets no gradient in this batch)."""
    from peft.functional import set_adapter, set_requires_grad
    from peft.tuners.lora import LoraLayer

    layer = next((module for module in transformer.modules() if isinstance(module, LoraLayer)), None)
    if layer is None or HIGH_ADAPTER not in layer.lora_A:
        return False
    if layer.active_adapters != [name]:
        set_adapter(transformer, name)
        set_requires_grad(transformer, [LOW_ADAPTER, HIGH_ADAPTER], True)
    return True


def separate_loras(settings: WanSettings, experts: ExpertSwitch) -> bool:
    """Whether a both-experts run trains one LoRA per expert: expert_loras = "separate" (the default) and a timestep
    range that draws batches for both (a range on one side of the boundary trains one expert, and one LoRA)."""
    boundary = boundary_of(settings, experts.default_boundary) * NUM_TRAIN_TIMESTEPS
    return settings.expert_loras == "separate" and settings.min_timestep < boundary < settings.max_timestep


def separate_weights_problem(network_weights: str) -> str:
    return (f"network_weights {network_weights}: a run that trains one LoRA per expert (expert_loras = \"separate\", "
            "the default with both experts) starts both LoRAs from scratch; set expert_loras = \"shared\" to "
            "continue one LoRA shared by both experts, or continue each expert's file in a run of that expert alone")


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
