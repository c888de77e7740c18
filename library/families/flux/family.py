"""FLUX.1 (dev and schnell; Kontext [dev] in library.families.flux.kontext): CLIP-L pooled output and T5 hidden
states condition a rectified-flow transformer that sees the 16-channel latents packed 2x2 into tokens, with image ids
for its rotary positions; dev also takes a guidance input. Trained with the flow-matching objective
(library.families.flow_matching), as kohya's flux_train_network.py does. Which FLUX.1 a folder or file holds is told
in library.families.flux.variants.

The loop keeps latents unpacked ([B, 16, H/8, W/8]): packing happens around the transformer call in `denoise`,
so masks, losses and caches see the same shapes as for SD.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from library.config import UserError
from library.config.network_args import NetworkArgs
from library.families.family import Components, Family, Tokenizer
from library.families.flow_matching import FlowMatchingObjective, FlowSettings, unsupported
from library.families.flux import lora as flux_lora
from library.families.settings import value_of
from library.families.shared import checks as transformer_checks
from library.families.shared.clip_text import tokenize
from library.families.shared.diffusers_folder import transformer_class
from library.families.shared.sampling import flow_euler_scheduler, pooled_prompt_embeds, unscaled_latents

logger = logging.getLogger(__name__)

FOLDERS = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")
TRANSFORMER_CLASS = "FluxTransformer2DModel"
GUIDANCE_KEY = "time_text_embed.guidance_embedder."  # present in dev's weights, absent in schnell's


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), C*4]: each 2x2 patch one token, channels first then the patch row and
    column (kohya's "b c (h ph) (w pw) -> b (h w) (c ph pw)", diffusers' _pack_latents)."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of pack_latents for an unpacked latent size (height, width)."""
    b, _, packed = tokens.shape
    c = packed // 4
    patches = tokens.reshape(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, c, height, width)


