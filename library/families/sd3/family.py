"""SD3 / SD3.5 (Medium, Large): CLIP-L's and CLIP-G's penultimate hidden states side by side, zero-padded to T5's
width and followed by T5's, condition an MMDiT on 2x2-patched 16-channel latents, with the two CLIPs' projected
pooled outputs. Trained as kohya's sd3_train_network.py trains it (library/sd3_train_utils.py): timesteps from the
weighting scheme's density, shifted by training_shift, the model's output preconditioned to x0
(noisy - sigma * output) against the latents, weighted by the scheme.
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
from library.families.flow_matching import (
    NUM_TRAIN_TIMESTEPS,
    FlowMatchingObjective,
    FlowSettings,
    density_sample,
    loss_weighting,
    sigmas_of,
    unsupported,
)
from library.families.loading import LoadRequest
from library.families.objective import per_sample_loss
from library.families.sd3 import lora as sd3_lora
from library.families.sd3 import pos_embed
from library.families.settings import value_of
from library.families.shared import checks as transformer_checks
from library.families.shared.diffusers_folder import load_folder, transformer_class
from library.families.shared.sampling import flow_euler_scheduler, pooled_prompt_embeds, unscaled_latents

logger = logging.getLogger(__name__)

FOLDERS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2",
           "tokenizer_3", "scheduler")
TRANSFORMER_CLASS = "SD3Transformer2DModel"
SD35_MEDIUM_POS_EMBED_SIZE = 384
# kohya's SD3 trainer reads none of FLUX's sampling options: it draws by weighting_scheme and training_shift.
FLUX_ONLY = {"timestep_sampling": "sigma", "sigmoid_scale": 1.0, "discrete_flow_shift": 3.0,
             "model_prediction_type": "sigma_scaled"}


@dataclasses.dataclass(frozen=True)
class SD3Objective(FlowMatchingObjective):
    """kohya's SD3 objective (get_noisy_model_input_and_timesteps, get_noise_pred_and_target)."""
    training_shift: float = 1.0
    min_timestep: int = 0
    max_timestep: int = NUM_TRAIN_TIMESTEPS

    def sample_timesteps(self, batch_size: int, generator: torch.Generator, device: torch.device | str,
                         latent_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
        """u from the weighting scheme's density, shifted, then integer timesteps in [min, max): sigma = t / 1000."""
        o = self.options
        u = density_sample(o.weighting_scheme, batch_size, generator, o.logit_mean, o.logit_std, o.mode_scale)
        shift = self.training_shift
        u = (u * shift) / (1 + (shift - 1) * u)
        return (u * (self.max_timestep - self.min_timestep) + self.min_timestep).long().float().to(device)

    def per_sample_loss(self, prediction: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor,
                        timesteps: torch.Tensor, mask: torch.Tensor | None = None,
                        noisy: torch.Tensor | None = None) -> torch.Tensor:
        """The output preconditioned to x0, `output * -sigma + noisy`, against the latents, weighted by
        sigma_sqrt / cosmap (kohya's compute_loss_weighting_for_sd3)."""
        if noisy is None:
            noisy = self.noisy_latents(latents, noise, timesteps)
        x0 = prediction.float() * -sigmas_of(timesteps, prediction) + noisy.float()
        loss = per_sample_loss(x0, latents.float(), self.loss.loss_type, self.huber_c(timesteps), mask)
        weighting = loss_weighting(self.options.weighting_scheme, timesteps.float() / NUM_TRAIN_TIMESTEPS)
        return loss if weighting is None else loss * weighting.to(loss.device)


@dataclasses.dataclass(frozen=True)
class SD3Settings(FlowSettings):
    """What SD3 reads from a run besides the flow-matching option groups: kohya's SD3 options, and those of other
    families it notes or checks."""
    sizes: transformer_checks.ImageSizes
    min_timestep: int
    max_timestep: int
    training_shift: float
    clip_skip: int | None
    max_token_length: int | None
    guidance_scale: float
    model_type: str | None
    clip_l_dropout_rate: float
    clip_g_dropout_rate: float
    t5_dropout_rate: float
    pos_emb_random_crop_rate: float
    enable_scaled_pos_embed: bool
    network_args: NetworkArgs
    network_train_unet_only: bool
    t5xxl_max_token_length: int | None
    apply_lg_attn_mask: bool
    apply_t5_attn_mask: bool


@dataclasses.dataclass(frozen=True)
class SD3(Family):
    """SD3 / SD3.5; `last_block` is the transformer's context-pre-only block (its LoRA keys differ)."""
    last_block: int = 23
    large: bool = False
    t5_max_length: int | None = None  # None: kohya's default, 256
    apply_lg_attn_mask: bool = False
    apply_t5_attn_mask: bool = False
    train_t5xxl: bool = False
    dropout_rates: tuple[float, float, float] = (0.0, 0.0, 0.0)  # kohya's clip_l / clip_g / t5 dropout rates
    clip_widths: tuple[int, int] = (768, 1280)  # CLIP-L's and CLIP-G's widths (hidden states and projections)
    pos_emb_random_crop_rate: float = 0.0  # kohya's SD3.5 Medium options (see sd3_pos_embed)
    scaled_pos_embed: bool = False

    base_model_version = "sd3"
    text_encoder_folders = ("text_encoder", "text_encoder_2", "text_encoder_3")
    tokenizer_folders = ("tokenizer", "tokenizer_2", "tokenizer_3")
    lora_text_prefixes = ("lora_te1", "lora_te2", "lora_te3")  # CLIP-L, CLIP-G, T5 (kohya's lora_sd3)
    default_sampling_scale = 7.5  # kohya's SD3 sample default CFG scale (sd3_train_utils)
    settings_type = SD3Settings

    @property
    def name(self) -> str:  # type: ignore[override]
        return "sd3-large" if self.large else "sd3-medium"

    def configured(self, settings: SD3Settings) -> SD3:

        for name, why in (("clip_skip", "kohya's SD3 trainer uses the CLIPs' penultimate layer"),
                          ("max_token_length", "the CLIPs read 77 tokens; the T5 length is t5xxl_max_token_length"),
                          ("guidance_scale", "SD3 has no guidance input"), ("model_type", "it is FLUX's option")):
            if getattr(settings, name) and not (name == "guidance_scale" and settings.guidance_scale == 3.5):
                logger.warning("%s has no effect for SD3, as in kohya's SD3 trainer: %s", name, why)
        for name, default in FLUX_ONLY.items():
            if getattr(settings.flow, name) != default:
                logger.warning("%s has no effect for SD3, as in kohya's SD3 trainer: timesteps are drawn by "
                               "weighting_scheme and training_shift, and the output is always preconditioned to x0",
                               name)
        rates = tuple(getattr(settings, name) for name in ("clip_l_dropout_rate", "clip_g_dropout_rate",
                                                         "t5_dropout_rate"))
        problems = [f"{name} {rate}: a probability, between 0 and 1" for name, rate in zip(
            ("clip_l_dropout_rate", "clip_g_dropout_rate", "t5_dropout_rate"), rates, strict=True)
            if not 0 <= rate <= 1]
        if not 0 <= settings.pos_emb_random_crop_rate <= 1:
            problems.append(f"pos_emb_random_crop_rate {settings.pos_emb_random_crop_rate}: a probability, between 0 "
                            "and 1")
        train_t5xxl = transformer_checks.raise_kohya_t5_problems(problems, settings, "SD3")
        return dataclasses.replace(self, t5_max_length=settings.t5xxl_max_token_length,
                                   apply_lg_attn_mask=settings.apply_lg_attn_mask,
                                   apply_t5_attn_mask=settings.apply_t5_attn_mask, train_t5xxl=train_t5xxl,
                                   dropout_rates=rates, pos_emb_random_crop_rate=settings.pos_emb_random_crop_rate,
                                   scaled_pos_embed=settings.enable_scaled_pos_embed)

    # --- prompts ----------------------------------------------------------------------------------------------
    def tokenizer(self, components: Components, max_token_length: int | None) -> Tokenizer:
        clip_l, clip_g, t5 = components.tokenizers
        length = self.t5_max_length or 256

        def tokens(caption: str) -> dict[str, torch.Tensor]:
            out = {}
            for key, tok in (("l", clip_l), ("g", clip_g)):
                encoded = tok(caption, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
                out[f"{key}_input_ids"], out[f"{key}_attn_mask"] = encoded.input_ids[0], encoded.attention_mask[0]
            t5_tokens = t5(caption, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
            out["t5_input_ids"], out["t5_attn_mask"] = t5_tokens.input_ids[0], t5_tokens.attention_mask[0]
            return out
        return tokens

    def encode_text(self, text_encoders: Sequence[torch.nn.Module], tokens: Mapping[str, torch.Tensor],
                    clip_skip: int | None) -> dict[str, torch.Tensor]:
        """kohya's Sd3TextEncodingStrategy: each CLIP's penultimate hidden states and projected pooled output (the
        attention mask passed in with apply_lg_attn_mask), T5's last hidden states (masked with
        apply_t5_attn_mask); the CLIP states side by side, zero-padded to T5's width, then T5's, along the
        sequence."""
        clip_l, clip_g, t5 = text_encoders
        outs, pooled = [], []
        for key, model in (("l", clip_l), ("g", clip_g)):
            mask = tokens[f"{key}_attn_mask"] if self.apply_lg_attn_mask else None
            result = model(tokens[f"{key}_input_ids"], attention_mask=mask, output_hidden_states=True)
            outs.append(result.hidden_states[-2])
            pooled.append(result.text_embeds)
        t5_mask = tokens["t5_attn_mask"] if self.apply_t5_attn_mask else None
        t5_out = t5(tokens["t5_input_ids"], attention_mask=t5_mask, return_dict=True).last_hidden_state
        lg = torch.cat(outs, dim=-1)
        lg = torch.nn.functional.pad(lg, (0, t5_out.shape[-1] - lg.shape[-1]))
        return {"encoder_hidden_states": torch.cat([lg, t5_out.to(lg.dtype)], dim=-2),
                "pooled": torch.cat(pooled, dim=-1)}

    # --- the denoiser ------------------------------------------------------------------------------------------
    def prepare_denoiser(self, denoiser: torch.nn.Module, resolutions: Sequence[tuple[int, int]]) -> None:
        """kohya's SD3.5 Medium position-embedding options, installed in the transformer's patch embedding (so
        sample images use them too, as in sd-scripts)."""
        if not (self.scaled_pos_embed or self.pos_emb_random_crop_rate):
            return
        if denoiser.config.pos_embed_max_size != SD35_MEDIUM_POS_EMBED_SIZE:
            logger.warning("enable_scaled_pos_embed / pos_emb_random_crop_rate are SD3.5 Medium's options (its "
                           "position grid is %d patches wide; this model's is %s); sd-scripts warns of unexpected "
                           "results on other SD3 models", SD35_MEDIUM_POS_EMBED_SIZE,
                           denoiser.config.pos_embed_max_size)
        sizes = pos_embed.latent_sizes(resolutions) if self.scaled_pos_embed else []
        pos_embed.install(denoiser, sizes)
        if sizes:
            logger.info("scaled position embeddings for latent sizes %s (resolutions %s)", sizes, sorted(resolutions))

    def step_conditioning(self, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """kohya's per-encoder dropout: for each caption, CLIP-L's, CLIP-G's and T5's outputs are each zeroed with
        their rate; with pos_emb_random_crop_rate, whether this step crops its position embeddings at random and
        where (three draws). All from the step's generator, so a resumed run does what the original did."""
        drawn = {}
        if any(self.dropout_rates):
            drawn["text_drop"] = torch.rand(batch_size, 3, generator=generator) < torch.tensor(self.dropout_rates)
        if self.pos_emb_random_crop_rate:
            drawn["pos_crop"] = torch.rand(3, generator=generator)
        return drawn

    @staticmethod
    def dropped(text: Mapping[str, torch.Tensor], drop: torch.Tensor,
                clip_widths: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoded prompt with the dropped encoders' parts zeroed (kohya's drop_cached_text_encoder_outputs):
        CLIP-L's and CLIP-G's columns of the first 77 tokens and of the pooled output, T5's tokens."""
        states, pooled = text["encoder_hidden_states"].clone(), text["pooled"].clone()
        l_width, g_width = clip_widths
        drop = drop.to(states.device)
        for i in range(states.shape[0]):
            if drop[i, 0]:
                states[i, :77, :l_width] = 0
                pooled[i, :l_width] = 0
            if drop[i, 1]:
                states[i, :77, l_width:l_width + g_width] = 0
                pooled[i, l_width:] = 0
            if drop[i, 2]:
                states[i, 77:] = 0
        return states, pooled

    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: Mapping[str, torch.Tensor], conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        _, _, height, width = noisy.shape
        transformer_checks.check_latent_size("SD3", height, width)
        dtype = noisy.dtype
        states, pooled = text["encoder_hidden_states"], text["pooled"]
        if "text_drop" in conditioning:
            states, pooled = self.dropped(text, conditioning["text_drop"], self.clip_widths)
        embedding = pos_embed.installed(denoiser)
        draws = conditioning.get("pos_crop")
        if embedding is not None and draws is not None and draws[0] < self.pos_emb_random_crop_rate:
            embedding.crop = (float(draws[1]), float(draws[2]))
        try:
            return denoiser(hidden_states=noisy, encoder_hidden_states=states.to(dtype),
                            pooled_projections=pooled.to(dtype), timestep=timesteps.to(dtype), return_dict=False)[0]
        finally:
            if embedding is not None:
                embedding.crop = None

    def objective(self, components: Components, settings: SD3Settings, device: torch.device) -> SD3Objective:
        # min/max_timestep are SD3's own (see SD3Objective), not ignored as for FLUX
        given = {k: v for k, v in settings.user_set.items() if k not in ("min_timestep", "max_timestep")}
        problems = unsupported(given, "SD3")
        if problems:
            raise UserError(problems)
        return SD3Objective(settings.flow, settings.noise, settings.loss, training_shift=settings.training_shift,
                            min_timestep=settings.min_timestep, max_timestep=settings.max_timestep)

    # --- LoRA files and metadata -------------------------------------------------------------------------------
    def lora_text_encoders(self, text_encoders: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
        return list(text_encoders) if self.train_t5xxl else list(text_encoders[:2])  # T5 only when asked (kohya)

    def denoiser_lora_targets(self, denoiser: torch.nn.Module, rank: int, alpha: float,
                              net: Any) -> tuple[list[str], dict[str, tuple[int, float]]]:
        try:
            return sd3_lora.targets(denoiser, net), {}
        except ValueError as e:
            raise UserError(str(e)) from None

    def export_lora_keys(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return sd3_lora.to_kohya(state_dict, self.last_block)

    def import_lora_keys(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return sd3_lora.from_kohya(state_dict, self.last_block)

    def metadata_flags(self, v_prediction: bool) -> dict[str, Any]:
        """kohya's modelspec for SD3: stable-diffusion-3-<m|5-large>/lora, Stability's implementation."""
        return {"base_model": "sd3", "architecture": f"stable-diffusion-3-{'5-large' if self.large else 'm'}/lora",
                "implementation": "https://github.com/Stability-AI/generative-models"}

    def metadata_fields(self, settings: SD3Settings) -> dict[str, Any]:
        return {"ss_apply_lg_attn_mask": settings.apply_lg_attn_mask,
                "ss_apply_t5_attn_mask": settings.apply_t5_attn_mask,
                **{f"ss_{name}": value_of(settings, name) for name in (
                    "weighting_scheme", "logit_mean", "logit_std", "mode_scale", "training_shift")}}

    # --- sampling ----------------------------------------------------------------------------------------------
    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline(
            scheduler=scheduler, vae=vae, text_encoder=text_encoders[0], tokenizer=tokenizers[0],
            text_encoder_2=text_encoders[1], tokenizer_2=tokenizers[1], text_encoder_3=text_encoders[2],
            tokenizer_3=tokenizers[2], transformer=denoiser)

    def sampling_scheduler(self, scheduler_config: Mapping[str, Any]) -> Any:
        """Euler on the flow with the model's shift (kohya's SD3 sampler)."""
        return flow_euler_scheduler(scheduler_config)

    def vae_latents(self, latents: torch.Tensor, vae_config: Any, width: int, height: int) -> torch.Tensor:
        return unscaled_latents(latents, vae_config)

    def prompt_embeds(self, positive: Mapping[str, torch.Tensor],
                      negative: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return pooled_prompt_embeds(positive, negative)


def is_sd3_folder(path: Path) -> bool:
    return transformer_class(path) == TRANSFORMER_CLASS


def family_of(transformer: Any, text_encoders: Sequence[Any]) -> SD3:
    """Large (38 blocks) or Medium, as kohya's modelspec names them, the context-pre-only block and the CLIPs'
    widths."""
    layers = transformer.config.num_layers
    widths = tuple(encoder.config.hidden_size for encoder in text_encoders[:2])
    return SD3(last_block=layers - 1, large=layers >= 38, clip_widths=widths)


def load_sd3_folder(request: LoadRequest) -> Components:
    """A diffusers SD3 / SD3.5 folder (StableDiffusion3Pipeline layout, all three text encoders), offline."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel

    return load_folder(request, "SD3 (with its three text encoders)", {
        "transformer": SD3Transformer2DModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModelWithProjection,
        "text_encoder_2": CLIPTextModelWithProjection, "text_encoder_3": T5EncoderModel, "tokenizer": CLIPTokenizer,
        "tokenizer_2": CLIPTokenizer, "tokenizer_3": AutoTokenizer, "scheduler": FlowMatchEulerDiscreteScheduler},
        family_of)
