"""run(config): wires the parts together; the training loop."""
from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, send_to_device, set_seed
from tqdm.auto import tqdm

from library.training import adapters as adapter_training
from library.network import lora as network
from library.core import seeds
from library.models import objective
from library.monitoring.chart import loss_by_timestep_chart, save_png
from library.network.metadata import lora_metadata, model_file_hashes
from library.training.accelerator import prepare_accelerator
from library.config import Config, UserError
from library.data.cache import cache_latents, cache_text_encoder_outputs
from library.data.dataset import TrainingData, build_training_data
from library.models.family import (Components, caption_tokenizer, encode_tokens, load_sd_components,
                               zero_terminal_snr)
from library.training.model import (SAVE_DTYPES, WEIGHT_DTYPES, DiffusionModel, NetworkSpec, Objective, batch_conditioning,
                           batch_latents, build_model, diffusion_loss, load_adapter, lora_modules, network_spec,
                           save_lora, trained_parts)
from library.training.optim import build_lr_scheduler, build_optimizer, schedule_free_eval, warmup_steps
from library.monitoring.sampling import SamplingModels, load_prompts, sample_images
from library.training.state import (Checkpointer, TrainState, epoch_name, incompatibilities, library_versions,
                           path_changes, prune_epochs, prune_steps, remove_stale_temporaries, resolve_resume,
                           state_dir_name, step_name)
from library.monitoring.tracking import StepMetrics, TimestepLoss, Trackers, lr_names
from library.monitoring.validation import evaluating, should_validate, validation_loss, validation_metrics

logger = logging.getLogger(__name__)


def cache_inputs(config: Config, data: TrainingData, components: Components, accelerator: Accelerator,
                 vae_dtype: torch.dtype) -> None:
    """Encode latents and text-encoder outputs once, before training, when asked."""
    if config.cache_latents or config.cache_latents_to_disk:
        cache_latents(data, components.vae, accelerator.device, vae_dtype, config.vae_batch_size,
                      config.cache_latents_to_disk, process_index=accelerator.process_index,
                      num_processes=accelerator.num_processes, wait_for_everyone=accelerator.wait_for_everyone,
                      skip_bad_images=config.skip_bad_images)
    if config.cache_text_encoder_outputs:
        @torch.no_grad()
        def encode(tokens: Any) -> Any:
            encoded = encode_tokens(components.text_encoder, components.text_encoder_2,
                                    send_to_device(tokens, accelerator.device), config.clip_skip)
            return send_to_device(encoded, "cpu")

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
    validation: dict[int, float] = field(default_factory=dict)  # the last validation loss per timestep
    step_times: list[float] = field(default_factory=list)  # wall seconds of each optimizer step


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
                "optimizer_args", "v_parameterization", "full_fp16", "full_bf16", "clip_skip",
                "max_token_length", "noise_offset_random_strength", "adaptive_noise_scale",
                "multires_noise_iterations", "multires_noise_discount", "ip_noise_gamma",
                "ip_noise_gamma_random_strength", "loss_type", "huber_schedule", "huber_c", "huber_scale",
                "debiased_estimation_loss", "scale_v_pred_loss_like_noise_pred", "v_pred_like_loss",
                "zero_terminal_snr", "masked_loss", "alpha_mask", "loraplus_lr_ratio", "loraplus_unet_lr_ratio",
                "loraplus_text_encoder_lr_ratio", "scale_weight_norms", "ema_decay")


def path_settings(config: Config, seed: int, data: TrainingData) -> dict[str, Any]:
    values = {name: getattr(config, name) for name in PATH_OPTIONS}
    values["seed"] = seed
    values["dataset"] = data.fingerprint()
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def sample_prompts(config: Config) -> list:
    if config.sample_prompts is None:
        if config.sample_every_n_steps or config.sample_every_n_epochs or config.sample_at_first:
            logger.warning("sample_every_n_steps / sample_every_n_epochs / sample_at_first do nothing without "
                           "sample_prompts")
        return []
    prompts = load_prompts(config.sample_prompts, config.resolution)
    if not (config.sample_every_n_steps or config.sample_every_n_epochs or config.sample_at_first):
        logger.warning("sample_prompts is set but no sample_every_n_steps, sample_every_n_epochs or "
                       "sample_at_first: no samples will be made")
    return prompts


