"""Loading SD1.x / SD2.x / SDXL from a diffusers folder or a single original-layout checkpoint, and telling which
of the three it is."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from library.config import UserError
from library.families.family import Components, Family
from library.families.loading import LoadRequest
from library.families.sd.family import SD1, SD2
from library.families.sd.sdxl import SDXL
from library.families.sd.single_file import ARCHITECTURES, load_single_file

logger = logging.getLogger(__name__)

FOLDERS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")


def is_sd_folder(path: Path) -> bool:
    return (path / "unet").is_dir()


def is_sd_file(path: Path) -> bool:
    """A file of the original SD layout; the single-file reader names what any unrecognised file is."""
    return path.is_file()


def _check_diffusers_folder(path: Path) -> None:
    missing = [name for name in FOLDERS if not (path / name).is_dir()]
    if missing:
        raise UserError(f"{path}: not a Stable Diffusion diffusers folder; missing {', '.join(missing)}/")


def _load_diffusers_folder(path: Path, weight_dtype: torch.dtype, vae_dtype: torch.dtype) -> dict[str, Any]:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    _check_diffusers_folder(path)
    try:
        sdxl = {}
        if (path / SDXL.text_encoder_folders[1]).is_dir():  # SDXL is told by its second text encoder
            sdxl = {"text_encoder_2": CLIPTextModelWithProjection.from_pretrained(
                        path, subfolder="text_encoder_2", local_files_only=True, dtype=weight_dtype),
                    "tokenizer_2": CLIPTokenizer.from_pretrained(path, subfolder="tokenizer_2", local_files_only=True)}
        return sdxl | {
            "unet": UNet2DConditionModel.from_pretrained(path, subfolder="unet", local_files_only=True,
                                                         torch_dtype=weight_dtype),
            "vae": AutoencoderKL.from_pretrained(path, subfolder="vae", local_files_only=True, torch_dtype=vae_dtype),
            "text_encoder": CLIPTextModel.from_pretrained(path, subfolder="text_encoder", local_files_only=True,
                                                          dtype=weight_dtype),
            "tokenizer": CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", local_files_only=True),
            "scheduler": DDPMScheduler.from_pretrained(path, subfolder="scheduler", local_files_only=True),
        }
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot load the model: {e}") from None


def load_sd_folder(request: LoadRequest) -> Components:
    return _components(_load_diffusers_folder(request.path, request.weight_dtype, request.vae_dtype), request)


def load_sd_file(request: LoadRequest) -> Components:
    parts = load_single_file(request.path, v2=request.v2, v_parameterization=request.v_parameterization,
                             weight_dtype=request.weight_dtype, vae_dtype=request.vae_dtype,
                             model_config=request.model_config, allow_pickle=request.allow_pickle_checkpoints,
                             architectures=tuple(ARCHITECTURES)).parts
    return _components(parts, request)


def _components(parts: dict[str, Any], request: LoadRequest) -> Components:
    family = _family_of(parts, request.v2)
    noise_scheduler = parts["scheduler"]
    scheduled_v = noise_scheduler.config.get("prediction_type") == "v_prediction"
    if scheduled_v and not request.v_parameterization:
        logger.info("the model's scheduler uses v-prediction; training with v_parameterization")
    return Components(denoiser=parts["unet"], vae=parts["vae"],
                      text_encoders=[parts[name] for name in family.text_encoder_folders],
                      tokenizers=[parts[name] for name in family.tokenizer_folders],
                      noise_scheduler=noise_scheduler, v_prediction=request.v_parameterization or scheduled_v,
                      family=family)


def _family_of(parts: dict[str, Any], v2: bool) -> Family:
    if "text_encoder_2" in parts:
        return SDXL
    # SD2's OpenCLIP encoder: 1024 wide with plain gelu (SD1's CLIP uses quick_gelu).
    text_config = parts["text_encoder"].config
    return SD2 if v2 or text_config.hidden_size == 1024 or text_config.hidden_act == "gelu" else SD1
