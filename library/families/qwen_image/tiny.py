"""A tiny Qwen-Image-shaped model built from configs, for tests and tries (nothing fetched from a hub).

The classes are the real ones at tiny widths: QwenImageTransformer2DModel (2x2 patches, double-stream blocks),
AutoencoderKLQwenImage (the video VAE, 8x down with Qwen-Image's latents_mean / latents_std), Qwen2.5-VL
(Qwen2_5_VLForConditionalGeneration, a one-block vision tower included, as QwenImagePipeline takes it) with a
byte-level BPE tokenizer built here, and Qwen-Image's scheduler config (dynamic shift). The tokenizer learns the
prompt template's words whole, so the template's system turn is 34 tokens, as with Qwen's own vocabulary.

    python -m library.families.tiny OUTPUT_DIR --family qwen_image [--files] [--seed N] [--overwrite]
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from library.families.qwen_image.files import COMFY_PREFIX
from library.families.shared import tiny_parts

logger = logging.getLogger(__name__)

WIDTH = 32  # text width and the transformer's inner dim (2 heads of 16)
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_CORPUS = ("system user assistant Describe the image by detailing color shape size texture quantity text spatial "
           "relationships of objects and background a an photo picture in on with sks dog cat person red green blue "
           "white black yellow orange circle square triangle diamond digit zero one two three four five six seven "
           "eight nine number written drawn small large")
# Qwen-Image's scheduler config (Qwen/Qwen-Image scheduler/scheduler_config.json).
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                    "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
                    "time_shift_type": "exponential"}


def build_tokenizer(corpus: str = _CORPUS) -> Any:
    """A Qwen2-style byte-level BPE tokenizer (Qwen's special tokens, pad <|endoftext|>) that keeps every word of
    `corpus` whole."""
    return tiny_parts.build_qwen_bpe_tokenizer(corpus, SPECIAL_TOKENS, 2000)


def build_tiny_qwen_image(seed: int = 0, corpus: str = _CORPUS, zero_cond_t: bool = False) -> dict[str, Any]:
    """The components of a tiny QwenImagePipeline (a tokenizer learning `corpus`; `zero_cond_t` as
    Qwen-Image-Edit-2511's transformer has it). Weights depend only on the seed; the caller's global RNG state
    is left untouched."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = build_tokenizer(corpus)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}

    def transformer() -> Any:
        return QwenImageTransformer2DModel(
            patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=WIDTH, axes_dims_rope=(4, 6, 6),
            zero_cond_t=zero_cond_t)

    def vae() -> Any:
        # Qwen-Image's VAE shape (dim_mult 1, 2, 4, 4; 2 blocks a level, as the layout of ComfyUI's file assumes;
        # time down after levels 2 and 3) at base width 8.
        return AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                      temperal_downsample=[False, True, True])

    def text_encoder() -> Any:
        return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config={"vocab_size": len(tokenizer), "hidden_size": WIDTH, "intermediate_size": 2 * WIDTH,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "max_position_embeddings": 2048, "tie_word_embeddings": False,
                         "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
                         "bos_token_id": ids[PAD], "eos_token_id": ids[IM_END], "pad_token_id": ids[PAD]},
            vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                           "out_hidden_size": WIDTH, "fullatt_block_indexes": [0]},
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            bos_token_id=ids[PAD], eos_token_id=ids[IM_END], pad_token_id=ids[PAD], tie_word_embeddings=False))

    return tiny_parts.seeded_parts(seed, 41, {"transformer": transformer, "vae": vae, "text_encoder": text_encoder},
                                   tokenizer=tokenizer, scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG))


