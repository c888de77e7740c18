"""The flow-matching objective of musubi-tuner's image trainers (Z-Image, Qwen-Image), as its NetworkTrainer draws
timesteps and weights the loss (musubi_tuner/training/trainer_base.py, training/timesteps.py).

What differs from kohya's FLUX objective (library.families.flow_matching): the prediction is always read raw (no
model_prediction_type), `sigma` sampling draws from the unshifted 1000-step schedule (musubi's
FlowMatchDiscreteScheduler applies its shift only when sampling images), sigma_sqrt / cosmap weight the loss
whatever the sampling, the defaults are musubi's (discrete_flow_shift 1.0, weighting_scheme none), and there are
musubi's image-size shifts (qwen_shift, flux2_shift) and logsnr sampling. Timesteps travel through the loop as
1000 * sigma, as for FLUX.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from library.config import UserError
from library.config.choices import MUSUBI_TIMESTEP_SAMPLINGS
from library.families.family import Components, Family
from library.families.flow_matching import (
    NUM_TRAIN_TIMESTEPS,
    FlowMatchingObjective,
    FlowOptions,
    FlowSettings,
    density_sample,
    loss_weighting,
    sigmas_of,
)
from library.families.objective import per_sample_loss
from library.families.settings import value_of
from library.families.shared import checks as transformer_checks
from library.families.shared.sampling import flow_euler_scheduler

logger = logging.getLogger(__name__)

SAMPLINGS = MUSUBI_TIMESTEP_SAMPLINGS  # what musubi_sigmas draws by
DEFAULT_FLOW_SHIFT = 1.0  # musubi's --discrete_flow_shift default


def lin_function(x1: float, y1: float, x2: float, y2: float, x: float) -> float:
    """musubi's get_lin_function(x1, y1, x2, y2)(x)."""
    m = (y2 - y1) / (x2 - x1)
    return m * x + (y1 - m * x1)


