"""Qwen-Image from the separate files people keep (ComfyUI's `diffusion_models/`, `text_encoders/`, `vae/`, which
musubi-tuner trains from): the transformer file is `pretrained_model_name_or_path`, `text_encoder` the Qwen2.5-VL
file and `ae` the VAE (musubi's --vae).

Widths come from the released model's configs shipped in configs/qwen_image/ (the Qwen2.5-VL-7B config as
musubi-tuner's load_qwen2_5_vl writes it), or from `model_config`, a diffusers Qwen-Image folder describing the
files (its weights are not read). The tokenizer is the Qwen vocabulary shipped for Z-Image (Qwen2.5 and Qwen3 share
it, with the same ids for the template's <|im_start|>, <|im_end|> and <|endoftext|>). The transformer file has
diffusers' names, with or without ComfyUI's `model.diffusion_model.`; the Qwen2.5-VL file may have ComfyUI's names
(`model.layers...`, `visual...`, as musubi reads them) or transformers'; the VAE file may be ComfyUI's (the Wan 2.1
VAE layout, converted by diffusers' own Wan converter) or diffusers'. A split `...-00001-of-0000N.safetensors` is
read with all its parts. Weights are built on the meta device and assigned from the files, cast to the training
dtype tensor by tensor; the transformer layer by layer, so that an int8 / nf4 base is quantized as it is read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from library.config import UserError
from library.core.memory import return_free_heap
from library.families.family import Components
from library.families.loading import LoadRequest
from library.families.qwen_image.family import QwenImageVae, family_of
from library.families.shared.diffusers_folder import transformer_components
from library.families.shared.safetensors_io import SafetensorsFile
from library.families.shared.separate_files import (
    assign,
    assign_streamed,
    file_keys,
    load_qwen_tokenizer,
    marked_keys,
    read_split,
    reading,
    shards,
)

SHIPPED_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "qwen_image"
SHIPPED_TOKENIZER = Path(__file__).resolve().parents[1] / "configs" / "z_image" / "tokenizer"
COMFY_PREFIX = "model.diffusion_model."
MARKER = "transformer_blocks.0.img_mod.1.weight"  # the image-stream modulation: only Qwen-Image's blocks have it
NOT_MARKER = "txt_in.text_norm.weight"  # Qwen-Image 2.1, another architecture


def is_qwen_image_file(path: Path) -> bool:
    keys = marked_keys(path, COMFY_PREFIX)
    return MARKER in keys and NOT_MARKER not in keys


def text_encoder_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's Qwen2.5-VL names (`model.layers...`, `visual...`) -> Qwen2_5_VLForConditionalGeneration's
    (`model.language_model.layers...`, `model.visual...`); transformers' own names stay."""
    out = {}
    for key, value in state.items():
        if key.startswith("visual."):
            key = "model." + key
        elif key.startswith("model.") and not key.startswith(("model.language_model.", "model.visual.")):
            key = "model.language_model." + key.removeprefix("model.")
        out[key] = value
    return out


def vae_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's VAE file (Wan 2.1's layout) or a diffusers VAE file -> diffusers' names."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    if any(key.startswith("encoder.down_blocks.") for key in state):
        return state
    return convert_wan_vae_to_diffusers(state)


def load_qwen_image_files(request: LoadRequest, zero_cond_t: bool | None = None) -> Components:
    """The separate files; `zero_cond_t` (Qwen-Image-Edit-2511's) overrides the transformer config's."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    path, model_config, weight_dtype = request.path, request.model_config, request.weight_dtype
    text_encoder, ae = request.required_files(("text_encoder", "ae"), "Qwen-Image", "the Qwen2.5-VL text encoder "
                                              "and the VAE files: ComfyUI's text_encoders/ and vae/")
    config_dir = Path(model_config) if model_config else SHIPPED_CONFIG
    local = {"local_files_only": True}
    family = "Qwen-Image"
    with reading(path, "the Qwen-Image files"):
        config = QwenImageTransformer2DModel.load_config(config_dir, subfolder="transformer", **local)
        if zero_cond_t is not None:
            config = {**config, "zero_cond_t": zero_cond_t}
        with init_empty_weights():
            transformer = QwenImageTransformer2DModel.from_config(config)
        if not request.skips("transformer"):  # else left on the meta device (a run by phase reads it later)
            assign_streamed(transformer, transformer_tensors(path, weight_dtype), str(path), path, family=family)
            return_free_heap()

        with init_empty_weights():
            vae = AutoencoderKLQwenImage.from_config(
                AutoencoderKLQwenImage.load_config(config_dir, subfolder="vae", **local))
        assign(vae, vae_state_dict(read_split(Path(ae), request.vae_dtype)), ae, family=family)
        return_free_heap()

        with init_empty_weights():
            qwen = Qwen2_5_VLForConditionalGeneration(
                Qwen2_5_VLConfig.from_pretrained(config_dir, subfolder="text_encoder", **local))
        if not request.skips("text_encoder"):
            qwen_state = text_encoder_state_dict(read_split(Path(text_encoder), weight_dtype))
            # The language-model head is never used for the hidden states; a file without it gets zeros.
            qwen_state.setdefault("lm_head.weight", torch.zeros(qwen.lm_head.weight.shape, dtype=weight_dtype))
            assign(qwen, qwen_state, text_encoder, family=family)

        tokenizer = load_qwen_tokenizer(config_dir / "tokenizer" if model_config else SHIPPED_TOKENIZER)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(config_dir, subfolder="scheduler", **local)
    return transformer_components(transformer, vae, [qwen], [tokenizer], scheduler, family_of(transformer, [qwen]),
                                  vae_view=QwenImageVae)


def transformer_tensors(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The transformer file's (split file's) weights without ComfyUI's prefix, one at a time (an int8 / nf4 base is
    quantized layer by layer as they come); an fp8 file with per-tensor scales is refused before any is read."""
    parts = shards(path)
    keys = [key for part in parts for key in file_keys(part)]
    scaled = [k for k in keys if k.removeprefix(COMFY_PREFIX) == "scaled_fp8"
              or k.endswith((".scale_weight", ".weight_scale"))]
    if scaled:  # the weights would load without their scales
        raise UserError(f"{path}: an fp8 file with per-tensor scales ({scaled[0]}, ...), which cannot be read "
                        "here (as in musubi-tuner); use the bf16 file")
    for part in parts:
        with SafetensorsFile(part) as f:
            for key in f.keys():
                yield key.removeprefix(COMFY_PREFIX), f.read(key, dtype)
