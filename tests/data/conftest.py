"""Fixtures the data tests share."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="package")
def tiny_vae():
    """A 4-level VAE of 32 channels (8x down, 4 latent channels), the same weights every time."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32,) * 4,
                            layers_per_block=1, latent_channels=4, norm_num_groups=32, sample_size=32)
    return vae.eval().requires_grad_(False)