def image_shift(mode: str, latent_size: tuple[int, int]) -> float:
    """exp(mu) of musubi's resolution-dependent shifts, from the loop's latent size: flux_shift and qwen_shift count
    its 2x2 patches, flux2_shift (flux_shift's line) its positions, as musubi does (FLUX.2's latents come patched)."""
    height, width = latent_size
    tokens = (height // 2) * (width // 2)
    if mode == "flux2_shift":
        return math.exp(lin_function(256, 0.5, 4096, 1.15, height * width))
    if mode == "flux_shift":
        return math.exp(lin_function(256, 0.5, 4096, 1.15, tokens))
    return math.exp(lin_function(256, 0.5, 8192, 0.9, tokens))  # qwen_shift


def musubi_sigmas(options: FlowOptions, batch_size: int, generator: torch.Generator, latent_size: tuple[int, int],
                  min_timestep: int = 0, max_timestep: int = NUM_TRAIN_TIMESTEPS) -> torch.Tensor:
    """Per-sample sigmas as musubi's get_noisy_model_input_and_timesteps draws them (without
    preserve_distribution_shape and timestep buckets); every draw from `generator`."""
    mode = options.timestep_sampling
    if mode == "sigma":
        # u picks an index into the schedule 1000, 999, ..., 1 (sigma = timestep / 1000), unshifted.
        u = density_sample(options.weighting_scheme, batch_size, generator, options.logit_mean, options.logit_std,
                           options.mode_scale)
        indices = (u * (max_timestep - min_timestep) + min_timestep).long().clamp(0, NUM_TRAIN_TIMESTEPS - 1)
        return (NUM_TRAIN_TIMESTEPS - indices).float() / NUM_TRAIN_TIMESTEPS
    if mode == "uniform":
        t = torch.rand(batch_size, generator=generator)
    elif mode == "sigmoid":
        t = torch.sigmoid(options.sigmoid_scale * torch.randn(batch_size, generator=generator))
    elif mode == "logsnr":
        logsnr = torch.randn(batch_size, generator=generator) * options.logit_std + options.logit_mean
        t = torch.sigmoid(-logsnr / 2)
    else:
        shift = options.discrete_flow_shift if mode == "shift" else image_shift(mode, latent_size)
        t = torch.sigmoid(torch.randn(batch_size, generator=generator) * options.sigmoid_scale)
        t = (t * shift) / (1 + (shift - 1) * t)
    # musubi scales [0, 1] onto [min_timestep, max_timestep] / 1000 (the default range leaves t as it is).
    return t * (max_timestep - min_timestep) / NUM_TRAIN_TIMESTEPS + min_timestep / NUM_TRAIN_TIMESTEPS


@dataclass(frozen=True)
class MusubiSettings(FlowSettings):
    """What musubi's image families read from a run besides the flow-matching option groups: the timestep range,
    the DDPM and FLUX options they refuse, and the options a family may name in its `refused_options`."""
    sizes: transformer_checks.ImageSizes
    min_timestep: int
    max_timestep: int
    min_snr_gamma: float | None
    v_parameterization: bool
    zero_terminal_snr: bool
    noise_offset: float | None
    network_train_unet_only: bool
    # what a family may refuse (refused_options)
    clip_skip: int | None
    max_token_length: int | None
    t5xxl_max_token_length: int | None
    apply_t5_attn_mask: bool
    clip_l: str | None
    t5xxl: str | None
    vae: str | None
    network_train_text_encoder_only: bool


@dataclass(frozen=True)
class MusubiFlowObjective(FlowMatchingObjective):
    """FlowMatchingObjective with musubi's timestep draw and loss: MSE (or the configured loss) of the raw
    prediction against noise - x0, weighted by sigma_sqrt / cosmap when asked."""
    min_timestep: int = 0
    max_timestep: int = NUM_TRAIN_TIMESTEPS

    def sample_timesteps(self, batch_size: int, generator: torch.Generator, device: torch.device | str,
                         latent_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
        sigmas = musubi_sigmas(self.options, batch_size, generator, latent_size, self.min_timestep,
                               self.max_timestep)
        return (sigmas * NUM_TRAIN_TIMESTEPS).to(device)

    def per_sample_loss(self, prediction: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor,
                        timesteps: torch.Tensor, mask: torch.Tensor | None = None,
                        noisy: torch.Tensor | None = None) -> torch.Tensor:
        target = noise.float() - latents.float()
        loss = per_sample_loss(prediction.float(), target, self.loss.loss_type, self.huber_c(timesteps), mask)
        weighting = loss_weighting(self.options.weighting_scheme, sigmas_of(timesteps, timesteps))
        return loss if weighting is None else loss * weighting.to(loss.device)

    @classmethod
    def from_settings(cls, settings: MusubiSettings) -> MusubiFlowObjective:
        """The run's objective, with musubi's defaults for the options the user did not set."""
        given = settings.user_set
        shift = settings.flow.discrete_flow_shift if "discrete_flow_shift" in given else DEFAULT_FLOW_SHIFT
        # kohya's default "uniform" draws and weights as musubi's "none" does; the metadata says musubi's name.
        scheme = settings.flow.weighting_scheme if "weighting_scheme" in given else "none"
        options = dataclasses.replace(settings.flow, discrete_flow_shift=shift, weighting_scheme=scheme,
                                      model_prediction_type="raw")
        return cls(options, settings.noise, settings.loss, min_timestep=settings.min_timestep,
                   max_timestep=settings.max_timestep)


def unsupported(settings: MusubiSettings, family: str) -> list[str]:
    """Options of the DDPM objective and of kohya's FLUX trainer that musubi's trainer does not have, each with
    why."""
    why = f"{family} is trained with flow matching, which has no DDPM noise schedule"
    problems = [f"{name}: not for {family} ({reason})" for name, reason in (
        ("min_snr_gamma", "Min-SNR weights by the SNR of a DDPM schedule; " + why),
        ("debiased_estimation_loss", "it weights by the SNR of a DDPM schedule; " + why),
        ("scale_v_pred_loss_like_noise_pred", f"it is for v-prediction models; {family} predicts a velocity"),
        ("v_pred_like_loss", f"it is for noise-prediction models; {family} predicts a velocity"),
        ("v_parameterization", f"{family} predicts a velocity, not v or noise"),
        ("zero_terminal_snr", "sigma 1 is already pure noise in flow matching"),
        ("noise_offset", "musubi-tuner's trainer does not apply it"),
        ("multires_noise_iterations", "musubi-tuner's trainer does not apply it"),
        ("adaptive_noise_scale", "musubi-tuner's trainer does not apply it"))
        if value_of(settings, name)]
    if "model_prediction_type" in settings.user_set:
        problems.append(f"model_prediction_type: not for {family} (musubi-tuner always trains the raw prediction "
                        "against noise - x0)")
    timesteps = (settings.min_timestep, settings.max_timestep)
    if settings.flow.timestep_sampling == "sigma" and timesteps != (0, NUM_TRAIN_TIMESTEPS):
        problems.append("min_timestep / max_timestep with timestep_sampling sigma: musubi-tuner limits the schedule's "
                        "index there, which runs from sigma 1 down, so the range would be mirrored; use another "
                        "timestep_sampling (uniform, sigmoid, shift, ...)")
    if settings.loss.loss_type in ("huber", "smooth_l1") and settings.loss.huber_schedule == "snr":
        problems.append(f"loss_type {settings.loss.loss_type} with huber_schedule snr: not for {family} (the schedule "
                        "follows a DDPM SNR); set huber_schedule to constant or exponential")
    return problems


def plain_lora_problems(net: Any, family: str, network_module: str) -> list[str]:
    """network_args musubi's LoRA modules for its image families do not take: conv and block dims, block learning
    rates, FLUX's keys, LyCORIS and DoRA (they train plain LoRA on Linear layers)."""
    problems = [f"network_args {key}: not for {family}" for key in (
        "conv_dim", "conv_alpha", "block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas",
        "down_lr_weight", "mid_lr_weight", "up_lr_weight") if getattr(net, key) is not None]
    problems += [f"network_args {key}: only for FLUX.1 (kohya's networks.lora_flux)" for key in net.flux_keys]
    if net.algo not in ("lora", "locon") or net.dora_wd or net.lycoris:
        problems.append(f"network_args algo / dora_wd / lycoris.kohya: {family} trains plain LoRA here "
                        f"(musubi-tuner's {network_module})")
    return problems


class MusubiFamily(Family):
    """What musubi-tuner's image families share here: one text encoder, never trained (musubi has no text-encoder
    LoRA); musubi's flow-matching objective with the DDPM and FLUX options refused; its ss_* fields and
    sai_model_spec; Euler sampling on the flow with the model's scheduler config. A subclass names its
    `display_name`, `implementation` (the URL musubi's model spec gives) and `lora_rules`: its lora module, whose
    `targets(denoiser, net)`, `to_file` and `from_file` are the denoiser's LoRA targets and file keys."""
    text_encoder_folders = ("text_encoder",)
    tokenizer_folders = ("tokenizer",)
    lora_text_prefixes = ("lora_te",)  # never written: the text encoder is not trained
    trains_text_encoders = False
    display_name = ""
    implementation = ""
    refused_options: tuple[tuple[str, str], ...] = ()  # the options `configured` refuses when set, each with why
    settings_type = MusubiSettings
    lora_rules: Any = None

    def configured(self, settings: MusubiSettings) -> Family:
        """Refuses the options that do not apply (`refused_options`, a guidance scale: musubi's image transformers
        have no guidance input) and sizes that do not fit the patches; nothing in the prompts depends on the
        config."""
        family = self.display_name
        problems = [f"{name}: not for {family} ({why})" for name, why in self.refused_options
                    if value_of(settings, name)]
        if "guidance_scale" in settings.user_set:
            problems.append(f"guidance_scale: not for {family} (its transformer has no guidance input)")
        problems += transformer_checks.size_problems(settings.sizes, family)
        if problems:
            raise UserError(problems)
        if not settings.network_train_unet_only:
            logger.info("%s: the text encoder is not trained (musubi-tuner trains the transformer only)", family)
        return self

    def objective(self, components: Components, settings: MusubiSettings,
                  device: torch.device) -> MusubiFlowObjective:
        problems = unsupported(settings, self.display_name)
        if problems:
            raise UserError(problems)
        return MusubiFlowObjective.from_settings(settings)

    def lora_text_encoders(self, text_encoders: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
        return []

    def denoiser_lora_targets(self, denoiser: torch.nn.Module, rank: int, alpha: float,
                              net: Any) -> tuple[list[str], dict[str, tuple[int, float]]]:
        try:
            return self.lora_rules.targets(denoiser, net), {}
        except ValueError as e:
            raise UserError(str(e)) from None

    def export_lora_keys(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.lora_rules.to_file(state_dict)

    def import_lora_keys(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.lora_rules.from_file(state_dict)

    def metadata_flags(self, v_prediction: bool) -> dict[str, Any]:
        # musubi's sai_model_spec: architecture "<model>/lora" and the model's implementation URL
        return {"base_model": self.base_model_version, "architecture": f"{self.display_name}/lora",
                "implementation": self.implementation}

    def metadata_fields(self, settings: MusubiSettings) -> dict[str, Any]:
        """musubi's flow-matching ss_* fields, with the values this run trained with."""
        options = MusubiFlowObjective.from_settings(settings).options
        return {f"ss_{name}": getattr(options, name) for name in (
            "weighting_scheme", "logit_mean", "logit_std", "mode_scale", "timestep_sampling", "sigmoid_scale",
            "discrete_flow_shift")}

    def sampling_scheduler(self, scheduler_config: Mapping[str, Any]) -> Any:
        """Euler on the flow with the model's own scheduler config (Z-Image's fixed shift 3, Qwen-Image's
        resolution-dependent shift), as musubi samples without --fs; sample_sampler / --ss do not apply."""
        return flow_euler_scheduler(scheduler_config)
