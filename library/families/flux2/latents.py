"""FLUX.2's latents and token positions, as Flux2Pipeline / Flux2KleinPipeline and musubi-tuner's flux2_utils
build them.

The FLUX.2 autoencoder gives 32 channels at 1/8 of the image side; the transformer sees them in 2x2 patches
(128 channels at 1/16), normalised per channel by the autoencoder's batch-norm running statistics, one token per
patch. `Flux2Vae` gives the loop and the caches that patched, normalised view as its 4-D latents (scaling factor 1,
no shift), as musubi's AutoEncoder.encode does, so the loop's latents are already the transformer's channels and
`pack` only flattens them.

Positions have four axes (t, h, w, l): the image's tokens (0, row, column, 0), the text's (0, 0, 0, index), and
reference images' (10 + 10 * i, row, column, 0) for the i-th.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence

import torch
from torch import nn

from library.families.shared.mode_posterior import ModePosterior

REFERENCE_SCALE = 10  # the t offset between reference images (the pipeline's and musubi's scale)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, 4C, H/2, W/2], channel-major then the patch's row and column (the pipeline's
    _patchify_latents, musubi's "c (i pi) (j pj) -> (c pi pj) i j")."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return patches.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """Inverse of patchify."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return patches.reshape(b, c // 4, h * 2, w * 2)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h * w, C]: one token per (patched) position, row-major."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, h * w, C] -> [B, C, h, w]."""
    b, _, c = tokens.shape
    return tokens.permute(0, 2, 1).reshape(b, c, height, width)


def image_ids(height: int, width: int, t: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """[h * w, 4] positions of an image's tokens: (t, row, column, 0)."""
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(height), torch.arange(width),
                                torch.arange(1)).to(device)


def text_ids(length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[length, 4] positions of the text's tokens: (0, 0, 0, index)."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(length)).to(device)


def reference_tokens(references: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference images' latents ([B, C, h_i, w_i] each, normalised as the target's) -> their tokens joined along
    the sequence [B, sum h_i * w_i, C] and positions [sum h_i * w_i, 4], the i-th at t = 10 + 10 * i."""
    tokens = torch.cat([pack(latents) for latents in references], dim=1)
    ids = torch.cat([image_ids(latents.shape[2], latents.shape[3], REFERENCE_SCALE * (i + 1), latents.device)
                     for i, latents in enumerate(references)])
    return tokens, ids


class Flux2Vae(nn.Module):
    """AutoencoderKLFlux2 seen as an image VAE whose 4-D latents are the transformer's channels: encode gives the
    mode patched 2x2 and normalised by the batch-norm running statistics, decode undoes both. `config` reads as the
    autoencoder's with scaling factor 1, no shift, and the statistics as latents_mean / latents_std (what
    Family.vae_latents gets)."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        from diffusers.configuration_utils import FrozenDict

        mean = vae.bn.running_mean.float()
        std = torch.sqrt(vae.bn.running_var.float() + vae.config.batch_norm_eps)
        self.config = FrozenDict({**vae.config, "scaling_factor": 1.0, "shift_factor": None,
                                  "latents_mean": mean.tolist(), "latents_std": std.tolist()})

    def encode(self, pixels: torch.Tensor) -> SimpleNamespace:
        mode = self.vae.encode(pixels).latent_dist.mode()
        return SimpleNamespace(latent_dist=ModePosterior(normalised(patchify(mode), self.config)))

    def decode(self, latents: torch.Tensor, return_dict: bool = False) -> tuple[torch.Tensor]:
        mean, std = statistics(self.config, latents)
        return (self.vae.decode(unpatchify(latents * std + mean), return_dict=False)[0],)


def statistics(config: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch-norm mean and standard deviation of a Flux2Vae config, shaped and typed for `like`."""
    shape = (1, len(config.latents_mean), 1, 1)
    mean = torch.tensor(config.latents_mean).view(shape).to(like.device, like.dtype)
    std = torch.tensor(config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, std


def normalised(patched: torch.Tensor, config: Any) -> torch.Tensor:
    """Patched autoencoder latents -> the transformer's range."""
    mean, std = statistics(config, patched)
    return (patched - mean) / std
