"""A tiny Chroma-shaped model built from configs, for tests and tries (nothing fetched from a hub).

Chroma is FLUX.1-schnell's architecture with the modulation layers pruned: one small MLP (the approximator,
`distilled_guidance_layer`) computes every block's modulation from the timestep, there is no CLIP-L and no
pooled or guidance input, and T5 is its only text encoder. The module names, the 16-channel VAE with its shift, the
T5 encoder and the flow-matching scheduler are the real ones; only widths shrink.

    python -m library.families.tiny OUTPUT_DIR --family chroma [--files] [--seed N] [--overwrite]
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from library.families.flux import tiny as flux_tiny
from library.families.shared import tiny_parts

logger = logging.getLogger(__name__)


def build_tiny_chroma(seed: int = 0) -> dict[str, Any]:
    """The components of a tiny ChromaPipeline. Weights depend only on the seed; the caller's global RNG state is
    left untouched."""
    from diffusers import ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    tokenizer = tiny_parts.build_t5_tokenizer()
    width = flux_tiny.WIDTH

    def transformer() -> Any:
        return ChromaTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=width, axes_dims_rope=(4, 6, 6), approximator_num_channels=8,
            approximator_hidden_dim=width, approximator_layers=1)

    models = {"transformer": transformer, "vae": tiny_parts.build_flux_vae,
              "text_encoder": lambda: tiny_parts.build_t5(tokenizer, width)}
    # FLUX.1's scheduler config, whose resolution-dependent shift is the schedule kohya samples Chroma with.
    return tiny_parts.seeded_parts(seed, 31, models, tokenizer=tokenizer,
                                   scheduler=FlowMatchEulerDiscreteScheduler(**flux_tiny.SCHEDULER_CONFIG))


def save_tiny_chroma(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny ChromaPipeline folder at `path` (atomically) and return it."""
    return tiny_parts.save_pipeline(path, overwrite, "ChromaPipeline", lambda: build_tiny_chroma(seed), "Chroma",
                                    seed)


def save_tiny_chroma_files(folder: str | os.PathLike[str], target: str | os.PathLike[str]) -> dict[str, Path]:
    """The tiny Chroma folder's weights as the separate files Chroma is shared in (kohya's --model_type chroma
    reads these): the BFL-layout transformer (behind `model.diffusion_model.`), t5xxl and ae. Returns their paths
    by option name."""
    from diffusers import AutoencoderKL, ChromaTransformer2DModel
    from transformers import T5EncoderModel

    parts = tiny_parts.read_parts(Path(folder), {"transformer": ChromaTransformer2DModel, "vae": AutoencoderKL,
                                                 "text_encoder": T5EncoderModel})
    files = {"transformer": (flux_tiny.bfl_file_state_dict(parts["transformer"]), "chroma-tiny.safetensors"),
             "ae": (tiny_parts.ae_state_dict(parts["vae"]), "ae.safetensors"),
             "t5xxl": (flux_tiny.t5xxl_state_dict(parts["text_encoder"]), "t5xxl.safetensors")}
    return tiny_parts.save_files(Path(target), files)
