"""Builds the Accelerator from the config: process group, DDP kwargs, torch.compile backend, DeepSpeed plugin."""
from __future__ import annotations

import datetime
import importlib.util
import logging
import os
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs

from library.config import Config, UserError
from library.training.extension_locks import check_extension_locks
from library.training.optim import parse_key_values, resolve_optimizer_type

logger = logging.getLogger(__name__)


def launcher_world_size() -> int:
    """The process count the launcher (torchrun / accelerate launch) announced."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def accelerator_kwargs(config: Config) -> dict[str, Any]:
    """The Accelerator's keyword arguments; split out so they can be inspected without starting a process group."""
    world_size = launcher_world_size()
    handlers: list[Any] = []
    # A process-group handler in a plain single process makes accelerate expect a group that never exists.
    if world_size > 1:
        timeout = datetime.timedelta(minutes=config.ddp_timeout) if config.ddp_timeout else None
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        handlers.append(InitProcessGroupKwargs(backend=backend, timeout=timeout))
    if config.ddp_gradient_as_bucket_view or config.ddp_static_graph:
        handlers.append(DistributedDataParallelKwargs(
            gradient_as_bucket_view=config.ddp_gradient_as_bucket_view, static_graph=config.ddp_static_graph))

    kwargs: dict[str, Any] = {
        "mixed_precision": config.mixed_precision,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "kwargs_handlers": handlers,
        # torch_compile compiles the denoiser's repeated blocks (training.model.compile_repeated_blocks), not the
        # whole model as accelerate's dynamo_backend would: compile time is paid once per block type.
        "dynamo_backend": "no",
        # The LR schedule counts optimizer steps; the trainer steps it once per optimizer step on every rank.
        "step_scheduler_with_optimizer": False,
    }
    if config.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        kwargs["deepspeed_plugin"] = deepspeed_plugin(config, world_size)
    elif not torch.cuda.is_available():
        # Without cpu=True, several CPU processes train unsynchronised copies and nothing says so.
        kwargs["cpu"] = True
    return kwargs


