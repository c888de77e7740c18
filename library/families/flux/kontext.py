"""FLUX.1 Kontext [dev]: FLUX.1 dev's transformer, trained to edit. The control (reference) image's latents, scaled
and packed 2x2 as the target's are, follow the target's tokens in the image sequence with their own positions (axis 0
set to 1, rows and columns from 0), and the prediction is sliced back to the target's tokens, so the loss sees the
target only: musubi-tuner's flux_kontext_train_network.py, and diffusers' FluxKontextPipeline at inference.

One control image per item, as musubi's FLUX.1 Kontext dataset takes. Training's guidance input is 1.0 unless
guidance_scale is set (musubi's); sampling's is 2.5 unless a prompt gives --g (musubi's default for Kontext).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch

from library.config import UserError
from library.families.flux.family import Flux, FluxSettings, image_ids, pack_latents
from library.families.shared import checks as transformer_checks

TRAINING_GUIDANCE = 1.0  # musubi's guidance input for Kontext training
SAMPLING_GUIDANCE = 2.5  # musubi's default_guidance_scale for Kontext inference
CONTROL_MULTIPLE = 16  # musubi crops a sampling control image to multiples of this (its own size otherwise)


def reference_ids(height: int, width: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[(H/2)(W/2), 3] positions of a reference image's packed tokens for unpacked latents (height, width): axis 0
    one, rows and columns counted from 0 as the target's are."""
    ids = image_ids(height, width, device, dtype)
    ids[:, 0] = 1
    return ids


@dataclasses.dataclass(frozen=True)
class FluxKontext(Flux):
    """FLUX.1 Kontext [dev]: a Flux whose image sequence carries the control image's tokens after the target's."""
    control_images = 1

    @property
    def name(self) -> str:  # type: ignore[override]
        return "flux1-kontext-dev"

    @property
    def base_model_version(self) -> str:  # type: ignore[override]
        return "flux1-kontext"  # a dev state does not resume a Kontext run

    def configured(self, settings: FluxSettings) -> FluxKontext:
        family = super().configured(settings)
        if "guidance_scale" not in settings.user_set:
            family = dataclasses.replace(family, guidance_scale=TRAINING_GUIDANCE)
        return family  # type: ignore[return-value]

    # --- the denoiser ------------------------------------------------------------------------------------------
    def control_conditioning(self, controls: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        if len(controls) != 1:
            raise UserError(f"FLUX.1 Kontext takes one control image per item; a batch brings {len(controls)}")
        return {"control_latents": controls[0]}

    def with_references(self, inputs: dict[str, Any], conditioning: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        if "control_latents" not in conditioning:
            raise ValueError("FLUX.1 Kontext trains on pairs: the batch carries no control latents")
        control = conditioning["control_latents"]
        _, _, height, width = control.shape
        transformer_checks.check_latent_size("FLUX.1 Kontext (its control images)", height, width)
        hidden = inputs["hidden_states"]
        tokens = pack_latents(control.to(device=hidden.device, dtype=hidden.dtype))
        ids = reference_ids(height, width, hidden.device, inputs["img_ids"].dtype)
        return {**inputs, "hidden_states": torch.cat([hidden, tokens], dim=1),
                "img_ids": torch.cat([inputs["img_ids"], ids], dim=0)}

    # --- LoRA files and metadata -------------------------------------------------------------------------------
    def metadata_flags(self, v_prediction: bool) -> dict[str, Any]:
        # ss_base_model_version stays kohya's flux1: the file has FLUX.1's keys and loads wherever FLUX.1's do.
        return {**super().metadata_flags(v_prediction), "architecture": "flux-1-kontext-dev/lora"}

    def metadata_fields(self, settings: FluxSettings) -> dict[str, Any]:
        return {**super().metadata_fields(settings), "ss_guidance_scale": self.guidance_scale}

    # --- sampling ----------------------------------------------------------------------------------------------
    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        from diffusers import FluxKontextPipeline

        return FluxKontextPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoders[0],
                                   tokenizer=tokenizers[0], text_encoder_2=text_encoders[1],
                                   tokenizer_2=tokenizers[1], transformer=denoiser)

    def sampling_guidance(self, scale: float, guidance: float | None, positive: Mapping[str, torch.Tensor],
                          width: int, height: int) -> dict[str, Any]:
        """FLUX.1's, with musubi's Kontext guidance by default; max_area keeps the prompt's size (the pipeline
        otherwise scales every sample to a megapixel)."""
        arguments = super().sampling_guidance(scale, SAMPLING_GUIDANCE if guidance is None else guidance, positive,
                                              width, height)
        return {**arguments, "max_area": width * height}

    def sampling_controls(self, images: Sequence[Any], arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The control image at its own size, cropped from the top left to multiples of 16 (musubi's sampling; the
        pipeline would resize it to a preferred Kontext size). With apply_t5_attn_mask its tokens join the mask."""
        if len(images) != 1:
            raise UserError(f"sample prompt: FLUX.1 Kontext takes one control image (--ci); got {len(images)}")
        image = images[0]
        width, height = (side // CONTROL_MULTIPLE * CONTROL_MULTIPLE for side in image.size)
        if not width or not height:
            raise UserError(f"sample prompt --ci: the control image is {image.size[0]}x{image.size[1]}; FLUX.1 "
                            f"Kontext needs sides of at least {CONTROL_MULTIPLE} pixels")
        out = {**arguments, "image": image.crop((0, 0, width, height)), "_auto_resize": False}
        if "joint_attention_kwargs" in arguments:
            mask = arguments["joint_attention_kwargs"]["attention_mask"]
            tokens = (height // CONTROL_MULTIPLE) * (width // CONTROL_MULTIPLE)
            control = torch.ones(*mask.shape[:-1], tokens, dtype=mask.dtype, device=mask.device)
            out["joint_attention_kwargs"] = {"attention_mask": torch.cat([mask, control], dim=-1)}
        return out
