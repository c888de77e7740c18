"""Stable Diffusion 1.x and 2.x: one CLIP text encoder, a UNet conditioned on its hidden states, DDPM noise."""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, TypeVar

import torch

from library.config import UserError
from library.families.family import Components, Family, Tokenizer
from library.families.objective import DiffusionObjective, LossOptions, NoiseOptions
from library.families.settings import FamilySettings
from library.families.shared.clip_text import apply_weights, encode_prompt, tokenize, tokenize_weighted

F = TypeVar("F", bound=Family)


@dataclass(frozen=True)
class SDSettings(FamilySettings):
    """What SD1.x, SD2.x and SDXL read from a run: kohya's caption weights and its DDPM objective's options."""
    weighted_captions: bool
    zero_terminal_snr: bool
    min_timestep: int
    max_timestep: int
    noise_offset: float | None
    min_snr_gamma: float | None
    noise: NoiseOptions
    loss: LossOptions


class StableDiffusion(Family):
    text_encoder_folders = ("text_encoder",)
    tokenizer_folders = ("tokenizer",)
    lora_text_prefixes = ("lora_te",)
    offers_weighted_captions = True
    settings_type = SDSettings

    def __init__(self, name: str, base_model_version: str, v2: bool):
        self.name = name
        self.base_model_version = base_model_version
        self.v2 = v2
        self.weighted_captions = False  # kohya's (word:1.2) weights on the text encoder's outputs

    def configured(self, settings: SDSettings) -> StableDiffusion:
        return with_weighted_captions(self, settings.weighted_captions)

    def tokenizer(self, components: Components, max_token_length: int | None) -> Tokenizer:
        return functools.partial(_token_dict, components.tokenizer, max_token_length=max_token_length,
                                 weighted=self.weighted_captions)

    def encode_text(self, text_encoders: Sequence[torch.nn.Module], tokens: Mapping[str, torch.Tensor],
                    clip_skip: int | None) -> dict[str, torch.Tensor]:
        states = encode_prompt(text_encoders[0], tokens["input_ids"], clip_skip)
        if "weights" in tokens:
            states = apply_weights(states, tokens["weights"])
        return {"encoder_hidden_states": states}

    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: Mapping[str, torch.Tensor], conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return denoiser(noisy, timesteps, text["encoder_hidden_states"], return_dict=False)[0]

    def objective(self, components: Components, settings: SDSettings, device: torch.device) -> DiffusionObjective:
        return ddpm_objective(components, settings, device)

    def metadata_flags(self, v_prediction: bool) -> dict[str, bool]:
        return {"v2": self.v2, "v_parameterization": v_prediction, "sdxl": False}

    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline(vae=vae, text_encoder=text_encoders[0], tokenizer=tokenizers[0], unet=denoiser,
                                       scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)

    def prompt_embeds(self, positive: Mapping[str, torch.Tensor],
                      negative: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"prompt_embeds": positive["encoder_hidden_states"],
                "negative_prompt_embeds": negative["encoder_hidden_states"]}


def with_weighted_captions(family: F, weighted_captions: bool) -> F:
    """`family` as it is, or with weighted_captions a copy that weights its captions (SD1.x / 2.x, SDXL)."""
    if not weighted_captions:
        return family
    weighted = copy.copy(family)
    weighted.weighted_captions = True
    return weighted


def _token_dict(tokenizer: Any, caption: str, max_token_length: int | None,
                weighted: bool = False) -> dict[str, torch.Tensor]:
    if weighted:
        ids, weights = tokenize_weighted(tokenizer, caption, max_token_length)
        return {"input_ids": ids, "weights": weights}
    return {"input_ids": tokenize(tokenizer, caption, max_token_length)}


def ddpm_objective(components: Components, settings: SDSettings, device: torch.device) -> DiffusionObjective:
    """Epsilon or v prediction on the model's noise schedule. With zero_terminal_snr the components' schedule is
    replaced by the rescaled one, so that samplers built from its config rescale too."""
    scheduler = components.noise_scheduler
    if settings.zero_terminal_snr:
        scheduler = components.noise_scheduler = zero_terminal_snr(scheduler)
    objective = DiffusionObjective(scheduler.alphas_cumprod.to(device), components.v_prediction, settings.min_timestep,
                                   settings.max_timestep, settings.noise_offset, settings.min_snr_gamma, settings.noise,
                                   settings.loss)
    problems = objective.problems()
    if problems:
        raise UserError(problems)
    return objective


def zero_terminal_snr(noise_scheduler: Any) -> Any:
    """The schedule rescaled so the last timestep is pure noise (Lin et al. 2023, kohya's zero_terminal_snr).

    The config carries `rescale_betas_zero_snr`, so samplers built from it rescale too. For training, the last
    sqrt(alpha_cumprod) is kept a hair above zero: at exactly zero the SNR is 0 and Min-SNR weights divide by it.
    """
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler.from_config(noise_scheduler.config, rescale_betas_zero_snr=True)
    scheduler.alphas_cumprod[-1] = 4.8973451890853435e-08 ** 2
    return scheduler


SD1 = StableDiffusion("sd1", "sd_v1", v2=False)
SD2 = StableDiffusion("sd2", "sd_v2", v2=True)
