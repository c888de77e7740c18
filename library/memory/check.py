"""The memory check before a run loads its base: the estimate (library.memory.estimate) against what the device
has, naming the options that would fit when it does not."""
from __future__ import annotations

import logging

import torch

from library.config import Config, UserError
from library.config.network_args import network_args_of
from library.memory import estimate as memory
from library.memory.precision import BasePrecision

logger = logging.getLogger(__name__)


def check_memory(config: Config, device: torch.device, num_processes: int, precision: BasePrecision,
                 vae_dtype: torch.dtype, available: float | None = None) -> None:
    """Estimate what the run will hold from the model files' headers and stop before loading (UserError) where it
    exceeds the memory available (the CUDA device's, or the host's shared by this machine's `num_processes`), naming the
    options that would fit. `available` stands in for the measured memory in tests."""
    files = memory.model_files(config.pretrained_model_name_or_path,
                               {"text": [config.clip_l, config.t5xxl, config.text_encoder], "vae": [config.ae]})
    if files is None:
        return
    counts: dict[str, memory.Counts] = {}
    try:
        for path, part in files:
            for name, found in memory.count_file(path, part).items():
                counts[name] = counts.get(name, memory.Counts()) + found
    except (OSError, ValueError, KeyError, TypeError):
        return  # the loader names what is wrong with the file
    # IA3 trains one scale per channel whatever network_dim says (the GUI's iA3 presets write 64 or 1024)
    rank = 1 if network_args_of(config).algo == "ia3" else config.network_dim
    settings = memory.Settings(precision.denoiser, precision.text_encoders, precision.compute_dtype, vae_dtype,
                               rank, config.gradient_checkpointing or config.cpu_offload_checkpointing,
                               reads_low=any((config.clip_l, config.t5xxl, config.ae)))  # as build_session reads
    sharing = 1 if device.type == "cuda" else num_processes
    need = memory.estimate(counts, settings)
    if available is None:
        available = memory.available_memory(device) / sharing
    where = "on the GPU" if device.type == "cuda" else "in host memory"
    logger.info("memory estimate %s: %s (%.1f GiB available)", where, need.describe(), available / memory.GIB)
    if need.total <= available:
        return
    fits = memory.alternatives(counts, settings, available, device.type == "cuda")
    raise UserError([f"this run needs about {need.total / memory.GIB:.1f} GiB {where} ({need.describe()}) and "
                     f"{available / memory.GIB:.1f} GiB is available: it would run out of memory; stopped before "
                     "loading",
                     f"options that would fit: {'; '.join(fits)}" if fits else
                     "none of base_model_precision fp8 / int8 / nf4 or gradient_checkpointing alone would fit"])
