"""Stable Diffusion 1.x, 2.x and SDXL: diffusers folders and single checkpoints in the original layout."""
