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

import torch

from library.families.flux.files import BFL_PREFIX, bfl_state_dict
from library.families.flux.tiny import VAE_SCALING_FACTOR, VAE_SHIFT_FACTOR, WIDTH, build_t5_tokenizer
from library.families.shared.tiny_parts import ae_state_dict, save_files, save_pipeline, seeded

logger = logging.getLogger(__name__)


def build_tiny_chroma(seed: int = 0) -> dict[str, Any]:
    """The components of a tiny ChromaPipeline. Weights depend only on the seed; the caller's global RNG state is
    left untouched."""
    from diffusers import AutoencoderKL, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    tokenizer = build_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        seeded(seed, 31)
        transformer = ChromaTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=WIDTH, axes_dims_rope=(4, 6, 6), approximator_num_channels=8,
            approximator_hidden_dim=WIDTH, approximator_layers=1)
        seeded(seed, 32)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 32, 32, 32),
                            layers_per_block=1, latent_channels=16, norm_num_groups=32, sample_size=64,
                            scaling_factor=VAE_SCALING_FACTOR, shift_factor=VAE_SHIFT_FACTOR,
                            use_quant_conv=False, use_post_quant_conv=False)
        seeded(seed, 33)
        t5 = T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=WIDTH, d_kv=8, d_ff=64, num_layers=2,
                                     num_heads=4, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                                     decoder_start_token_id=0))
    # FLUX.1's scheduler config, whose resolution-dependent shift is the schedule kohya samples Chroma with.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    for model in (transformer, vae, t5):
        model.eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": t5, "tokenizer": tokenizer,
            "scheduler": scheduler}


def save_tiny_chroma(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny ChromaPipeline folder at `path` (atomically) and return it."""
    return save_pipeline(path, overwrite, "ChromaPipeline", lambda: build_tiny_chroma(seed), "Chroma", seed)


def save_tiny_chroma_files(folder: str | os.PathLike[str], target: str | os.PathLike[str]) -> dict[str, Path]:
    """The tiny Chroma folder's weights as the separate files Chroma is shared in (kohya's --model_type chroma
    reads these): the BFL-layout transformer (behind `model.diffusion_model.`), t5xxl and ae. Returns their paths
    by option name."""
    from diffusers import AutoencoderKL, ChromaTransformer2DModel
    from transformers import T5EncoderModel


    folder, target = Path(folder), Path(target)
    local = {"local_files_only": True}
    transformer = ChromaTransformer2DModel.from_pretrained(folder, subfolder="transformer", **local)
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae", **local)
    t5 = T5EncoderModel.from_pretrained(folder, subfolder="text_encoder", **local)
    ae = ae_state_dict(vae)
    files = {
        "transformer": ({BFL_PREFIX + k: v for k, v in bfl_state_dict(transformer).items()},
                        "chroma-tiny.safetensors"),
        "ae": (ae, "ae.safetensors"),
        # T5's embedding is stored once (shared.weight), as in the t5xxl files people use.
        "t5xxl": ({k: v for k, v in t5.state_dict().items() if k != "encoder.embed_tokens.weight"},
                  "t5xxl.safetensors"),
    }
    return save_files(target, files)
