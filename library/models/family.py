"""Model families (SD1.x, SD2.x, SDXL): loading their components and encoding prompts.

A family is a small description (`Family`), not a subclass of the trainer: what differs between families is data
here, plus the two prompt encoders (CLIP hidden states; SDXL's two encoders with pooled output and size
conditioning).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from library.config import UserError
from library.models.single_file import load_single_file

logger = logging.getLogger(__name__)

SD_COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")


@dataclass(frozen=True)
class Family:
    """What differs between model families."""
    name: str
    base_model_version: str  # kohya's ss_base_model_version (v-prediction adds "_v" for SD2)
    text_encoders: tuple[str, ...]  # diffusers subfolders, in conditioning order
    tokenizers: tuple[str, ...]
    lora_text_prefixes: tuple[str, ...]  # kohya key prefix of each text encoder's LoRA
    pipeline: str  # diffusers pipeline class that samples it
    size_conditioning: bool  # the UNet also takes the pooled text embedding and per-image size ids


SD1 = Family("sd1", "sd_v1", ("text_encoder",), ("tokenizer",), ("lora_te",), "StableDiffusionPipeline", False)
SD2 = dataclasses.replace(SD1, name="sd2", base_model_version="sd_v2")
SDXL = Family("sdxl", "sdxl_base_v1-0", ("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2"),
              ("lora_te1", "lora_te2"), "StableDiffusionXLPipeline", True)
FAMILIES = {family.name: family for family in (SD1, SD2, SDXL)}


@dataclass
class Components:
    unet: Any
    vae: Any
    text_encoder: Any
    tokenizer: Any
    noise_scheduler: Any
    v_prediction: bool
    family: Family
    text_encoder_2: Any = None  # SDXL's second text encoder (CLIP with projection) and its tokenizer
    tokenizer_2: Any = None

    @property
    def base_model_version(self) -> str:
        return self.family.base_model_version

    @property
    def sdxl(self) -> bool:
        return self.family.size_conditioning

    @property
    def text_encoders(self) -> list[Any]:
        return [self.text_encoder] + ([self.text_encoder_2] if self.sdxl else [])


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
        if (path / SDXL.text_encoders[1]).is_dir():  # SDXL is told by its second text encoder
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


def load_sd_components(model_path: str | Path, v2: bool = False, v_parameterization: bool = False,
                       weight_dtype: torch.dtype = torch.float32,
                       vae_dtype: torch.dtype = torch.float32, model_config: str | Path | None = None,
                       allow_pickle_checkpoints: bool = False) -> Components:
    """Load UNet, VAE, CLIP text encoder, tokenizer and noise schedule from a local diffusers folder or a
    single-file checkpoint (see library.models.single_file; `model_config` and `allow_pickle_checkpoints` apply there).

    Weights are loaded straight into their training dtype (casting afterwards makes diffusers warn and doubles
    the peak memory of the load).
    """
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    path = Path(model_path)
    if path.is_file():
        parts = load_single_file(path, v2=v2, v_parameterization=v_parameterization, weight_dtype=weight_dtype,
                                 vae_dtype=vae_dtype, model_config=model_config,
                                 allow_pickle=allow_pickle_checkpoints, architectures=("sd1", "sd2", "sdxl")).parts
    else:
        parts = _load_diffusers_folder(path, weight_dtype, vae_dtype)
    unet, vae, text_encoder, tokenizer, noise_scheduler = (parts[name] for name in SD_COMPONENTS)

    scheduled_v = noise_scheduler.config.get("prediction_type") == "v_prediction"
    v_prediction = v_parameterization or scheduled_v
    if scheduled_v and not v_parameterization:
        logger.info("the model's scheduler uses v-prediction; training with v_parameterization")
    if "text_encoder_2" in parts:
        return Components(unet, vae, text_encoder, tokenizer, noise_scheduler, v_prediction, SDXL,
                          parts["text_encoder_2"], parts["tokenizer_2"])
    # SD2's OpenCLIP encoder: 1024 wide with plain gelu (SD1's CLIP uses quick_gelu).
    sd2 = v2 or text_encoder.config.hidden_size == 1024 or text_encoder.config.hidden_act == "gelu"
    return Components(unet, vae, text_encoder, tokenizer, noise_scheduler, v_prediction, SD2 if sd2 else SD1)


def tokenize(tokenizer: Any, caption: str, max_token_length: int | None = None) -> torch.Tensor:
    """Token ids as the text encoder sees them: (77,) for the model's own length, or, with kohya's
    max_token_length 150 / 225, (2 or 3, 77): the caption cut into 75-token chunks, each wrapped in BOS ... EOS."""
    window = tokenizer.model_max_length  # 77
    length = window if max_token_length is None or max_token_length + 2 <= window else max_token_length + 2
    ids = tokenizer(caption, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids[0]
    if length == window:
        return ids
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    chunks = []
    for start in range(1, length - 1, window - 2):
        chunk = torch.cat([ids[:1], ids[start:start + window - 2], ids[-1:]])
        if pad != eos:
            # SD2's tokenizer pads with a separate token: a chunk cut mid-caption must still end in EOS, and an
            # empty chunk reads <BOS> <EOS> <PAD> ..., as kohya builds them.
            if chunk[-2] not in (eos, pad):
                chunk[-1] = eos
            if chunk[1] == pad:
                chunk[1] = eos
        chunks.append(chunk)
    return torch.stack(chunks)


def encode_prompt(text_encoder: Any, input_ids: torch.Tensor, clip_skip: int | None = None) -> torch.Tensor:
    """The CLIP text encoder's hidden states for SD1.x / SD2.x conditioning.

    `clip_skip` n takes the output of the n-th layer from the end, through the final layer norm (kohya's
    definition: 1 is the last layer, 2 the penultimate). Chunked ids (batch, chunks, 77) are encoded chunk by
    chunk and joined as kohya joins them: the first BOS, each chunk's 75 inner states, the last EOS.
    """
    chunked = input_ids.dim() == 3
    flat = input_ids.reshape(-1, input_ids.shape[-1])
    if clip_skip is None or clip_skip <= 1:
        states = text_encoder(flat, return_dict=False)[0]
    else:
        hidden = text_encoder(flat, output_hidden_states=True, return_dict=True).hidden_states[-clip_skip]
        # transformers 5 flattened CLIPTextModel (no `.text_model` level); older versions nest it.
        final_norm = getattr(text_encoder, "text_model", text_encoder).final_layer_norm
        states = final_norm(hidden)
    return _join_chunks(states, input_ids) if chunked else states


def _join_chunks(states: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """(batch * chunks, 77, D) states of chunked ids (batch, chunks, 77) -> (batch, chunks * 75 + 2, D)."""
    window = input_ids.shape[-1]
    states = states.reshape(input_ids.shape[0], -1, states.shape[-1])
    parts = [states[:, :1]]
    parts += [states[:, start:start + window - 2] for start in range(1, states.shape[1], window)]
    parts.append(states[:, -1:])
    return torch.cat(parts, dim=1)


def tokenize_sdxl(tokenizer: Any, tokenizer_2: Any, caption: str,
                  max_token_length: int | None = None) -> dict[str, torch.Tensor]:
    return {"input_ids": tokenize(tokenizer, caption, max_token_length),
            "input_ids_2": tokenize(tokenizer_2, caption, max_token_length)}


def encode_sdxl(text_encoder: Any, text_encoder_2: Any, input_ids: torch.Tensor,
                input_ids_2: torch.Tensor) -> dict[str, torch.Tensor]:
    """SDXL's conditioning: both encoders' penultimate hidden states (without the final layer norm),
    concatenated, and the second encoder's projected pooled output (of the first chunk for long captions)."""
    states = []
    for encoder, ids in ((text_encoder, input_ids), (text_encoder_2, input_ids_2)):
        out = encoder(ids.reshape(-1, ids.shape[-1]), output_hidden_states=True, return_dict=True)
        hidden = out.hidden_states[-2]
        states.append(_join_chunks(hidden, ids) if ids.dim() == 3 else hidden)
    pooled = out.text_embeds.reshape(input_ids_2.shape[0], -1, out.text_embeds.shape[-1])[:, 0]
    return {"encoder_hidden_states": torch.cat(states, dim=-1), "pooled": pooled}


