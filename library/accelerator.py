"""Builds the Accelerator from the config: process group, DDP kwargs, torch.compile backend, DeepSpeed plugin."""
from __future__ import annotations

import datetime
import importlib.util
import os
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DistributedDataParallelKwargs, InitProcessGroupKwargs

from library.config import Config, UserError


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
        "dynamo_backend": config.dynamo_backend if config.torch_compile else "no",
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
    def setting(name: str, env: str) -> Any:
        # The training config wins; otherwise what `accelerate launch` (its config file or flags) put in the env.
        if config.is_set(name) or env not in os.environ:
            return getattr(config, name)
        value = os.environ[env]
        return int(value) if name == "zero_stage" else (None if value == "none" else value)

    plugin = DeepSpeedPlugin(
        zero_stage=setting("zero_stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE"),
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        gradient_clipping=config.max_grad_norm or None,
        offload_optimizer_device=setting("offload_optimizer_device", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
        offload_param_device=setting("offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
    )
    micro_batch = config.train_batch_size
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch
    plugin.deepspeed_config["train_batch_size"] = micro_batch * config.gradient_accumulation_steps * world_size
    return plugin


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
    return accelerator
