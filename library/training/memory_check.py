"""The memory check before a run loads its base: the estimate (library.memory.estimate) against what the device
has, naming the options that would fit when it does not. A run by phase
(library.training.base_loading.encode_first) is planned by phase: its largest phase must fit."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from library.config import Config, UserError
from library.config.network_args import network_args_of
from library.data.dataset import TrainingData
from library.data.scan import ImageRecord
from library.families.registry import entry_for
from library.memory import estimate as memory
from library.memory.precision import BasePrecision

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryPlan:
    """What a run's memory check weighs: the model files' counts, the run's settings, and how it goes."""
    counts: dict[str, memory.Counts]
    settings: memory.Settings
    by_phase: bool
    sampling: bool
    cuda: bool
    read_apart: bool  # the loader reads the model's parts one at a time (a transformer family's diffusers folder)
    swapped: float | None  # blocks_to_swap's share of the denoiser, where it counts and could be told

    def planned(self, settings: memory.Settings | None = None) -> dict[str, memory.Estimate]:
        """Each phase's estimate (one, named "", for a run not by phase), under the run's settings or `settings`."""
        settings = settings or self.settings
        if not self.by_phase:
            return {"": memory.estimate(self.counts, settings)}
        plan = memory.phases(self.counts, settings, self.sampling, host=not self.cuda)
        if not self.cuda and not self.read_apart:
            # the host reads every part at once, and holds the denoiser as read while the encoders fill the caches
            reading = memory.load_and_training(self.counts, settings)[0]
            encoding = plan[memory.TEXT_PHASE]
            plan = {"reading every part": reading, **plan, memory.TEXT_PHASE: memory.Estimate(
                {**encoding.parts, "denoiser as read": reading.parts["denoiser as read"]})}
        return plan


def memory_plan(config: Config, device: torch.device, precision: BasePrecision, vae_dtype: torch.dtype,
                by_phase: bool = False, sampling: bool = False, tokens: int = 0) -> MemoryPlan | None:
    """The plan check_memory weighs, from the model files' headers; None where they cannot be read by header
    (pickles, .bin) or are broken (the loader names what is wrong)."""
    files = memory.model_files(config.pretrained_model_name_or_path,
                               {"text": [config.clip_l, config.t5xxl, config.text_encoder], "vae": [config.ae]})
    if files is None:
        return None
    counts: dict[str, memory.Counts] = {}
    try:
        for path, part in files:
            for name, found in memory.count_file(path, part).items():
                counts[name] = counts.get(name, memory.Counts()) + found
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # IA3 trains one scale per channel whatever network_dim says (the GUI's iA3 presets write 64 or 1024)
    rank = 1 if network_args_of(config).algo == "ia3" else config.network_dim
    cuda = device.type == "cuda"
    reads_low = any((config.clip_l, config.t5xxl, config.ae))  # as read_base reads
    settings = memory.Settings(precision.denoiser, precision.text_encoders, precision.compute_dtype, vae_dtype,
                               rank, config.gradient_checkpointing or config.cpu_offload_checkpointing,
                               reads_low=reads_low, quantized_as_read=reads_low and entry_for(
                                   config.pretrained_model_name_or_path).quantizes_while_reading, tokens=tokens,
                               offload_checkpoints=cuda and config.cpu_offload_checkpointing)
    swapped = swapped_share(config) if cuda and config.blocks_to_swap else None
    if swapped:
        settings = replace(settings, swapped_fraction=swapped)
    return MemoryPlan(counts, settings, by_phase, sampling, cuda, reads_apart(config.pretrained_model_name_or_path),
                      swapped)


