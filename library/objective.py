"""The diffusion training objective as pure tensor functions: noise, timesteps, target, loss weighting.

Random draws take an explicit torch.Generator so that the training path depends only on (seed, step, rank), never
on the global random stream (which a resume cannot restore exactly and which other code consumes).
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.nn.functional as F


def derive_seed(seed: int, *keys: Any) -> int:
    """A 64-bit seed that depends only on the run seed and the keys (epoch, batch, purpose, ...)."""
    digest = hashlib.blake2b(repr((seed,) + keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def torch_seed(seed: int, *keys: Any) -> int:
    """derive_seed within the range torch.manual_seed accepts."""
    return derive_seed(seed, *keys) & ((1 << 63) - 1)


def step_generator(seed: int, *keys: Any) -> torch.Generator:
    """A CPU generator seeded from the run seed and keys (for example epoch and batch position)."""
    return torch.Generator(device="cpu").manual_seed(torch_seed(seed, *keys))


def sample_noise(latents: torch.Tensor, generator: torch.Generator, noise_offset: float | None = None) -> torch.Tensor:
    """Gaussian noise like `latents`, plus per-channel offset noise when asked (drawn on CPU for reproducibility)."""
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
    if noise_offset:
        offset = torch.randn((latents.shape[0], latents.shape[1], 1, 1), generator=generator, dtype=torch.float32)
        noise = noise + noise_offset * offset
    return noise.to(device=latents.device, dtype=latents.dtype)


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


def per_sample_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over every axis but the batch, in float32."""
    loss = F.mse_loss(prediction.float(), target.float(), reduction="none")
    return loss.mean(dim=tuple(range(1, loss.ndim)))
