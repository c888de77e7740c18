"""run(config): wires the parts together; the training loop."""
from __future__ import annotations

import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from tqdm.auto import tqdm

from library import network, objective
from library.accelerator import prepare_accelerator
from library.config import Config, UserError
from library.data import ImageCaptionDataset, SeededBatchSampler, discover_subsets
from library.families import Components, encode_prompt, load_sd_components, tokenize
from library.optim import build_lr_scheduler, build_optimizer, warmup_steps

logger = logging.getLogger(__name__)

WEIGHT_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SAVE_DTYPES = {None: None, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class DiffusionModel(torch.nn.Module):
    """The text encoder and UNet as one module, so DDP and DeepSpeed see every LoRA parameter in one place."""

    def __init__(self, unet: torch.nn.Module, text_encoder: torch.nn.Module, train_text_encoder: bool):
        super().__init__()
        self.unet = unet
        self.text_encoder = text_encoder
        self.train_text_encoder = train_text_encoder

    def forward(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(self.train_text_encoder and torch.is_grad_enabled()):
            hidden_states = encode_prompt(self.text_encoder, input_ids)
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
def encode_latents(vae: torch.nn.Module, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """VAE posterior sample scaled to the UNet's latent range."""
    distribution = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist
    # Drawn on CPU from the step's generator, so the sample does not depend on the device or the global RNG.
    eps = torch.randn(distribution.mean.shape, generator=generator, dtype=torch.float32)
    latents = distribution.mean + distribution.std * eps.to(device=distribution.mean.device,
                                                              dtype=distribution.mean.dtype)
    return latents * vae.config.scaling_factor


@dataclass(frozen=True)
class Plan:
    """Derived counts; kept out of the read-only config."""
    batches_per_epoch: int  # per process
    steps_per_epoch: int
    total_steps: int
    num_epochs: int


def make_plan(config: Config, batches_per_epoch: int) -> Plan:
    steps_per_epoch = math.ceil(batches_per_epoch / config.gradient_accumulation_steps)
    if config.max_train_epochs:
        total_steps = steps_per_epoch * config.max_train_epochs
    else:
        total_steps = config.max_train_steps
    return Plan(batches_per_epoch, steps_per_epoch, total_steps, math.ceil(total_steps / steps_per_epoch))


@dataclass
class RunResult:
    """What a finished run reports back to its caller (tests and benchmarks)."""
    output_file: Path | None
    global_step: int
    model: DiffusionModel | None = None  # the unwrapped trained model, for in-process callers
    losses: list[float] = field(default_factory=list)  # mean loss of each optimizer step on this process
    step_times: list[float] = field(default_factory=list)  # wall seconds of each optimizer step


def resolve_seed(config: Config, accelerator: Accelerator) -> int:
    """The configured seed, or one random seed shared by every process."""
    seed = config.seed if config.seed is not None else secrets.randbelow(2**31)
    if accelerator.num_processes > 1 and config.seed is None:
        seed = broadcast_object_list([seed])[0]
    return seed


def trained_parts(config: Config) -> tuple[bool, bool]:
    """(train the UNet, train the text encoder)."""
    return not config.network_train_text_encoder_only, not config.network_train_unet_only


def build_model(config: Config, components: Components, device: torch.device) -> tuple[DiffusionModel, list[dict[str, Any]]]:
    """Freeze the base (already in its weight dtype), attach fp32 LoRA; return the model and optimizer groups."""
    train_unet, train_text_encoder = trained_parts(config)
    unet, text_encoder = components.unet, components.text_encoder
    for module in (unet, text_encoder, components.vae):
        module.requires_grad_(False)
    components.vae.to(device).eval()
    unet.to(device)
    text_encoder.to(device)

    groups: list[dict[str, Any]] = []
    if train_unet:
        params = network.attach_lora(unet, network.unet_target_modules(unet), config.network_dim,
                                     config.network_alpha, config.network_dropout)
        groups.append({"params": params, "lr": config.unet_lr if config.unet_lr is not None
                       else config.learning_rate, "name": "unet"})
    if train_text_encoder:
        params = network.attach_lora(text_encoder, network.text_encoder_target_modules(text_encoder),
                                     config.network_dim, config.network_alpha, config.network_dropout)
        groups.append({"params": params, "lr": config.text_encoder_lr if config.text_encoder_lr is not None
                       else config.learning_rate, "name": "text_encoder"})
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        if train_text_encoder:
            # Non-reentrant: with a frozen base the inputs need no grad, which reentrant checkpointing requires.
            text_encoder.activation_checkpointing_enable({"use_reentrant": False})
    unet.train(train_unet)
    text_encoder.train(train_text_encoder)
    return DiffusionModel(unet, text_encoder, train_text_encoder), groups


def lora_modules(model: DiffusionModel, config: Config) -> dict[str, torch.nn.Module]:
    train_unet, train_text_encoder = trained_parts(config)
    modules: dict[str, torch.nn.Module] = {}
    if train_unet:
        modules["lora_unet"] = model.unet
    if train_text_encoder:
        modules["lora_te"] = model.text_encoder
    return modules


def save_lora(config: Config, model: DiffusionModel, path: Path, metadata: dict[str, str]) -> None:
    state_dict = network.kohya_state_dict(lora_modules(model, config), config.network_alpha,
                                          SAVE_DTYPES[config.save_precision])
    network.save_lora_file(path, state_dict, {} if config.no_metadata else metadata)


def training_metadata(config: Config, components: Components, plan: Plan, dataset: ImageCaptionDataset, seed: int,
                      started_at: float, global_step: int, epoch: int) -> dict[str, str]:
    return network.lora_metadata(
        network_dim=config.network_dim, network_alpha=config.network_alpha,
        v2=components.base_model_version == "sd_v2", v_parameterization=components.v_prediction,
        network_module=config.network_module, network_dropout=config.network_dropout,
        learning_rate=config.learning_rate, unet_lr=config.unet_lr, text_encoder_lr=config.text_encoder_lr,
        max_train_steps=plan.total_steps, steps=global_step, epoch=epoch, num_epochs=plan.num_epochs, seed=seed,
        resolution=config.resolution, training_started_at=started_at, training_finished_at=time.time(),
        num_train_images=dataset.num_images, num_batches_per_epoch=plan.batches_per_epoch,
        batch_size=config.train_batch_size, output_name=config.output_name,
        sd_model_name=Path(config.pretrained_model_name_or_path).name, mixed_precision=config.mixed_precision,
        lr_scheduler=config.lr_scheduler, lr_warmup_steps=warmup_steps(config.lr_warmup_steps, plan.total_steps),
        optimizer=config.optimizer_type, gradient_accumulation_steps=config.gradient_accumulation_steps,
        gradient_checkpointing=config.gradient_checkpointing, max_grad_norm=config.max_grad_norm,
        min_snr_gamma=config.min_snr_gamma, noise_offset=config.noise_offset,
        training_comment=config.training_comment,
    )


def run(config: Config) -> RunResult:
    """Train a LoRA as configured and write it to output_dir/output_name.safetensors."""
    started_at = time.time()
    accelerator = prepare_accelerator(config)
    try:
        return _train(config, accelerator, started_at)
    finally:
        accelerator.end_training()


def _train(config: Config, accelerator: Accelerator, started_at: float) -> RunResult:
    seed = resolve_seed(config, accelerator)
    set_seed(seed)  # LoRA initialisation; the training path itself uses step generators
    weight_dtype = WEIGHT_DTYPES[config.mixed_precision]

    subsets = discover_subsets(config.train_data_dir, config.caption_extension)
    components = load_sd_components(config.pretrained_model_name_or_path, config.v2, config.v_parameterization,
                                    weight_dtype, torch.float32 if config.no_half_vae else weight_dtype)
    dataset = ImageCaptionDataset(subsets, config.resolution,
                                  lambda caption: tokenize(components.tokenizer, caption))
    sampler = SeededBatchSampler(len(dataset), config.train_batch_size, seed)
    dataloader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=config.max_data_loader_n_workers,
        persistent_workers=config.persistent_data_loader_workers and config.max_data_loader_n_workers > 0)

    model, groups = build_model(config, components, accelerator.device)
    trainable = [p for group in groups for p in group["params"]]
    optimizer = build_optimizer(config.optimizer_type, groups, config.learning_rate, config.optimizer_args)

    # The plan needs the per-process batch count, which only the prepared loader knows.
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    plan = make_plan(config, len(dataloader))
    lr_scheduler = accelerator.prepare(build_lr_scheduler(
        config.lr_scheduler, optimizer, plan.total_steps, config.lr_warmup_steps, config.lr_scheduler_num_cycles,
        config.lr_scheduler_power))

    obj = Objective(components.noise_scheduler.alphas_cumprod.to(accelerator.device), components.v_prediction,
                    config.min_timestep, config.max_timestep, config.noise_offset, config.min_snr_gamma)
    logger.info("%d images x repeats = %d samples, %d batches per epoch per process, %d epochs, %d steps",
                dataset.num_images, len(dataset), plan.batches_per_epoch, plan.num_epochs, plan.total_steps)

    result = RunResult(output_file=None, global_step=0)
    progress = tqdm(total=plan.total_steps, desc="steps", disable=not accelerator.is_main_process,
                    dynamic_ncols=True)
    global_step, epoch = 0, 0
    step_losses: list[torch.Tensor] = []
    step_started = time.perf_counter()
    for epoch in range(plan.num_epochs):
        sampler.set_epoch(epoch)
        for batch_index, batch in enumerate(dataloader):
            generator = objective.step_generator(seed, epoch, batch_index, accelerator.process_index)
            with accelerator.accumulate(model):
                latents = encode_latents(components.vae, batch["pixels"], generator).to(weight_dtype)
                noise = objective.sample_noise(latents, generator, obj.noise_offset)
                timesteps = objective.sample_timesteps(latents.shape[0], generator, obj.min_timestep,
                                                       obj.max_timestep, latents.device)
                with accelerator.autocast():
                    loss = diffusion_loss(model, latents, batch["input_ids"], noise, timesteps, obj).mean()
                accelerator.backward(loss)
                if accelerator.sync_gradients and config.max_grad_norm:
                    accelerator.clip_grad_norm_(trainable, config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_losses.append(loss.detach())
            if not accelerator.sync_gradients:
                continue

            lr_scheduler.step()
            global_step += 1
            now = time.perf_counter()
            result.step_times.append(now - step_started)
            step_started = now
            result.losses.append(torch.stack(step_losses).float().mean().item())
            step_losses.clear()
            progress.update(1)
            progress.set_postfix(loss=f"{result.losses[-1]:.4f}", s_per_step=f"{result.step_times[-1]:.3f}",
                                 refresh=False)
            if global_step >= plan.total_steps:
                break
        if global_step >= plan.total_steps:
            break
    progress.close()

    result.global_step = global_step
    result.model = accelerator.unwrap_model(model)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        output_dir = Path(config.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        path = output_dir / f"{config.output_name}.safetensors"
        metadata = training_metadata(config, components, plan, dataset, seed, started_at, global_step, epoch + 1)
        save_lora(config, result.model, path, metadata)
        logger.info("saved %s", path)
        result.output_file = path
    return result
