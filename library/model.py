"""The trained model: the text encoder and UNet as one module with LoRA attached, its loss, and LoRA files."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from library import network, objective
from library.cache import check_finite_latents, sample_cached_latents
from library.config import Config, UserError
from library.families import Components, encode_prompt

logger = logging.getLogger(__name__)

WEIGHT_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SAVE_DTYPES = {None: None, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class DiffusionModel(torch.nn.Module):
    """The text encoder and UNet as one module, so DDP and DeepSpeed see every LoRA parameter in one place."""

    def __init__(self, unet: torch.nn.Module, text_encoder: torch.nn.Module, train_text_encoder: bool,
                 clip_skip: int | None = None):
        super().__init__()
        self.unet = unet
        self.text_encoder = text_encoder
        self.train_text_encoder = train_text_encoder
        self.clip_skip = clip_skip

    def forward(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, conditioning: torch.Tensor) -> torch.Tensor:
        """`conditioning`: token ids, or text-encoder hidden states when they were cached (float)."""
        if conditioning.is_floating_point():
            hidden_states = conditioning
        else:
            with torch.set_grad_enabled(self.train_text_encoder and torch.is_grad_enabled()):
                hidden_states = encode_prompt(self.text_encoder, conditioning, self.clip_skip)
        return self.unet(noisy_latents, timesteps, hidden_states, return_dict=False)[0]


@dataclass(frozen=True)
class Objective:
    """What the loss needs from the model family and the config."""
    alphas_cumprod: torch.Tensor
    v_prediction: bool
    min_timestep: int
    max_timestep: int
    noise_offset: float | None
    min_snr_gamma: float | None


def diffusion_loss(model: torch.nn.Module, latents: torch.Tensor, input_ids: torch.Tensor, noise: torch.Tensor,
                   timesteps: torch.Tensor, obj: Objective) -> torch.Tensor:
    """Per-sample loss of the noise (or v) prediction at the given noise and timesteps."""
    noisy = objective.add_noise(latents, noise, timesteps, obj.alphas_cumprod)
    prediction = model(noisy, timesteps, input_ids)
    target = objective.prediction_target(latents, noise, timesteps, obj.alphas_cumprod, obj.v_prediction)
    loss = objective.per_sample_loss(prediction, target)
    if obj.min_snr_gamma:
        loss = loss * objective.min_snr_weight(timesteps, obj.alphas_cumprod, obj.min_snr_gamma, obj.v_prediction)
    return loss


@torch.no_grad()
def encode_latents(vae: torch.nn.Module, pixels: torch.Tensor, generator: torch.Generator,
                   vae_dtype: torch.dtype) -> torch.Tensor:
    """VAE posterior sample scaled to the UNet's latent range."""
    # The dtype is passed in: diffusers' vae.dtype walks every submodule, a cost on every step.
    distribution = vae.encode(pixels.to(dtype=vae_dtype)).latent_dist
    # Drawn on CPU from the step's generator, so the sample does not depend on the device or the global RNG.
    eps = torch.randn(distribution.mean.shape, generator=generator, dtype=torch.float32)
    latents = distribution.mean + distribution.std * eps.to(device=distribution.mean.device,
                                                              dtype=distribution.mean.dtype)
    return latents * vae.config.scaling_factor


def batch_latents(batch: dict[str, Any], vae: torch.nn.Module, generator: torch.Generator,
                  vae_dtype: torch.dtype) -> torch.Tensor:
    """The batch's latents: a posterior sample from cached parameters, or from encoding its pixels."""
    if "latent_mean" in batch:
        return sample_cached_latents(batch["latent_mean"], batch["latent_logvar"], generator,
                                     vae.config.scaling_factor, vae_dtype)
    latents = encode_latents(vae, batch["pixels"], generator, vae_dtype)
    check_finite_latents(latents, batch["path"])
    return latents


@dataclass(frozen=True)
class NetworkSpec:
    """The LoRA's shape: from the config, or read from network_weights with dim_from_weights."""
    dim: int
    alpha: float
    initial_weights: dict[str, torch.Tensor] | None = None


