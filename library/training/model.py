"""The trained model: the text encoder and UNet as one module with LoRA attached, its loss, and LoRA files."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from library.training import adapters as adapter_training
from library.network import lora as network
from library.network import targets as network_setup
from library.models import objective
from library.data.cache import check_finite_latents, sample_cached_latents
from library.config import Config, UserError
from library.models.family import Components, encode_prompt, encode_sdxl, sdxl_time_ids
from library.config.network_args import network_args_of

logger = logging.getLogger(__name__)

WEIGHT_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SAVE_DTYPES = {None: None, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class DiffusionModel(torch.nn.Module):
    """The text encoder(s) and UNet as one module, so DDP and DeepSpeed see every LoRA parameter in one place."""

    def __init__(self, unet: torch.nn.Module, text_encoder: torch.nn.Module, train_text_encoder: bool,
                 clip_skip: int | None = None, text_encoder_2: torch.nn.Module | None = None):
        super().__init__()
        self.unet = unet
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2  # SDXL
        self.train_text_encoder = train_text_encoder
        self.clip_skip = clip_skip

    def forward(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                conditioning: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        """`conditioning`: token ids, or text-encoder hidden states when they were cached (float); for SDXL a dict
        (see `batch_conditioning`)."""
        if isinstance(conditioning, dict):
            return self._forward_sdxl(noisy_latents, timesteps, conditioning)
        if conditioning.is_floating_point():
            hidden_states = conditioning
        else:
            with torch.set_grad_enabled(self.train_text_encoder and torch.is_grad_enabled()):
                hidden_states = encode_prompt(self.text_encoder, conditioning, self.clip_skip)
        return self.unet(noisy_latents, timesteps, hidden_states, return_dict=False)[0]

    def _forward_sdxl(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                      conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
        if "encoder_hidden_states" in conditioning:
            text = conditioning
        else:
            with torch.set_grad_enabled(self.train_text_encoder and torch.is_grad_enabled()):
                text = encode_sdxl(self.text_encoder, self.text_encoder_2, conditioning["input_ids"],
                                   conditioning["input_ids_2"])
        dtype = noisy_latents.dtype
        added = {"text_embeds": text["pooled"].to(dtype), "time_ids": conditioning["time_ids"].to(dtype)}
        return self.unet(noisy_latents, timesteps, text["encoder_hidden_states"].to(dtype),
                         added_cond_kwargs=added, return_dict=False)[0]


def batch_conditioning(batch: dict[str, Any]) -> torch.Tensor | dict[str, torch.Tensor]:
    """What the model is conditioned on: token ids or cached hidden states; for SDXL (a batch with input_ids_2 or
    pooled outputs) both encoders' ids or outputs plus the size conditioning."""
    if "input_ids_2" not in batch and "pooled" not in batch:
        return batch.get("encoder_hidden_states", batch.get("input_ids"))
    keys = ("encoder_hidden_states", "pooled") if "pooled" in batch else ("input_ids", "input_ids_2")
    return {**{key: batch[key] for key in keys}, "time_ids": sdxl_time_ids(batch)}


@dataclass(frozen=True)
class Objective:
    """What the loss needs from the model family and the config."""
    alphas_cumprod: torch.Tensor
    v_prediction: bool
    min_timestep: int
    max_timestep: int
    noise_offset: float | None
    min_snr_gamma: float | None
    noise: objective.NoiseOptions = objective.NoiseOptions()
    loss: objective.LossOptions = objective.LossOptions()

    def __post_init__(self) -> None:
        # Whether the model predicts v is known only here: v_parameterization may come from its scheduler config.
        problems = self.loss.problems(self.v_prediction)
        if problems:
            raise UserError(problems)


