"""Tiny Wan-shaped models built from configs, for tests and tries (nothing fetched from a hub).

The classes are the real ones at tiny widths: WanTransformer3DModel ((1, 2, 2) patches, 2 blocks of 2 heads of 16),
AutoencoderKLWan (Wan 2.1's VAE shape: 4x in time, 8x in space, 16 channels, its latents_mean / latents_std) at base
width 8, UMT5EncoderModel with a small T5 tokenizer, and Wan 2.1's diffusers scheduler (UniPC on the flow, shift 3).
`wan22_a14b` holds two such transformers, transformer/ the high-noise expert and transformer_2/ the low-noise one,
with the pipeline's boundary_ratio 0.875 (Wan2.2-T2V-A14B-Diffusers' layout); `wan22_ti2v_5b` has TI2V 5B's
48-channel VAE (16x down) and a 48-channel transformer (a folder only: no --files); `wan21_i2v` and
`wan22_i2v_a14b` are WanImageToVideoPipeline folders (build_tiny_wan_i2v) whose --files are the I2V transformer
files and, for `wan21_i2v`, its image encoder as musubi's clip file (official layout) and ComfyUI's clip_vision_h.

    python -m library.families.tiny OUTPUT_DIR --family wan21|wan22_a14b|wan22_ti2v_5b|wan21_i2v|wan22_i2v_a14b
        [--files] [--seed N]
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from library.families.shared import tiny_parts
from library.families.wan import clip as wan_clip
from library.families.wan.experts import DEFAULT_BOUNDARY
from library.families.wan.files import SCHEDULER_CONFIG
from library.families.wan.weights import COMFY_PREFIX, I2V_CHANNELS

WIDTH = 32  # text width and the transformer's inner dim


def _transformer(channels: int = 16, in_channels: int | None = None, image_dim: int | None = None) -> Any:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                 in_channels=in_channels or channels, out_channels=channels, text_dim=WIDTH,
                                 freq_dim=32, ffn_dim=64, num_layers=2, image_dim=image_dim,
                                 added_kv_proj_dim=WIDTH if image_dim else None)


def _ti2v_vae() -> Any:
    """Wan 2.2's TI2V VAE shape (48 channels, 2x2 pixel patches first, residual blocks: 16x down in space) at base
    width 8; its latents_mean / latents_std are spread values standing in for the released ones."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                            temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                            out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                            latents_mean=[round(-0.5 + i / 48, 4) for i in range(48)],
                            latents_std=[round(0.5 + i / 48, 4) for i in range(48)])


