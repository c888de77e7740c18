"""Wan image-to-video: Wan 2.1 I2V 14B (CLIP vision features of the first frame beside the prompt) and Wan 2.2 I2V
A14B (no image encoder; its two experts as the T2V A14B's), trained as musubi-tuner's wan_train_network.py trains
them and conditioned as diffusers' WanImageToVideoPipeline conditions them.

The condition is each clip's first frame (musubi's rule: wan_cache_latents.py takes `contents[:, :, 0:1]`; an image
is its own first frame). The transformer (in_channels 36) reads the noisy latents, then 4 mask channels (1 on the
latent frame made from the first pixel frame, which the VAE's 4x in time puts alone in latent frame 0; 0 after), then
the VAE's normalised latents of the first frame followed by F - 1 black frames (0 in [-1, 1]): musubi's `y` and the
pipeline's `condition`. Wan 2.1 I2V also reads the image encoder's penultimate hidden states of the first frame
(CLIPVisionModel, `hidden_states[-2]`, its CLIPImageProcessor's input: the pipeline's encode_image). The
image encoder is the folder's image_encoder/, or, for a transformer file, musubi's clip file converted to the same
CLIPVisionModel (library.families.wan.clip).

The VAE view (FirstFrameVae) encodes each clip's first-frame condition (and CLIP features) whenever the latents are
encoded before training, as musubi's latent cache holds them beside the latents (in memory here, keyed by the
item's latents); without cached latents they are encoded from the batch's pixels each step. A cache on disk is
refused for these models (its latents would come without their condition).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any, Mapping, Sequence

import torch

from library.config import UserError
from library.families.loading import LoadRequest
from library.families.wan.experts import ExpertSwitch, WanSettings
from library.families.wan.family import Wan, WanVae, _call
from library.families.wan.kind import task_problem
from library.families.wan.weights import I2V_CHANNELS

TEMPORAL = 4  # the VAE's frames per latent frame
I2V_BOUNDARY = 0.9  # musubi's timestep_boundary default for i2v-A14B (0.875 for T2V)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WanI2VSettings(WanSettings):
    cache_latents: bool
    cache_latents_to_disk: bool


class ImageParts:
    """What the image conditioning encodes with: the run's VAE (WanVae) and, for Wan 2.1, the image encoder and its
    processor (None for Wan 2.2). Shared by the family's configured copies."""

    def __init__(self, clip: bool = False, encoder: Any = None, processor: Any = None, clip_file: str | None = None):
        self.vae: Any = None
        self.clip = clip  # Wan 2.1 I2V: an image encoder (the folder's image_encoder/, or musubi's clip file)
        self.clip_file = clip_file  # the clip file the encoder was read from (None: from the folder)
        self.encoder, self.processor = encoder, processor
        self.recording = True  # until training starts: each latent encoded comes with its condition
        self.conditions: dict[str, dict[str, torch.Tensor]] = {}  # by latent_key of the item's latents

    def condition(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch's first-frame conditioning (the image latents and, for Wan 2.1, the image embeddings)."""
        out = {"image_latents": first_frame_condition(self.vae, pixels)}
        if self.clip:
            if next(self.encoder.parameters()).device != pixels.device:
                self.encoder.to(pixels.device)
            out["image_embeds"] = image_embeds(self.encoder, self.processor, pixels)
        return out


def latent_key(latents: torch.Tensor) -> str:
    """An item's latents (the latent cache's float32 posterior mean) as a key."""
    latents = latents.detach().float().cpu().contiguous()
    return hashlib.blake2b(repr(tuple(latents.shape)).encode() + latents.numpy().tobytes(), digest_size=16).hexdigest()


class FirstFrameVae(WanVae):
    """WanVae that, while `parts.recording` (before training), keeps each encoded item's first-frame condition by
    its latents, so that cached latents come with their condition."""

    def __init__(self, vae: WanVae, parts: ImageParts):
        super().__init__(vae.vae)
        self.parts = parts

    def encode(self, pixels: torch.Tensor) -> Any:
        out = super().encode(pixels)
        if self.parts.recording:
            means = out.latent_dist.mean
            for i, condition in enumerate(_items(self.parts.condition(pixels))):
                self.parts.conditions[latent_key(means[i])] = condition
        return out


def _items(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    size = next(iter(batch.values())).shape[0]
    return [{name: value[i].cpu() for name, value in batch.items()} for i in range(size)]


def mask_channels(batch: int, frames: int, height: int, width: int) -> torch.Tensor:
    """(B, 4, F', h, w): 1 where a latent channel comes from the first pixel frame, as the pipeline builds it."""
    mask = torch.zeros(batch, 1, frames, height, width)
    mask[:, :, 0] = 1
    mask = torch.cat([mask[:, :, :1].repeat_interleave(TEMPORAL, dim=2), mask[:, :, 1:]], dim=2)
    return mask.view(batch, -1, TEMPORAL, height, width).transpose(1, 2)


@torch.no_grad()
def first_frame_condition(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, F, H, W) or (B, 3, H, W) pixels in [-1, 1] -> (B, 20, F', h, w): the mask channels, then the VAE's
    normalised latents (the posterior's mode) of the first frame followed by F - 1 black frames."""
    video = pixels.unsqueeze(2) if pixels.ndim == 4 else pixels
    frames = video.shape[2]
    first = video[:, :, :1]
    condition = torch.cat([first, first.new_zeros(first.shape[0], first.shape[1], frames - 1, *first.shape[3:])],
                          dim=2)
    dtype = next(vae.parameters()).dtype
    with torch.autocast(pixels.device.type, enabled=False):
        latents = WanVae.encode(vae, condition.to(dtype)).latent_dist.mean
    mask = mask_channels(latents.shape[0], frames, *latents.shape[-2:]).to(latents.device, latents.dtype)
    return torch.cat([mask, latents], dim=1)


@torch.no_grad()
def image_embeds(encoder: Any, processor: Any, pixels: torch.Tensor) -> torch.Tensor:
    """The first frames' (B, 3, [F,] H, W) image-encoder features: the uint8 frame through the CLIPImageProcessor
    and CLIPVisionModel's penultimate hidden states, as WanImageToVideoPipeline.encode_image gives them."""
    from PIL import Image

    first = pixels[:, :, 0] if pixels.ndim == 5 else pixels
    frames = ((first.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    device = next(encoder.parameters()).device
    inputs = processor(images=[Image.fromarray(frame) for frame in frames], return_tensors="pt").to(device)
    inputs["pixel_values"] = inputs["pixel_values"].to(next(encoder.parameters()).dtype)
    with torch.autocast(device.type, enabled=False):
        return encoder(**inputs, output_hidden_states=True).hidden_states[-2]


@dataclasses.dataclass(frozen=True)
class WanI2V(Wan):
    """Wan image-to-video: `parts.encoder` is Wan 2.1's image encoder (None for 2.2 A14B). Each item's first frame is
    the condition; a sample prompt gives its first frame as a control image (--ci)."""
    parts: ImageParts = dataclasses.field(default_factory=ImageParts)
    display_name = "Wan I2V"
    settings_type = WanI2VSettings
    offers_i2v = True
    control_images = 1  # a sample prompt's first frame (--ci); a dataset's is each clip's own first frame
    refused_options = tuple((name, reason) for name, reason in Wan.refused_options if name != "clip")

    def configured(self, settings: WanI2VSettings) -> WanI2V:
        problem = task_problem("i2v-14B" if self.parts.clip else "i2v-A14B", settings.task)
        problems = [problem] if problem else []
        if settings.clip and not self.parts.clip:
            problems.append("clip: Wan 2.2 I2V A14B has no image encoder; remove clip")
        elif settings.clip and self.parts.clip_file is None:
            problems.append("clip: the Wan I2V diffusers folder brings its image encoder (image_encoder/); musubi's "
                            "clip file goes with a transformer file (remove clip)")
        if settings.user_set.get("i2v") is False:
            problems.append("i2v false: Wan I2V models always train on each clip's first frame; remove i2v")
        if settings.cache_latents_to_disk:
            problems.append("cache_latents_to_disk: Wan I2V keeps each clip's first-frame condition with its latents "
                            "in memory only; use cache_latents")
        boundary = settings.timestep_boundary
        if boundary is None and settings.dit_high_noise and self.experts is None:
            boundary = I2V_BOUNDARY  # both experts from their files: musubi's boundary for i2v-A14B
        try:
            configured = Wan.configured(self, dataclasses.replace(settings, task=None, clip=None,
                                                                  timestep_boundary=boundary))
        except UserError as e:
            problems += e.problems
        if problems:
            raise UserError(problems)
        if configured.experts is None and not self.parts.clip \
                and (settings.min_timestep, settings.max_timestep) == (0, 1000):
            logger.warning("Wan 2.2 I2V A14B with one expert: musubi-tuner recommends its timestep range, "
                           "min_timestep 0 / max_timestep 900 for the low-noise expert, 900 / 1000 for the high-noise "
                           "one")
        version = "2.1" if self.parts.clip else "2.2"
        return dataclasses.replace(configured, version=version)

    def attach_vae(self, vae: WanVae) -> FirstFrameVae:
        self.parts.vae = FirstFrameVae(vae, self.parts)
        return self.parts.vae

    def control_problems(self, counts: Mapping[int, int]) -> list[str]:
        with_controls = sum(items for count, items in counts.items() if count)
        return [f"the dataset has control images ({with_controls} items), but Wan I2V is conditioned on each clip's "
                "own first frame: they would be ignored; remove control_directory / control_path"
                ] if with_controls else []

    def batch_conditioning(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Each item's first-frame conditioning: kept when its latents were cached, else encoded from its pixels."""
        if self.parts.vae is None:
            raise RuntimeError("Wan I2V: the VAE was not attached when the model was read")
        if "latent_mean" not in batch:
            self.parts.recording = False
            self.parts.conditions.clear()
            return self.parts.condition(batch["pixels"])
        means = batch["latent_mean"]
        keys = [latent_key(mean) for mean in means]
        missing = [path for key, path in zip(keys, batch.get("path", ["?"] * len(keys)), strict=True)
                   if key not in self.parts.conditions]
        if missing:
            raise UserError([f"{path}: its latents came without the first frame's condition (Wan I2V encodes both "
                             "together before training)" for path in missing])
        items = [self.parts.conditions[key] for key in keys]
        return {name: torch.stack([item[name] for item in items]).to(means.device) for name in items[0]}

    def predict(self, denoiser: torch.nn.Module, hidden: torch.Tensor, timesteps: torch.Tensor, states: torch.Tensor,
                conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        condition = conditioning["image_latents"].to(hidden.device, hidden.dtype)
        inputs = torch.cat([hidden, condition], dim=1)
        if "image_embeds" not in conditioning:
            return _call(denoiser, inputs, timesteps, states)
        return denoiser(hidden_states=inputs, timestep=timesteps.to(hidden.dtype), encoder_hidden_states=states,
                        encoder_hidden_states_image=conditioning["image_embeds"].to(hidden.device, hidden.dtype),
                        return_dict=False)[0]

    def metadata_fields(self, settings: WanSettings) -> dict[str, Any]:
        fields = super().metadata_fields(settings)
        fields.setdefault("ss_task", "i2v-14B" if self.parts.clip else "i2v-A14B")
        return fields

    # --- sampling ----------------------------------------------------------------------------------------------
    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        """WanImageToVideoPipeline around the low-noise (or only) transformer; the prompt's --ci is its image."""
        from diffusers import WanImageToVideoPipeline
        from diffusers.image_processor import VaeImageProcessor

        class FirstFramePipeline(WanImageToVideoPipeline):
            def __call__(self, *args: Any, image: Any = None, **kwargs: Any) -> Any:
                if image is None:
                    raise UserError("a Wan I2V sample prompt needs its first frame: give it as --i IMAGE (or --ci)")
                return super().__call__(*args, image=image, **kwargs)

        if self.experts is not None:
            self.experts.activate(denoiser, high=False)
        if self.parts.encoder is not None:
            self.parts.encoder.to(next(denoiser.parameters()).device)
        pipe = FirstFramePipeline(tokenizer=tokenizers[0], text_encoder=text_encoders[0], vae=vae.vae,
                                  scheduler=scheduler, transformer=denoiser, image_encoder=self.parts.encoder,
                                  image_processor=self.parts.processor)
        pipe.image_processor = _Processors(self.parts.processor,
                                           VaeImageProcessor(vae_scale_factor=pipe.vae_scale_factor_spatial))
        return pipe

    def sampling_controls(self, images: Sequence[Any], arguments: Mapping[str, Any]) -> dict[str, Any]:
        return {**arguments, "image": images[0]}


class _Processors:
    """The pipeline's image_processor: called, the image encoder's CLIPImageProcessor (encode_image); its
    postprocess, the VAE image processor's (the sampler decodes the latents itself)."""

    def __init__(self, clip: Any, vae: Any):
        self.clip, self.vae = clip, vae

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.clip(*args, **kwargs)

    def postprocess(self, *args: Any, **kwargs: Any) -> Any:
        return self.vae.postprocess(*args, **kwargs)


def i2v_family(request: LoadRequest, transformer: Any, experts: ExpertSwitch | None) -> WanI2V:
    """The family of a WanImageToVideoPipeline folder: Wan 2.1 I2V (its image_encoder/ read here, with the VAE's
    part of the folder) or Wan 2.2 I2V A14B (two experts, no image encoder)."""
    from library.families.shared.diffusers_folder import read_folder

    channels = transformer.config.in_channels
    if channels != I2V_CHANNELS:
        raise UserError(f"{request.path}: a Wan image-to-video transformer with {channels} input channels; Wan 2.1 "
                        f"I2V 14B and 2.2 I2V A14B ({I2V_CHANNELS}) are trained here (TI2V 5B has 48; FLF2V and "
                        "Fun-Control are not trained here)")
    clip = transformer.config.image_dim is not None
    if clip and not (request.path / "image_encoder").is_dir():
        raise UserError(f"{request.path}: a Wan 2.1 I2V folder without image_encoder/ (its CLIP vision model)")
    parts = ImageParts(clip)
    if clip and not request.skips("vae"):
        from transformers import CLIPImageProcessor, CLIPVisionModel

        parts.encoder = read_folder(request.path, "Wan", {"image_encoder": (CLIPVisionModel, request.weight_dtype)}
                                    )["image_encoder"].eval().requires_grad_(False)
        parts.processor = CLIPImageProcessor.from_pretrained(request.path, subfolder="image_processor",
                                                             local_files_only=True)
    return WanI2V(version="2.1" if clip else "2.2", experts=experts, parts=parts)



def file_family(encoder: Any, processor: Any, clip_file: str | None = None) -> WanI2V:
    """The family of an image-to-video transformer file: Wan 2.1 I2V with the image encoder read from musubi's clip
    file (`encoder`, `processor`), or Wan 2.2 I2V A14B (None: no image encoder; one expert, or both with
    dit_high_noise)."""
    clip = encoder is not None
    return WanI2V(version="2.1" if clip else "2.2",
                  parts=ImageParts(clip, encoder, processor, clip_file=clip_file if clip else None))
