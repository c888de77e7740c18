"""Tiny, deterministic Stable-Diffusion-shaped models built from configs.

Used by the quickstart, the tests and the benchmarks, so that nothing is ever fetched from a model hub.
The layout mirrors SD1.x (cross-attention transformer blocks with 1x1-conv proj_in/proj_out, an 8x VAE,
a CLIP text model, SD's DDPM schedule) so key names and code paths match the real models; only widths shrink.

    python -m library.families.tiny OUTPUT_DIR --family sd1|sd2|sdxl [--size tiny|small]
                                    [--prediction-type epsilon|v_prediction] [--seed N] [--overwrite]
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from library.families.sd.entry import PREDICTION_TYPES, SIZES
from library.families.sd.single_file import save_checkpoint
from library.families.shared.ldm_export import ldm_state_dict
from library.families.shared.tiny_parts import (  # noqa: F401 - re-exported for the tools and tests
    BOS_TOKEN,
    BPE_CORPUS,
    EOS_TOKEN,
    MODEL_MAX_LENGTH,
    NUM_MERGES,
    build_tiny_tokenizer,
    check_target,
    learn_vocab_and_merges,
    seeded,
    write_bpe_files,
    write_pipeline,
)

logger = logging.getLogger(__name__)

FAMILIES = ("sd1", "sd2")  # sd2: linear proj_in/proj_out, OpenCLIP's gelu and "!" padding

# Per size: UNet widths, latent size, text width. Heads are chosen so every attention head is 8 wide.
_SIZE_SPECS: dict[str, dict[str, Any]] = {
    "tiny": {
        "block_out_channels": (32, 64),
        "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
        "sample_size": 8,
        "text_width": 32,
    },
    "small": {
        "block_out_channels": (64, 128, 256),
        "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        "sample_size": 16,
        "text_width": 64,
    },
}
_VAE_SCALE = 8  # 4 VAE levels -> 3 downsamplings
_HEAD_WIDTH = 8


def _check_args(size: str, prediction_type: str, family: str = "sd1") -> None:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")


def build_tiny_sd1(size: str = "tiny", seed: int = 0, prediction_type: str = "epsilon",
                   family: str = "sd1") -> dict[str, Any]:
    """Build {"unet", "vae", "text_encoder", "tokenizer", "scheduler"} for a tiny SD1- (or SD2-) shaped model.

    Weights depend only on (size, seed); the caller's global torch RNG state is left untouched.
    """
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    _check_args(size, prediction_type, family)
    spec = _SIZE_SPECS[size]
    width = spec["text_width"]
    sd2 = family == "sd2"
    tokenizer = build_tiny_tokenizer("!" if sd2 else EOS_TOKEN)

    with torch.random.fork_rng(devices=[]):
        seeded(seed, 1)
        unet = UNet2DConditionModel(
            sample_size=spec["sample_size"],
            in_channels=4,
            out_channels=4,
            down_block_types=spec["down_block_types"],
            up_block_types=spec["up_block_types"],
            block_out_channels=spec["block_out_channels"],
            layers_per_block=2,
            cross_attention_dim=width,
            # diffusers reads attention_head_dim as the number of heads (legacy naming kept for SD1 configs).
            attention_head_dim=tuple(c // _HEAD_WIDTH for c in spec["block_out_channels"]),
            use_linear_projection=sd2,
            norm_num_groups=32,
        )
        seeded(seed, 2)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(32, 32, 32, 32),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=32,
            sample_size=spec["sample_size"] * _VAE_SCALE,
        )
        seeded(seed, 3)
        text_config = CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=width,
            intermediate_size=4 * width,
            projection_dim=width,
            num_hidden_layers=2,
            num_attention_heads=width // _HEAD_WIDTH,
            max_position_embeddings=MODEL_MAX_LENGTH,
            hidden_act="gelu" if sd2 else "quick_gelu",
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        text_encoder = CLIPTextModel(text_config)

    scheduler = DDPMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        prediction_type=prediction_type,
        clip_sample=False,
    )
    for model in (unet, vae, text_encoder):
        model.eval()
    return {
        "unet": unet,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": scheduler,
    }


def save_pipeline(components: dict[str, Any], target: Path, corpus: str = BPE_CORPUS) -> None:
    """Write `components` as a StableDiffusionPipeline folder at `target`, replacing any old one atomically.

    `corpus` is what the tokenizer's merges were learned from; vocab.json and merges.txt are written from it.
    """
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(**components, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    write_pipeline(pipe, target, ("tokenizer",), corpus)


def save_tiny_sd1(
    path: str | os.PathLike[str],
    size: str = "tiny",
    seed: int = 0,
    prediction_type: str = "epsilon",
    overwrite: bool = False,
    family: str = "sd1",
) -> Path:
    """Write a complete diffusers StableDiffusionPipeline folder at `path` (atomically) and return it.

    An existing non-empty `path` is an error unless `overwrite` is set.
    """
    _check_args(size, prediction_type, family)
    target = Path(path).absolute()
    check_target(target, overwrite)
    save_pipeline(build_tiny_sd1(size=size, seed=seed, prediction_type=prediction_type, family=family), target)
    logger.info("wrote tiny %s model (size=%s, seed=%d, %s) to %s", family, size, seed, prediction_type, target)
    return target


def save_tiny_sd1_single_file(path: str | os.PathLike[str], size: str = "tiny", seed: int = 0,
                              open_clip: bool = False) -> Path:
    """Write the tiny SD1 model of (size, seed) as one safetensors file in the original SD (LDM) key layout.

    The weights equal those of `save_tiny_sd1(size=size, seed=seed)`; a file holds no scheduler or tokenizer,
    so loading it needs that folder as `model_config`. `open_clip` writes the text encoder in SD2's OpenCLIP
    layout (cond_stage_model.model.), which makes the file read as an SD2.x checkpoint.
    """

    _check_args(size, "epsilon")
    parts = build_tiny_sd1(size=size, seed=seed)
    state = ldm_state_dict(parts["unet"], parts["vae"], parts["text_encoder"], open_clip=open_clip)
    target = save_checkpoint(state, Path(path).absolute())
    logger.info("wrote tiny SD1 single-file checkpoint (size=%s, seed=%d) to %s", size, seed, target)
    return target


def build_tiny_sdxl(seed: int = 0) -> dict[str, Any]:
    """Build the components of a tiny SDXL-shaped pipeline: two text encoders (CLIP and CLIP with projection, the
    second padding with "!"), a UNet with SDXL's text_time conditioning and linear projections, a VAE and SDXL's
    noise schedule. The block layout (no attention in the first block, 2 transformer layers in the last) keeps
    SDXL's module names."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    width, time_dim = 32, 8
    tokenizer, tokenizer_2 = build_tiny_tokenizer(), build_tiny_tokenizer("!")

    def text_config(tok: Any, act: str) -> Any:
        return CLIPTextConfig(vocab_size=len(tok), hidden_size=width, intermediate_size=4 * width,
                              projection_dim=width, num_hidden_layers=2, num_attention_heads=width // _HEAD_WIDTH,
                              max_position_embeddings=MODEL_MAX_LENGTH, hidden_act=act,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)

    with torch.random.fork_rng(devices=[]):
        seeded(seed, 11)
        unet = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(32, 64), layers_per_block=2, transformer_layers_per_block=(1, 2),
            attention_head_dim=(4, 8), cross_attention_dim=2 * width, use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=time_dim,
            projection_class_embeddings_input_dim=width + 6 * time_dim, norm_num_groups=32,
        )
        seeded(seed, 12)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 32, 32, 32),
                            layers_per_block=1, latent_channels=4, norm_num_groups=32, sample_size=64,
                            scaling_factor=0.13025)
        seeded(seed, 13)
        text_encoder = CLIPTextModel(text_config(tokenizer, "quick_gelu"))
        seeded(seed, 14)
        text_encoder_2 = CLIPTextModelWithProjection(text_config(tokenizer_2, "gelu"))
    scheduler = EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                       beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading",
                                       prediction_type="epsilon")
    for model in (unet, vae, text_encoder, text_encoder_2):
        model.eval()
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2,
            "tokenizer": tokenizer, "tokenizer_2": tokenizer_2, "scheduler": scheduler}


def save_tiny_sdxl(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny StableDiffusionXLPipeline folder at `path` (atomically) and return it."""
    from diffusers import StableDiffusionXLPipeline

    target = Path(path).absolute()
    check_target(target, overwrite)
    pipe = StableDiffusionXLPipeline(**build_tiny_sdxl(seed), force_zeros_for_empty_prompt=True)
    write_pipeline(pipe, target, ("tokenizer", "tokenizer_2"))
    return target


def save_sd1(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False, size: str | None = None,
             prediction_type: str | None = None) -> Path:
    """The tiny SD1 of the CLI (`--family sd1`): epsilon unless told otherwise."""
    return save_tiny_sd1(path, size or "tiny", seed, prediction_type or "epsilon", overwrite, "sd1")


def save_sd2(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False, size: str | None = None,
             prediction_type: str | None = None) -> Path:
    """The tiny SD2 of the CLI (`--family sd2`): v-prediction unless told otherwise, as SD2's 768-v models."""
    return save_tiny_sd1(path, size or "tiny", seed, prediction_type or "v_prediction", overwrite, "sd2")