def build_tiny_wan(seed: int = 0, experts: int = 1, ti2v: bool = False) -> dict[str, Any]:
    """The components of a tiny WanPipeline (with `experts` 2, Wan 2.2 A14B's two transformers; `ti2v`, Wan 2.2 TI2V
    5B's shape: its 48-channel VAE and expand_timesteps). Weights depend only on the seed; the caller's global RNG
    state is left untouched."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = tiny_parts.build_t5_tokenizer()

    def vae() -> Any:
        # Wan 2.1's VAE shape (2 blocks a level, as ComfyUI's layout assumes; time down after levels 2 and 3).
        return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                temperal_downsample=[False, True, True])

    def text_encoder() -> Any:
        return UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=WIDTH, d_kv=8, d_ff=64, num_layers=2,
                                           num_heads=4, feed_forward_proj="gated-gelu", pad_token_id=0,
                                           eos_token_id=1, decoder_start_token_id=0))

    models = {"transformer": (lambda: _transformer(48)) if ti2v else _transformer, "vae": _ti2v_vae if ti2v else vae,
              "text_encoder": text_encoder}
    others: dict[str, Any] = {"expand_timesteps": True} if ti2v else {}
    if experts == 2:
        models["transformer_2"] = _transformer
        others["boundary_ratio"] = DEFAULT_BOUNDARY
    return tiny_parts.seeded_parts(seed, 51, models, tokenizer=tokenizer,
                                   scheduler=UniPCMultistepScheduler(**SCHEDULER_CONFIG), **others)


def build_tiny_wan_i2v(seed: int = 0, experts: int = 1) -> dict[str, Any]:
    """A tiny WanImageToVideoPipeline's parts: with one transformer Wan 2.1 I2V's shape (36 input channels, the
    image cross-attention over a CLIPVisionModel's features, its CLIPImageProcessor at 32 pixels); with two, Wan 2.2
    I2V A14B's (two 36-channel experts, no image encoder, boundary_ratio 0.9 as Wan2.2-I2V-A14B-Diffusers has)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    parts = build_tiny_wan(seed, experts=experts)
    clip = experts == 1

    def i2v() -> Any:
        return _transformer(16, in_channels=36, image_dim=WIDTH if clip else None)

    def image_encoder() -> Any:
        return CLIPVisionModel(CLIPVisionConfig(hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=3,
                                                num_attention_heads=2, image_size=32, patch_size=8))

    models = {"transformer": i2v, **({"transformer_2": i2v} if experts == 2 else {}),
              **({"image_encoder": image_encoder} if clip else {})}
    parts.update(tiny_parts.seeded_parts(seed, 71, models))
    if clip:
        parts["image_processor"] = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    else:
        parts["boundary_ratio"] = 0.9
    return parts


def save_tiny_wan21_i2v(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny Wan 2.1 I2V WanImageToVideoPipeline folder (with its image encoder) at `path`."""
    return tiny_parts.save_pipeline(path, overwrite, "WanImageToVideoPipeline", lambda: build_tiny_wan_i2v(seed),
                                    "Wan 2.1 I2V", seed)


def save_tiny_wan22_i2v_a14b(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny Wan 2.2 I2V A14B WanImageToVideoPipeline folder (two experts, no image encoder) at `path`."""
    return tiny_parts.save_pipeline(path, overwrite, "WanImageToVideoPipeline",
                                    lambda: build_tiny_wan_i2v(seed, experts=2), "Wan 2.2 I2V A14B", seed)


def save_tiny_wan21(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny Wan 2.1 T2V WanPipeline folder at `path` (atomically) and return it."""
    return tiny_parts.save_pipeline(path, overwrite, "WanPipeline", lambda: build_tiny_wan(seed), "Wan 2.1", seed)


def save_tiny_wan22_a14b(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny Wan 2.2 T2V A14B WanPipeline folder (two experts) at `path` (atomically) and return it."""
    return tiny_parts.save_pipeline(path, overwrite, "WanPipeline", lambda: build_tiny_wan(seed, experts=2),
                                    "Wan 2.2 A14B", seed)


def save_tiny_wan22_ti2v_5b(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny Wan 2.2 TI2V 5B WanPipeline folder (its VAE's shape, expand_timesteps) at `path`."""
    return tiny_parts.save_pipeline(path, overwrite, "WanPipeline", lambda: build_tiny_wan(seed, ti2v=True),
                                    "Wan 2.2 TI2V 5B", seed)


# diffusers' names -> the original Wan layout's (the inverse of diffusers' convert_wan_transformer_to_diffusers for
# the text-to-video and image-to-video weights), applied in order
_TO_ORIGINAL = (
    (r"^condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),  # Wan 2.1 I2V's image embedder
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
    (r"^condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."), (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."), (r"\.scale_shift_table$", ".modulation"), (r"\.attn1\.", ".self_attn."),
    (r"\.attn2\.", ".cross_attn."), (r"\.to_out\.0\.", ".o."), (r"\.to_([qkv])\.", r".\1."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."), (r"\.ffn\.net\.2\.", ".ffn.2."), (r"\.norm2\.", ".norm3."),
    (r"\.add_k_proj\.", ".k_img."), (r"\.add_v_proj\.", ".v_img."), (r"\.norm_added_k\.", ".norm_k_img."))


def original_state_dict(transformer: Any) -> dict[str, torch.Tensor]:
    """A WanTransformer3DModel's weights in the original Wan layout (ComfyUI's and the official files')."""
    out = {}
    for key, value in transformer.state_dict().items():
        for pattern, replacement in _TO_ORIGINAL:
            key = re.sub(pattern, replacement, key)
        out[key] = value
    return out


_T5_TO_OFFICIAL = (
    (r"^shared\.weight$", "token_embedding.weight"), (r"^encoder\.final_layer_norm\.", "norm."),
    (r"^encoder\.block\.(\d+)\.layer\.0\.layer_norm\.", r"blocks.\1.norm1."),
    (r"^encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.relative_attention_bias\.",
     r"blocks.\1.pos_embedding.embedding."),
    (r"^encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.([qkvo])\.", r"blocks.\1.attn.\2."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.layer_norm\.", r"blocks.\1.norm2."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wi_0\.", r"blocks.\1.ffn.gate.0."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wi_1\.", r"blocks.\1.ffn.fc1."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wo\.", r"blocks.\1.ffn.fc2."))


def official_t5_state_dict(encoder: Any) -> dict[str, torch.Tensor]:
    """A UMT5EncoderModel's weights in Wan's own layout (models_t5_umt5-xxl-enc-bf16.pth)."""
    out = {}
    for key, value in encoder.state_dict().items():
        if key == "encoder.embed_tokens.weight":
            continue  # tied to shared
        for pattern, replacement in _T5_TO_OFFICIAL:
            key = re.sub(pattern, replacement, key)
        out[key] = value
    return out


def save_tiny_wan_files(folder: str | os.PathLike[str], target: str | os.PathLike[str]) -> dict[str, Path]:
    """The tiny Wan folder's weights as users keep them: the (low-noise) transformer in the original layout behind
    `model.diffusion_model.` (diffusion_models/), for A14B the high-noise one too (`dit_high_noise`), UMT5 with
    transformers' names (text_encoders/, ComfyUI's file) and the VAE (vae/, diffusers' names); for Wan 2.1 I2V its
    image encoder as musubi's `clip` file in the official layout (clip_vision/*.pth, with a seeded projection head)
    and, beside it, as ComfyUI's clip_vision_h (transformers' names). Returns their paths by option name
    (`pretrained_model_name_or_path` as "transformer")."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    folder, target = Path(folder), Path(target)
    two = (folder / "transformer_2").is_dir()
    classes = {"transformer": WanTransformer3DModel, "vae": AutoencoderKLWan, "text_encoder": UMT5EncoderModel}
    if two:
        classes["transformer_2"] = WanTransformer3DModel
    parts = tiny_parts.read_parts(folder, classes)
    low = parts["transformer_2"] if two else parts["transformer"]
    i2v = low.config.in_channels == I2V_CHANNELS
    kind = "i2v" if i2v else "t2v"
    encoder = {k: v for k, v in parts["text_encoder"].state_dict().items() if k != "encoder.embed_tokens.weight"}
    files = {
        "transformer": ({COMFY_PREFIX + k: v for k, v in original_state_dict(low).items()},
                        f"diffusion_models/wan_tiny_{'i2v_' if i2v else ''}low_noise.safetensors" if two else
                        f"diffusion_models/wan2.1_{kind}_tiny.safetensors"),
        "t5": (encoder, "text_encoders/umt5_xxl_tiny.safetensors"),
        "ae": (parts["vae"].state_dict(), "vae/wan_2.1_vae_tiny.safetensors"),
    }
    if two:
        files["dit_high_noise"] = (original_state_dict(parts["transformer"]),
                                   f"diffusion_models/wan_tiny_{'i2v_' if i2v else ''}high_noise.safetensors")
    paths = tiny_parts.save_files(target, files)
    if (folder / "image_encoder").is_dir():
        paths["clip"] = save_clip_files(folder, target)["clip"]  # ComfyUI's clip_vision_h is written beside it
    return paths


def save_clip_files(folder: Path, target: Path) -> dict[str, Path]:
    """The folder's image encoder (CLIPVisionModel) with a projection head drawn from a fixed seed, written as the
    official models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth lays it out and as ComfyUI's clip_vision_h."""
    from transformers import CLIPVisionModel

    model = CLIPVisionModel.from_pretrained(folder, subfolder="image_encoder", local_files_only=True)
    tower = {k.removeprefix("vision_model."): v for k, v in model.state_dict().items()}
    width = model.config.hidden_size
    tower[wan_clip.PROJECTION] = torch.randn(width, width, generator=torch.Generator().manual_seed(0)) / width ** 0.5
    official = target / "clip_vision" / "models_clip_open-clip-xlm-roberta-tiny.pth"
    official.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone().contiguous() for k, v in wan_clip.wan_state_dict(tower).items()}, official)
    comfy = {("" if k == wan_clip.PROJECTION else "vision_model.") + k: v for k, v in tower.items()}
    paths = tiny_parts.save_files(target, {"clip_vision_h": (comfy, "clip_vision/clip_vision_h_tiny.safetensors")})
    return {"clip": official, **paths}
