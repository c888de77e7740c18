"""A tiny FLUX.1-dev-shaped model built from configs, for tests and benchmarks (nothing fetched from a hub).

The module layout is FLUX's (double and single transformer blocks with a guidance embedding, a 16-channel VAE with
a shift factor, CLIP-L and T5 text encoders, the flow-matching scheduler), so key names and code paths match
the real model; only widths shrink. The T5 tokenizer is a small Unigram vocabulary (shared.tiny_parts).

    python -m library.families.tiny OUTPUT_DIR --family flux [--seed N] [--overwrite] [--files]
    python -m library.families.tiny OUTPUT_DIR --family flux_kontext [--seed N] [--overwrite] [--files]
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from library.families.flux.files import BFL_PREFIX, bfl_state_dict
from library.families.shared import tiny_parts
from library.families.shared.tiny_parts import (  # build_t5_tokenizer also for tools/pretrain_flux_base.py
    MODEL_MAX_LENGTH,
    build_flux_vae,
    build_t5,
    build_t5_tokenizer,
    build_tiny_tokenizer,
)

logger = logging.getLogger(__name__)

WIDTH = 32  # text widths and the transformer's inner width (2 heads of 16)
# FLUX.1-dev's scheduler config: shift 3 with resolution-dependent (dynamic) shifting for inference.
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                    "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}


def build_tiny_flux(seed: int = 0, guidance: bool = True) -> dict[str, Any]:
    """The components of a tiny FluxPipeline; `guidance=False` gives a schnell-shaped transformer. Weights depend
    only on the seed; the caller's global RNG state is left untouched."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer, tokenizer_2 = build_tiny_tokenizer(), build_t5_tokenizer()

    def transformer() -> Any:
        return FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=WIDTH, pooled_projection_dim=WIDTH, guidance_embeds=guidance,
            axes_dims_rope=(4, 6, 6))

    def clip() -> Any:
        return CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=WIDTH, intermediate_size=4 * WIDTH, projection_dim=WIDTH,
            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=MODEL_MAX_LENGTH,
            hidden_act="quick_gelu", bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id))

    models = {"transformer": transformer, "vae": build_flux_vae, "text_encoder": clip,
              "text_encoder_2": lambda: build_t5(tokenizer_2, WIDTH)}
    return tiny_parts.seeded_parts(seed, 21, models, tokenizer=tokenizer, tokenizer_2=tokenizer_2,
                                   scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG))


def save_tiny_flux(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False,
                   guidance: bool = True) -> Path:
    """Write a tiny FluxPipeline folder at `path` (atomically) and return it."""
    from diffusers import FluxPipeline

    target = Path(path).absolute()
    tiny_parts.check_target(target, overwrite)
    tiny_parts.write_pipeline(FluxPipeline(**build_tiny_flux(seed, guidance)), target, ("tokenizer",))
    logger.info("wrote tiny FLUX model (seed=%d, guidance=%s) to %s", seed, guidance, target)
    return target


def save_tiny_flux_kontext(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny FluxKontextPipeline folder at `path` (atomically) and return it: the same parts as the tiny
    FLUX.1 dev (Kontext [dev] is dev's architecture), named a Kontext pipeline in its model_index.json."""
    from diffusers import FluxKontextPipeline

    target = Path(path).absolute()
    tiny_parts.check_target(target, overwrite)
    tiny_parts.write_pipeline(FluxKontextPipeline(**build_tiny_flux(seed)), target, ("tokenizer",))
    logger.info("wrote tiny FLUX.1 Kontext model (seed=%d) to %s", seed, target)
    return target


def save_tiny_flux_files(folder: str | os.PathLike[str], target: str | os.PathLike[str]) -> dict[str, Path]:
    """The tiny FLUX (or FLUX.1 Kontext) folder's weights as kohya's separate files: the BFL-layout transformer (behind
    `model.diffusion_model.`, as BFL ships it), clip_l, t5xxl and ae. Returns their paths by option name."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    parts = tiny_parts.read_parts(Path(folder), {"transformer": FluxTransformer2DModel, "vae": AutoencoderKL,
                                      "text_encoder": CLIPTextModel, "text_encoder_2": T5EncoderModel})
    clip = parts["text_encoder"]
    files = {
        "transformer": (bfl_file_state_dict(parts["transformer"]), "flux1-tiny.safetensors"),
        "ae": (tiny_parts.ae_state_dict(parts["vae"]), "ae.safetensors"),
        "clip_l": ({"text_model." + k.removeprefix("text_model."): v for k, v in clip.state_dict().items()},
                   "clip_l.safetensors"),
        "t5xxl": (t5xxl_state_dict(parts["text_encoder_2"]), "t5xxl.safetensors"),
    }
    return tiny_parts.save_files(Path(target), files)


def bfl_file_state_dict(transformer: Any) -> dict[str, torch.Tensor]:
    """A FLUX.1 (or Chroma) transformer's weights as BFL ships them: BFL's layout behind `model.diffusion_model.`."""
    return {BFL_PREFIX + k: v for k, v in bfl_state_dict(transformer).items()}


def t5xxl_state_dict(t5: Any) -> dict[str, torch.Tensor]:
    """A T5 encoder's weights as the t5xxl files people use store them: the embedding once (shared.weight)."""
    return {k: v for k, v in t5.state_dict().items() if k != "encoder.embed_tokens.weight"}
