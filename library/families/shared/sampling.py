"""What the transformer families' sampling shares: Euler on the flow with the model's own scheduler config, the
prompt-embedding arguments of the pipelines that take a pooled output too (FLUX.1, SD3), and the VAE's scaling and
shift undone on the pipeline's latents."""
from __future__ import annotations

from typing import Any, Mapping

import torch


def flow_euler_scheduler(scheduler_config: Mapping[str, Any]) -> Any:
    """FlowMatchEulerDiscreteScheduler with the model's scheduler config (its shift, and its resolution-dependent
    shift where the config has one)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler.from_config(dict(scheduler_config))


def pooled_prompt_embeds(positive: Mapping[str, torch.Tensor],
                         negative: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`encode_text`'s hidden states and pooled output, for the prompt and the negative prompt."""
    return {"prompt_embeds": positive["encoder_hidden_states"], "pooled_prompt_embeds": positive["pooled"],
            "negative_prompt_embeds": negative["encoder_hidden_states"],
            "negative_pooled_prompt_embeds": negative["pooled"]}


def unscaled_latents(latents: torch.Tensor, vae_config: Any) -> torch.Tensor:
    """Latents in the transformer's range -> what the VAE decodes: its scaling factor and shift undone."""
    return latents / vae_config.scaling_factor + vae_config.shift_factor
