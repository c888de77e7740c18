"""The options kohya's sd3_train_network.py reads for SD3 / SD3.5 (its names and defaults)."""
from __future__ import annotations

from library.config.option_types import Option, to_bool, to_float, to_str
from library.families.shared.options import (
    CLIP_L,
    SIGMA_DENSITY,
    T5_PROMPTS,
    T5XXL,
    TEXT_ENCODER_TRAINING,
    TIMESTEP_RANGE,
    VAE,
)


def _model(name: str, convert, default, help: str, **kw) -> Option:
    return Option(name, convert, default, help, group="model", **kw)


OPTIONS = (
    CLIP_L,
    _model("clip_g", to_str, None, "SD3 from a checkpoint without text encoders: the CLIP-G text encoder "
           ".safetensors (kohya's clip_g; clip_l and t5xxl name the other two)", is_path=True, metavar="PATH"),
    T5XXL,
    VAE,
    *T5_PROMPTS,
    _model("apply_lg_attn_mask", to_bool, False, "SD3: pass the padding mask into CLIP-L and CLIP-G"),
    _model("clip_l_dropout_rate", to_float, 0.0, "SD3: kohya's per-caption dropout of CLIP-L's outputs"),
    _model("clip_g_dropout_rate", to_float, 0.0, "SD3: kohya's per-caption dropout of CLIP-G's outputs"),
    _model("t5_dropout_rate", to_float, 0.0, "SD3: kohya's per-caption dropout of T5's outputs"),
    _model("pos_emb_random_crop_rate", to_float, 0.0,
           "SD3: SD3.5 Medium's probability that a step reads its position embeddings from a random place of the "
           "grid instead of its centre (kohya's)"),
    _model("enable_scaled_pos_embed", to_bool, False,
           "SD3: SD3.5 Medium's position embeddings scaled for each dataset resolution, in training and samples "
           "(kohya's)"),
    _model("training_shift", to_float, 1.0,
           "SD3: shift of the timestep draw, u -> shift * u / (1 + (shift - 1) * u), after weighting_scheme"),
    TEXT_ENCODER_TRAINING,
    *TIMESTEP_RANGE,
    *SIGMA_DENSITY,
)
