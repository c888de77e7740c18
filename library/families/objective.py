"""The diffusion training objective as pure tensor functions: noise, timesteps, target, loss weighting.

Random draws take an explicit torch.Generator so that the training path depends only on (seed, step, rank), never
on the global random stream (which a resume cannot restore exactly and which other code consumes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from library.config.choices import HUBER_SCHEDULES as HUBER_SCHEDULES  # spelled once, with the schema's choices
from library.config.choices import LOSS_TYPES as LOSS_TYPES

# kohya caps the SNR at this in its debiased and v-prediction-scale weights (SD's SNR at t = 0 is about 1175).
SNR_CAP = 1000.0


@dataclass(frozen=True)
class NoiseOptions:
    """kohya's noise options besides noise_offset; the field names are the config's."""
    noise_offset_random_strength: bool = False
    adaptive_noise_scale: float | None = None
    multires_noise_iterations: int | None = None
    multires_noise_discount: float = 0.3
    ip_noise_gamma: float | None = None
    ip_noise_gamma_random_strength: bool = False


@dataclass(frozen=True)
class LossOptions:
    """kohya's loss function and timestep weightings besides min_snr_gamma; the field names are the config's."""
    loss_type: str = "l2"
    huber_schedule: str = "snr"
    huber_c: float = 0.1
    huber_scale: float = 1.0
    scale_v_pred_loss_like_noise_pred: bool = False
    v_pred_like_loss: float | None = None
    debiased_estimation_loss: bool = False

    def problems(self, v_prediction: bool) -> list[str]:
        """What kohya refuses for the model's prediction type (known only once the model is loaded)."""
        problems = []
        if self.scale_v_pred_loss_like_noise_pred and not v_prediction:
            problems.append("scale_v_pred_loss_like_noise_pred needs a v-prediction model (v_parameterization, or a "
                            "scheduler with prediction_type v_prediction); this model predicts noise")
        if self.v_pred_like_loss and v_prediction:
            problems.append("v_pred_like_loss is for noise-prediction models; this model predicts v (remove "
                            "v_pred_like_loss)")
        return problems


def sample_noise(latents: torch.Tensor, generator: torch.Generator, noise_offset: float | None = None,
                 options: NoiseOptions | None = None) -> torch.Tensor:
    """Gaussian noise like `latents`, then kohya's offset noise and multi-resolution noise when asked.

    Drawn on CPU for reproducibility; each option draws only when it is on, so turning one on leaves the draws of a
    run without it unchanged.
    """
    options = options or NoiseOptions()
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
    if noise_offset:
        strength = offset_strength(latents, generator, noise_offset, options)
        offset = torch.randn((latents.shape[0], latents.shape[1], 1, 1), generator=generator, dtype=torch.float32)
        noise = noise + strength * offset
    if options.multires_noise_iterations:
        noise = pyramid_noise(noise, generator, options.multires_noise_iterations, options.multires_noise_discount)
    return noise.to(device=latents.device, dtype=latents.dtype)


def offset_strength(latents: torch.Tensor, generator: torch.Generator, noise_offset: float,
                    options: NoiseOptions) -> float | torch.Tensor:
    """kohya's offset-noise scale: noise_offset, or uniform in [0, noise_offset) with noise_offset_random_strength
    (one draw for the batch); plus adaptive_noise_scale * |channel mean of the latents|, clamped at 0."""
    strength: float | torch.Tensor = noise_offset
    if options.noise_offset_random_strength:
        strength = noise_offset * torch.rand((), generator=generator).item()
    if options.adaptive_noise_scale is not None:
        channel_mean = latents.detach().float().mean(dim=(2, 3), keepdim=True).abs().cpu()
        strength = torch.clamp(strength + options.adaptive_noise_scale * channel_mean, min=0.0)
    return strength


def pyramid_noise(noise: torch.Tensor, generator: torch.Generator, iterations: int, discount: float) -> torch.Tensor:
    """kohya's multires noise (pyramid noise): add Gaussian noise drawn at sizes shrinking by a random factor in
    [2, 4) per level, upsampled bilinearly and weighted discount**level (level 0 is full size), stopping at a side
    of 1; then divide by the standard deviation of the whole batch."""
    height, width = noise.shape[-2:]
    for level in range(iterations):
        factor = (2 + 2 * torch.rand((), generator=generator).item()) ** level
        size = (max(1, int(height / factor)), max(1, int(width / factor)))
        layer = torch.randn((*noise.shape[:-2], *size), generator=generator, dtype=torch.float32)
        noise = noise + F.interpolate(layer, size=(height, width), mode="bilinear") * discount**level
        if 1 in size:
            break
    return noise / noise.std()