def deepspeed_plugin(config: Config, world_size: int) -> DeepSpeedPlugin:
    if importlib.util.find_spec("deepspeed") is None:
        raise UserError("deepspeed = true needs DeepSpeed: pip install deepspeed "
                        "(DS_BUILD_OPS=0 pip install deepspeed installs without compiling ops)")
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one process per machine looks (and removes)
        lock_problems = check_extension_locks()  # a stale op build lock would make DeepSpeed wait forever
        if lock_problems:
            raise UserError(lock_problems)
    def setting(name: str, env: str) -> Any:
        # The training config wins; otherwise what `accelerate launch` (its config file or flags) put in the env.
        if config.is_set(name) or env not in os.environ:
            return getattr(config, name)
        value = os.environ[env]
        return int(value) if name == "zero_stage" else (None if value == "none" else value)

    zero_stage = setting("zero_stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE")
    offload_optimizer = setting("offload_optimizer_device", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE")
    plugin = DeepSpeedPlugin(
        zero_stage=zero_stage,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        gradient_clipping=config.max_grad_norm or None,
        offload_optimizer_device=offload_optimizer,
        offload_param_device=setting("offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
    )
    micro_batch = config.train_batch_size
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch
    plugin.deepspeed_config["train_batch_size"] = micro_batch * config.gradient_accumulation_steps * world_size
    cpu_adam = offload_optimizer is not None and keeps_deepspeed_cpu_adam(config)
    if offload_optimizer is not None and not cpu_adam:
        # accelerate would otherwise swap any optimizer for DeepSpeed's CPU Adam, keeping only lr and weight_decay.
        plugin.deepspeed_config["zero_force_ds_cpu_optimizer"] = False
        logger.info("DeepSpeed optimizer offload: the configured optimizer steps on the CPU copy (DeepSpeed's CPU "
                    "Adam is used only for AdamW with lr and weight_decay)")
    if config.mixed_precision == "fp16":
        # accelerate keeps an "fp16" section it finds and only fills in "enabled".
        plugin.deepspeed_config["fp16"] = deepspeed_fp16_section(config, zero_stage, offload_optimizer, cpu_adam)
    return plugin


def keeps_deepspeed_cpu_adam(config: Config) -> bool:
    """Whether DeepSpeed's CPU Adam is exactly the configured optimizer: AdamW with at most a weight decay (accelerate
    carries only lr and weight_decay over to it)."""
    name = resolve_optimizer_type(config.optimizer_type, config.use_8bit_adam, config.use_lion_optimizer)
    return name == "AdamW" and set(parse_key_values(config.optimizer_args)) <= {"weight_decay"}


def deepspeed_fp16_section(config: Config, zero_stage: int, offload_optimizer: str | None,
                           cpu_adam: bool) -> dict[str, Any]:
    """kohya's fp16 settings: the dynamic loss scale starts at 2**0 instead of 2**16, which overflows the first
    steps of a fresh LoRA; full_fp16 / fp16_master_weights_and_gradients keep fp16 master weights, which DeepSpeed
    offers only for ZeRO-2 with its CPU Adam."""
    section: dict[str, Any] = {"enabled": True, "auto_cast": True, "initial_scale_power": 0}
    if config.full_fp16 or config.fp16_master_weights_and_gradients:
        if zero_stage == 2 and offload_optimizer == "cpu" and cpu_adam:
            section["fp16_master_weights_and_grads"] = True
        else:
            logger.warning("full_fp16 / fp16_master_weights_and_gradients under DeepSpeed need zero_stage 2, "
                           "offload_optimizer_device cpu and AdamW (got zero_stage %s, offload_optimizer_device %s, "
                           "optimizer_type %s); the master weights stay fp32", zero_stage, offload_optimizer,
                           config.optimizer_type)
    return section


def prepare_accelerator(config: Config) -> Accelerator:
    """The Accelerator kohya's train_network would build, checked against the launcher's process count."""
    if not torch.cuda.is_available():
        # What DeepSpeed would detect anyway, said up front so its import does not warn about a missing GPU.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    expected = launcher_world_size()
    try:
        accelerator = Accelerator(**accelerator_kwargs(config))
    except ValueError as e:
        # accelerate's own launch checks (missing MASTER_ADDR, inconsistent rank variables, ...)
        raise UserError(f"cannot start {expected} process(es) as launched: {e}. Launch several processes with "
                        "`accelerate launch --num_processes N` or `torchrun --nproc_per_node N`.") from None
    if accelerator.num_processes != expected:
        raise UserError(
            f"the launcher started {expected} processes but accelerate sees {accelerator.num_processes}; "
            "every process would train as rank 0 on the same data. Launch with `accelerate launch "
            "--num_processes N` or `torchrun --nproc_per_node N`, and check the accelerate config.")
    if config.full_fp16 and accelerator.scaler is not None:
        allow_fp16_gradients(accelerator.scaler)
    if config.fp16_master_weights_and_gradients and accelerator.distributed_type != DistributedType.DEEPSPEED:
        logger.warning("fp16_master_weights_and_gradients is a DeepSpeed setting and has no effect without "
                       "deepspeed = true; full_fp16 trains fp16 LoRA weights without DeepSpeed")
    return accelerator


def allow_fp16_gradients(scaler: torch.amp.GradScaler) -> None:
    """full_fp16: the trained weights are fp16 themselves, whose gradients torch's GradScaler refuses to unscale
    (it expects fp32 master weights). Unscaling them in place is what full_fp16 asks for."""
    unscale_grads = scaler._unscale_grads_

    def unscale_allowing_fp16(optimizer, inv_scale, found_inf, allow_fp16):  # noqa: ARG001 (signature of torch's)
        return unscale_grads(optimizer, inv_scale, found_inf, True)

    scaler._unscale_grads_ = unscale_allowing_fp16
