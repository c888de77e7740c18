"""Model families: loading components from a local diffusers folder and encoding prompts.

Only the SD1.x / SD2.x layout (one CLIP text encoder) lives here so far; a family is a small description, not a
subclass of the trainer.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from library.config import UserError

logger = logging.getLogger(__name__)

SD_COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")


@dataclass
class Components:
    unet: Any
    vae: Any
    text_encoder: Any
    tokenizer: Any
    noise_scheduler: Any
    v_prediction: bool
    base_model_version: str  # kohya's ss_base_model_version


def _check_diffusers_folder(path: Path) -> None:
    if path.is_file():
        raise UserError(f"{path}: single-file checkpoints are not supported yet; give a diffusers model folder "
                        "(StableDiffusionPipeline layout with unet/, vae/, text_encoder/, tokenizer/, scheduler/)")
    missing = [name for name in SD_COMPONENTS if not (path / name).is_dir()]
    if missing:
        raise UserError(f"{path}: not a Stable Diffusion diffusers folder; missing {', '.join(missing)}/")


def load_sd_components(model_path: str | Path, v2: bool = False, v_parameterization: bool = False,
                       weight_dtype: torch.dtype = torch.float32,
                       vae_dtype: torch.dtype = torch.float32) -> Components:
    """Load UNet, VAE, CLIP text encoder, tokenizer and noise schedule from a local diffusers folder.

    Weights are loaded straight into their training dtype (casting afterwards makes diffusers warn and doubles
    the peak memory of the load).
    """
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    path = Path(model_path)
    _check_diffusers_folder(path)
    try:
        unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", local_files_only=True,
                                                    torch_dtype=weight_dtype)
        vae = AutoencoderKL.from_pretrained(path, subfolder="vae", local_files_only=True, torch_dtype=vae_dtype)
        text_encoder = CLIPTextModel.from_pretrained(path, subfolder="text_encoder", local_files_only=True,
                                                     dtype=weight_dtype)
        tokenizer = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", local_files_only=True)
        noise_scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler", local_files_only=True)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot load the model: {e}") from None

    scheduled_v = noise_scheduler.config.get("prediction_type") == "v_prediction"
    v_prediction = v_parameterization or scheduled_v
    if scheduled_v and not v_parameterization:
        logger.info("the model's scheduler uses v-prediction; training with v_parameterization")
    sd2 = v2 or text_encoder.config.hidden_size == 1024
    return Components(unet, vae, text_encoder, tokenizer, noise_scheduler, v_prediction,
                      "sd_v2" if sd2 else "sd_v1")


def tokenize(tokenizer: Any, caption: str) -> torch.Tensor:
    """Token ids padded to the tokenizer's length (77 for CLIP), truncated as the original models were trained."""
    return tokenizer(caption, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids[0]


def encode_prompt(text_encoder: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Last hidden state of the CLIP text encoder (SD1.x / SD2.x conditioning)."""
    return text_encoder(input_ids, return_dict=False)[0]
