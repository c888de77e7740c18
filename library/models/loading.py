"""Loading a base model from a local diffusers folder or a single-file checkpoint, and telling its family."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from library.config import UserError
from library.core.memory import return_free_heap
from library.models.chroma import is_bfl_chroma, is_chroma_folder, load_chroma_files, load_chroma_folder
from library.models.family import Components, Family
from library.models.flux import is_flux_folder, load_flux_folder
from library.models.flux_files import is_bfl_flux, load_flux_files
from library.models.qwen_image import is_qwen_image_folder, load_qwen_image_folder
from library.models.qwen_image_files import is_qwen_image_file, load_qwen_image_files
from library.models.sd import SD1, SD2
from library.models.sd3 import is_sd3_folder, load_sd3_folder
from library.models.sd3_files import is_sd3_file, load_sd3_files
from library.models.sdxl import SDXL
from library.models.single_file import file_tokenizer, load_single_file
from library.models.z_image import is_z_image_folder, load_z_image_folder
from library.models.z_image_files import is_z_image_file, load_z_image_files

logger = logging.getLogger(__name__)

FAMILIES: dict[str, Family] = {family.name: family for family in (SD1, SD2, SDXL)}
SD_COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")


def _check_diffusers_folder(path: Path) -> None:
    missing = [name for name in SD_COMPONENTS if not (path / name).is_dir()]
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


def load_components(model_path: str | Path, v2: bool = False, v_parameterization: bool = False,
                    weight_dtype: torch.dtype = torch.float32,
                    vae_dtype: torch.dtype = torch.float32, model_config: str | Path | None = None,
                    allow_pickle_checkpoints: bool = False, clip_l: str | None = None, t5xxl: str | None = None,
                    ae: str | None = None, text_encoder: str | None = None,
                    clip_g: str | None = None) -> Components:
    """Load the denoiser, VAE, text encoders, tokenizers and noise schedule from a local diffusers folder (SD,
    FLUX.1 or Chroma, told by its transformer/ folder), a single-file checkpoint (see library.models.single_file;
    `model_config` and `allow_pickle_checkpoints` apply there), a BFL FLUX.1 transformer file with the `clip_l`,
    `t5xxl` and `ae` files (library.models.flux_files), a BFL Chroma transformer file with `t5xxl` and `ae`
    (library.models.chroma), or a Z-Image transformer file with `text_encoder` and `ae`
    (library.models.z_image_files) or a Qwen-Image one with `text_encoder` and `ae`
    (library.models.qwen_image_files), and tell the family.

    Weights are loaded straight into their training dtype (casting afterwards makes diffusers warn and doubles
    the peak memory of the load), and the heap pages the load freed go back to the system.
    """
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        path = Path(model_path)
        config = None if model_config is None else str(model_config)
        if path.is_file() and is_sd3_file(path):
            return load_sd3_files(path, clip_l, clip_g, t5xxl, config, weight_dtype, vae_dtype)
        if path.is_file() and is_bfl_chroma(path):
            return load_chroma_files(path, t5xxl, ae, config, weight_dtype, vae_dtype)
        if path.is_file() and is_z_image_file(path):
            return load_z_image_files(path, text_encoder, ae, config, weight_dtype, vae_dtype)
        if path.is_file() and is_qwen_image_file(path):
            return load_qwen_image_files(path, text_encoder, ae, config, weight_dtype, vae_dtype)
        if text_encoder is not None:
            raise UserError(f"text_encoder: only for a Z-Image transformer file (or a Qwen-Image one; musubi-tuner's "
                            f"separate files); {path} is not one (a folder brings its own text encoder)")
        if path.is_file() and is_bfl_flux(path):
            return load_flux_files(path, clip_l, t5xxl, ae, None if model_config is None else str(model_config),
                                   weight_dtype, vae_dtype)
        if path.is_file():
            parts = load_single_file(path, v2=v2, v_parameterization=v_parameterization, weight_dtype=weight_dtype,
                                     vae_dtype=vae_dtype, model_config=model_config,
                                     allow_pickle=allow_pickle_checkpoints, architectures=tuple(FAMILIES)).parts
        elif is_z_image_folder(path):
            return load_z_image_folder(path, weight_dtype, vae_dtype)
        elif is_qwen_image_folder(path):
            return load_qwen_image_folder(path, weight_dtype, vae_dtype)
        elif is_chroma_folder(path):
            return load_chroma_folder(path, weight_dtype, vae_dtype)
        elif is_sd3_folder(path):
            return load_sd3_folder(path, weight_dtype, vae_dtype)
        elif is_flux_folder(path):
            return load_flux_folder(path, weight_dtype, vae_dtype)
        else:
            parts = _load_diffusers_folder(path, weight_dtype, vae_dtype)
        family = _family_of(parts, v2)
        noise_scheduler = parts["scheduler"]
        scheduled_v = noise_scheduler.config.get("prediction_type") == "v_prediction"
        if scheduled_v and not v_parameterization:
            logger.info("the model's scheduler uses v-prediction; training with v_parameterization")
        return Components(denoiser=parts["unet"], vae=parts["vae"],
                          text_encoders=[parts[name] for name in family.text_encoder_folders],
                          tokenizers=[parts[name] for name in family.tokenizer_folders],
                          noise_scheduler=noise_scheduler, v_prediction=v_parameterization or scheduled_v,
                          family=family)
    finally:
        return_free_heap()  # the read and converted copies of the weights: 0.4-1 GiB for SDXL


def _family_of(parts: dict[str, Any], v2: bool) -> Family:
    if "text_encoder_2" in parts:
        return SDXL
    # SD2's OpenCLIP encoder: 1024 wide with plain gelu (SD1's CLIP uses quick_gelu).
    text_config = parts["text_encoder"].config
    return SD2 if v2 or text_config.hidden_size == 1024 or text_config.hidden_act == "gelu" else SD1


def caption_tokenizer(model: str | Path | None, model_config: str | Path | None = None) -> Any:
    """The model's (first) CLIP tokenizer, loaded without the model (for --dataset_check): its tokenizer/ folder,
    or for a single .safetensors file the shipped (or model_config) tokenizer of the architecture its keys show.
    None when neither can be had."""
    if model is None:
        return None
    try:
        from transformers import CLIPTokenizer

        if Path(model, "tokenizer").is_dir():
            tokenizer = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer", local_files_only=True)
        elif Path(model).is_file() and Path(model).suffix.lower() == ".safetensors":
            tokenizer = file_tokenizer(Path(model), model_config)
        else:
            return None
    except Exception as e:  # noqa: BLE001 - the report still works without token counts
        logger.info("no tokenizer for the dataset check (%s); captions are not tokenized", e)
        return None
    # transformers 5 returns an empty tokenizer instead of failing when the vocabulary files are missing.
    return tokenizer if len(tokenizer) > 256 and tokenizer.model_max_length < 100_000 else None
