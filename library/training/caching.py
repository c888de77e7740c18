"""What is encoded once before training (latents, text-encoder outputs) and why, and the encoding itself.

Both caches are exact: the latent cache keeps each image's posterior (encoded one image per VAE call, as the
uncached path encodes) and each step draws its sample from the step generator; the text cache keeps the frozen
encoders' outputs per caption. So they are on by default wherever nothing per step needs what they would skip:
latents unless a subset draws random crops, text unless a text encoder is trained or a caption changes each time.
An explicit `cache_latents` / `cache_text_encoder_outputs` (true or false) always wins.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

from library.config import Config
from library.data.cache import cache_latents, cache_text_encoder_outputs
from library.data.dataset import TrainingData
from library.families.family import Components
from library.training.model import DiffusionModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachePlan:
    latents: bool
    text: bool
    notes: tuple[str, ...]


def plan_caching(config: Config, data: TrainingData, train_text_encoder: bool,
                 prompt_reads_controls: bool = False) -> CachePlan:
    notes = []
    if config.is_set("cache_latents") or config.cache_latents_to_disk:
        latents = config.cache_latents or config.cache_latents_to_disk
    else:
        cropped = sorted({str(r.subset.image_dir) for r in data.records if r.subset.random_crop or r.subset.color_aug})
        latents = not cropped
        notes.append("latents are cached in memory: the VAE encodes each image once and every step samples from "
                     "its cached posterior, as it would encoding the image then (cache_latents = false turns this "
                     "off)" if latents else
                     f"latents are encoded each step: random_crop / color_aug change the pixels each time "
                     f"({', '.join(cropped)})")
    if prompt_reads_controls:
        text = False
        notes.append("text-encoder outputs are not cached: the prompt is encoded with each item's control images")
    elif config.cache_text_encoder_outputs_to_disk:
        # sd-scripts: _to_disk turns on cache_text_encoder_outputs. The outputs are encoded once at start here
        # and kept in memory: no file beside the images.
        text = True
        notes.append("cache_text_encoder_outputs_to_disk: text-encoder outputs are cached in memory, encoded once "
                     "at start; no cache file is written")
    elif config.is_set("cache_text_encoder_outputs"):
        text = config.cache_text_encoder_outputs
    else:
        varying = sorted({str(r.subset.image_dir) for r in data.records if r.subset.caption_ops})
        text = not train_text_encoder and not varying
        if text:
            notes.append("text-encoder outputs are cached: the text encoders are not trained and every caption is "
                         "fixed (cache_text_encoder_outputs = false turns this off)")
        elif not train_text_encoder:
            notes.append("text-encoder outputs are not cached: shuffle_caption / caption_tag_dropout_rate change "
                         f"the caption each time ({', '.join(varying)})")
    return CachePlan(latents, text, tuple(notes))


def cache_inputs(config: Config, data: TrainingData, components: Components, accelerator: Accelerator,
                 vae_dtype: torch.dtype, plan: CachePlan) -> None:
    """Encode latents and text-encoder outputs once, before training, as planned."""
    for note in plan.notes:
        logger.info(note)
    if plan.latents:
        cache_latents(data, components.vae, accelerator.device, vae_dtype, config.vae_batch_size,
                      config.cache_latents_to_disk, process_index=accelerator.process_index,
                      num_processes=accelerator.num_processes, wait_for_everyone=accelerator.wait_for_everyone,
                      skip_bad_images=config.skip_bad_images)
    if plan.text:
        @torch.no_grad()
        def encode(tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            encoded = components.family.encode_text(components.text_encoders,
                                                    send_to_device(tokens, accelerator.device), config.clip_skip)
            return send_to_device(encoded, "cpu")

        cache_text_encoder_outputs(data, encode, batch_size=config.text_encoder_batch_size or 16)


def release_encoders(components: Components, model: DiffusionModel | None, plan: CachePlan, train_text_encoder: bool,
                     sampling: bool, device: torch.device, validating: bool = False) -> None:
    """Once the VAE's and the frozen text encoders' outputs are cached, only sampling needs them. Without sample
    prompts their weights are dropped (moved to the meta device: the modules and configs stay, the memory goes);
    with them they wait on the CPU between sampling rounds (`on_device`). A cached encoder also leaves the trained
    module, which then holds only what each step runs (`model`: None in a run by phase, whose trained module is
    built without them). Validation images are encoded when validated (`validating`), so the VAE then stays."""
    parked: list[str] = []
    if plan.text and not train_text_encoder:
        if model is not None:
            model.text_encoders = torch.nn.ModuleList()
        parked += [f"text encoder {i + 1}" for i in range(len(components.text_encoders))]
        _park(components.text_encoders, sampling)
    if plan.latents and not validating:
        parked.append("VAE")
        _park([components.vae], sampling)
    if parked and not sampling:
        logger.info("%s: outputs cached and no sample prompts, so the weights are freed", ", ".join(parked))
    elif parked and device.type != "cpu":
        logger.info("%s: outputs cached, so they wait on the CPU between sampling rounds", ", ".join(parked))


def _park(modules: Sequence[torch.nn.Module], sampling: bool) -> None:
    for module in modules:
        module.to("cpu" if sampling else "meta")


@contextlib.contextmanager
def on_device(modules: Sequence[torch.nn.Module], device: torch.device) -> Iterator[None]:
    """Bring modules parked on the CPU to `device` for the block, then back."""
    moved = [m for m in modules if next(m.parameters()).device != device]
    for module in moved:
        module.to(device)
    try:
        yield
    finally:
        for module in moved:
            module.to("cpu")