def check_memory(config: Config, device: torch.device, num_processes: int, precision: BasePrecision,
                 vae_dtype: torch.dtype, available: float | None = None, by_phase: bool = False,
                 sampling: bool = False, tokens: int = 0) -> None:
    """Estimate what the run will hold from the model files' headers and stop before loading (UserError) where it
    exceeds the memory available (the CUDA device's, or the host's shared by this machine's `num_processes`), naming the
    options that would fit. `by_phase`: the run caches its frozen text encoders' outputs and frees them before the
    denoiser is read (then each phase is checked on its own, `sampling` saying whether sample prompts bring the
    encoders back). blocks_to_swap on CUDA counts where the denoiser's blocks can be told without reading it (a
    diffusers folder read by part). `tokens`: the largest batch's (batch_tokens). `available` stands in for the
    measured memory in tests."""
    run = memory_plan(config, device, precision, vae_dtype, by_phase, sampling, tokens)
    if run is None:
        return
    cuda, settings, swapped, planned = run.cuda, run.settings, run.swapped, run.planned
    plan = planned(settings)
    need = memory.peak(plan)
    sharing = 1 if cuda else num_processes
    if available is None:
        available = memory.available_memory(device) / sharing
    where = "on the GPU" if cuda else "in host memory"
    swap_note = "" if not (cuda and config.blocks_to_swap) else (
        f"; blocks_to_swap {config.blocks_to_swap}: {swapped:.0%} of the denoiser in host memory" if swapped else
        f"; blocks_to_swap {config.blocks_to_swap} not counted (the denoiser's blocks are told from a diffusers "
        "folder only)")
    if by_phase:
        logger.info("memory estimate %s by phase (the largest must fit): %s (%.1f GiB available)%s", where,
                    memory.describe_phases(plan), available / memory.GIB, swap_note)
    else:
        logger.info("memory estimate %s: %s (%.1f GiB available)%s", where, need.describe(),
                    available / memory.GIB, swap_note)
    if need.total <= available:
        return
    fits = memory.alternatives(run.counts, settings, available, cuda,
                               lambda changed: memory.peak(planned(changed)).total)
    phase = next(name for name, estimate in plan.items() if estimate is need)
    raise UserError([f"this run needs about {need.total / memory.GIB:.1f} GiB {where}"
                     f"{f' while {phase}' if phase else ''} ({need.describe()}) and "
                     f"{available / memory.GIB:.1f} GiB is available: it would run out of memory; stopped before "
                     "loading",
                     f"options that would fit: {'; '.join(fits)}" if fits else
                     "none of base_model_precision fp8 / int8 / nf4 or gradient_checkpointing alone would fit"])


def batch_tokens(data: TrainingData, frames_step: int | None) -> int:
    """The largest batch's latent tokens, as the activations grow with them: its batch size x its bucket's patches
    (memory.PIXELS_PER_TOKEN a side) x a clip's latent frames (1 + (frames - 1) / the family's step)."""
    def tokens(record: ImageRecord) -> int:
        frames = 1 if record.frames is None else (len(record.frames) - 1) // (frames_step or 1) + 1
        width, height = record.bucket
        patches = -(-width // memory.PIXELS_PER_TOKEN) * -(-height // memory.PIXELS_PER_TOKEN)
        return data.specs[record.dataset_index].batch_size * patches * frames

    return max((tokens(record) for record in data.records), default=0)


def reads_apart(model: str | None) -> bool:
    from library.families.loading import reads_by_part

    return reads_by_part(model)


def swapped_share(config: Config) -> float | None:
    """blocks_to_swap's share of the denoiser's weights, from its family's swap plan on the denoiser built from its
    folder's config (nothing of it or the text encoders read); None where the model is not such a folder or its
    family has no plan."""
    if not reads_apart(config.pretrained_model_name_or_path):
        return None
    from library.families.loading import load_components

    try:
        components = load_components(Path(config.pretrained_model_name_or_path),
                                     model_version=config.model_version,
                                     skip=frozenset({"denoiser", "text"}))  # some loaders read the VAE's statistics
        return memory.swapped_share(components.denoiser,
                                    components.family.block_swap_plan(components.denoiser, config.blocks_to_swap))
    except (UserError, OSError, ValueError):
        return None  # the loader or the swap plan names the problem when the run reaches them
