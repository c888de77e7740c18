"""The posterior a VAE wrapper hands back when a family trains on the mode of its VAE's posterior (musubi-tuner
encodes with posterior.mode()): the wrapper's latents as the mean, and a logvar that is finite (the caches check
it) but so low that exp(logvar / 2) is exactly 0 in float32, bf16 and fp16, so a "sample" is the mode."""
from __future__ import annotations

import torch


class ModePosterior:
    """`mean`: the latents as the family's transformer takes them; `logvar` and `std` make every sample the mean."""
    LOGVAR = -1e4

    def __init__(self, mean: torch.Tensor):
        self.mean = mean
        self.logvar = torch.full_like(mean, self.LOGVAR)
        self.std = torch.zeros_like(mean)
