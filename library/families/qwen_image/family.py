"""Qwen-Image (Qwen/Qwen-Image): a double-stream transformer over 2x2 patches of a 16-channel video VAE's latents,
conditioned on the last hidden states of Qwen2.5-VL-7B read through a fixed prompt template. Trained as
musubi-tuner's qwen_image_train_network.py trains it: the transformer only, the model's time input sigma, its raw
output trained against noise - x0 (musubi's call_dit), and musubi's timestep sampling
(library.families.shared.musubi_flow).

The VAE works on [B, C, T, H, W] with per-channel mean / std normalisation; `QwenImageVae` gives the loop and the
caches the 4-D, already normalised view every other family has (one frame, scaling factor 1), so nothing outside
this module knows the difference. `denoise` packs the latents into 2x2 patches with their img_shapes, as musubi's
call_dit and QwenImagePipeline do, and unpacks the prediction.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from library.config import UserError
from library.families.family import Components, Tokenizer
from library.families.loading import LoadRequest
from library.families.qwen_image import lora as qwen_image_lora
from library.families.shared import checks as transformer_checks
from library.families.shared import musubi_flow
from library.families.shared.diffusers_folder import load_folder, transformer_class
from library.families.shared.mode_posterior import ModePosterior

logger = logging.getLogger(__name__)

FOLDERS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
TRANSFORMER_CLASS = "QwenImageTransformer2DModel"
# musubi's get_qwen_prompt_embeds and QwenImagePipeline: the caption inside this template; the template's first 34
# tokens (the system turn and "<|im_start|>user\n") are dropped from the hidden states.
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
DROP_TOKENS = 34
MAX_TOKENS = 1024  # musubi's tokenizer_max_length: tokens kept after the dropped ones
DEFAULT_CFG = 4.0  # musubi's sample cfg_scale without --l (true CFG)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, 4C]: musubi's pack_latents (and QwenImagePipeline's _pack_latents)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, H/2 * W/2, 4C] -> [B, C, H, W] (latent height and width): musubi's unpack_latents without the frame."""
    b, _, channels = tokens.shape
    x = tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, height, width)