def perturb_noise(noise: torch.Tensor, generator: torch.Generator, options: NoiseOptions) -> torch.Tensor:
    """kohya's input perturbation (ip_noise_gamma): the noise that goes into the latents gets another
    gamma-scaled Gaussian, while the target is still built from `noise`. ip_noise_gamma_random_strength draws the
    scale uniformly in [0, gamma), once per batch."""
    gamma = options.ip_noise_gamma
    if not gamma:
        return noise
    strength = gamma * torch.rand((), generator=generator).item() if options.ip_noise_gamma_random_strength else gamma
    extra = torch.randn(noise.shape, generator=generator, dtype=torch.float32).to(noise.device)
    return (noise.float() + strength * extra).to(noise.dtype)


def sample_timesteps(batch_size: int, generator: torch.Generator, min_timestep: int, max_timestep: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniform integer timesteps in [min_timestep, max_timestep)."""
    timesteps = torch.randint(min_timestep, max_timestep, (batch_size,), generator=generator)
    return timesteps.to(device)


def _gather(values: torch.Tensor, timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    out = values.to(device=timesteps.device)[timesteps].to(dtype=torch.float32)
    return out.reshape(-1, *([1] * (like.ndim - 1)))


def add_noise(latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
              alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """The forward process q(x_t | x_0): sqrt(a) * x0 + sqrt(1 - a) * noise, computed in float32."""
    alpha = _gather(alphas_cumprod, timesteps, latents)
    noisy = alpha.sqrt() * latents.float() + (1 - alpha).sqrt() * noise.float()
    return noisy.to(latents.dtype)


def prediction_target(latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                      alphas_cumprod: torch.Tensor, v_prediction: bool) -> torch.Tensor:
    """epsilon: the noise; v-prediction: sqrt(a) * noise - sqrt(1 - a) * x0."""
    if not v_prediction:
        return noise
    alpha = _gather(alphas_cumprod, timesteps, latents)
    return (alpha.sqrt() * noise.float() - (1 - alpha).sqrt() * latents.float()).to(latents.dtype)


def snr(timesteps: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio a / (1 - a) at each timestep."""
    alpha = alphas_cumprod.to(device=timesteps.device, dtype=torch.float32)[timesteps]
    return alpha / (1 - alpha)


def min_snr_weight(timesteps: torch.Tensor, alphas_cumprod: torch.Tensor, gamma: float,
                   v_prediction: bool) -> torch.Tensor:
    """Min-SNR-gamma weights (Hang et al. 2023): min(SNR, gamma) / SNR, or / (SNR + 1) for v-prediction."""
    ratio = snr(timesteps, alphas_cumprod)
    clipped = torch.clamp(ratio, max=gamma)
    return clipped / (ratio + 1) if v_prediction else clipped / ratio


def capped_snr(timesteps: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    return torch.clamp(snr(timesteps, alphas_cumprod), max=SNR_CAP)


def v_pred_scale(timesteps: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """kohya's scale_v_pred_loss_like_noise_pred weight SNR / (SNR + 1), with the SNR capped at 1000: it turns a
    v-prediction loss into the size of a noise-prediction loss."""
    ratio = capped_snr(timesteps, alphas_cumprod)
    return ratio / (ratio + 1)


def v_pred_like_weight(timesteps: torch.Tensor, alphas_cumprod: torch.Tensor, strength: float) -> torch.Tensor:
    """kohya's v_pred_like_loss as a weight: loss + strength * loss / v_pred_scale."""
    return 1 + strength / v_pred_scale(timesteps, alphas_cumprod)


def debiased_weight(timesteps: torch.Tensor, alphas_cumprod: torch.Tensor, v_prediction: bool) -> torch.Tensor:
    """kohya's debiased estimation weight: 1 / sqrt(SNR), or 1 / (SNR + 1) for v-prediction; SNR capped at 1000."""
    ratio = capped_snr(timesteps, alphas_cumprod)
    return 1 / (ratio + 1) if v_prediction else 1 / ratio.sqrt()


def timestep_weight(timesteps: torch.Tensor, alphas_cumprod: torch.Tensor, v_prediction: bool,
                    min_snr_gamma: float | None, options: LossOptions) -> torch.Tensor | None:
    """The product of every per-sample weighting in use (kohya's post-processing of the loss), or None.

    kohya applies them one after another (Min-SNR, v-prediction scale, v-prediction-like loss, debiased); each is
    a per-sample factor, so their product is the same loss.
    """
    weights = []
    if min_snr_gamma:
        weights.append(min_snr_weight(timesteps, alphas_cumprod, min_snr_gamma, v_prediction))
    if options.scale_v_pred_loss_like_noise_pred:
        weights.append(v_pred_scale(timesteps, alphas_cumprod))
    if options.v_pred_like_loss:
        weights.append(v_pred_like_weight(timesteps, alphas_cumprod, options.v_pred_like_loss))
    if options.debiased_estimation_loss:
        weights.append(debiased_weight(timesteps, alphas_cumprod, v_prediction))
    if not weights:
        return None
    weight = weights[0]
    for other in weights[1:]:
        weight = weight * other
    return weight


def huber_threshold(timesteps: torch.Tensor, alphas_cumprod: torch.Tensor, options: LossOptions) -> torch.Tensor | None:
    """kohya's per-sample huber_c for loss_type huber and smooth_l1 (None for l1 and l2).

    constant: huber_c * huber_scale. exponential: huber_scale * huber_c ** (t / T), from huber_scale at t = 0 down
    to huber_c * huber_scale at t = T (the number of training timesteps). snr: (1 - huber_c) / (1 + sigma)**2 +
    huber_c with sigma = sqrt((1 - a) / a), from about 1 at low noise down to huber_c; kohya leaves huber_scale
    out of this schedule, and so does this.
    """
    if options.loss_type not in ("huber", "smooth_l1"):
        return None
    if options.huber_schedule == "constant":
        return torch.full(timesteps.shape, options.huber_c * options.huber_scale, dtype=torch.float32,
                          device=timesteps.device)
    if options.huber_schedule == "exponential":
        exponent = timesteps.to(torch.float32) / alphas_cumprod.shape[0]
        return torch.exp(math.log(options.huber_c) * exponent) * options.huber_scale
    if options.huber_schedule == "snr":
        alpha = alphas_cumprod.to(device=timesteps.device, dtype=torch.float32)[timesteps]
        sigma = ((1 - alpha) / alpha).sqrt()
        return (1 - options.huber_c) / (1 + sigma) ** 2 + options.huber_c
    raise ValueError(f"unknown huber_schedule {options.huber_schedule!r}")


def elementwise_loss(prediction: torch.Tensor, target: torch.Tensor, loss_type: str = "l2",
                     huber_c: torch.Tensor | None = None) -> torch.Tensor:
    """kohya's loss_type per element, in float32. With d = prediction - target and c the per-sample huber_c:
    l2 d**2, l1 |d|, huber 2c(sqrt(d**2 + c**2) - c) (a pseudo-Huber loss scaled to 2|d|c far out),
    smooth_l1 2(sqrt(d**2 + c**2) - c)."""
    prediction, target = prediction.float(), target.float()
    if loss_type == "l2":
        return F.mse_loss(prediction, target, reduction="none")
    if loss_type == "l1":
        return F.l1_loss(prediction, target, reduction="none")
    if loss_type not in ("huber", "smooth_l1"):
        raise ValueError(f"unknown loss_type {loss_type!r}")
    if huber_c is None:
        raise ValueError(f"loss_type {loss_type} needs huber_c")
    c = huber_c.to(device=prediction.device, dtype=torch.float32).reshape(-1, *([1] * (prediction.ndim - 1)))
    root = torch.sqrt((prediction - target) ** 2 + c**2) - c
    return 2 * c * root if loss_type == "huber" else 2 * root


def resize_mask(mask: torch.Tensor, size: tuple[int, int] | torch.Size) -> torch.Tensor:
    """A (batch, 1, H, W) mask in [0, 1] averaged down to the latent size, as kohya resizes it ("area")."""
    return F.interpolate(mask.float(), size=tuple(size), mode="area")


def per_sample_loss(prediction: torch.Tensor, target: torch.Tensor, loss_type: str = "l2",
                    huber_c: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The elementwise loss averaged over every axis but the batch, in float32; with a mask, the mask-weighted
    mean over the mask's area (kohya averages over the whole latent instead, so a mostly masked-out image counts
    for little there; here each image counts by its kept region's loss). An all-zero mask gives 0.
    """
    loss = elementwise_loss(prediction, target, loss_type, huber_c)
    dims = tuple(range(1, loss.ndim))
    if mask is None:
        return loss.mean(dim=dims)
    weights = resize_mask(mask, loss.shape[2:]).to(device=loss.device, dtype=loss.dtype).expand_as(loss)
    return (loss * weights).sum(dim=dims) / weights.sum(dim=dims).clamp_min(torch.finfo(loss.dtype).tiny)


class Objective(Protocol):
    """What the loop asks of a training objective: noise, timesteps, the noisy input and the per-sample loss.
    DDPM's DiffusionObjective and FLUX's FlowMatchingObjective (and the families' variants of it) implement it;
    timesteps travel as floats in [0, num_train_timesteps)."""

    @property
    def num_train_timesteps(self) -> int: ...

    def sample_noise(self, latents: torch.Tensor, generator: torch.Generator) -> torch.Tensor: ...

    def sample_timesteps(self, batch_size: int, generator: torch.Generator, device: torch.device | str,
                         latent_size: tuple[int, int]) -> torch.Tensor: ...

    def input_noise(self, noise: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None: ...

    def noisy_latents(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor: ...

    def per_sample_loss(self, prediction: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor,
                        timesteps: torch.Tensor, mask: torch.Tensor | None = None,
                        noisy: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class DiffusionObjective:
    """Noise (epsilon) or v prediction on a DDPM noise schedule, with kohya's noise and loss options.

    The loop asks an objective for noise, timesteps, the noisy input and the per-sample loss; a family returns the
    objective it is trained with, so another one (flow matching) plugs in beside this.
    """
    alphas_cumprod: torch.Tensor
    v_prediction: bool
    min_timestep: int
    max_timestep: int
    noise_offset: float | None
    min_snr_gamma: float | None
    noise: NoiseOptions = NoiseOptions()
    loss: LossOptions = LossOptions()

    def problems(self) -> list[str]:
        # Whether the model predicts v is known only here: v_parameterization may come from its scheduler config.
        return self.loss.problems(self.v_prediction)

    @property
    def num_train_timesteps(self) -> int:
        return self.alphas_cumprod.shape[0]

    def sample_noise(self, latents: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return sample_noise(latents, generator, self.noise_offset, self.noise)

    def sample_timesteps(self, batch_size: int, generator: torch.Generator, device: torch.device | str,
                         latent_size: tuple[int, int] | None = None) -> torch.Tensor:
        # latent_size is for objectives whose draw depends on the image size (FLUX's flux_shift).
        return sample_timesteps(batch_size, generator, self.min_timestep, self.max_timestep, device)

    def input_noise(self, noise: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
        """The noise the input is made with when it differs from the target's (ip_noise_gamma), else None."""
        return perturb_noise(noise, generator, self.noise) if self.noise.ip_noise_gamma else None

    def noisy_latents(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        return add_noise(latents, noise, timesteps, self.alphas_cumprod)

    def per_sample_loss(self, prediction: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor,
                        timesteps: torch.Tensor, mask: torch.Tensor | None = None,
                        noisy: torch.Tensor | None = None) -> torch.Tensor:
        # noisy (the model's input) is for objectives whose prediction is read relative to it (flow matching).
        target = prediction_target(latents, noise, timesteps, self.alphas_cumprod, self.v_prediction)
        huber_c = huber_threshold(timesteps, self.alphas_cumprod, self.loss)
        loss = per_sample_loss(prediction, target, self.loss.loss_type, huber_c, mask)
        weight = timestep_weight(timesteps, self.alphas_cumprod, self.v_prediction, self.min_snr_gamma, self.loss)
        return loss if weight is None else loss * weight
