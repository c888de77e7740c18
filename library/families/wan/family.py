"""Wan 2.1 / 2.2 text-to-video: a DiT over (1, 2, 2) patches of a 16-channel causal video VAE's latents, conditioned
on UMT5-XXL's last hidden states (512 tokens, padding zeroed). Trained as musubi-tuner's wan_train_network.py trains
it: the transformer only, its time input the timestep (1000 * sigma), its raw output trained against noise - x0
(call_dit), musubi's timestep sampling (library.families.shared.musubi_flow). Wan 2.2 A14B's two experts are one
transformer whose base weights are swapped at timestep_boundary under one LoRA, as musubi does (experts.py).

Pixels arrive as (B, C, F, H, W) for video items and (B, C, H, W) for images (one frame); `WanVae` encodes both to
normalised latents of the same rank ((x - latents_mean) / latents_std, the posterior's mode, as musubi's WanVAE and
diffusers' WanPipeline do), and `denoise` gives the transformer a frame axis when the latents have none.
"""
from __future__ import annotations

import dataclasses
import html
import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, Mapping, Sequence

import torch
from torch import nn

from library.config import UserError
from library.families.family import Components, LoraAdapter, Tokenizer
from library.families.settings import value_of
from library.families.shared import checks as transformer_checks
from library.families.shared import musubi_flow
from library.families.shared.mode_posterior import ModePosterior
from library.families.wan import lora as wan_lora
from library.families.wan.entry import FRAMES
from library.families.wan.experts import (
    EXPERT_ADAPTERS,
    ExpertSwitch,
    WanObjective,
    WanSettings,
    boundary_of,
    high_noise_weights,
    separate_loras,
    separate_weights_problem,
)
from library.families.wan.kind import T2V, TI2V_TASK, task_problem

logger = logging.getLogger(__name__)

TRANSFORMER_CLASS = "WanTransformer3DModel"
MAX_TOKENS = 512  # musubi's text_len, WanPipeline's max_sequence_length
DEFAULT_CFG = 5.0  # musubi's sample_guide_scale for Wan 2.1
TI2V = "2.2-ti2v-5B"  # the version of Wan 2.2 TI2V 5B