class QwenImageVae(nn.Module):
    """AutoencoderKLQwenImage seen as a 4-D image VAE whose latents are already in the transformer's range:
    encode gives (z - latents_mean) / latents_std per channel of the one frame (musubi's encode_pixels_to_latents),
    decode undoes it. `config` reads as the VAE's with scaling_factor 1 and no shift."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        from diffusers.configuration_utils import FrozenDict

        self.config = FrozenDict({**vae.config, "scaling_factor": 1.0})

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.vae.config.z_dim, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean).view(shape).to(like.device, like.dtype)
        std = torch.tensor(self.vae.config.latents_std).view(shape).to(like.device, like.dtype)
        return mean, std

    def encode(self, pixels: torch.Tensor) -> SimpleNamespace:
        mode = self.vae.encode(pixels.unsqueeze(2)).latent_dist.mode().squeeze(2)
        mean, std = self._stats(mode)
        return SimpleNamespace(latent_dist=ModePosterior((mode - mean) / std))

    def decode(self, latents: torch.Tensor, return_dict: bool = False) -> tuple[torch.Tensor]:
        mean, std = self._stats(latents)
        pixels = self.vae.decode((latents * std + mean).unsqueeze(2), return_dict=False)[0]
        return (pixels.squeeze(2),)


@dataclasses.dataclass(frozen=True)
class QwenImage(musubi_flow.MusubiFamily):
    """Qwen-Image; nothing in the prompts depends on the config. `last_block` is the transformer's last block
    index (its text-stream-only layers get no LoRA; library.families.qwen_image.lora)."""
    last_block: int | None = None
    name = "qwen-image"
    base_model_version = "qwen_image"  # musubi's ss_base_model_version (architecture_full_name)
    display_name = "Qwen-Image"
    implementation = "https://github.com/QwenLM/Qwen-Image"
    default_sampling_scale = DEFAULT_CFG
    refused_options = (
        ("clip_skip", "Qwen-Image reads Qwen2.5-VL's last hidden states, as musubi-tuner and QwenImagePipeline do"),
        ("max_token_length", f"prompts are up to {MAX_TOKENS} Qwen2.5-VL tokens after the template, musubi's "
                             "fixed length"),
        ("t5xxl_max_token_length", "Qwen-Image has no T5"),
        ("apply_t5_attn_mask", "Qwen-Image has no T5; Qwen2.5-VL's padding is always masked"),
        ("clip_l", "Qwen-Image has no CLIP-L"), ("t5xxl", "Qwen-Image has no T5"),
        ("vae", "Qwen-Image's VAE comes with the model (its vae/ folder, or ae for the separate files)"),
        ("network_train_text_encoder_only", "musubi-tuner trains Qwen-Image's transformer only"))

    # --- prompts ----------------------------------------------------------------------------------------------
    def tokenizer(self, components: Components, max_token_length: int | None) -> Tokenizer:
        tokenizer = components.tokenizers[0]

        def tokens(caption: str) -> dict[str, torch.Tensor]:
            # Padded to the longest possible prompt so that captions stack; the padding is masked out later.
            encoded = tokenizer(PROMPT_TEMPLATE.format(caption), padding="max_length", padding_side="right",
                                max_length=MAX_TOKENS + DROP_TOKENS, truncation=True, return_tensors="pt")
            return {"input_ids": encoded.input_ids[0], "attention_mask": encoded.attention_mask[0]}
        return tokens

    def encode_text(self, text_encoders: Sequence[torch.nn.Module], tokens: Mapping[str, torch.Tensor],
                    clip_skip: int | None) -> dict[str, torch.Tensor]:
        """Qwen2.5-VL's last hidden states without the template's first 34 tokens (musubi's
        get_qwen_prompt_embeds); the mask travels with them. The language model is run without its head."""
        mask = tokens["attention_mask"]
        states = text_encoders[0].model(input_ids=tokens["input_ids"], attention_mask=mask,
                                         output_hidden_states=True).hidden_states[-1]
        return {"encoder_hidden_states": states[:, DROP_TOKENS:], "attention_mask": mask[:, DROP_TOKENS:].bool()}

    # --- the denoiser ------------------------------------------------------------------------------------------
    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: Mapping[str, torch.Tensor], conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        batch, _, height, width = noisy.shape
        transformer_checks.check_latent_size("Qwen-Image", height, width)
        states, mask = _trimmed(text)
        prediction = denoiser(hidden_states=pack(noisy), encoder_hidden_states=states.to(noisy.dtype),
                              encoder_hidden_states_mask=mask, timestep=(timesteps.float() / 1000).to(noisy.dtype),
                              img_shapes=[[(1, height // 2, width // 2)]] * batch, return_dict=False)[0]
        return unpack(prediction, height, width)

    def block_swap_plan(self, denoiser: torch.nn.Module, blocks_to_swap: int) -> list[tuple[Any, int]]:
        """kohya's schedule (library.memory.offload) brings block k - p back only after a later block's backward,
        so it swaps at most all blocks but two (Qwen-Image: 58 of 60; musubi's own offloader allows 59)."""
        blocks = denoiser.transformer_blocks
        if blocks_to_swap > len(blocks) - 2:
            raise UserError(f"blocks_to_swap {blocks_to_swap}: Qwen-Image swaps at most {len(blocks) - 2} of its "
                            f"{len(blocks)} blocks here")
        return [(blocks, blocks_to_swap)]

    # --- LoRA files ---------------------------------------------------------------------------------------------
    def denoiser_lora_targets(self, denoiser: torch.nn.Module, rank: int, alpha: float,
                              net: Any) -> tuple[list[str], dict[str, tuple[int, float]]]:
        try:
            return qwen_image_lora.targets(denoiser, net), {}
        except ValueError as e:
            raise UserError(str(e)) from None

    def export_lora_keys(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return qwen_image_lora.to_file(state_dict)

    def import_lora_keys(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return qwen_image_lora.from_file(state_dict, self.last_block)

    # --- sampling ----------------------------------------------------------------------------------------------
    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        from diffusers import QwenImagePipeline

        return QwenImagePipeline(scheduler=scheduler, vae=vae.vae, text_encoder=text_encoders[0],
                                 tokenizer=tokenizers[0], transformer=denoiser)

    def sampling_guidance(self, scale: float, guidance: float | None, positive: Mapping[str, torch.Tensor],
                          width: int, height: int) -> dict[str, Any]:
        """--l (default 4.0, musubi's) is the true CFG scale with the negative prompt (--n, else the empty one):
        neg + scale * (pos - neg), rescaled to the positive prediction's norm, as musubi and QwenImagePipeline
        compute it; 1 or less samples without it."""
        if guidance is not None:
            logger.warning("sample prompt --g %g: Qwen-Image has no guidance input; use --l for CFG", guidance)
        return {"true_cfg_scale": scale}

    def vae_latents(self, latents: torch.Tensor, vae_config: Any, width: int, height: int) -> torch.Tensor:
        # the pipeline's packed latents -> QwenImageVae's normalised 4-D latents
        return unpack(latents, 2 * (height // 16), 2 * (width // 16))

    def prompt_embeds(self, positive: Mapping[str, torch.Tensor],
                      negative: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        (states, mask), (neg_states, neg_mask) = _trimmed(positive), _trimmed(negative)
        return {"prompt_embeds": states, "prompt_embeds_mask": mask, "negative_prompt_embeds": neg_states,
                "negative_prompt_embeds_mask": neg_mask}


def _trimmed(text: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoded prompts cut to the longest unpadded one (musubi pads its per-caption embeddings to the batch's
    longest and masks the rest)."""
    mask = text["attention_mask"].bool()
    length = int(mask.sum(dim=1).max())
    return text["encoder_hidden_states"][:, :length], mask[:, :length].to(text["encoder_hidden_states"].device)


def is_qwen_image_folder(path: Path) -> bool:
    return transformer_class(path) == TRANSFORMER_CLASS


def load_qwen_image_folder(request: LoadRequest) -> Components:
    """A diffusers Qwen-Image folder (Qwen/Qwen-Image layout), offline."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    return load_folder(request, "Qwen-Image", {
        "transformer": QwenImageTransformer2DModel, "vae": AutoencoderKLQwenImage,
        "text_encoder": Qwen2_5_VLForConditionalGeneration, "tokenizer": AutoTokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler}, family_of, vae_view=QwenImageVae)


def family_of(transformer: Any, text_encoders: Sequence[Any]) -> QwenImage:
    """The family of a loaded Qwen-Image transformer: its last block's index."""
    return QwenImage(last_block=transformer.config.num_layers - 1)
