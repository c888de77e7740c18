"""The options kohya's flux_train_network.py reads for FLUX.1 (Chroma reads them too, from its own entry), and
musubi-tuner's model_version, which tells FLUX.1 Kontext [dev]'s single file from dev's."""
from __future__ import annotations

from library.config.option_types import Option, to_bool, to_float, to_str
from library.families.shared.options import (
    AE,
    BLOCKS_TO_SWAP,
    CLIP_L,
    MODEL_VERSION,
    PREDICTION_TYPE,
    SIGMA_DENSITY,
    T5_PROMPTS,
    T5XXL,
    TEXT_ENCODER_TRAINING,
    TIMESTEP_SAMPLING,
    VAE,
)

GUIDANCE_SCALE = Option("guidance_scale", to_float, 3.5,
                        "FLUX dev: the guidance input of the transformer during training", group="model")
MODEL_TYPE = Option("model_type", to_str, None,
                    "kohya's flux_train_network.py --model_type: flux or chroma; the family is read from the "
                    "weights, and a model_type that disagrees with them is an error", choices=("flux", "chroma"),
                    group="model")
# What kohya's FLUX trainer reads for FLUX.1 and Chroma alike.
KOHYA_FLUX = (T5XXL, AE, VAE, *T5_PROMPTS, GUIDANCE_SCALE, MODEL_TYPE, TEXT_ENCODER_TRAINING, *TIMESTEP_SAMPLING,
              PREDICTION_TYPE, *SIGMA_DENSITY)

SPLIT_MODE = Option("split_mode", to_bool, False,
                    "FLUX: deprecated in sd-scripts, where it means blocks_to_swap 18 unless blocks_to_swap is set; "
                    "so here", group="training")
OPTIONS = (CLIP_L, MODEL_VERSION, *KOHYA_FLUX, BLOCKS_TO_SWAP, SPLIT_MODE)
