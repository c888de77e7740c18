"""The rectified-flow (flow-matching) objective FLUX.1 is trained with, as kohya's flux_train_network.py does it.

Timesteps travel through the loop as `1000 * sigma` (float), kohya's convention, so the timestep-binned loss,
validation at fixed timesteps (sigma = t / 1000) and the loss chart work unchanged. The noisy input is
`(1 - sigma) * x0 + sigma * noise` and the target is always `noise - x0` (kohya's, for every prediction type).
Every random draw comes from the step's generator on CPU, so a resumed run draws what the original drew.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from library.families.objective import LossOptions, NoiseOptions, per_sample_loss, perturb_noise
from library.families.settings import FamilySettings

logger = logging.getLogger(__name__)
NUM_TRAIN_TIMESTEPS = 1000


@dataclass(frozen=True)
class FlowOptions:
    """kohya's flow-matching options; the field names are the config's."""
    timestep_sampling: str = "sigma"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 3.0
    model_prediction_type: str = "sigma_scaled"
    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29


@dataclass(frozen=True)
class FlowSettings(FamilySettings):
    """What a flow-matching family's objective reads from a run: kohya's option groups, and the options the user
    set (`unsupported` notes or refuses those of the DDPM objective)."""
    user_set: Mapping[str, Any]
    flow: FlowOptions
    noise: NoiseOptions
    loss: LossOptions


def shifted_sigmas(shift: float, num_timesteps: int = NUM_TRAIN_TIMESTEPS) -> torch.Tensor:
    """The discrete schedule of kohya's FlowMatchEulerDiscreteScheduler: t/1000 for t = 1000..1, shifted by
    shift * s / (1 + (shift - 1) * s); index 0 is sigma 1."""
    sigmas = torch.linspace(1, num_timesteps, num_timesteps, dtype=torch.float32).flip(0) / num_timesteps
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def density_sample(scheme: str, batch_size: int, generator: torch.Generator, logit_mean: float, logit_std: float,
                   mode_scale: float) -> torch.Tensor:
    """kohya's compute_density_for_timestep_sampling: u in [0, 1) per sample."""
    if scheme == "logit_normal":
        return torch.sigmoid(torch.randn(batch_size, generator=generator) * logit_std + logit_mean)
    u = torch.rand(batch_size, generator=generator)
    if scheme == "mode":
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def flux_shift_mu(tokens: int) -> float:
    """FLUX's image-size shift: linear in the packed token count, 0.5 at 256 tokens and 1.15 at 4096."""
    slope = (1.15 - 0.5) / (4096 - 256)
    return slope * tokens + (0.5 - slope * 256)


def time_shift(mu: float, t: torch.Tensor) -> torch.Tensor:
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1))


