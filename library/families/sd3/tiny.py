"""A tiny SD3.5-Medium-shaped model built from configs, for tests and tries (nothing fetched from a hub).

The module layout is SD3's MMDiT (joint blocks with q/k RMS norms, the last one context-pre-only, a dual-attention
first block as in SD3.5 Medium), CLIP-L and CLIP-G with projections, T5, a 16-channel VAE with SD3's scaling and
shift factors and the flow-matching scheduler with shift 3; only widths shrink.

    python -m library.families.tiny OUTPUT_DIR --family sd3 [--seed N] [--overwrite]
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from library.families.sd3.files import ENCODER_PREFIX, PREFIX, sai_state_dict
from library.families.shared import tiny_parts
from library.families.shared.tiny_parts import MODEL_MAX_LENGTH, build_t5, build_t5_tokenizer, build_tiny_tokenizer

logger = logging.getLogger(__name__)

CLIP_WIDTH, T5_WIDTH = 16, 32  # CLIP-L + CLIP-G hidden states (16 + 16) fill T5's width, as 768 + 1280 <= 4096
VAE_SCALING_FACTOR, VAE_SHIFT_FACTOR = 1.5305, 0.0609  # SD3's VAE constants (diffusers' vae/config.json)


def build_tiny_sd3(seed: int = 0) -> dict[str, Any]:
    """The components of a tiny StableDiffusion3Pipeline. Weights depend only on the seed; the caller's global RNG
    state is left untouched."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    tokenizer, tokenizer_2, tokenizer_3 = build_tiny_tokenizer(), build_tiny_tokenizer("!"), build_t5_tokenizer()

    def clip(tok: Any, act: str) -> Any:
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=CLIP_WIDTH, intermediate_size=4 * CLIP_WIDTH, projection_dim=CLIP_WIDTH,
            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=MODEL_MAX_LENGTH, hidden_act=act,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))

    def transformer() -> Any:
        return SD3Transformer2DModel(
            sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
            num_attention_heads=4, joint_attention_dim=T5_WIDTH, caption_projection_dim=32,
            pooled_projection_dim=2 * CLIP_WIDTH, pos_embed_max_size=32, dual_attention_layers=(0,),
            qk_norm="rms_norm")

    models = {"transformer": transformer,
              "vae": lambda: tiny_parts.build_flux_vae(VAE_SCALING_FACTOR, VAE_SHIFT_FACTOR),
              "text_encoder": lambda: clip(tokenizer, "quick_gelu"),
              "text_encoder_2": lambda: clip(tokenizer_2, "gelu"),
              "text_encoder_3": lambda: build_t5(tokenizer_3, T5_WIDTH)}
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # SD3 / SD3.5's config
    return tiny_parts.seeded_parts(seed, 41, models, tokenizer=tokenizer, tokenizer_2=tokenizer_2,
                                   tokenizer_3=tokenizer_3, scheduler=scheduler)


def save_tiny_sd3(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny StableDiffusion3Pipeline folder at `path` (atomically) and return it."""
    return tiny_parts.save_pipeline(path, overwrite, "StableDiffusion3Pipeline", lambda: build_tiny_sd3(seed), "SD3",
                                    seed, ("tokenizer", "tokenizer_2"))


def save_tiny_sd3_files(folder: str | os.PathLike[str], target: str | os.PathLike[str]) -> dict[str, Path]:
    """The tiny SD3 folder's weights as the single files people share: Stability's checkpoint with the text encoders
    inside (`sd3-tiny.safetensors`), one without them (`sd3-tiny-no-te.safetensors`) and kohya's separate clip_l,
    clip_g and t5xxl files. Returns their paths by option name ("checkpoint", "checkpoint_no_te", "clip_l", ...)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    parts = tiny_parts.read_parts(Path(folder), {
        "transformer": SD3Transformer2DModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModelWithProjection,
        "text_encoder_2": CLIPTextModelWithProjection, "text_encoder_3": T5EncoderModel})
    base = {PREFIX + k: v for k, v in sai_state_dict(parts["transformer"]).items()}
    base.update({"first_stage_model." + k: v for k, v in tiny_parts.ae_state_dict(parts["vae"]).items()})
    encoders = {"clip_l": parts["text_encoder"], "clip_g": parts["text_encoder_2"], "t5xxl": parts["text_encoder_3"]}
    # T5's embedding is stored once (shared.weight), as in the t5xxl files people use.
    separate = {name: {k: v for k, v in model.state_dict().items() if k != "encoder.embed_tokens.weight"}
                for name, model in encoders.items()}
    files = {"checkpoint": ({**base, **{ENCODER_PREFIX.format(n) + k: v for n, sd in separate.items()
                                        for k, v in sd.items()}}, "sd3-tiny.safetensors"),
             "checkpoint_no_te": (base, "sd3-tiny-no-te.safetensors"),
             **{name: (sd, f"{name}.safetensors") for name, sd in separate.items()}}
    return tiny_parts.save_files(Path(target), files)
