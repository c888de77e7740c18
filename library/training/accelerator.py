"""Builds the Accelerator from the config: process group, DDP kwargs, torch.compile backend, DeepSpeed plugin."""
from __future__ import annotations

import contextlib
import datetime
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs
from accelerate.utils.constants import MODEL_NAME

from library.config import Config, UserError
from library.config.network_args import network_args_of
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
    # DyLoRA trains one block of ranks per step, and LyCORIS' module dropout skips whole layers: the others get no
    # gradient, which DDP must be told of.
    net = network_args_of(config)
    unused = net.algo == "dylora" or bool(net.module_dropout and net.variant != "lora")
    if config.ddp_gradient_as_bucket_view or config.ddp_static_graph or unused:
        handlers.append(DistributedDataParallelKwargs(
            gradient_as_bucket_view=config.ddp_gradient_as_bucket_view, static_graph=config.ddp_static_graph,
            find_unused_parameters=unused))

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
    offload_param = setting("offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")
    if "nvme" in (offload_optimizer, offload_param):
        nvme_problems = []
        if zero_stage != 3:
            nvme_problems.append(f"offload to NVMe needs zero_stage = 3 (got {zero_stage}: DeepSpeed would keep that "
                                 "optimizer state in CPU memory instead); set zero_stage = 3, or offload to \"cpu\"")
        if not async_io_available():
            nvme_problems.append("offload to NVMe needs DeepSpeed's async_io op, which is built against libaio: "
                                 "install it (Debian/Ubuntu: apt install libaio-dev; Fedora: dnf install "
                                 "libaio-devel), then `ds_report` lists async_io as compatible")
        if nvme_problems:
            raise UserError(nvme_problems)
    plugin = DeepSpeedPlugin(
        zero_stage=zero_stage,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        gradient_clipping=config.max_grad_norm or None,
        offload_optimizer_device=offload_optimizer,
        offload_param_device=offload_param,
        offload_optimizer_nvme_path=setting("offload_optimizer_nvme_path",
                                            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"),
        offload_param_nvme_path=setting("offload_param_nvme_path", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"),
        zero3_save_16bit_model=config.zero3_save_16bit_model if config.is_set("zero3_save_16bit_model") else None,
        zero3_init_flag=config.zero3_init_flag if config.is_set("zero3_init_flag") else None,
    )
    if zero_stage == 3 and plugin.zero3_init_flag:
        logger.info("zero3_init_flag: the base is read whole in each process and sharded when training starts "
                    "(diffusers' models cannot be built sharded, and caching needs the text encoders whole)")
    if offload_param == "nvme":
        # Each parameter fetched from NVMe holds one of DeepSpeed's few swap buffers (buffer_count, 5) until it is
        # released, and by default none is released that is used again within 1e9 parameters (the whole model):
        # the second step runs out of buffers ("Not enough buffers 0 for swapping 1").
        plugin.deepspeed_config["zero_optimization"]["stage3_max_reuse_distance"] = 0
        keep_nvme_parameter_dtype_on_cpu()
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


def keep_nvme_parameter_dtype_on_cpu() -> None:
    """DeepSpeed's zero.Init picks the dtype of the parameters it swaps to NVMe as `dtype or torch.float16 if
    fp16_supported else torch.bfloat16 ...`: on its CPU accelerator (no fp16) that is bfloat16 whatever dtype it was
    given, and fp32 weights came back from the swap as bf16 ("Input type (torch.FloatTensor) and weight type
    (CPUBFloat16Type) should be the same"). On the CPU accelerator the given dtype is kept; GPUs support fp16, so
    there DeepSpeed already keeps it."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as ZeroInit

    if get_accelerator().device_name() != "cpu" or getattr(ZeroInit._set_dtype, "keeps_dtype", False):
        return
    set_dtype = ZeroInit._set_dtype

    def _set_dtype(self: Any, ds_config: Any, dtype: torch.dtype | None) -> None:
        set_dtype(self, ds_config, dtype)
        if dtype is not None:
            self.dtype = dtype

    _set_dtype.keeps_dtype = True  # type: ignore[attr-defined]
    ZeroInit._set_dtype = _set_dtype


def async_io_available() -> bool:
    """Whether DeepSpeed can build (or has) its async_io op, which every NVMe offload reads and writes through."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    return builder is not None and builder.is_compatible(verbose=False)


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


def allow_unused_parameters(accelerator: Accelerator, why: str) -> None:
    """Before prepare: DDP told that some trained parameters may get no gradient in a step (`why`: what trains
    them). DDP then averages a gradient that some processes gave and leaves one that no process gave as None,
    which the optimizer skips. DeepSpeed's ZeRO optimizer would step such parameters with a zero gradient (its
    moments still move them), so it is refused; so is gradient accumulation over several processes, where DDP
    finds the unused parameters of a step's last batch only: a gradient a process accumulated in an earlier batch
    would not be averaged when no process used that adapter in the last one."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise UserError(f"deepspeed: not offered for {why}: ZeRO steps every parameter, an unused one with a zero "
                        "gradient that its moments still move; train without DeepSpeed (DDP)")
    if accelerator.num_processes > 1 and accelerator.gradient_accumulation_steps > 1:
        raise UserError(f"gradient_accumulation_steps {accelerator.gradient_accumulation_steps} with "
                        f"{accelerator.num_processes} processes: not offered for {why} (DDP would not average a "
                        "gradient accumulated before a step's last batch); use a larger train_batch_size or one "
                        "process")
    handler = accelerator.ddp_handler or DistributedDataParallelKwargs()
    handler.find_unused_parameters = True
    accelerator.ddp_handler = handler


def allow_fp16_gradients(scaler: torch.amp.GradScaler) -> None:
    """full_fp16: the trained weights are fp16 themselves, whose gradients torch's GradScaler refuses to unscale
    (it expects fp32 master weights). Unscaling them in place is what full_fp16 asks for."""
    unscale_grads = scaler._unscale_grads_

    def unscale_allowing_fp16(optimizer, inv_scale, found_inf, allow_fp16):  # noqa: ARG001 (signature of torch's)
        return unscale_grads(optimizer, inv_scale, found_inf, True)

    scaler._unscale_grads_ = unscale_allowing_fp16


def realign_cpu_adam(optimizer: Any) -> None:
    """After a resume: make DeepSpeed's CPU Adam continue exactly as the uninterrupted run.

    Its C++ object keeps beta1**t and beta2**t, updated by one float multiplication per step; a fresh object (a
    resumed process) starts them from pow(beta, t) instead, so the bias corrections and every later update differed
    in the last bits (up to 5e-7 in a LoRA). Replaying the step count on throwaway one-element tensors rebuilds the
    same running products. Other optimizers are left alone (torch's AdamW derives the correction from its step)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    inner = optimizer
    while not isinstance(inner, DeepSpeedCPUAdam):  # accelerate's wrapper, then DeepSpeed's ZeRO optimizer
        inner = getattr(inner, "optimizer", None)
        if inner is None:
            return
    steps = max((int(state["step"]) for state in inner.state.values() if "step" in state), default=0)
    if steps == 0:
        return
    group = inner.param_groups[0]
    beta1, beta2 = group["betas"]
    param, grad, exp_avg, exp_avg_sq = (torch.zeros(1) for _ in range(4))
    for step in range(1, steps + 1):
        inner.ds_opt_adam.adam_update(inner.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                      group["weight_decay"], group["bias_correction"], param, grad, exp_avg,
                                      exp_avg_sq)




def restore_nvme_optimizer_state(engine: Any, state_dir: Path) -> None:
    """After a resume with the optimizer offloaded to NVMe: load the optimizer's own state, which DeepSpeed skips.

    DeepSpeed restores such an optimizer only by copying the checkpoint's swap files back into the NVMe folder; the
    state dict (each group's step, the tensors too small to swap) is never loaded, so Adam restarted from zero
    moments at step 1. Loading it as for the other offloads leaves the swapped moments as empty tensors, which the
    swapper no longer tracks: they are replaced by tensors of their size, which the next step reads from the
    copied files."""
    if not engine.zero_nvme_offload_optimizer():
        return
    engine._load_zero_checkpoint(str(state_dir), MODEL_NAME, load_optimizer_states=True)  # accelerate's tag
    zero = engine.optimizer
    for group, parameter in enumerate(zero.fp32_partitioned_groups_flat):
        if not zero._swappable_optimizer_subgroup(group):
            continue  # kept in memory and loaded whole
        state = zero.optimizer.state.get(parameter, {})
        numel = zero.fp16_partitioned_groups_flat_numel[group]
        for name, value in state.items():
            if torch.is_tensor(value) and value.numel() == 0:
                state[name] = torch.zeros(numel, dtype=parameter.dtype, device=parameter.device)


def zero3(accelerator: Accelerator) -> bool:
    """Whether DeepSpeed shards the parameters themselves (ZeRO-3): the base and the adapter live in pieces."""
    plugin = accelerator.state.deepspeed_plugin if accelerator.distributed_type == DistributedType.DEEPSPEED else None
    return plugin is not None and plugin.zero_stage == 3


@contextlib.contextmanager
def loading_whole(accelerator: Accelerator) -> Iterator[None]:
    """Read the base whole in this process. Under ZeRO-3, accelerate registers its DeepSpeed config with
    transformers, whose from_pretrained then builds the text encoders sharded, before caching could run them;
    the engine shards everything the trained module holds when training starts."""
    if not zero3(accelerator):
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


@contextlib.contextmanager
def gathered(accelerator: Accelerator, params: Iterable[torch.nn.Parameter], modify: bool = False) -> Iterator[None]:
    """Under ZeRO-3, the whole tensors of `params` on every process for the duration (with `modify`, what the
    main process writes into them is kept and re-sharded). Every process must enter it; elsewhere a no-op."""
    if not zero3(accelerator):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params), modifier_rank=0 if modify else None):
        yield


def zero3_refusals(config: Config, sampling: bool, validating: bool, prior_reg: bool = False) -> None:
    """What ZeRO-3 cannot do here, said before the model is sharded: sampling and validation run the sharded model
    outside the engine on each process's own share of prompts or images, so the processes would wait on each
    other's parameter gathers; the EMA would average shards. `prior_reg` samples need a second forward in the step
    (the adapters off), which DeepSpeed 0.19's ZeRO-3 runs in a fresh run but not after a resume: a parameter it
    keeps whole is released between the two forwards and read unsharded by its parent module (CLIP's position
    embedding), so a preempted run could not go on."""
    problems = []
    if prior_reg:
        problems.append("prior_reg (a dataset key): training towards the base model's own prediction is not "
                        "available with zero_stage 3 (its second forward of a step fails under ZeRO-3 once a run "
                        "is resumed); use zero_stage 2 or DDP")
    if sampling:
        problems.append("sample_prompts: sampling during training is not available with zero_stage 3 (the denoiser is "
                        "sharded across processes); sample from the saved LoRA files, or use zero_stage 2")
    if validating:
        problems.append("validation (validation_split or a validation dataset) is not available with zero_stage 3; "
                        "use zero_stage 2 or DDP to validate")
    if config.ema_decay is not None:
        problems.append("ema_decay is not available with zero_stage 3 (each process holds only a shard of the "
                        "adapter); use zero_stage 2")
    if problems:
        raise UserError(problems)


def parameter_storage(module: torch.nn.Module) -> dict[str, int]:
    """Parameter elements this process stores: `shard` (under ZeRO-3, its piece of every tensor, `ds_tensor`),
    `whole` (tensors present in full: all of them without ZeRO-3; under it, those DeepSpeed keeps whole on every
    process, below stage3_param_persistence_threshold), and `model`, the module's parameter elements."""
    shard = whole = model = 0
    for param in module.parameters():
        piece = getattr(param, "ds_tensor", None)
        shard += piece.numel() if piece is not None else 0
        whole += param.data.numel()
        model += getattr(param, "ds_numel", param.numel())
    return {"shard": shard, "whole": whole, "model": model}
