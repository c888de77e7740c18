"""run(config): wires the parts together; the training loop."""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, set_seed
from tqdm.auto import tqdm

from library import network, objective
from library.metadata import lora_metadata
from library.accelerator import prepare_accelerator
from library.config import Config, UserError
from library.cache import cache_latents, cache_text_encoder_outputs, check_finite_latents, sample_cached_latents
from library.data import TrainingData, build_training_data
from library.families import Components, encode_prompt, load_sd_components, tokenize
from library.optim import build_lr_scheduler, build_optimizer, warmup_steps
from library.state import (Checkpointer, TrainState, epoch_name, incompatibilities, library_versions,
                           path_changes, prune_epochs, prune_steps, remove_stale_temporaries, resolve_resume,
                           state_dir_name, step_name)

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

    def forward(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, conditioning: torch.Tensor) -> torch.Tensor:
        """`conditioning`: token ids, or text-encoder hidden states when they were cached (float)."""
        if conditioning.is_floating_point():
            hidden_states = conditioning
        else:
            with torch.set_grad_enabled(self.train_text_encoder and torch.is_grad_enabled()):
                hidden_states = encode_prompt(self.text_encoder, conditioning)
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


def cache_inputs(config: Config, data: TrainingData, components: Components, accelerator: Accelerator,
                 vae_dtype: torch.dtype) -> None:
    """Encode latents and text-encoder outputs once, before training, when asked."""
    if config.cache_latents or config.cache_latents_to_disk:
        cache_latents(data, components.vae, accelerator.device, vae_dtype, config.vae_batch_size,
                      config.cache_latents_to_disk, process_index=accelerator.process_index,
                      num_processes=accelerator.num_processes, wait_for_everyone=accelerator.wait_for_everyone,
                      skip_bad_images=config.skip_bad_images)
    if config.cache_text_encoder_outputs:
        text_encoder = components.text_encoder

        @torch.no_grad()
        def encode(input_ids: torch.Tensor) -> torch.Tensor:
            return encode_prompt(text_encoder, input_ids.to(accelerator.device)).cpu()

        cache_text_encoder_outputs(data, encode)


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
    losses: list[float] = field(default_factory=list)  # each optimizer step's loss, averaged over processes
    step_times: list[float] = field(default_factory=list)  # wall seconds of each optimizer step


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
    model = DiffusionModel(unet, text_encoder, train_text_encoder)
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


def run_fingerprint(config: Config, spec: NetworkSpec, components: Components,
                    model: DiffusionModel) -> dict[str, Any]:
    """What a state must share with this run to be resumed: the adapter's shape and the base architecture."""
    train_unet, train_text_encoder = trained_parts(config)
    return {
        "network_module": config.network_module, "network_dim": spec.dim, "network_alpha": spec.alpha,
        "network_args": list(config.network_args), "train_unet": train_unet,
        "train_text_encoder": train_text_encoder, "optimizer_type": config.optimizer_type.lower(),
        "lora_modules": _digest(sorted(name for prefix, module in lora_modules(model, config).items()
                                       for name, _ in network.lora_layers(module))),
        "base_model_version": components.base_model_version,
        "unet_config": _digest(_architecture(components.unet.config)),
        "text_encoder_config": _digest(_architecture(components.text_encoder.config.to_dict())),
    }


def _architecture(config: Any) -> dict[str, Any]:
    return {k: v for k, v in dict(config).items() if not k.startswith("_") and k not in ("dtype", "torch_dtype")}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


PATH_OPTIONS = ("seed", "train_batch_size", "gradient_accumulation_steps", "resolution", "train_data_dir",
                "learning_rate", "unet_lr", "text_encoder_lr", "lr_scheduler", "lr_warmup_steps", "mixed_precision",
                "max_grad_norm", "min_snr_gamma", "noise_offset", "min_timestep", "max_timestep", "network_dropout",
                "optimizer_args", "v_parameterization", "full_fp16", "full_bf16")


def path_settings(config: Config, seed: int, data: TrainingData) -> dict[str, Any]:
    values = {name: getattr(config, name) for name in PATH_OPTIONS}
    values["seed"] = seed
    values["dataset"] = data.fingerprint()
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def resolve_seed(config: Config, accelerator: Accelerator, resumed: TrainState | None) -> int:
    """The resumed run's seed, the configured one, or one random seed shared by every process."""
    if resumed is not None and config.seed is None:
        return resumed.seed
    seed = config.seed if config.seed is not None else secrets.randbelow(2**31)
    if accelerator.num_processes > 1 and config.seed is None:
        seed = broadcast_object_list([seed])[0]
    return seed


def run(config: Config) -> RunResult:
    """Train a LoRA as configured and write it to output_dir/output_name.safetensors."""
    started_at = time.time()
    accelerator = prepare_accelerator(config)
    try:
        return _train(config, accelerator, started_at)
    finally:
        accelerator.end_training()