def image_ids(height: int, width: int, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[(H/2)(W/2), 3] positions of the packed tokens: axis 0 zero, axis 1 the row, axis 2 the column."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] += torch.arange(height // 2)[:, None]
    ids[..., 2] += torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


def transformer_inputs(noisy: torch.Tensor, timesteps: torch.Tensor, states: torch.Tensor) -> dict[str, Any]:
    """What every call of a FLUX.1-architecture transformer (FLUX.1's, Chroma's) takes: the packed latents, the text
    states, the timestep as a fraction, the image and text tokens' positions."""
    _, _, height, width = noisy.shape
    dtype, device = noisy.dtype, noisy.device
    return {"hidden_states": pack_latents(noisy), "encoder_hidden_states": states,
            "timestep": (timesteps.float() / 1000).to(dtype), "img_ids": image_ids(height, width, device, dtype),
            "txt_ids": torch.zeros(states.shape[1], 3, device=device, dtype=dtype), "return_dict": False}


def joint_attention_mask(text_mask: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, text + image tokens] for latents of (height, width): the text tokens come first in the joint attention,
    as boolean `text_mask` says; image tokens are never masked."""
    image = torch.ones(text_mask.shape[0], (height // 2) * (width // 2), dtype=torch.bool, device=text_mask.device)
    return torch.cat([text_mask, image], dim=1)


@dataclasses.dataclass(frozen=True)
class FluxSettings(FlowSettings):
    """What the families of FLUX.1's architecture read from a run, besides their objective's options."""
    sizes: transformer_checks.ImageSizes
    clip_skip: int | None
    max_token_length: int | None
    model_type: str | None
    network_args: NetworkArgs
    network_train_unet_only: bool
    t5xxl_max_token_length: int | None
    apply_t5_attn_mask: bool
    guidance_scale: float


class FluxArchitecture(Family):
    """What the families of FLUX.1's architecture share, as kohya's flux_train_network.py trains them (FLUX.1, and
    Chroma with --model_type chroma): its flow-matching objective, kohya's FLUX LoRA keys (lora_flux) and ss_*
    fields (told apart by ss_model_type), Euler sampling and the pipelines' packed latents. A subclass names its
    `display_name` (in messages) and `model_type` (kohya's)."""
    display_name = "FLUX"
    model_type = "flux"
    default_sampling_scale = 1.0  # kohya's: no (true) CFG unless a prompt asks with --l
    settings_type = FluxSettings

    def objective(self, components: Components, settings: FluxSettings,
                  device: torch.device) -> FlowMatchingObjective:
        problems = unsupported(settings.user_set, self.display_name)
        if problems:
            raise UserError(problems)
        return FlowMatchingObjective(settings.flow, settings.noise, settings.loss)

    def denoiser_lora_targets(self, denoiser: torch.nn.Module, rank: int, alpha: float,
                              net: Any) -> tuple[list[str], dict[str, tuple[int, float]]]:
        """kohya's lora_flux targets; in Chroma's blocks those are the attention and MLP layers (8 per double
        block, linear1 and linear2 per single block): the modulation layers are not there."""
        try:
            return flux_lora.targets(denoiser, rank, alpha, net)
        except ValueError as e:
            raise UserError(str(e).replace("FLUX", self.display_name)) from None

    def export_lora_keys(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return flux_lora.to_kohya(state_dict)

    def import_lora_keys(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return flux_lora.from_kohya(state_dict)

    def metadata_fields(self, settings: FluxSettings) -> dict[str, Any]:
        """The ss_* fields kohya's FLUX trainer writes."""
        return {"ss_model_type": self.model_type, "ss_apply_t5_attn_mask": settings.apply_t5_attn_mask,
                **{f"ss_{name}": value_of(settings, name) for name in (
                    "weighting_scheme", "logit_mean", "logit_std", "mode_scale", "guidance_scale",
                    "timestep_sampling", "sigmoid_scale", "model_prediction_type", "discrete_flow_shift")}}

    def sampling_scheduler(self, scheduler_config: Mapping[str, Any]) -> Any:
        """Euler on the flow (kohya's FLUX sampler; sample_sampler / --ss do not apply), with the model's
        resolution-dependent shift, which is kohya's get_schedule."""
        return flow_euler_scheduler(scheduler_config)

    def vae_latents(self, latents: torch.Tensor, vae_config: Any, width: int, height: int) -> torch.Tensor:
        # FluxPipeline's and ChromaPipeline's latent side: 2 * (side // (2 * VAE factor)); FLUX's VAE is 8x, a tiny
        # one may be 4x.
        factor = 2 * 2 ** (len(vae_config.block_out_channels) - 1)
        return unscaled_latents(unpack_latents(latents, 2 * (height // factor), 2 * (width // factor)), vae_config)


@dataclasses.dataclass(frozen=True)
class Flux(FluxArchitecture):
    """FLUX.1 dev (guidance input) or schnell; the prompt settings come from the config (`configured`)."""
    schnell: bool = False
    t5_max_length: int | None = None  # None: kohya's default, 256 for schnell and 512 for dev
    apply_t5_attn_mask: bool = False
    guidance_scale: float = 3.5
    train_t5xxl: bool = False  # kohya's network_args train_t5xxl: T5 gets LoRA when the text encoders train

    text_encoder_folders = ("text_encoder", "text_encoder_2")
    tokenizer_folders = ("tokenizer", "tokenizer_2")
    lora_text_prefixes = ("lora_te1", "lora_te3")  # CLIP-L, T5 (kohya's names)

    @property
    def name(self) -> str:  # type: ignore[override]
        return "flux1-schnell" if self.schnell else "flux1-dev"

    @property
    def base_model_version(self) -> str:  # type: ignore[override]
        return "flux1"

    def configured(self, settings: FluxSettings) -> Flux:
        for name, why in (("clip_skip", "kohya's FLUX trainer uses CLIP-L's pooled output only"),
                          ("max_token_length", "CLIP-L reads 77 tokens; the T5 length is t5xxl_max_token_length")):
            if getattr(settings, name):  # kohya's FLUX trainer accepts both and uses neither
                logger.warning("%s has no effect for FLUX, as in kohya's FLUX trainer: %s", name, why)
        problems = []
        if settings.model_type == "chroma":
            problems.append("model_type chroma: the weights are FLUX.1's (they have its modulation layers, which "
                            "Chroma's approximator replaces); set model_type = \"flux\" or leave it out")
        train_t5xxl = transformer_checks.raise_kohya_t5_problems(problems, settings, "FLUX")
        return dataclasses.replace(self, t5_max_length=settings.t5xxl_max_token_length,
                                   apply_t5_attn_mask=settings.apply_t5_attn_mask,
                                   guidance_scale=settings.guidance_scale, train_t5xxl=train_t5xxl)

    @property
    def t5_length(self) -> int:
        return self.t5_max_length or (256 if self.schnell else 512)

    # --- prompts ----------------------------------------------------------------------------------------------
    def tokenizer(self, components: Components, max_token_length: int | None) -> Tokenizer:
        clip, t5 = components.tokenizers
        length = self.t5_length

        def tokens(caption: str) -> dict[str, torch.Tensor]:
            t5_tokens = t5(caption, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
            return {"input_ids": tokenize(clip, caption), "t5_input_ids": t5_tokens.input_ids[0],
                    "t5_attn_mask": t5_tokens.attention_mask[0]}
        return tokens

    def encode_text(self, text_encoders: Sequence[torch.nn.Module], tokens: Mapping[str, torch.Tensor],
                    clip_skip: int | None) -> dict[str, torch.Tensor]:
        """CLIP-L's pooled output (no projection) and T5's last hidden states; T5 sees the padding mask only with
        apply_t5_attn_mask (kohya's), and the mask travels with the outputs for the transformer."""
        clip, t5 = text_encoders
        pooled = clip(tokens["input_ids"], return_dict=True).pooler_output
        mask = tokens["t5_attn_mask"]
        states = t5(tokens["t5_input_ids"], attention_mask=mask if self.apply_t5_attn_mask else None,
                    return_dict=True).last_hidden_state
        return {"encoder_hidden_states": states, "pooled": pooled, "t5_attn_mask": mask}

    # --- the denoiser ------------------------------------------------------------------------------------------
    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: Mapping[str, torch.Tensor], conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        batch, _, height, width = noisy.shape
        transformer_checks.check_latent_size("FLUX", height, width)
        inputs = self.with_references(transformer_inputs(noisy, timesteps,
                                                         text["encoder_hidden_states"].to(noisy.dtype)), conditioning)
        extra: dict[str, Any] = {}
        if self.apply_t5_attn_mask:  # the text's padding masked; every image token (target and reference) seen
            text_mask = text["t5_attn_mask"].to(device=noisy.device, dtype=torch.bool)
            image = torch.ones(batch, inputs["hidden_states"].shape[1], dtype=torch.bool, device=noisy.device)
            extra["joint_attention_kwargs"] = {"attention_mask": torch.cat([text_mask, image], dim=1)[:, None, None]}
        guidance = None
        if denoiser.config.guidance_embeds:
            guidance = torch.full((batch,), self.guidance_scale, device=noisy.device, dtype=torch.float32)
        out = denoiser(**inputs, pooled_projections=text["pooled"].to(noisy.dtype), guidance=guidance, **extra)[0]
        # Reference tokens follow the target's: the prediction, and so the loss, is the target's tokens only.
        return unpack_latents(out[:, :(height // 2) * (width // 2)], height, width)

    def with_references(self, inputs: dict[str, Any], conditioning: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The transformer's inputs with reference images' tokens and positions appended to the image sequence
        (FLUX.1 Kontext's); FLUX.1 dev and schnell have none."""
        return inputs

    def control_problems(self, counts: Mapping[int, int]) -> list[str]:
        problems = super().control_problems(counts)
        if problems and not self.control_images:
            problems.append("FLUX.1 Kontext [dev] trains from control images: its diffusers folder (model_index.json "
                            "names FluxKontextPipeline) is recognised; for its single file "
                            "(flux1-kontext-dev.safetensors) set model_version = \"kontext\"")
        return problems

    def block_swap_plan(self, denoiser: torch.nn.Module, blocks_to_swap: int) -> list[tuple[Any, int]]:
        """kohya's split: half (rounded down) of the count in double blocks, twice the rest in single blocks, each
        at most its number of blocks less 2 (FLUX.1-dev: up to 35)."""
        double, single = denoiser.transformer_blocks, denoiser.single_transformer_blocks
        swap_double = blocks_to_swap // 2
        swap_single = (blocks_to_swap - swap_double) * 2
        if swap_double > len(double) - 2 or swap_single > len(single) - 2:
            raise UserError(f"blocks_to_swap {blocks_to_swap}: FLUX swaps at most {len(double) - 2} double blocks and "
                            f"{len(single) - 2} single blocks; this asks for {swap_double} double and {swap_single} "
                            "single blocks")
        return [(double, swap_double), (single, swap_single)]

    # --- LoRA files and metadata -------------------------------------------------------------------------------
    def lora_text_encoders(self, text_encoders: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
        return list(text_encoders) if self.train_t5xxl else [text_encoders[0]]  # T5 only when asked, as kohya

    def metadata_flags(self, v_prediction: bool) -> dict[str, Any]:
        return {"base_model": "flux1", "architecture": f"flux-1-{'schnell' if self.schnell else 'dev'}/lora",
                "implementation": "https://github.com/black-forest-labs/flux"}

    # --- sampling ----------------------------------------------------------------------------------------------
    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        from diffusers import FluxPipeline

        return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoders[0], tokenizer=tokenizers[0],
                            text_encoder_2=text_encoders[1], tokenizer_2=tokenizers[1], transformer=denoiser)

    def sampling_guidance(self, scale: float, guidance: float | None, positive: Mapping[str, torch.Tensor],
                          width: int, height: int) -> dict[str, Any]:
        """--g (default 3.5, kohya's) is dev's guidance input. --l above 1 turns on kohya's true CFG, the negative
        prompt (--n, else the empty one) run beside the positive: neg + (pos - neg) * scale. The pipeline does that
        for scales above 1 only, so a scale below 1 is reported and treated as 1."""
        arguments: dict[str, Any] = {"guidance_scale": 3.5 if guidance is None else guidance,
                                     "true_cfg_scale": scale}
        if scale < 1:
            logger.warning("sample prompt --l %g: FLUX's true CFG needs a scale above 1; sampling without it", scale)
        if self.apply_t5_attn_mask and "t5_attn_mask" in positive:
            if scale > 1:
                logger.warning("sample prompt --l %g with apply_t5_attn_mask: the negative prompt is masked like the "
                               "positive one", scale)
            # The pipeline places the image at height // 16 x width // 16 tokens after the text.
            image = torch.ones(1, (height // 16) * (width // 16), dtype=torch.bool)
            mask = torch.cat([positive["t5_attn_mask"].cpu().bool(), image], dim=1)
            arguments["joint_attention_kwargs"] = {"attention_mask": mask[:, None, None, :].to(
                positive["t5_attn_mask"].device)}
        return arguments

    def prompt_embeds(self, positive: Mapping[str, torch.Tensor],
                      negative: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return pooled_prompt_embeds(positive, negative)


def is_flux_folder(path: Path) -> bool:
    return transformer_class(path) == TRANSFORMER_CLASS


def is_schnell(transformer: torch.nn.Module) -> bool:
    """Told from the weights, as kohya does: schnell has no guidance embedding."""
    return not any(name.startswith(GUIDANCE_KEY) for name, _ in transformer.named_parameters())