def sampling_due(config: Config, step: int, epoch_ended: bool, epoch: int) -> int | None | bool:
    """kohya's rule: with sample_every_n_epochs, sample at those epoch ends only (named by epoch); otherwise every
    sample_every_n_steps steps (named by step). Returns the epoch, None for a step round, or False."""
    if config.sample_every_n_epochs:
        return epoch if epoch_ended and epoch % config.sample_every_n_epochs == 0 else False
    if config.sample_every_n_steps and step % config.sample_every_n_steps == 0:
        return None
    return False


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
    trackers = Trackers()
    try:
        return _train(config, accelerator, started_at, trackers)
    finally:
        trackers.finish()
        accelerator.end_training()


def _train(config: Config, accelerator: Accelerator, started_at: float, trackers: Trackers) -> RunResult:
    output_dir = Path(config.output_dir)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(output_dir, "sample")
    accelerator.wait_for_everyone()
    resume_dir = resolve_resume(config.resume, output_dir)
    resumed = TrainState.read(resume_dir) if resume_dir else None
    seed = resolve_seed(config, accelerator, resumed)
    set_seed(seed)  # LoRA initialisation; the training path itself uses step generators
    weight_dtype = WEIGHT_DTYPES[config.mixed_precision]
    vae_dtype = torch.float32 if config.no_half_vae else weight_dtype
    spec = network_spec(config)

    prompts = sample_prompts(config)
    # The images are checked before the model is loaded, so data problems surface in seconds.
    data = build_training_data(config, None, seed, accelerator.num_processes)
    components = load_sd_components(config.pretrained_model_name_or_path, config.v2, config.v_parameterization,
                                    weight_dtype, vae_dtype, config.model_config, config.allow_pickle_checkpoints)
    data.set_tokenizer(caption_tokenizer(components, config.max_token_length))
    if config.zero_terminal_snr:
        components.noise_scheduler = zero_terminal_snr(components.noise_scheduler)

    model, groups = build_model(config, components, accelerator.device, spec)
    trainable = [p for group in groups for p in group["params"]]
    cache_inputs(config, data, components, accelerator, vae_dtype)
    sampler = data.sampler
    dataloader = data.dataloader(config.max_data_loader_n_workers, config.persistent_data_loader_workers)
    optimizer = build_optimizer(config.optimizer_type, groups, config.learning_rate, config.optimizer_args,
                                use_8bit_adam=config.use_8bit_adam, use_lion_optimizer=config.use_lion_optimizer)
    state = TrainState(seed=seed, world_size=accelerator.num_processes,
                       fingerprint=run_fingerprint(config, spec, components, model),
                       path_settings=path_settings(config, seed, data), versions=library_versions())

    # Batches are dealt round-robin to the processes; the scheduler must exist before prepare so that DeepSpeed
    # owns and checkpoints it.
    plan = make_plan(config, math.ceil(len(sampler) / accelerator.num_processes))
    lr_scheduler = build_lr_scheduler(config.lr_scheduler, optimizer, plan.total_steps, config.lr_warmup_steps,
                                      config.lr_scheduler_num_cycles, config.lr_scheduler_power,
                                      lr_decay_steps=config.lr_decay_steps,
                                      min_lr_ratio=config.lr_scheduler_min_lr_ratio,
                                      timescale=config.lr_scheduler_timescale,
                                      scheduler_type=config.lr_scheduler_type,
                                      scheduler_args=config.lr_scheduler_args)
    model, optimizer, dataloader, lr_scheduler = accelerator.prepare(model, optimizer, dataloader, lr_scheduler)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # DeepSpeed may swap in its own optimizer (CPU Adam for offload) and replaces its param groups when a state
        # is loaded; the schedule must set the learning rate of the optimizer that actually steps.
        lr_scheduler.scheduler.optimizer = optimizer.optimizer
    if len(dataloader) != plan.batches_per_epoch:
        raise RuntimeError(f"planned {plan.batches_per_epoch} batches per process, the loader has {len(dataloader)}")

    unwrapped = accelerator.unwrap_model(model)
    save_dtype = SAVE_DTYPES[config.save_precision]
    ema = (adapter_training.AdapterEMA(lora_modules(unwrapped, config), config.ema_decay)
           if config.ema_decay is not None else None)
    checkpointer = Checkpointer(
        accelerator,
        write_adapter=lambda path: save_lora(config, unwrapped, spec, path, {}, None),
        read_adapter=lambda path: load_adapter(config, unwrapped, network.load_kohya_lora(path)[0], strict=True,
                                               source=str(path)),
        write_ema=adapter_training.ema_writer(ema) if ema else None,
        read_ema=adapter_training.ema_reader(ema) if ema else None)
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
                    config.min_timestep, config.max_timestep, config.noise_offset, config.min_snr_gamma,
                    objective.NoiseOptions.from_config(config), objective.LossOptions.from_config(config))
    metrics = StepMetrics(TimestepLoss(config.min_timestep, config.max_timestep, config.loss_timestep_bins),
                          plan.steps_per_epoch)
    if resumed is not None:
        metrics.load_state_dict(resumed.metrics)
    group_names = lr_names(groups)
    if accelerator.is_main_process:
        trackers.start(config, started_at)

    def validation_losses(batch: dict[str, Any], generator: torch.Generator,
                          timesteps: torch.Tensor) -> torch.Tensor:
        """One held-out image at every validation timestep, with the same latent sample and noise."""
        batch = send_to_device(batch, accelerator.device)
        latents = batch_latents(batch, components.vae, generator, vae_dtype).to(weight_dtype)
        noise = objective.sample_noise(latents, generator, obj.noise_offset, obj.noise)
        n = len(timesteps)
        conditioning = send_to_device(batch_conditioning(batch), accelerator.device)
        conditioning = ({k: v.expand(n, *v.shape[1:]) for k, v in conditioning.items()}
                        if isinstance(conditioning, dict) else conditioning.expand(n, *conditioning.shape[1:]))
        masked = {"mask": batch["loss_mask"].expand(n, *batch["loss_mask"].shape[1:])} if "loss_mask" in batch else {}
        with accelerator.autocast():
            return diffusion_loss(unwrapped, latents.expand(n, *latents.shape[1:]), conditioning,
                                  noise.expand(n, *noise.shape[1:]), timesteps, obj, **masked).float()

    def sample(epoch: int | None = None) -> None:
        def encode_text(text: str) -> torch.Tensor:
            tokens = send_to_device(caption_tokenizer(components, config.max_token_length)(text), accelerator.device)
            tokens = {k: v[None] for k, v in tokens.items()} if isinstance(tokens, dict) else tokens[None]
            return encode_tokens(unwrapped.text_encoder, unwrapped.text_encoder_2, tokens, config.clip_skip)

        models = SamplingModels(unwrapped.unet, unwrapped.text_encoder, components.vae, components.tokenizer,
                                components.noise_scheduler.config,
                                "v_prediction" if components.v_prediction else None, encode_text,
                                unwrapped.text_encoder_2, components.tokenizer_2)
        with schedule_free_eval(optimizer):
            samples = sample_images(
                prompts, models, output_dir / "sample", config.output_name, base_seed=seed,
                step=None if epoch is not None else state.global_step, epoch=epoch,
                default_sampler=config.sample_sampler, device=accelerator.device,
                autocast_dtype=None if config.mixed_precision == "no" else weight_dtype,
                process_index=accelerator.process_index, num_processes=accelerator.num_processes)
        if samples:
            trackers.log_images({f"sample/{s.prompt.index:02d}": np.asarray(s.image) for s in samples},
                                step=state.global_step)

    def validate() -> None:
        # A schedule-free optimizer is measured at the weights it would save.
        with schedule_free_eval(optimizer), evaluating([unwrapped]):
            losses = validation_loss(
                data.validation, data.collate_fn, validation_losses, config.validation_timesteps,
                seed if config.validation_seed is None else config.validation_seed, accelerator.device,
                accelerator.process_index, accelerator.num_processes,
                lambda t: accelerator.reduce(t, reduction="sum") if accelerator.num_processes > 1 else t)
        result.validation = losses
        trackers.log(validation_metrics(losses), step=state.global_step)
        logger.info("validation loss at step %d: %s", state.global_step,
                    ", ".join(f"t{t} {v:.4f}" for t, v in losses.items()))
    logger.info("%d batches per epoch per process, %d epochs, %d steps", plan.batches_per_epoch, plan.num_epochs,
                plan.total_steps)

    def metadata() -> dict[str, str]:
        return training_metadata(config, spec, components, plan, data, seed, started_at, state)

    def save_snapshot(name: str, with_state: bool) -> None:
        if accelerator.is_main_process:
            path = output_dir / f"{name}.safetensors"
            # A schedule-free optimizer's kept weights, not its training ones; or the EMA when asked.
            saved_weights = ema.swapped() if ema and config.ema_for_saved_file else nullcontext()
            with schedule_free_eval(optimizer), saved_weights:
                save_lora(config, unwrapped, spec, path, metadata(), save_dtype)
            logger.info("saved %s", path)
        if with_state:
            state.metrics = metrics.state_dict()
            checkpointer.save(output_dir / state_dir_name(name), state)

    result = RunResult(output_file=None, global_step=state.global_step)
    progress = tqdm(total=plan.total_steps, initial=state.global_step, desc="steps",
                    disable=not accelerator.is_main_process, dynamic_ncols=True)
    step_losses: list[torch.Tensor] = []
    step_samples: list[tuple[torch.Tensor, torch.Tensor]] = []  # (per-sample loss, timestep) for the bins
    validated_at = -1
    if prompts and config.sample_at_first:
        sample()
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
            generator = seeds.step_generator(seed, *keys)
            # Dropout draws from the global stream; reseeding it per batch makes it independent of history.
            torch.manual_seed(seeds.torch_seed(seed, *keys, 1))
            with accelerator.accumulate(model):
                latents = batch_latents(batch, components.vae, generator, vae_dtype).to(weight_dtype)
                noise = objective.sample_noise(latents, generator, obj.noise_offset, obj.noise)
                timesteps = objective.sample_timesteps(latents.shape[0], generator, obj.min_timestep,
                                                       obj.max_timestep, latents.device)
                # Passed only when in use, so that wrappers of diffusion_loss (the tests') see the plain call.
                extra: dict[str, torch.Tensor] = {}
                if obj.noise.ip_noise_gamma:
                    extra["input_noise"] = objective.perturb_noise(noise, generator, obj.noise)
                if "loss_mask" in batch:
                    extra["mask"] = batch["loss_mask"]
                with accelerator.autocast():
                    conditioning = batch_conditioning(batch)
                    per_sample = diffusion_loss(model, latents, conditioning, noise, timesteps, obj, **extra)
                    per_sample = per_sample * batch["loss_weight"]
                    loss = per_sample.mean()
                accelerator.backward(loss)
                if accelerator.sync_gradients and config.max_grad_norm:
                    accelerator.clip_grad_norm_(trainable, config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_losses.append(loss.detach())
            step_samples.append((per_sample.detach(), timesteps))
            if not accelerator.sync_gradients:
                continue
            adapter_logs = adapter_training.after_optimizer_step(lora_modules(unwrapped, config).values(),
                                                                 config.scale_weight_norms, ema)

            lr_scheduler.step()
            state.global_step += 1
            state.batch_in_epoch = batch_index + 1
            if state.batch_in_epoch >= plan.batches_per_epoch:
                state.epoch, state.batch_in_epoch = epoch + 1, 0
            now = time.perf_counter()
            result.step_times.append(now - step_started)
            step_started = now
            # One collective per step: this process's mean loss, sample count and binned loss sums, added up.
            per_sample_losses = torch.cat([losses for losses, _ in step_samples])
            packed = torch.cat([torch.stack(step_losses).float().mean().double().cpu().view(1),
                                torch.tensor([float(per_sample_losses.numel())], dtype=torch.float64),
                                metrics.timestep_loss.totals(per_sample_losses,
                                                             torch.cat([t for _, t in step_samples]))])
            if accelerator.num_processes > 1:
                packed = accelerator.reduce(packed.to(accelerator.device), reduction="sum").cpu()
            result.losses.append(packed[0].item() / accelerator.num_processes)
            step_losses.clear()
            step_samples.clear()
            values = metrics.step(result.losses[-1], packed[2:], dict(zip(group_names, (
                group["lr"] for group in optimizer.param_groups))), int(packed[1].item()), result.step_times[-1],
                accelerator.device)
            trackers.log({**values, **adapter_logs}, step=state.global_step)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("step %d loss %.6f lr %s", state.global_step, result.losses[-1],
                             [group["lr"] for group in optimizer.param_groups])
            progress.update(1)
            progress.set_postfix(loss=f"{result.losses[-1]:.4f}", s_per_step=f"{result.step_times[-1]:.3f}",
                                 refresh=False)

            if data.validation is not None and should_validate(
                    state.global_step, state.batch_in_epoch == 0, state.epoch, config.validate_every_n_steps,
                    config.validate_every_n_epochs):
                validate()
                validated_at = state.global_step
            if prompts:
                sample_epoch = sampling_due(config, state.global_step, state.batch_in_epoch == 0, state.epoch)
                if sample_epoch is not False:
                    sample(sample_epoch)
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
    if data.validation is not None and validated_at != state.global_step:
        validate()

    result.global_step = state.global_step
    result.model = unwrapped
    save_snapshot(config.output_name, config.save_state or config.save_state_on_train_end)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        result.output_file = output_dir / f"{config.output_name}.safetensors"
        chart = loss_by_timestep_chart(metrics.timestep_loss.bins(), result.validation,
                                       components.noise_scheduler.config.num_train_timesteps)
        save_png(chart, output_dir / f"{config.output_name}_loss_by_timestep.png")
        trackers.log_images({"loss/by_timestep": np.asarray(chart)}, step=state.global_step)
    return result


def training_metadata(config: Config, spec: NetworkSpec, components: Components, plan: Plan,
                      data: TrainingData, seed: int, started_at: float, state: TrainState) -> dict[str, str]:
    model = Path(config.pretrained_model_name_or_path)
    # A folder has no single file to hash; kohya writes "IsADirectory" there, which helps nobody.
    model_hashes = model_file_hashes(str(model.resolve())) if model.is_file() else {}
    return lora_metadata(
        network_dim=spec.dim, network_alpha=spec.alpha,
        v2=components.family.name == "sd2", v_parameterization=components.v_prediction,
        sdxl=components.sdxl,
        network_module=config.network_module, network_dropout=config.network_dropout,
        network_args=dict(arg.split("=", 1) for arg in config.network_args),
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
        min_snr_gamma=config.min_snr_gamma, noise_offset=config.noise_offset, clip_skip=config.clip_skip,
        max_token_length=config.max_token_length,
        training_comment=config.training_comment, title=config.metadata_title, author=config.metadata_author,
        description=config.metadata_description, license=config.metadata_license, tags=config.metadata_tags,
        extra={**data.kohya_metadata(), **model_hashes},
    )