def diffusion_loss(model: torch.nn.Module, latents: torch.Tensor, input_ids: torch.Tensor, noise: torch.Tensor,
                   timesteps: torch.Tensor, obj: Objective, input_noise: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample loss of the noise (or v) prediction at the given noise and timesteps.

    `input_noise` (ip_noise_gamma) replaces `noise` in the noisy latents only; the target is built from `noise`.
    `mask` (batch, 1, H, W) in [0, 1] weights the loss per pixel (alpha_mask, masked_loss).
    """
    noisy = objective.add_noise(latents, noise if input_noise is None else input_noise, timesteps, obj.alphas_cumprod)
    prediction = model(noisy, timesteps, input_ids)
    target = objective.prediction_target(latents, noise, timesteps, obj.alphas_cumprod, obj.v_prediction)
    huber_c = objective.huber_threshold(timesteps, obj.alphas_cumprod, obj.loss)
    loss = objective.per_sample_loss(prediction, target, obj.loss.loss_type, huber_c, mask)
    weight = objective.timestep_weight(timesteps, obj.alphas_cumprod, obj.v_prediction, obj.min_snr_gamma, obj.loss)
    return loss if weight is None else loss * weight


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
    unet, text_encoders = components.unet, components.text_encoders
    for module in (unet, *text_encoders, components.vae):
        module.requires_grad_(False)
    components.vae.to(device).eval()
    unet.to(device)
    for text_encoder in text_encoders:
        text_encoder.to(device)

    groups: list[dict[str, Any]] = []
    net = network_args_of(config)
    if train_unet:
        network_setup.attach_network(unet, "unet", spec.dim, spec.alpha, config.network_dropout, net)
        groups += adapter_training.optimizer_groups([unet], config.unet_lr if config.unet_lr is not None
                                                    else config.learning_rate, "unet", net.loraplus_ratio("unet"),
                                                    network_setup.block_lr(unet, spec.dim, spec.alpha, net))
    if train_text_encoder:
        for text_encoder in text_encoders:
            network_setup.attach_network(text_encoder, "text_encoder", spec.dim, spec.alpha, config.network_dropout,
                                         net)
        groups += adapter_training.optimizer_groups(
            text_encoders, config.text_encoder_lr if config.text_encoder_lr is not None else config.learning_rate,
            "text_encoder", net.loraplus_ratio("text_encoder"))
    if config.full_fp16 or config.full_bf16:
        for group in groups:
            for param in group["params"]:
                param.data = param.data.to(WEIGHT_DTYPES[config.mixed_precision])
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        if train_text_encoder:
            for text_encoder in text_encoders:
                # Non-reentrant: with a frozen base the inputs need no grad, which reentrant checkpointing needs.
                text_encoder.activation_checkpointing_enable({"use_reentrant": False})
    unet.train(train_unet)
    for text_encoder in text_encoders:
        text_encoder.train(train_text_encoder)
    model = DiffusionModel(unet, components.text_encoder, train_text_encoder, config.clip_skip,
                           components.text_encoder_2)
    if spec.initial_weights is not None:
        load_adapter(config, model, spec.initial_weights, strict=False, source=str(config.network_weights))
    return model, groups


def lora_modules(model: DiffusionModel, config: Config) -> dict[str, torch.nn.Module]:
    train_unet, train_text_encoder = trained_parts(config)
    modules: dict[str, torch.nn.Module] = {}
    if train_unet:
        modules["lora_unet"] = model.unet
    if train_text_encoder and model.text_encoder_2 is not None:
        modules["lora_te1"], modules["lora_te2"] = model.text_encoder, model.text_encoder_2
    elif train_text_encoder:
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
        # Keys are "<module>.<tensor>"; a module has 2 (LoRA) to 5 (DoRA, LoHa, LoKr) of them.
        missing_modules = {key.split(".", 1)[0] for key in report.missing}
        logger.warning("%s: %d LoRA modules are not in the file and start from scratch", source,
                       len(missing_modules))


def save_lora(config: Config, model: DiffusionModel, spec: NetworkSpec, path: Path, metadata: dict[str, str],
              dtype: torch.dtype | None) -> None:
    net = network_args_of(config)
    # conv_alpha, block_alphas and whole-matrix LoKr layers have their own alpha; the check against spec.alpha fits
    # the rest.
    uniform = net.conv_dim is None and net.block_alphas is None and net.conv_block_dims is None
    alpha = spec.alpha if uniform and net.variant != "lokr" else None
    state_dict = network.kohya_state_dict(lora_modules(model, config), alpha, dtype)
    network.save_lora_file(path, state_dict, {} if config.no_metadata else metadata)
