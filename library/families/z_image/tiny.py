"""A tiny Z-Image-shaped model built from configs, for tests and tries (nothing fetched from a hub).

The classes are the real ones at tiny widths: ZImageTransformer2DModel (refiners, main layers, 2x2 patches), a
Qwen3 language model as the text encoder with a byte-level BPE tokenizer and a chat template built here, FLUX.1's
16-channel VAE constants and Z-Image's flow-matching scheduler (shift 3, no dynamic shifting).

    python -m library.families.tiny OUTPUT_DIR --family z_image [--files] [--seed N] [--overwrite]
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from library.families.shared import tiny_parts
from library.families.z_image.files import COMFY_PREFIX, comfy_state_dict

logger = logging.getLogger(__name__)

WIDTH = 32  # text width and the transformer's dim (2 heads of 16)


def build_tiny_z_image(seed: int = 0) -> dict[str, Any]:
    """The components of a tiny ZImagePipeline. Weights depend only on the seed; the caller's global RNG state is
    left untouched."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = tiny_parts.build_qwen3_tokenizer()

    def transformer() -> Any:
        model = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=WIDTH, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=WIDTH, axes_dims=[4, 6, 6], axes_lens=[1536, 512, 512])
        # diffusers starts the pad tokens at zero; give them values so a test sees them (the released weights do).
        torch.nn.init.normal_(model.x_pad_token, std=0.02)
        torch.nn.init.normal_(model.cap_pad_token, std=0.02)
        return model

    def text_encoder() -> Any:
        return Qwen3Model(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
            tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))

    # FLUX.1's autoencoder, which Z-Image uses; Z-Image's scheduler config: shift 3, no resolution-dependent shift.
    models = {"transformer": transformer, "vae": tiny_parts.build_flux_vae, "text_encoder": text_encoder}
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return tiny_parts.seeded_parts(seed, 31, models, tokenizer=tokenizer, scheduler=scheduler)


def save_tiny_z_image(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny ZImagePipeline folder at `path` (atomically) and return it."""
    return tiny_parts.save_pipeline(path, overwrite, "ZImagePipeline", lambda: build_tiny_z_image(seed), "Z-Image",
                                    seed)


def save_tiny_z_image_files(folder: str | os.PathLike[str], target: str | os.PathLike[str]) -> dict[str, Path]:
    """The tiny Z-Image folder's weights as ComfyUI users keep them: the transformer in ComfyUI's layout behind
    `model.diffusion_model.` (diffusion_models/), the Qwen3 file with Qwen3ForCausalLM's `model.` names
    (text_encoders/) and the autoencoder in FLUX.1's ae.safetensors layout (vae/). Returns their paths by option
    name (`pretrained_model_name_or_path` as "transformer")."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Model

    parts = tiny_parts.read_parts(Path(folder), {"transformer": ZImageTransformer2DModel, "vae": AutoencoderKL,
                                                 "text_encoder": Qwen3Model})
    files = {
        "transformer": ({COMFY_PREFIX + k: v for k, v in comfy_state_dict(parts["transformer"]).items()},
                        "diffusion_models/z_image_tiny.safetensors"),
        "text_encoder": ({"model." + k: v for k, v in parts["text_encoder"].state_dict().items()},
                         "text_encoders/qwen_3_tiny.safetensors"),
        "ae": (tiny_parts.ae_state_dict(parts["vae"]), "vae/ae.safetensors"),
    }
    return tiny_parts.save_files(Path(target), files)
