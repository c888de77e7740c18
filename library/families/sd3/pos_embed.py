"""sd-scripts' SD3.5 Medium position-embedding options on diffusers' SD3 transformer (sd3_train_network.py):

- `pos_emb_random_crop_rate`: with this probability a step reads its patches' position embeddings from a random
  place of the stored grid instead of its centre (one place for the whole batch, as sd-scripts draws it).
- `enable_scaled_pos_embed`: for each training resolution, a sin-cos grid 1.5x the resolution's patch count whose
  centre spans the coordinates the model was trained on (KohakuBlueleaf's get_scaled_2d_sincos_pos_embed, base
  size 16); a latent takes the grid of the resolution nearest its area, as sd-scripts selects it. The stored
  embedding is not used then, in training or in sample images.

Both replace the transformer's PatchEmbed.cropped_pos_embed with a `PositionEmbedding`. The random draws come
from the step's generator (Family.step_conditioning), so a resumed run crops where the original did.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import torch

logger = logging.getLogger(__name__)

POS_EMBED_MAX_RATIO = 1.5  # sd-scripts' MMDiT.POS_EMBED_MAX_RATIO: a scaled grid's side per patch of the resolution
BASE_SIZE = 16


def _sincos(embed_dim: int, positions: np.ndarray) -> np.ndarray:
    """1-D sin-cos embedding of `positions` (any shape) -> (positions.size, embed_dim), in float64."""
    omega = 1.0 / 10000 ** (np.arange(embed_dim // 2, dtype=np.float64) / (embed_dim / 2.0))
    angles = np.einsum("m,d->md", positions.reshape(-1).astype(np.float64), omega)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


def scaled_sincos_grid(embed_dim: int, grid_size: int, sample_size: int, base_size: int = BASE_SIZE) -> torch.Tensor:
    """A grid_size x grid_size sin-cos embedding whose central sample_size x sample_size patches have the
    coordinates a base_size grid spreads over them; (1, grid_size**2, embed_dim), float32."""
    scale = base_size * grid_size / sample_size
    shift = scale * (grid_size - sample_size) / (2 * grid_size)
    axis = np.arange(grid_size, dtype=np.float32) / grid_size * scale - shift
    columns, rows = np.meshgrid(axis, axis)  # the column coordinate first, as the released embedding is built
    table = np.concatenate([_sincos(embed_dim // 2, columns), _sincos(embed_dim // 2, rows)], axis=1)
    return torch.from_numpy(table).float().unsqueeze(0)


class PositionEmbedding:
    """Stands in for a PatchEmbed's cropped_pos_embed(height, width): the crop of the stored grid, or of the
    scaled grid for the latent's area, at the centre or at this step's random place (`crop`, two draws in [0, 1)
    for top and left, set around one forward)."""

    def __init__(self, patch_embed: torch.nn.Module, latent_sizes: Sequence[int] = ()):
        self.patch_embed = patch_embed
        self.crop: tuple[float, float] | None = None
        self.dim = patch_embed.pos_embed.shape[-1]
        patched = sorted({size // patch_embed.patch_size for size in latent_sizes})
        self.tables: dict[int, torch.Tensor] = {}
        # A latent of area a takes the first size whose bound holds it: halfway (in area) to the next size, and
        # for the largest 1.5x its side squared; a larger latent gets a grid of its own (sd-scripts' warning).
        self.bounds: list[tuple[int, int]] = [((p * p + q * q) // 2, p) for p, q in pairwise(patched)]
        if patched:
            self.bounds.append((int((patched[-1] * POS_EMBED_MAX_RATIO) ** 2), patched[-1]))
        for size in patched:
            self.tables[size] = scaled_sincos_grid(self.dim, int(size * POS_EMBED_MAX_RATIO), size)

    @property
    def scaled(self) -> bool:
        return bool(self.tables)

    def _table(self, height: int, width: int) -> tuple[torch.Tensor, int]:
        if not self.scaled:
            return self.patch_embed.pos_embed, self.patch_embed.pos_embed_max_size
        size = next((p for bound, p in self.bounds if height * width <= bound), self.bounds[-1][1])
        side = int(size * POS_EMBED_MAX_RATIO)
        if height > side or width > side:
            size = max(height, width)
            side = int(size * POS_EMBED_MAX_RATIO)
            logger.warning("a %dx%d-patch latent is taller or wider than its scaled position grid; added a grid "
                           "for %d patches", height, width, size)
            self.tables[size] = scaled_sincos_grid(self.dim, side, size)
            self.bounds = sorted([*self.bounds, (side * side, size)])
        return self.tables[size], side

    def __call__(self, height: int, width: int) -> torch.Tensor:
        patch = self.patch_embed.patch_size
        height, width = height // patch, width // patch
        table, side = self._table(height, width)
        if height > side or width > side:
            raise ValueError(f"a {height}x{width}-patch latent exceeds the {side}x{side} position grid")
        if self.crop is None:
            top, left = (side - height) // 2, (side - width) // 2
        else:
            top = min(int(self.crop[0] * (side - height + 1)), side - height)
            left = min(int(self.crop[1] * (side - width + 1)), side - width)
        grid = table.to(self.patch_embed.proj.weight.device).reshape(1, side, side, -1)
        return grid[:, top:top + height, left:left + width, :].reshape(1, -1, grid.shape[-1])


def install(transformer: torch.nn.Module, latent_sizes: Sequence[int]) -> PositionEmbedding:
    """Put a PositionEmbedding in the transformer's PatchEmbed (scaled grids for `latent_sizes`, if any)."""
    patch_embed = transformer.pos_embed
    embedding = PositionEmbedding(patch_embed, latent_sizes)
    patch_embed.cropped_pos_embed = embedding
    return embedding


def installed(transformer: torch.nn.Module) -> PositionEmbedding | None:
    embedding = getattr(getattr(transformer, "pos_embed", None), "cropped_pos_embed", None)
    return embedding if isinstance(embedding, PositionEmbedding) else None


def latent_sizes(resolutions: Sequence[tuple[int, int]]) -> list[int]:
    """sd-scripts: each dataset resolution's latent side, round(sqrt(width * height)) // 8."""
    return sorted({round(math.sqrt(w * h)) // 8 for w, h in resolutions})
