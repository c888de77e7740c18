"""Wan 2.2 TI2V 5B: one 48-channel transformer over its own VAE's latents (16x down in space) that draws text-to-video
and image-to-video. Without `i2v` it trains text-to-video (every token at the item's timestep). With `i2v` (musubi's
wan_cache_latents.py --i2v; musubi-tuner has no TI2V training of its own) each clip's first frame is the condition,
as diffusers' WanImageToVideoPipeline conditions TI2V 5B (`expand_timesteps`) and Wan's textimage2video.py does:

- the first latent frame of the transformer's input is the clip's own clean latent frame, not noised. The causal VAE
  encodes the first pixel frame alone into latent frame 0, so that frame is the image's latent the pipeline's
  prepare_latents encodes from the first frame (checked in the tests);
- its tokens get timestep 0 and the others the item's timestep (the pipeline's `first_frame_mask * t` per token);
- it is left out of the loss (DiffSynth-Studio's TI2V training drops it the same way): the loss is the mean over
  latent frames 1..F'-1.

An item of one latent frame (an image, or a clip of 1 to 4 frames) has nothing to predict beside its condition: it
trains as text-to-image, as without `i2v`. A sample prompt with a first frame (musubi's --i, or --ci) draws through
WanImageToVideoPipeline with expand_timesteps, one without through WanPipeline, whichever way the run trains.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch

from library.config import UserError
from library.families.wan.experts import WanObjective, WanSettings
from library.families.wan.family import TI2V, TI2V_TASK, Wan


def conditioned(latents: torch.Tensor) -> bool:
    """Whether these latents have a first frame to keep as the condition and frames after it to train."""
    return latents.ndim == 5 and latents.shape[2] > 1


@dataclasses.dataclass(frozen=True)
class FirstFrameObjective(WanObjective):
    """WanObjective whose noisy input keeps the first latent frame clean and whose loss leaves it out."""

    def noisy_latents(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        noisy = super().noisy_latents(latents, noise, timesteps)
        if not conditioned(latents):
            return noisy
        return torch.cat([latents[:, :, :1].to(noisy.dtype), noisy[:, :, 1:]], dim=2)

    def per_sample_loss(self, prediction: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor,
                        timesteps: torch.Tensor, mask: torch.Tensor | None = None,
                        noisy: torch.Tensor | None = None) -> torch.Tensor:
        if conditioned(latents):
            prediction, latents, noise = prediction[:, :, 1:], latents[:, :, 1:], noise[:, :, 1:]
            noisy = None if noisy is None else noisy[:, :, 1:]
        return super().per_sample_loss(prediction, latents, noise, timesteps, mask, noisy=noisy)


def token_timesteps(timesteps: torch.Tensor, hidden: torch.Tensor, patch_size: Sequence[int]) -> torch.Tensor:
    """(B,) timesteps -> (B, tokens): 0 on the first latent frame's tokens, the item's timestep on the others, in
    the transformer's token order (frame, row, column), as the pipeline's first_frame_mask gives them."""
    frames, height, width = (size // patch for size, patch in zip(hidden.shape[2:], patch_size, strict=True))
    per_frame = height * width
    tokens = timesteps.to(hidden.dtype).reshape(-1, 1).expand(hidden.shape[0], frames * per_frame).clone()
    tokens[:, :per_frame] = 0
    return tokens


@dataclasses.dataclass(frozen=True)
class WanTI2V(Wan):
    """Wan 2.2 TI2V 5B; `i2v` (the run's) trains it on each clip's first frame."""
    version: str = TI2V
    i2v: bool = False
    offers_i2v = True
    control_images = 1  # a sample prompt's first frame (--i / --ci); optional for TI2V 5B

    def configured(self, settings: WanSettings) -> WanTI2V:
        """The run's i2v (read as the option the user set, default off) on top of Wan's checks."""
        task = None if settings.task == TI2V_TASK else settings.task
        configured = Wan.configured(self, dataclasses.replace(settings, task=task))
        return dataclasses.replace(configured, i2v=bool(settings.user_set.get("i2v", False)))

    def control_problems(self, counts: Mapping[int, int]) -> list[str]:
        with_controls = sum(items for count, items in counts.items() if count)
        return [f"the dataset has control images ({with_controls} items), but Wan 2.2 TI2V 5B takes none (with i2v "
                "its condition is each clip's own first frame): they would be ignored; remove control_directory / "
                "control_path"] if with_controls else []

    def objective(self, components: Any, settings: WanSettings, device: torch.device) -> WanObjective:
        base = super().objective(components, settings, device)
        if not self.i2v:
            return base
        return FirstFrameObjective(**{field.name: getattr(base, field.name) for field in dataclasses.fields(base)})

    def predict(self, denoiser: torch.nn.Module, hidden: torch.Tensor, timesteps: torch.Tensor, states: torch.Tensor,
                conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if not (self.i2v and conditioned(hidden)):
            return super().predict(denoiser, hidden, timesteps, states, conditioning)
        tokens = token_timesteps(timesteps, hidden, denoiser.config.patch_size)
        return denoiser(hidden_states=hidden, timestep=tokens, encoder_hidden_states=states, return_dict=False)[0]

    def metadata_fields(self, settings: WanSettings) -> dict[str, Any]:
        fields = super().metadata_fields(settings)
        if self.i2v:
            fields["ss_i2v"] = True
        return fields

    # --- sampling ----------------------------------------------------------------------------------------------
    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        """WanPipeline for a text prompt, WanImageToVideoPipeline with expand_timesteps for one with a first frame
        (the pipelines share the modules)."""
        from diffusers import WanImageToVideoPipeline

        text = super().pipeline(denoiser, vae, text_encoders, tokenizers, scheduler)
        image = WanImageToVideoPipeline(tokenizer=tokenizers[0], text_encoder=text_encoders[0], vae=vae.vae,
                                        scheduler=scheduler, transformer=denoiser, expand_timesteps=True)
        return _TextOrImage(text, image)

    def sampling_controls(self, images: Sequence[Any], arguments: Mapping[str, Any]) -> dict[str, Any]:
        if len(images) != 1:
            raise UserError(f"a Wan 2.2 TI2V 5B sample prompt takes one first frame (--i), not {len(images)}")
        return {**arguments, "image": images[0]}


class _TextOrImage:
    """The sampling pipeline: text-to-video, or image-to-video when called with an image."""

    def __init__(self, text: Any, image: Any):
        self.text, self.image = text, image
        self.image_processor = text.image_processor  # the sampler's postprocess of decoded frames

    def set_progress_bar_config(self, **options: Any) -> None:
        self.text.set_progress_bar_config(**options)
        self.image.set_progress_bar_config(**options)

    def __call__(self, *args: Any, image: Any = None, **kwargs: Any) -> Any:
        if image is None:
            return self.text(*args, **kwargs)
        return self.image(*args, image=image, **kwargs)