def sdxl_time_ids(batch: dict[str, Any]) -> torch.Tensor:
    """SDXL's size conditioning per image: original (h, w), crop top-left (top, left), target (h, w)."""
    return torch.cat([batch["original_size"], batch["crop_top_left"], batch["target_size"]], dim=1)


def zero_terminal_snr(noise_scheduler: Any) -> Any:
    """The schedule rescaled so the last timestep is pure noise (Lin et al. 2023, kohya's zero_terminal_snr).

    The config carries `rescale_betas_zero_snr`, so samplers built from it rescale too. For training, the last
    sqrt(alpha_cumprod) is kept a hair above zero: at exactly zero the SNR is 0 and Min-SNR weights divide by it.
    """
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler.from_config(noise_scheduler.config, rescale_betas_zero_snr=True)
    scheduler.alphas_cumprod[-1] = 4.8973451890853435e-08 ** 2
    return scheduler


def caption_tokenizer(components: Components, max_token_length: int | None) -> Callable[[str], Any]:
    """caption -> token ids for this model: a tensor, or for SDXL a dict with both tokenizers' ids."""
    if components.sdxl:
        return functools.partial(tokenize_sdxl, components.tokenizer, components.tokenizer_2,
                                 max_token_length=max_token_length)
    return functools.partial(tokenize, components.tokenizer, max_token_length=max_token_length)


def encode_tokens(text_encoder: Any, text_encoder_2: Any, tokens: Any, clip_skip: int | None) -> Any:
    """Token ids from `caption_tokenizer` (batched) -> hidden states, or for SDXL the dict of encode_sdxl."""
    if isinstance(tokens, dict):
        return encode_sdxl(text_encoder, text_encoder_2, tokens["input_ids"], tokens["input_ids_2"])
    return encode_prompt(text_encoder, tokens, clip_skip)
