"""Tiny, deterministic Stable-Diffusion-shaped models built from configs.

Used by the quickstart, the tests and the benchmarks, so that nothing is ever fetched from a model hub.
The layout mirrors SD1.x (cross-attention transformer blocks with 1x1-conv proj_in/proj_out, an 8x VAE,
a CLIP text model, SD's DDPM schedule) so key names and code paths match the real models; only widths shrink.

    python -m library.models.tiny OUTPUT_DIR [--family sd1|sd2|sdxl|flux|chroma|sd3|z_image|qwen_image [--files]]
                                             [--seed N] [--overwrite]
                                             [--size tiny|small] [--prediction-type epsilon|v_prediction]
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

import torch

from library.models.tiny_parts import (  # noqa: F401 - re-exported for the tools and tests
    _BPE_CORPUS,
    BOS_TOKEN,
    EOS_TOKEN,
    MODEL_MAX_LENGTH,
    NUM_MERGES,
    _check_target,
    _learn_vocab_and_merges,
    _seeded,
    _write_bpe_files,
    _write_pipeline,
    build_tiny_tokenizer,
)

logger = logging.getLogger(__name__)

SIZES = ("tiny", "small")
PREDICTION_TYPES = ("epsilon", "v_prediction")
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
        _seeded(seed, 1)
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
        _seeded(seed, 2)
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
        _seeded(seed, 3)
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


def save_pipeline(components: dict[str, Any], target: Path, corpus: str = _BPE_CORPUS) -> None:
    """Write `components` as a StableDiffusionPipeline folder at `target`, replacing any old one atomically.

    `corpus` is what the tokenizer's merges were learned from; vocab.json and merges.txt are written from it.
    """
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(**components, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    _write_pipeline(pipe, target, ("tokenizer",), corpus)


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
    _check_target(target, overwrite)
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
    from library.models.ldm_export import ldm_state_dict
    from library.models.single_file import save_checkpoint

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
        _seeded(seed, 11)
        unet = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(32, 64), layers_per_block=2, transformer_layers_per_block=(1, 2),
            attention_head_dim=(4, 8), cross_attention_dim=2 * width, use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=time_dim,
            projection_class_embeddings_input_dim=width + 6 * time_dim, norm_num_groups=32,
        )
        _seeded(seed, 12)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 32, 32, 32),
                            layers_per_block=1, latent_channels=4, norm_num_groups=32, sample_size=64,
                            scaling_factor=0.13025)
        _seeded(seed, 13)
        text_encoder = CLIPTextModel(text_config(tokenizer, "quick_gelu"))
        _seeded(seed, 14)
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
    _check_target(target, overwrite)
    pipe = StableDiffusionXLPipeline(**build_tiny_sdxl(seed), force_zeros_for_empty_prompt=True)
    _write_pipeline(pipe, target, ("tokenizer", "tokenizer_2"))
    return target


# --family -> (module, function writing the folder, function writing kohya's / ComfyUI's separate files or None);
# imported when asked, so that `python -m library.models.tiny` stays light and these modules never import this one.
ONE_SHAPE_FAMILIES: dict[str, tuple[str, str, str | None]] = {
    "sdxl": ("library.models.tiny", "save_tiny_sdxl", None),
    "flux": ("library.models.tiny_flux", "save_tiny_flux", "save_tiny_flux_files"),
    "chroma": ("library.models.tiny_chroma", "save_tiny_chroma", "save_tiny_chroma_files"),
    "sd3": ("library.models.tiny_sd3", "save_tiny_sd3", "save_tiny_sd3_files"),
    "z_image": ("library.models.tiny_z_image", "save_tiny_z_image", "save_tiny_z_image_files"),
    "qwen_image": ("library.models.tiny_qwen_image", "save_tiny_qwen_image", "save_tiny_qwen_image_files"),
}


def main(argv: list[str] | None = None) -> int:
    """CLI entry: write a tiny model folder."""
    import importlib

    parser = argparse.ArgumentParser(prog="python -m library.models.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="folder to write the diffusers pipeline into")
    parser.add_argument("--family", choices=(*FAMILIES, *ONE_SHAPE_FAMILIES), default="sd1")
    parser.add_argument("--size", choices=SIZES, default=None, help="tiny (default) or small; sd1 and sd2 only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prediction-type", choices=PREDICTION_TYPES, default=None,
                        help="default: epsilon for sd1, v_prediction for sd2; sd1 and sd2 only")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty folder")
    parser.add_argument("--files", action="store_true",
                        help="also write the separate files users load (for flux and chroma: the BFL-layout "
                             "transformer, t5xxl, ae and, for flux, clip_l) into OUTPUT_DIR/files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.family in ONE_SHAPE_FAMILIES:
            if args.size is not None or args.prediction_type is not None:
                parser.error(f"--size and --prediction-type apply to sd1 and sd2; the tiny {args.family} has one "
                             "shape")
            module_name, save_name, files_name = ONE_SHAPE_FAMILIES[args.family]
            if args.files and files_name is None:
                parser.error(f"--files: the tiny {args.family} is written as a folder only")
            module = importlib.import_module(module_name)
            out = getattr(module, save_name)(args.output_dir, args.seed, args.overwrite)
            print(f"wrote tiny {args.family} model (seed {args.seed}) to {out}")
            if args.files:
                for name, path in getattr(module, files_name)(out, out / "files").items():
                    print(f"  {name}: {path}")
            return 0
        size = args.size or "tiny"
        prediction_type = args.prediction_type or ("v_prediction" if args.family == "sd2" else "epsilon")
        out = save_tiny_sd1(args.output_dir, size, args.seed, prediction_type, args.overwrite, args.family)
    except FileExistsError as e:
        parser.exit(2, f"error: {e}\n")
    print(f"wrote tiny {args.family} model ({size}, seed {args.seed}, {prediction_type}) to {out}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