def sample_sigmas(options: FlowOptions, batch_size: int, generator: torch.Generator,
                  latent_size: tuple[int, int]) -> torch.Tensor:
    """Per-sample sigmas as kohya's get_noisy_model_input_and_timesteps draws them (latent_size: unpacked h, w)."""
    mode = options.timestep_sampling
    if mode == "uniform":
        return torch.rand(batch_size, generator=generator)
    if mode in ("sigmoid", "shift", "flux_shift"):
        u = torch.sigmoid(options.sigmoid_scale * torch.randn(batch_size, generator=generator))
        if mode == "sigmoid":
            return u
        if mode == "shift":
            shift = options.discrete_flow_shift
            return u * shift / (1 + (shift - 1) * u)
        height, width = latent_size
        return time_shift(flux_shift_mu((height // 2) * (width // 2)), u)
    u = density_sample(options.weighting_scheme, batch_size, generator, options.logit_mean, options.logit_std,
                       options.mode_scale)
    # mode maps u = 0 to exactly 1 (and a far logit-normal tail rounds to 1): kohya would index past the end.
    indices = (u * NUM_TRAIN_TIMESTEPS).long().clamp(max=NUM_TRAIN_TIMESTEPS - 1)
    return shifted_sigmas(options.discrete_flow_shift)[indices]


def loss_weighting(scheme: str, sigmas: torch.Tensor) -> torch.Tensor | None:
    """kohya's compute_loss_weighting_for_sd3 (applied with model_prediction_type sigma_scaled only)."""
    if scheme == "sigma_sqrt":
        return sigmas.float() ** -2.0
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas.float() + 2 * sigmas.float() ** 2))
    return None


def sigmas_of(timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    sigmas = timesteps.to(dtype=torch.float32) / NUM_TRAIN_TIMESTEPS
    return sigmas.reshape(-1, *([1] * (like.ndim - 1)))


# What kohya's FLUX trainer (flux_train_network.py) accepts and does not apply: its post_process_loss returns the loss
# unchanged, its noise is plain Gaussian, its FlowMatchEulerDiscreteScheduler replaces the DDPM one (so no betas to
# rescale) and its sigmas come from timestep_sampling. Accepted here too, with a note in the log.
_IGNORED_AS_KOHYA = (
    ("min_snr_gamma", "Min-SNR weights by the SNR of a DDPM schedule"),
    ("debiased_estimation_loss", "it weights by the SNR of a DDPM schedule"),
    ("scale_v_pred_loss_like_noise_pred", "it is for v-prediction models"),
    ("v_pred_like_loss", "it is for noise-prediction models"),
    ("v_parameterization", "the model predicts a velocity, not v or noise"),
    ("zero_terminal_snr", "sigma 1 is already pure noise in flow matching"),
    ("noise_offset", "kohya's FLUX trainer draws plain Gaussian noise"),
    ("noise_offset_random_strength", "kohya's FLUX trainer draws plain Gaussian noise"),
    ("adaptive_noise_scale", "kohya's FLUX trainer draws plain Gaussian noise"),
    ("multires_noise_iterations", "kohya's FLUX trainer draws plain Gaussian noise"),
)


def ignored_notes(settings: Mapping[str, Any], family: str = "FLUX") -> list[str]:
    """Notes for the DDPM-objective options among the user's `settings` that, as in kohya's FLUX trainer, do
    nothing here."""
    notes = [f"{name} has no effect for {family}, as in kohya's FLUX trainer: {why}; {family} is trained with flow "
             "matching" for name, why in _IGNORED_AS_KOHYA if settings.get(name)]
    if (settings.get("min_timestep", 0), settings.get("max_timestep", NUM_TRAIN_TIMESTEPS)) != (0, NUM_TRAIN_TIMESTEPS):
        notes.append(f"min_timestep / max_timestep have no effect for {family}, as in kohya's FLUX trainer: sigmas "
                     "are drawn by timestep_sampling")
    return notes


def unsupported(settings: Mapping[str, Any], family: str = "FLUX") -> list[str]:
    """The options of the DDPM objective among the user's `settings` (FlowSettings.user_set) that flow matching cannot
    take. Those kohya's FLUX trainer accepts and ignores are logged (ignored_notes) and ignored; `family` names the
    model in the messages."""
    for note in ignored_notes(settings, family):
        logger.warning(note)
    problems = []
    loss_type = settings.get("loss_type")
    if loss_type in ("huber", "smooth_l1") and settings.get("huber_schedule") == "snr":
        # kohya's snr schedule reads the DDPM scheduler's alphas_cumprod, which FLUX's scheduler has not.
        problems.append(f"loss_type {loss_type} with huber_schedule snr: not for {family} (the schedule "
                        "follows a DDPM SNR); set huber_schedule to constant or exponential")
    sampling = settings.get("timestep_sampling")
    if sampling in ("qwen_shift", "flux2_shift", "logsnr"):
        problems.append(f"timestep_sampling {sampling}: not for {family} (musubi-tuner's sampling, "
                        "offered for its families; kohya's FLUX trainer has no such choice)")
    return problems


@dataclass(frozen=True)
class FlowMatchingObjective:
    """What the loop asks an objective for (see DiffusionObjective), for rectified flow."""
    options: FlowOptions = FlowOptions()
    noise: NoiseOptions = NoiseOptions()
    loss: LossOptions = LossOptions()

    num_train_timesteps: int = NUM_TRAIN_TIMESTEPS

    def sample_noise(self, latents: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
        return noise.to(device=latents.device, dtype=latents.dtype)

    def sample_timesteps(self, batch_size: int, generator: torch.Generator, device: torch.device | str,
                         latent_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
        return (sample_sigmas(self.options, batch_size, generator, latent_size) * NUM_TRAIN_TIMESTEPS).to(device)

    def input_noise(self, noise: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
        return perturb_noise(noise, generator, self.noise) if self.noise.ip_noise_gamma else None

    def noisy_latents(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        sigmas = sigmas_of(timesteps, latents)
        return ((1 - sigmas) * latents.float() + sigmas * noise.float()).to(latents.dtype)

    def per_sample_loss(self, prediction: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor,
                        timesteps: torch.Tensor, mask: torch.Tensor | None = None,
                        noisy: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of kohya's prediction types against noise - x0; `noisy` is the input the model saw (it
        differs from noisy_latents(noise) with ip_noise_gamma)."""
        if noisy is None:
            noisy = self.noisy_latents(latents, noise, timesteps)
        prediction = prediction.float()
        weighting = None
        kind = self.options.model_prediction_type
        if kind == "additive":
            prediction = prediction + noisy.float()
        elif kind == "sigma_scaled":
            prediction = prediction * -sigmas_of(timesteps, prediction) + noisy.float()
            weighting = loss_weighting(self.options.weighting_scheme, timesteps.float() / NUM_TRAIN_TIMESTEPS)
        target = noise.float() - latents.float()
        loss = per_sample_loss(prediction, target, self.loss.loss_type, self.huber_c(timesteps), mask)
        # kohya weights each element before averaging; a per-sample weight gives the same mean.
        return loss if weighting is None else loss * weighting.to(loss.device)

    def huber_c(self, timesteps: torch.Tensor) -> torch.Tensor | None:
        """kohya's constant and exponential huber_c schedules over t in [0, 1000] (snr is refused up front)."""
        options = self.loss
        if options.loss_type not in ("huber", "smooth_l1"):
            return None
        if options.huber_schedule == "constant":
            return torch.full(timesteps.shape, options.huber_c * options.huber_scale, dtype=torch.float32,
                              device=timesteps.device)
        exponent = timesteps.to(torch.float32) / NUM_TRAIN_TIMESTEPS
        return torch.exp(math.log(options.huber_c) * exponent) * options.huber_scale