def network_spec(config: Config) -> NetworkSpec:
    if config.network_weights is None:
        return NetworkSpec(config.network_dim, config.network_alpha)
    try:
        state_dict, _ = network.load_kohya_lora(config.network_weights)
        dim, alpha = network.dims_from_state_dict(state_dict)
    except (OSError, ValueError) as e:
        raise UserError(f"network_weights {config.network_weights}: {e}") from None
    if config.dim_from_weights:
        logger.info("dim_from_weights: network_dim %d, network_alpha %g from %s", dim, alpha, config.network_weights)
        return NetworkSpec(dim, alpha, state_dict)
    return NetworkSpec(config.network_dim, config.network_alpha, state_dict)


def trained_parts(config: Config) -> tuple[bool, bool]:
    """(train the UNet, train the text encoder)."""
    return not config.network_train_text_encoder_only, not config.network_train_unet_only


def build_model(config: Config, components: Components, device: torch.device,
                spec: NetworkSpec | None = None) -> tuple[DiffusionModel, list[dict[str, Any]]]:
    """Freeze the base (already in its weight dtype), attach the LoRA (fp32, or the weight dtype with full_fp16 /
    full_bf16); return the model and optimizer groups."""
    spec = spec or NetworkSpec(config.network_dim, config.network_alpha)
    train_unet, train_text_encoder = trained_parts(config)
    unet, text_encoder = components.unet, components.text_encoder
    for module in (unet, text_encoder, components.vae):
        module.requires_grad_(False)
    components.vae.to(device).eval()
    unet.to(device)
    text_encoder.to(device)

    groups: list[dict[str, Any]] = []
    if train_unet:
        params = network.attach_lora(unet, network.unet_target_modules(unet), spec.dim, spec.alpha,
                                     config.network_dropout)
        groups.append({"params": params, "lr": config.unet_lr if config.unet_lr is not None
                       else config.learning_rate, "name": "unet"})
    if train_text_encoder:
        params = network.attach_lora(text_encoder, network.text_encoder_target_modules(text_encoder),
                                     spec.dim, spec.alpha, config.network_dropout)
        groups.append({"params": params, "lr": config.text_encoder_lr if config.text_encoder_lr is not None
                       else config.learning_rate, "name": "text_encoder"})
    if config.full_fp16 or config.full_bf16:
        for group in groups:
            for param in group["params"]:
                param.data = param.data.to(WEIGHT_DTYPES[config.mixed_precision])
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        if train_text_encoder:
            # Non-reentrant: with a frozen base the inputs need no grad, which reentrant checkpointing requires.
            text_encoder.activation_checkpointing_enable({"use_reentrant": False})
    unet.train(train_unet)
    text_encoder.train(train_text_encoder)
    model = DiffusionModel(unet, text_encoder, train_text_encoder, config.clip_skip)
    if spec.initial_weights is not None:
        load_adapter(config, model, spec.initial_weights, strict=False, source=str(config.network_weights))
    return model, groups


def lora_modules(model: DiffusionModel, config: Config) -> dict[str, torch.nn.Module]:
    train_unet, train_text_encoder = trained_parts(config)
    modules: dict[str, torch.nn.Module] = {}
    if train_unet:
        modules["lora_unet"] = model.unet
    if train_text_encoder:
        modules["lora_te"] = model.text_encoder
    return modules


def load_adapter(config: Config, model: DiffusionModel, state_dict: dict[str, torch.Tensor], strict: bool,
                 source: str) -> None:
    """Kohya-format weights into the attached LoRA. Keys for a part that is not trained are left out."""
    modules = lora_modules(model, config)
    if not strict:
        state_dict = {k: v for k, v in state_dict.items() if k.startswith(tuple(f"{p}_" for p in modules))}
    try:
        report = network.apply_kohya_state_dict(modules, state_dict, strict=strict)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None
    if report.missing:
        logger.warning("%s: %d LoRA modules are not in the file and start from scratch", source,
                       len(report.missing) // 2)


def save_lora(config: Config, model: DiffusionModel, spec: NetworkSpec, path: Path, metadata: dict[str, str],
              dtype: torch.dtype | None) -> None:
    state_dict = network.kohya_state_dict(lora_modules(model, config), spec.alpha, dtype)
    network.save_lora_file(path, state_dict, {} if config.no_metadata else metadata)
