"""The base-model options that one family reads: FLUX.1's and SD3's under sd-scripts' names, Z-Image's and
Qwen-Image's under musubi-tuner's (grouped with the other model options in --help); and the family tuples that
options name in their `families`."""
from __future__ import annotations

from library.config.option_types import Option, _to_bool, _to_float, _to_int, _to_str

SD = ("sd",)  # SD1.x, SD2.x, SDXL: the DDPM objective
FLUX_LIKE = ("flux", "chroma")  # kohya's flux_train_network.py
MUSUBI = ("z_image", "qwen_image")  # musubi-tuner's image trainers
FLOW = (*FLUX_LIKE, "sd3", *MUSUBI)  # trained with flow matching

FAMILY_MODEL_OPTIONS = [
    # FLUX.1 (kohya's flux_train_network.py names and defaults)
    Option("clip_l", _to_str, None, "FLUX from separate files: the CLIP-L text encoder .safetensors", is_path=True,
         metavar="PATH", families=("flux", "sd3")),
    Option("t5xxl", _to_str, None, "FLUX from separate files: the T5-XXL text encoder .safetensors", is_path=True,
         metavar="PATH", families=(*FLUX_LIKE, "sd3")),
    Option("ae", _to_str, None, "FLUX (and Chroma, Z-Image, Qwen-Image) from separate files: the autoencoder "
         "(ae.safetensors; for Qwen-Image its VAE file, musubi's --vae)", is_path=True, metavar="PATH",
         families=(*FLUX_LIKE, *MUSUBI)),
    Option("t5xxl_max_token_length", _to_int, None,
         "FLUX: T5 prompt length in tokens (default 512 for dev, 256 for schnell)", families=(*FLUX_LIKE, "sd3")),
    Option("vae", _to_str, None,
         "a VAE to use instead of the model's (a diffusers VAE folder, or a .safetensors file with diffusers' or "
         "the original key names, e.g. SDXL's fp16-fixed VAE); FLUX.1's is ae", is_path=True, metavar="PATH",
         families=(*SD, *FLUX_LIKE, "sd3", "z_image")),  # Qwen-Image's video VAE comes with the model
    Option("apply_t5_attn_mask", _to_bool, False,
         "FLUX: mask T5's padding tokens, in T5 and in the transformer's attention", families=(*FLUX_LIKE, "sd3")),
    # Chroma must set it to 0.
    Option("guidance_scale", _to_float, 3.5, "FLUX dev: the guidance input of the transformer during training",
           families=FLUX_LIKE),
    Option("model_type", _to_str, None,
         "kohya's flux_train_network.py --model_type: flux or chroma; the family is read from the weights, and a "
         "model_type that disagrees with them is an error", choices=FLUX_LIKE, families=FLUX_LIKE),
    # SD3 / SD3.5 (kohya's sd3_train_network.py names and defaults)
    Option("clip_g", _to_str, None, "SD3 from a checkpoint without text encoders: the CLIP-G text encoder "
         ".safetensors (kohya's clip_g; clip_l and t5xxl name the other two)", is_path=True, metavar="PATH",
         families=("sd3",)),
    Option("apply_lg_attn_mask", _to_bool, False, "SD3: pass the padding mask into CLIP-L and CLIP-G",
           families=("sd3",)),
    Option("clip_l_dropout_rate", _to_float, 0.0, "SD3: kohya's per-caption dropout of CLIP-L's outputs",
           families=("sd3",)),
    Option("clip_g_dropout_rate", _to_float, 0.0, "SD3: kohya's per-caption dropout of CLIP-G's outputs",
           families=("sd3",)),
    Option("t5_dropout_rate", _to_float, 0.0, "SD3: kohya's per-caption dropout of T5's outputs", families=("sd3",)),
    Option("pos_emb_random_crop_rate", _to_float, 0.0,
         "SD3: SD3.5 Medium's probability that a step reads its position embeddings from a random place of the "
         "grid instead of its centre (kohya's)", families=("sd3",)),
    Option("enable_scaled_pos_embed", _to_bool, False,
         "SD3: SD3.5 Medium's position embeddings scaled for each dataset resolution, in training and samples "
         "(kohya's)", families=("sd3",)),
    Option("training_shift", _to_float, 1.0,
         "SD3: shift of the timestep draw, u -> shift * u / (1 + (shift - 1) * u), after weighting_scheme",
         families=("sd3",)),
    # musubi-tuner's names (Z-Image, Qwen-Image from separate files)
    Option("text_encoder", _to_str, None,
         "Z-Image / Qwen-Image from separate files: the Qwen3 / Qwen2.5-VL text encoder .safetensors (ComfyUI's "
         "text_encoders/ file, or the first of the official split files)", is_path=True, metavar="PATH",
         families=MUSUBI),
]
