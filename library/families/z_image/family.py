"""Z-Image (Tongyi-MAI; base and Turbo): a single-stream transformer over 2x2 patches of FLUX.1's 16-channel latents,
conditioned on the second-to-last hidden states of Qwen3-4B read through its chat template. Trained as
musubi-tuner's zimage_train_network.py trains it: the transformer only (musubi never trains the text encoder), the
model's time input 1 - sigma, its output the negated velocity (musubi's target is x0 - noise), and musubi's
timestep sampling (library.families.shared.musubi_flow).

The loop keeps latents as [B, 16, H/8, W/8]; `denoise` hands the transformer its lists of per-image latents and
per-caption embeddings (padding removed by the mask, as ZImagePipeline does) and negates its output, so the loss
compares a velocity with noise - x0 as for FLUX.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from library.families.family import Components, Tokenizer
from library.families.loading import LoadRequest
from library.families.shared import checks as transformer_checks
from library.families.shared import musubi_flow, qwen3_text
from library.families.shared.diffusers_folder import load_folder, transformer_class
from library.families.shared.sampling import unscaled_latents
from library.families.z_image import lora as z_image_lora

logger = logging.getLogger(__name__)

FOLDERS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
TRANSFORMER_CLASS = "ZImageTransformer2DModel"
DEFAULT_CFG = 4.0  # musubi's sample CFG scale without --l (Z-Image base's official default)


@dataclasses.dataclass(frozen=True)
class ZImage(musubi_flow.MusubiFamily):
    """Z-Image; nothing in the prompts depends on the config."""
    name = "z-image"
    base_model_version = "z_image"  # musubi's ss_base_model_version
    display_name = "Z-Image"
    implementation = "https://github.com/Tongyi-MAI/Z-Image"
    lora_rules = z_image_lora
    default_sampling_scale = DEFAULT_CFG
    refused_options = (
        ("clip_skip", "Z-Image reads Qwen3's second-to-last layer, as musubi-tuner and ZImagePipeline do"),
        ("max_token_length",
         f"prompts are {qwen3_text.MAX_SEQUENCE_LENGTH} Qwen3 tokens, musubi-tuner's fixed length"),
        ("t5xxl_max_token_length", "Z-Image has no T5"),
        ("apply_t5_attn_mask", "Z-Image has no T5; Qwen3's padding is always left out"),
        ("clip_l", "Z-Image has no CLIP-L"), ("t5xxl", "Z-Image has no T5"),
        ("network_train_text_encoder_only", "musubi-tuner trains Z-Image's transformer only"))

    # --- prompts ----------------------------------------------------------------------------------------------
    def tokenizer(self, components: Components, max_token_length: int | None) -> Tokenizer:
        """The caption as ZImagePipeline and musubi give it to Qwen3: a chat-template user turn, thinking enabled."""
        return qwen3_text.chat_tokenizer(components.tokenizers[0], thinking=True)

    def encode_text(self, text_encoders: Sequence[torch.nn.Module], tokens: Mapping[str, torch.Tensor],
                    clip_skip: int | None) -> dict[str, torch.Tensor]:
        """Qwen3's second-to-last hidden states (musubi's get_text_embeds); the mask travels with them."""
        mask = tokens["attention_mask"].bool()
        states = text_encoders[0](input_ids=tokens["input_ids"], attention_mask=mask,
                                  output_hidden_states=True).hidden_states[-2]
        return {"encoder_hidden_states": states, "attention_mask": mask}

    # --- the denoiser ------------------------------------------------------------------------------------------
    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: Mapping[str, torch.Tensor], conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        _, _, height, width = noisy.shape
        transformer_checks.check_latent_size("Z-Image", height, width)
        states = text["encoder_hidden_states"].to(noisy.dtype)
        mask = text["attention_mask"].to(states.device).bool()
        captions = [state[keep] for state, keep in zip(states, mask, strict=True)]
        images = list(noisy.unsqueeze(2).unbind(0))  # [C, 1, H, W] each: one frame
        t = (1 - timesteps.float() / 1000).to(noisy.dtype)  # musubi's (1000 - t) / 1000
        out = denoiser(images, t, captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    # --- sampling ----------------------------------------------------------------------------------------------
    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        from diffusers import ZImagePipeline

        return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoders[0], tokenizer=tokenizers[0],
                              transformer=denoiser)

    def sampling_guidance(self, scale: float, guidance: float | None, positive: Mapping[str, torch.Tensor],
                          width: int, height: int) -> dict[str, Any]:
        """--l (default 4.0, musubi's) above 1 runs CFG with the negative prompt (--n, else the empty one):
        pos + scale * (pos - neg), as musubi and ZImagePipeline compute it; 1 or less samples without it."""
        if guidance is not None:
            logger.warning("sample prompt --g %g: Z-Image has no guidance input; use --l for CFG", guidance)
        return {"guidance_scale": scale if scale > 1 else 0.0}

    def vae_latents(self, latents: torch.Tensor, vae_config: Any, width: int, height: int) -> torch.Tensor:
        return unscaled_latents(latents, vae_config)

    def prompt_embeds(self, positive: Mapping[str, torch.Tensor],
                      negative: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        def embeds(encoded: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
            return [state[mask.bool()] for state, mask in zip(encoded["encoder_hidden_states"],
                                                              encoded["attention_mask"], strict=True)]
        return {"prompt_embeds": embeds(positive), "negative_prompt_embeds": embeds(negative)}


def is_z_image_folder(path: Path) -> bool:
    return transformer_class(path) == TRANSFORMER_CLASS


def load_z_image_folder(request: LoadRequest) -> Components:
    """A diffusers Z-Image folder (Tongyi-MAI/Z-Image or Z-Image-Turbo layout), offline."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen3Model

    return load_folder(request, "Z-Image", {
        "transformer": ZImageTransformer2DModel, "vae": AutoencoderKL, "text_encoder": Qwen3Model,
        "tokenizer": AutoTokenizer, "scheduler": FlowMatchEulerDiscreteScheduler}, lambda *_: ZImage())
