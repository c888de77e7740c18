"""SDXL: two CLIP text encoders (penultimate states joined, the second's pooled output) and size conditioning."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from library.families.family import Components, Family, Tokenizer
from library.families.objective import DiffusionObjective
from library.families.sd.family import SDSettings, ddpm_objective, with_weighted_captions
from library.families.sd.sgm_names import sgm_path
from library.families.shared.clip_text import apply_weights, join_chunks, tokenize, tokenize_weighted


class StableDiffusionXL(Family):
    name = "sdxl"
    base_model_version = "sdxl_base_v1-0"
    text_encoder_folders = ("text_encoder", "text_encoder_2")
    tokenizer_folders = ("tokenizer", "tokenizer_2")
    lora_text_prefixes = ("lora_te1", "lora_te2")
    offers_weighted_captions = True
    settings_type = SDSettings
    weighted_captions = False  # kohya's (word:1.2) weights on both encoders' hidden states (not the pooled output)

    def configured(self, settings: SDSettings) -> StableDiffusionXL:
        return with_weighted_captions(self, settings.weighted_captions)

    def tokenizer(self, components: Components, max_token_length: int | None) -> Tokenizer:
        first, second = components.tokenizers

        def tokens(caption: str) -> dict[str, torch.Tensor]:
            if self.weighted_captions:
                (ids, weights), (ids_2, weights_2) = (tokenize_weighted(t, caption, max_token_length)
                                                      for t in (first, second))
                return {"input_ids": ids, "input_ids_2": ids_2, "weights": weights, "weights_2": weights_2}
            return {"input_ids": tokenize(first, caption, max_token_length),
                    "input_ids_2": tokenize(second, caption, max_token_length)}
        return tokens

    def encode_text(self, text_encoders: Sequence[torch.nn.Module], tokens: Mapping[str, torch.Tensor],
                    clip_skip: int | None) -> dict[str, torch.Tensor]:
        """Both encoders' penultimate hidden states (without the final layer norm), concatenated, and the second
        encoder's projected pooled output (of the first chunk for long captions). clip_skip does not apply."""
        states = []
        out = None
        for encoder, ids, weights in zip(text_encoders, (tokens["input_ids"], tokens["input_ids_2"]),
                                         (tokens.get("weights"), tokens.get("weights_2")), strict=True):
            out = encoder(ids.reshape(-1, ids.shape[-1]), output_hidden_states=True, return_dict=True)
            hidden = out.hidden_states[-2]
            hidden = join_chunks(hidden, ids) if ids.dim() == 3 else hidden
            states.append(hidden if weights is None else apply_weights(hidden, weights))
        ids_2 = tokens["input_ids_2"]
        pooled = out.text_embeds.reshape(ids_2.shape[0], -1, out.text_embeds.shape[-1])[:, 0]
        return {"encoder_hidden_states": torch.cat(states, dim=-1), "pooled": pooled}

    def batch_conditioning(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {"time_ids": time_ids(batch)}

    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: Mapping[str, torch.Tensor], conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        dtype = noisy.dtype
        added = {"text_embeds": text["pooled"].to(dtype), "time_ids": conditioning["time_ids"].to(dtype)}
        return denoiser(noisy, timesteps, text["encoder_hidden_states"].to(dtype), added_cond_kwargs=added,
                        return_dict=False)[0]

    def objective(self, components: Components, settings: SDSettings, device: torch.device) -> DiffusionObjective:
        return ddpm_objective(components, settings, device)

    def kohya_module_path(self, prefix: str, path: str, model: torch.nn.Module) -> str:
        """UNet modules under their original-SD path, as sd-scripts names SDXL LoRA keys; text encoders as they are."""
        if prefix != self.lora_denoiser_prefix:
            return path
        config = model.config
        if not isinstance(config.layers_per_block, int):
            # the original layout has one count for every level; per-level counts have no kohya names
            raise ValueError(f"SDXL UNet with per-level layers_per_block {config.layers_per_block}: no kohya names")
        up_has_attention = ["CrossAttn" in kind for kind in config.up_block_types]
        return sgm_path(path, config.layers_per_block, up_has_attention)

    def metadata_flags(self, v_prediction: bool) -> dict[str, bool]:
        return {"v2": False, "v_parameterization": v_prediction, "sdxl": True}

    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline(vae=vae, text_encoder=text_encoders[0], text_encoder_2=text_encoders[1],
                                         tokenizer=tokenizers[0], tokenizer_2=tokenizers[1], unet=denoiser,
                                         scheduler=scheduler)

    def prompt_embeds(self, positive: Mapping[str, torch.Tensor],
                      negative: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"prompt_embeds": positive["encoder_hidden_states"], "pooled_prompt_embeds": positive["pooled"],
                "negative_prompt_embeds": negative["encoder_hidden_states"],
                "negative_pooled_prompt_embeds": negative["pooled"]}


def time_ids(batch: Mapping[str, Any]) -> torch.Tensor:
    """SDXL's size conditioning per image: original (h, w), crop top-left (top, left), target (h, w)."""
    return torch.cat([batch["original_size"], batch["crop_top_left"], batch["target_size"]], dim=1)


SDXL = StableDiffusionXL()
