"""The base-model options that one family reads: FLUX.1's and SD3's under sd-scripts' names, Z-Image's and
Qwen-Image's under musubi-tuner's (grouped with the other model options in --help)."""
from __future__ import annotations

from library.config.option_types import Option, _to_bool, _to_float, _to_int, _to_str

FAMILY_MODEL_OPTIONS = [
    # FLUX.1 (kohya's flux_train_network.py names and defaults)
    Option("clip_l", _to_str, None, "FLUX from separate files: the CLIP-L text encoder .safetensors", is_path=True,
         metavar="PATH"),
    Option("t5xxl", _to_str, None, "FLUX from separate files: the T5-XXL text encoder .safetensors", is_path=True,
         metavar="PATH"),
    Option("ae", _to_str, None, "FLUX (and Chroma, Z-Image, Qwen-Image) from separate files: the autoencoder "
         "(ae.safetensors; for Qwen-Image its VAE file, musubi's --vae)", is_path=True, metavar="PATH"),
    Option("t5xxl_max_token_length", _to_int, None,
         "FLUX: T5 prompt length in tokens (default 512 for dev, 256 for schnell)"),
    Option("vae", _to_str, None,
         "a VAE to use instead of the model's (a diffusers VAE folder, or a .safetensors file with diffusers' or "
         "the original key names, e.g. SDXL's fp16-fixed VAE); FLUX.1's is ae", is_path=True, metavar="PATH"),
    Option("apply_t5_attn_mask", _to_bool, False,
         "FLUX: mask T5's padding tokens, in T5 and in the transformer's attention"),
    Option("guidance_scale", _to_float, 3.5, "FLUX dev: the guidance input of the transformer during training"),
    Option("model_type", _to_str, None,
         "kohya's flux_train_network.py --model_type: flux or chroma; the family is read from the weights, and a "
         "model_type that disagrees with them is an error", choices=("flux", "chroma")),
    # SD3 / SD3.5 (kohya's sd3_train_network.py names and defaults)
    Option("clip_g", _to_str, None, "SD3 from a checkpoint without text encoders: the CLIP-G text encoder "
         ".safetensors (kohya's clip_g; clip_l and t5xxl name the other two)", is_path=True, metavar="PATH"),
    Option("apply_lg_attn_mask", _to_bool, False, "SD3: pass the padding mask into CLIP-L and CLIP-G"),
    Option("clip_l_dropout_rate", _to_float, 0.0, "SD3: kohya's per-caption dropout of CLIP-L's outputs"),
    Option("clip_g_dropout_rate", _to_float, 0.0, "SD3: kohya's per-caption dropout of CLIP-G's outputs"),
    Option("t5_dropout_rate", _to_float, 0.0, "SD3: kohya's per-caption dropout of T5's outputs"),
    Option("pos_emb_random_crop_rate", _to_float, 0.0,
         "SD3: SD3.5 Medium's probability that a step reads its position embeddings from a random place of the "
         "grid instead of its centre (kohya's)"),
    Option("enable_scaled_pos_embed", _to_bool, False,
         "SD3: SD3.5 Medium's position embeddings scaled for each dataset resolution, in training and samples "
         "(kohya's)"),
    Option("training_shift", _to_float, 1.0,
         "SD3: shift of the timestep draw, u -> shift * u / (1 + (shift - 1) * u), after weighting_scheme"),
    # musubi-tuner's names (Z-Image, Qwen-Image from separate files)
    Option("text_encoder", _to_str, None,
         "Z-Image / Qwen-Image from separate files: the Qwen3 / Qwen2.5-VL text encoder .safetensors (ComfyUI's "
         "text_encoders/ file, or the first of the official split files)", is_path=True, metavar="PATH"),
]