class WanVae(nn.Module):
    """AutoencoderKLWan with latents already in the transformer's range: encode takes (B, C, F, H, W) video or
    (B, C, H, W) images (one frame) and gives (z - latents_mean) / latents_std of the same rank; decode undoes it.
    `config` reads as the VAE's with scaling_factor 1 and no shift."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        from diffusers.configuration_utils import FrozenDict

        self.config = FrozenDict({**vae.config, "scaling_factor": 1.0})

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean).view(shape).to(like.device, like.dtype)
        std = torch.tensor(self.vae.config.latents_std).view(shape).to(like.device, like.dtype)
        return mean, std

    def encode(self, pixels: torch.Tensor) -> SimpleNamespace:
        image = pixels.ndim == 4
        mode = self.vae.encode(pixels.unsqueeze(2) if image else pixels).latent_dist.mode()
        mean, std = self._stats(mode)
        latents = (mode - mean) / std
        return SimpleNamespace(latent_dist=ModePosterior(latents.squeeze(2) if image else latents))

    def decode(self, latents: torch.Tensor, return_dict: bool = False) -> tuple[torch.Tensor]:
        image = latents.ndim == 4
        latents = latents.unsqueeze(2) if image else latents
        mean, std = self._stats(latents)
        pixels = self.vae.decode(latents * std + mean, return_dict=False)[0]
        return (pixels.squeeze(2) if image else pixels,)


def clean_prompt(text: str) -> str:
    """musubi's and WanPipeline's prompt cleaning without ftfy (not installed here): HTML entities undone, runs of
    whitespace made one space."""
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


@dataclasses.dataclass(frozen=True)
class Wan(musubi_flow.MusubiFamily):
    """Wan T2V. `experts` is the 2.2 A14B expert switch (None for one transformer); `version` "2.1", "2.2" (A14B) or
    TI2V (TI2V 5B: its text-to-video training gives every token the item's timestep, which is what WanPipeline's
    expand_timesteps gives without an image; library.families.wan.ti2v adds its image-to-video training).
    `offers_i2v`: the model trains on a first frame (the I2V models always, TI2V 5B with musubi's i2v)."""
    version: str = "2.1"
    experts: ExpertSwitch | None = None
    name = "wan"
    base_model_version = "wan"  # musubi's ss_base_model_version (ARCHITECTURE_WAN_FULL)
    display_name = "Wan"
    implementation = "https://github.com/Wan-Video/Wan2.1"
    lora_rules = wan_lora
    default_sampling_scale = DEFAULT_CFG
    settings_type = WanSettings
    frames_rule = FRAMES
    offers_i2v: ClassVar[bool] = False
    refused_options = (
        ("clip_skip", "Wan reads UMT5's last hidden states, as musubi-tuner and WanPipeline do"),
        ("max_token_length", f"prompts are {MAX_TOKENS} UMT5 tokens, musubi's fixed length"),
        ("t5xxl_max_token_length", f"Wan's UMT5 reads {MAX_TOKENS} tokens"),
        ("apply_t5_attn_mask", "Wan's UMT5 padding is always masked and zeroed, as in musubi-tuner"),
        ("clip_l", "Wan has no CLIP-L"), ("t5xxl", "Wan's text encoder is UMT5: t5"),
        ("clip", "musubi-tuner's CLIP vision file is for Wan 2.1 I2V (i2v-14B); the model is text-to-video"),
        ("vae", "Wan's VAE comes with the model (its vae/ folder, or ae for the separate files)"),
        ("network_train_text_encoder_only", "musubi-tuner trains Wan's transformer only"))

    def configured(self, settings: WanSettings) -> Wan:
        """Refuses what does not apply (the I2V / Fun-Control tasks, the experts' options without two experts, the
        image families' refusals); with dit_high_noise, the family gets the expert switch that prepare_denoiser
        fills with the high-noise expert's file."""
        task = settings.task
        problem = task_problem(TI2V_TASK if self.version == TI2V else T2V, task)
        problems = [problem] if problem else []
        experts = self.experts
        if settings.dit_high_noise:
            if experts is not None:
                problems.append("dit_high_noise: the model's folder brings both experts (transformer/ is the "
                                "high-noise one); remove it")
            else:
                experts = ExpertSwitch(None, pending=Path(settings.dit_high_noise))
        if settings.user_set.get("i2v") and not self.offers_i2v:
            problems.append("i2v: the model is a text-to-video Wan; image-to-video trains an I2V model (i2v-14B, "
                            "i2v-A14B) or TI2V 5B")
        if self.version == TI2V:
            problems += [f"{name} {value}: Wan 2.2 TI2V 5B needs multiples of 32 (its VAE is 16x down)"
                         for name, value in (("resolution", settings.sizes.resolution),
                                             ("bucket_reso_steps", settings.sizes.bucket_reso_steps))
                         if any(side % 32 for side in (value if isinstance(value, tuple) else (value,)))
                         and (name == "resolution" or settings.sizes.enable_bucket)]
        asked = [name for name in ("timestep_boundary", "offload_inactive_dit") if value_of(settings, name)]
        asked += ["expert_loras"] if "expert_loras" in settings.user_set else []
        for name in asked if experts is None else []:
            problems.append(f"{name}: only for Wan 2.2 A14B with both experts (dit_high_noise, or a diffusers "
                            "folder with transformer_2)")
        if experts is not None and separate_loras(settings, experts) and settings.network_weights:
            problems.append(separate_weights_problem(settings.network_weights))
        if experts is not None and settings.offload_inactive_dit and settings.blocks_to_swap:
            problems.append("offload_inactive_dit with blocks_to_swap: musubi-tuner refuses the two together; "
                            "use one")
        if settings.timestep_boundary is not None and not 0 < settings.timestep_boundary < 1000:
            problems.append(f"timestep_boundary {settings.timestep_boundary}: give 0 to 1 or 0 to 1000")
        try:
            super().configured(settings)
        except UserError as e:
            problems = [*problems, *e.problems]
        if problems:
            raise UserError(problems)
        if experts is not None:
            experts.configure(boundary_of(settings, experts.default_boundary), settings.offload_inactive_dit,
                              separate_loras(settings, experts))
        two = experts is not None or task == "t2v-A14B"
        if experts is None and task == "t2v-A14B" and (settings.min_timestep, settings.max_timestep) == (0, 1000):
            logger.warning("task t2v-A14B with one expert: musubi-tuner recommends its timestep range, min_timestep 0 "
                           "/ max_timestep 875 for the low-noise expert, 875 / 1000 for the high-noise one")
        return dataclasses.replace(self, version="2.2" if two and self.version != TI2V else self.version,
                                   experts=experts)

    def lora_adapters(self) -> tuple[LoraAdapter, ...]:
        """One LoRA per expert (expert_loras = "separate" with both experts); else the one LoRA."""
        return EXPERT_ADAPTERS if self.experts is not None and self.experts.separate else super().lora_adapters()

    def prepare_denoiser(self, denoiser: torch.nn.Module, resolutions: Sequence[tuple[int, int]]) -> None:
        """Reads dit_high_noise (the high-noise expert) against the loaded low-noise transformer."""
        if self.experts is not None and self.experts.pending is not None:
            self.experts.high = high_noise_weights(self.experts.pending, denoiser)
            self.experts.pending = None

    def objective(self, components: Components, settings: WanSettings, device: torch.device) -> WanObjective:
        problems = musubi_flow.unsupported(settings, self.display_name)
        if problems:
            raise UserError(problems)
        base = musubi_flow.MusubiFlowObjective.from_settings(settings)
        boundary = self.experts.boundary if self.experts is not None else None
        return WanObjective(base.options, base.noise, base.loss, min_timestep=base.min_timestep,
                            max_timestep=base.max_timestep, boundary=boundary)

    # --- prompts ----------------------------------------------------------------------------------------------
    def tokenizer(self, components: Components, max_token_length: int | None) -> Tokenizer:
        tokenizer = components.tokenizers[0]

        def tokens(caption: str) -> dict[str, torch.Tensor]:
            encoded = tokenizer(clean_prompt(caption), padding="max_length", max_length=MAX_TOKENS, truncation=True,
                                add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
            return {"input_ids": encoded.input_ids[0], "attention_mask": encoded.attention_mask[0]}
        return tokens

    def encode_text(self, text_encoders: Sequence[torch.nn.Module], tokens: Mapping[str, torch.Tensor],
                    clip_skip: int | None) -> dict[str, torch.Tensor]:
        """UMT5's last hidden states with the padding's rows zeroed: the 512 rows WanPipeline gives the transformer
        (musubi trims each prompt and the model pads it back with zeros, the same)."""
        mask = tokens["attention_mask"]
        states = text_encoders[0](input_ids=tokens["input_ids"], attention_mask=mask).last_hidden_state
        return {"encoder_hidden_states": states * mask.unsqueeze(-1).to(states.dtype)}

    # --- the denoiser ------------------------------------------------------------------------------------------
    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: Mapping[str, torch.Tensor], conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        image = noisy.ndim == 4
        height, width = noisy.shape[-2:]
        transformer_checks.check_latent_size("Wan", height, width)
        hidden = noisy.unsqueeze(2) if image else noisy
        states = text["encoder_hidden_states"].to(noisy.dtype)
        high = self.experts.high_items(timesteps) if self.experts is not None else None
        if high is None or bool(high.all()) or not bool(high.any()):
            if self.experts is not None:
                self.experts.activate(denoiser, high is not None and bool(high.all()))
            prediction = self.predict(denoiser, hidden, timesteps, states, conditioning)
        else:  # a batch on both sides (validation's fixed timesteps): each expert predicts its own items
            prediction = torch.empty_like(hidden)
            for side in (False, True):
                items = (high == side).nonzero().flatten().to(hidden.device)
                self.experts.activate(denoiser, side)
                prediction[items] = self.predict(denoiser, hidden[items], timesteps[items.to(timesteps.device)],
                                                 states[items.to(states.device)],
                                                 {k: v[items.to(v.device)] for k, v in conditioning.items()})
        return prediction.squeeze(2) if image else prediction

    def attach_vae(self, vae: WanVae) -> WanVae:
        """The loaded VAE -> the VAE the run uses: the image-to-video family's also encodes each clip's first frame
        when the latents are encoded (cached or not), and keeps the VAE for training."""
        return vae

    def predict(self, denoiser: torch.nn.Module, hidden: torch.Tensor, timesteps: torch.Tensor, states: torch.Tensor,
                conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's raw output for (B, C, F, H, W) latents (the image-to-video models add their image
        conditioning here)."""
        return _call(denoiser, hidden, timesteps, states)

    def block_swap_plan(self, denoiser: torch.nn.Module, blocks_to_swap: int) -> list[tuple[Any, int]]:
        """kohya's schedule (library.memory.offload) swaps at most all blocks but two (Wan 14B: 38 of 40)."""
        blocks = denoiser.blocks
        if blocks_to_swap > len(blocks) - 2:
            raise UserError(f"blocks_to_swap {blocks_to_swap}: Wan swaps at most {len(blocks) - 2} of its "
                            f"{len(blocks)} blocks here")
        return [(blocks, blocks_to_swap)]

    # --- LoRA files ---------------------------------------------------------------------------------------------
    def kohya_module_path(self, prefix: str, path: str, model: torch.nn.Module) -> str:
        return wan_lora.original_path(path)

    def metadata_flags(self, v_prediction: bool) -> dict[str, Any]:
        # musubi's sai_model_spec: architecture wan2.1 (also for 2.2), implementation Wan2.1's repository
        return {"base_model": self.base_model_version, "architecture": "wan2.1/lora",
                "implementation": self.implementation}

    def metadata_fields(self, settings: WanSettings) -> dict[str, Any]:
        fields = super().metadata_fields(settings)
        if settings.task is not None:
            fields["ss_task"] = settings.task
        if self.version == TI2V:
            fields["ss_task"] = "ti2v-5B"
        if self.experts is not None:
            fields["ss_timestep_boundary"] = self.experts.boundary
        return fields

    # --- sampling ----------------------------------------------------------------------------------------------
    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        """WanPipeline around the low-noise (or only) transformer, as musubi samples; one frame per sample prompt,
        its image made by the VAE decode the sampler runs."""
        from diffusers import WanPipeline
        from diffusers.image_processor import VaeImageProcessor

        if self.experts is not None:
            self.experts.activate(denoiser, high=False)
        pipe = WanPipeline(tokenizer=tokenizers[0], text_encoder=text_encoders[0], vae=vae.vae, scheduler=scheduler,
                           transformer=denoiser)
        pipe.image_processor = VaeImageProcessor(vae_scale_factor=pipe.vae_scale_factor_spatial)
        return pipe

    def sampling_scheduler(self, scheduler_config: Mapping[str, Any]) -> Any:
        """The model's own scheduler (Wan's diffusers folders: UniPC on the flow, flow_shift 3 for 480p), as
        WanPipeline samples."""
        import diffusers

        name = scheduler_config.get("_class_name", "UniPCMultistepScheduler")
        return getattr(diffusers, name).from_config(dict(scheduler_config))

    def sampling_guidance(self, scale: float, guidance: float | None, positive: Mapping[str, torch.Tensor],
                          width: int, height: int) -> dict[str, Any]:
        """--l (default 5.0, musubi's) is the CFG scale with the negative prompt; one frame."""
        if guidance is not None:
            logger.warning("sample prompt --g %g: Wan has no guidance input; use --l for CFG", guidance)
        return {"guidance_scale": scale, "num_frames": 1}

    def vae_latents(self, latents: torch.Tensor, vae_config: Any, width: int, height: int) -> torch.Tensor:
        return latents.squeeze(2) if latents.ndim == 5 and latents.shape[2] == 1 else latents

    def prompt_embeds(self, positive: Mapping[str, torch.Tensor],
                      negative: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return {"prompt_embeds": positive["encoder_hidden_states"],
                "negative_prompt_embeds": negative["encoder_hidden_states"]}


def _call(denoiser: torch.nn.Module, hidden: torch.Tensor, timesteps: torch.Tensor,
          states: torch.Tensor) -> torch.Tensor:
    return denoiser(hidden_states=hidden, timestep=timesteps.to(hidden.dtype), encoder_hidden_states=states,
                    return_dict=False)[0]