def save_tiny_qwen_image(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny QwenImagePipeline folder at `path` (atomically) and return it."""
    return tiny_parts.save_pipeline(path, overwrite, "QwenImagePipeline", lambda: build_tiny_qwen_image(seed),
                                    "Qwen-Image", seed)


def comfy_vae_state_dict(vae: Any) -> dict[str, torch.Tensor]:
    """An AutoencoderKLQwenImage's weights in ComfyUI's (Wan 2.1 VAE) layout, for writing test files as ComfyUI keeps
    them: the inverse of the names diffusers' convert_wan_vae_to_diffusers and musubi-tuner's
    convert_comfyui_state_dict read (flat encoder.downsamples / decoder.upsamples, residual.0/2/3/6, head.0/2,
    middle.0/1/2, conv1 / conv2 for the quant convs)."""
    import re

    residual = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6",
                "conv_shortcut": "shortcut"}
    out = {}
    for key, value in vae.state_dict().items():
        new = key
        new = re.sub(r"^quant_conv\.", "conv1.", new)
        new = re.sub(r"^post_quant_conv\.", "conv2.", new)
        new = re.sub(r"^(encoder|decoder)\.conv_in\.", r"\1.conv1.", new)
        new = re.sub(r"^(encoder|decoder)\.norm_out\.", r"\1.head.0.", new)
        new = re.sub(r"^(encoder|decoder)\.conv_out\.", r"\1.head.2.", new)
        new = re.sub(r"^(encoder|decoder)\.mid_block\.attentions\.0\.", r"\1.middle.1.", new)
        match = re.match(r"^(encoder|decoder)\.mid_block\.resnets\.(\d)\.(\w+)\.(.+)$", new)
        if match:
            part, index, layer, rest = match.groups()
            new = f"{part}.middle.{2 * int(index)}.{residual[layer]}.{rest}"
        match = re.match(r"^encoder\.down_blocks\.(\d+)\.(norm1|conv1|norm2|conv2|conv_shortcut)\.(.+)$", new)
        if match:
            new = f"encoder.downsamples.{match.group(1)}.{residual[match.group(2)]}.{match.group(3)}"
        new = new.replace("encoder.down_blocks.", "encoder.downsamples.")
        match = re.match(r"^decoder\.up_blocks\.(\d)\.resnets\.(\d)\.(\w+)\.(.+)$", new)
        if match:  # three blocks and an upsampler per level: flat index 4 * level + block
            level, index, layer, rest = match.groups()
            new = f"decoder.upsamples.{4 * int(level) + int(index)}.{residual[layer]}.{rest}"
        match = re.match(r"^decoder\.up_blocks\.(\d)\.upsamplers\.0\.(.+)$", new)
        if match:
            new = f"decoder.upsamples.{4 * int(match.group(1)) + 3}.{match.group(2)}"
        out[new] = value
    return out


def save_tiny_qwen_image_files(folder: str | os.PathLike[str], target: str | os.PathLike[str]) -> dict[str, Path]:
    """The tiny Qwen-Image folder's weights as ComfyUI users keep them: the transformer behind
    `model.diffusion_model.` (diffusion_models/), Qwen2.5-VL with ComfyUI's names (`model.layers...`, `visual...`,
    `lm_head`; text_encoders/) and the VAE in the Wan 2.1 layout (vae/). Returns their paths by option name
    (`pretrained_model_name_or_path` as "transformer")."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    parts = tiny_parts.read_parts(Path(folder), {
        "transformer": QwenImageTransformer2DModel, "vae": AutoencoderKLQwenImage,
        "text_encoder": Qwen2_5_VLForConditionalGeneration})
    text = {}
    for key, value in parts["text_encoder"].state_dict().items():
        text[key.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)] = value
    files = {
        "transformer": ({COMFY_PREFIX + k: v for k, v in parts["transformer"].state_dict().items()},
                        "diffusion_models/qwen_image_tiny.safetensors"),
        "text_encoder": (text, "text_encoders/qwen_2.5_vl_tiny.safetensors"),
        "ae": (comfy_vae_state_dict(parts["vae"]), "vae/qwen_image_vae.safetensors"),
    }
    return tiny_parts.save_files(Path(target), files)