def _train(config: Config, accelerator: Accelerator, started_at: float) -> RunResult:
    output_dir = Path(config.output_dir)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(output_dir)
    accelerator.wait_for_everyone()
    resume_dir = resolve_resume(config.resume, output_dir)
    resumed = TrainState.read(resume_dir) if resume_dir else None
    seed = resolve_seed(config, accelerator, resumed)
    set_seed(seed)  # LoRA initialisation; the training path itself uses step generators
    weight_dtype = WEIGHT_DTYPES[config.mixed_precision]
    vae_dtype = torch.float32 if config.no_half_vae else weight_dtype
    spec = network_spec(config)

    # The images are checked before the model is loaded, so data problems surface in seconds.
    data = build_training_data(config, None, seed, accelerator.num_processes)
    components = load_sd_components(config.pretrained_model_name_or_path, config.v2, config.v_parameterization,
                                    weight_dtype, vae_dtype)
    data.dataset.tokenize = functools.partial(tokenize, components.tokenizer)

    model, groups = build_model(config, components, accelerator.device, spec)
    trainable = [p for group in groups for p in group["params"]]
    cache_inputs(config, data, components, accelerator, vae_dtype)
    sampler = data.sampler
    dataloader = data.dataloader(config.max_data_loader_n_workers, config.persistent_data_loader_workers)
    optimizer = build_optimizer(config.optimizer_type, groups, config.learning_rate, config.optimizer_args)
    state = TrainState(seed=seed, world_size=accelerator.num_processes,
                       fingerprint=run_fingerprint(config, spec, components, model),
                       path_settings=path_settings(config, seed, data), versions=library_versions())

    # Batches are dealt round-robin to the processes; the scheduler must exist before prepare so that DeepSpeed
    # owns and checkpoints it.
    plan = make_plan(config, math.ceil(len(sampler) / accelerator.num_processes))
    lr_scheduler = build_lr_scheduler(config.lr_scheduler, optimizer, plan.total_steps, config.lr_warmup_steps,
                                      config.lr_scheduler_num_cycles, config.lr_scheduler_power)
    model, optimizer, dataloader, lr_scheduler = accelerator.prepare(model, optimizer, dataloader, lr_scheduler)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # DeepSpeed may swap in its own optimizer (CPU Adam for offload) and replaces its param groups when a state
        # is loaded; the schedule must set the learning rate of the optimizer that actually steps.
        lr_scheduler.scheduler.optimizer = optimizer.optimizer
    if len(dataloader) != plan.batches_per_epoch:
        raise RuntimeError(f"planned {plan.batches_per_epoch} batches per process, the loader has {len(dataloader)}")

    unwrapped = accelerator.unwrap_model(model)
    save_dtype = SAVE_DTYPES[config.save_precision]
    checkpointer = Checkpointer(
        accelerator,
        write_adapter=lambda path: save_lora(config, unwrapped, spec, path, {}, None),
        read_adapter=lambda path: load_adapter(config, unwrapped, network.load_kohya_lora(path)[0], strict=True,
                                               source=str(path)))
    if resumed is not None:
        problems = incompatibilities(resumed, state)
        if problems:
            raise UserError([f"cannot resume from {resume_dir}: it was saved by an incompatible run"] + problems)
        for change in path_changes(resumed, state):
            logger.warning("resuming with a changed setting; the run will not follow the original path: %s", change)
        checkpointer.load(resume_dir)
        state.epoch, state.global_step, state.batch_in_epoch = (
            resumed.epoch, resumed.global_step, resumed.batch_in_epoch)
        logger.info("resumed from %s at step %d (epoch %d, batch %d)", resume_dir, state.global_step,
                    state.epoch + 1, state.batch_in_epoch)

    obj = Objective(components.noise_scheduler.alphas_cumprod.to(accelerator.device), components.v_prediction,
                    config.min_timestep, config.max_timestep, config.noise_offset, config.min_snr_gamma)
    logger.info("%d batches per epoch per process, %d epochs, %d steps", plan.batches_per_epoch, plan.num_epochs,
                plan.total_steps)

    def metadata() -> dict[str, str]:
        return training_metadata(config, spec, components, plan, data, seed, started_at, state)

    def save_snapshot(name: str, with_state: bool) -> None:
        if accelerator.is_main_process:
            path = output_dir / f"{name}.safetensors"
            save_lora(config, unwrapped, spec, path, metadata(), save_dtype)
            logger.info("saved %s", path)
        if with_state:
            checkpointer.save(output_dir / state_dir_name(name), state)

    result = RunResult(output_file=None, global_step=state.global_step)
    progress = tqdm(total=plan.total_steps, initial=state.global_step, desc="steps",
                    disable=not accelerator.is_main_process, dynamic_ncols=True)
    step_losses: list[torch.Tensor] = []
    step_started = time.perf_counter()
    while state.global_step < plan.total_steps and state.epoch < plan.num_epochs:
        epoch, first_batch = state.epoch, state.batch_in_epoch
        # Batches are dealt round-robin to processes, so k batches per process are k * world batches overall.
        sampler.set_epoch(epoch, start_batch=first_batch * accelerator.num_processes)
        # accelerate's loader calls set_epoch(its own pass count) when iteration starts: make that count ours.
        dataloader.set_epoch(epoch)
        for batch_index, batch in enumerate(dataloader, start=first_batch):
            # Keyed by the batch's position in the epoch's global order (batches are dealt round-robin), so the
            # same batch gets the same noise whatever the number of processes.
            keys = (epoch, batch_index * accelerator.num_processes + accelerator.process_index)
            generator = objective.step_generator(seed, *keys)
            # Dropout draws from the global stream; reseeding it per batch makes it independent of history.
            torch.manual_seed(objective.torch_seed(seed, *keys, 1))
            with accelerator.accumulate(model):
                latents = batch_latents(batch, components.vae, generator, vae_dtype).to(weight_dtype)
                noise = objective.sample_noise(latents, generator, obj.noise_offset)
                timesteps = objective.sample_timesteps(latents.shape[0], generator, obj.min_timestep,
                                                       obj.max_timestep, latents.device)
                with accelerator.autocast():
                    conditioning = batch.get("encoder_hidden_states", batch.get("input_ids"))
                    loss = diffusion_loss(model, latents, conditioning, noise, timesteps, obj)
                    loss = (loss * batch["loss_weight"]).mean()
                accelerator.backward(loss)
                if accelerator.sync_gradients and config.max_grad_norm:
                    accelerator.clip_grad_norm_(trainable, config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_losses.append(loss.detach())
            if not accelerator.sync_gradients:
                continue

            lr_scheduler.step()
            state.global_step += 1
            state.batch_in_epoch = batch_index + 1
            if state.batch_in_epoch >= plan.batches_per_epoch:
                state.epoch, state.batch_in_epoch = epoch + 1, 0
            now = time.perf_counter()
            result.step_times.append(now - step_started)
            step_started = now
            step_loss = torch.stack(step_losses).float().mean()
            if accelerator.num_processes > 1:
                step_loss = accelerator.reduce(step_loss, reduction="mean")
            result.losses.append(step_loss.item())
            step_losses.clear()
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("step %d loss %.6f lr %s", state.global_step, result.losses[-1],
                             [group["lr"] for group in optimizer.param_groups])
            progress.update(1)
            progress.set_postfix(loss=f"{result.losses[-1]:.4f}", s_per_step=f"{result.step_times[-1]:.3f}",
                                 refresh=False)

            if state.global_step >= plan.total_steps:
                break
            if config.save_every_n_steps and state.global_step % config.save_every_n_steps == 0:
                save_snapshot(step_name(config.output_name, state.global_step), config.save_state)
                if accelerator.is_main_process:
                    prune_steps(output_dir, config.output_name, state.global_step, config.save_last_n_steps, False)
                    prune_steps(output_dir, config.output_name, state.global_step,
                                config.save_last_n_steps_state, True)
            if state.batch_in_epoch == 0 and config.save_every_n_epochs and \
                    state.epoch % config.save_every_n_epochs == 0:
                save_snapshot(epoch_name(config.output_name, state.epoch), config.save_state)
                if accelerator.is_main_process:
                    prune_epochs(output_dir, config.output_name, config.save_last_n_epochs, False)
                    prune_epochs(output_dir, config.output_name, config.save_last_n_epochs_state, True)
        else:
            # The loader ran out without the step counter wrapping the epoch (an empty remainder).
            if state.epoch == epoch:
                state.epoch, state.batch_in_epoch = epoch + 1, 0
    progress.close()

    result.global_step = state.global_step
    result.model = unwrapped
    save_snapshot(config.output_name, config.save_state or config.save_state_on_train_end)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        result.output_file = output_dir / f"{config.output_name}.safetensors"
    return result


def training_metadata(config: Config, spec: NetworkSpec, components: Components, plan: Plan,
                      data: TrainingData, seed: int, started_at: float, state: TrainState) -> dict[str, str]:
    return lora_metadata(
        network_dim=spec.dim, network_alpha=spec.alpha,
        v2=components.base_model_version == "sd_v2", v_parameterization=components.v_prediction,
        network_module=config.network_module, network_dropout=config.network_dropout,
        learning_rate=config.learning_rate, unet_lr=config.unet_lr, text_encoder_lr=config.text_encoder_lr,
        max_train_steps=plan.total_steps, steps=state.global_step, epoch=state.epoch, num_epochs=plan.num_epochs,
        seed=seed, resolution=config.resolution, training_started_at=started_at, training_finished_at=time.time(),
        num_train_images=data.num_train_images, num_reg_images=data.num_reg_images,
        num_batches_per_epoch=plan.batches_per_epoch,
        batch_size=config.train_batch_size, output_name=config.output_name,
        sd_model_name=Path(config.pretrained_model_name_or_path).name, mixed_precision=config.mixed_precision,
        full_fp16=config.full_fp16,
        lr_scheduler=config.lr_scheduler, lr_warmup_steps=warmup_steps(config.lr_warmup_steps, plan.total_steps),
        optimizer=config.optimizer_type, gradient_accumulation_steps=config.gradient_accumulation_steps,
        gradient_checkpointing=config.gradient_checkpointing, max_grad_norm=config.max_grad_norm,
        min_snr_gamma=config.min_snr_gamma, noise_offset=config.noise_offset,
        training_comment=config.training_comment, extra=data.kohya_metadata(),
    )
