"""Everything a run builds before its first step: seed, data, model, caches, optimizer, accelerator state, resume."""
from __future__ import annotations

import logging
import math
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType, broadcast_object_list, set_seed
from torch.utils.data import DataLoader

from library.config import Config, UserError
from library.data.dataset import TrainingData, build_training_data
from library.data.kohya_fields import kohya_dataset_fields
from library.families.family import Components
from library.families.loading import musubi_autoencoder
from library.families.objective import Objective
from library.families.registry import entry_for
from library.families.settings import FamilySettings
from library.memory.precision import BasePrecision
from library.monitoring.sample_prompts import SamplePrompt, load_prompts
from library.monitoring.tracking import StepMetrics, TimestepLoss, lr_names
from library.network.metadata import (
    DatasetFacts,
    FamilyFlags,
    ModelCard,
    NetworkFacts,
    RunProgress,
    TrainingFacts,
    lora_metadata,
    model_file_hashes,
)
from library.training import adapters as adapter_training
from library.training.accelerator import (
    allow_unused_parameters,
    gathered,
    realign_cpu_adam,
    restore_nvme_optimizer_state,
    zero3,
    zero3_refusals,
)
from library.training.base_loading import encode_first, give_back_memory, load_base, load_denoiser
from library.training.caching import CachePlan, cache_inputs, release_encoders
from library.training.fingerprint import path_settings, run_fingerprint
from library.training.hub import HUB_STATE_FOLDER, download_state, parse_hub_state
from library.training.model import (
    SAVE_DTYPES,
    WEIGHT_DTYPES,
    DiffusionModel,
    NetworkSpec,
    build_model,
    check_controls,
    compile_repeated_blocks,
    load_lora_files,
    lora_modules,
    network_spec,
    save_lora,
    trained_parts,
)
from library.training.optim import build_optimizer
from library.training.preflight import OutputLock, check_free_space, check_free_space_for_resume, prepare_output_dir
from library.training.schedules import build_lr_scheduler, warmup_steps
from library.training.start import fast_forward, initial_position, resume_note
from library.training.state import (
    Checkpointer,
    TrainState,
    incompatibilities,
    library_versions,
    path_changes,
    remove_stale_temporaries,
    resolve_resume,
)

logger = logging.getLogger(__name__)


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
class Session:
    """The parts of a run, built by `build_session` and used by the loop."""
    config: Config
    accelerator: Accelerator
    output_dir: Path
    seed: int
    started_at: float
    weight_dtype: torch.dtype
    vae_dtype: torch.dtype
    spec: NetworkSpec
    prompts: list[SamplePrompt]
    data: TrainingData
    components: Components
    settings: FamilySettings  # what the family reads from the config
    objective: Objective
    model: torch.nn.Module  # the prepared (wrapped) model
    unwrapped: DiffusionModel
    trainable: list[torch.nn.Parameter]
    group_names: list[str]
    optimizer: torch.optim.Optimizer  # accelerate's wrapper of it
    lr_scheduler: AcceleratedScheduler
    dataloader: DataLoader
    plan: Plan
    state: TrainState
    metrics: StepMetrics
    ema: adapter_training.AdapterEMA | None
    checkpointer: Checkpointer

    @property
    def save_dtype(self) -> torch.dtype | None:
        return SAVE_DTYPES[self.config.save_precision]

    def metadata(self) -> dict[str, str]:
        return training_metadata(self)


def build_session(config: Config, accelerator: Accelerator, started_at: float) -> Session:
    """Build every part in the order that fixes the run's random draws (LoRA initialisation follows set_seed)."""
    config = musubi_autoencoder(config)
    output_dir = Path(config.output_dir)
    resume_dir, resumed = resume_point(config, accelerator, output_dir)
    seed = resolve_seed(config, accelerator, resumed)
    set_seed(seed)  # LoRA initialisation; the training path itself uses step generators
    weight_dtype = WEIGHT_DTYPES[config.mixed_precision]
    vae_dtype = torch.float32 if config.no_half_vae else weight_dtype
    prompts = sample_prompts(config)
    # The images are checked before the model is loaded, so data problems surface in seconds; video clips are cut
    # for the family the registry tells from the model's files.
    entry = entry_for(config.pretrained_model_name_or_path)
    if entry.check_before_load and (problems := entry.check_before_load(Path(config.pretrained_model_name_or_path),
                                                                        config)):
        raise UserError(problems)
    frames_rule = entry.frames_rule
    data = build_training_data(config, None, seed, accelerator.num_processes, frames_rule)
    components, settings = load_base(config, accelerator, data, weight_dtype, vae_dtype, bool(prompts), frames_rule)
    family = components.family
    if family.frames_rule != frames_rule:  # the clips were cut by the entry's rule
        raise RuntimeError(f"{family.name}: its Family's frames_rule {family.frames_rule} differs from its registry "
                           f"entry's {frames_rule}")
    check_controls(family, data, prompts)
    spec = network_spec(config, family)
    data.set_tokenizer(family.tokenizer(components, config.max_token_length), family.prompt_reads_controls)
    objective = family.objective(components, settings, accelerator.device)
    caching, phased = encode_first(config, accelerator, data, components, vae_dtype, bool(prompts))
    load_denoiser(config, components, data, weight_dtype, vae_dtype)  # where the first read left it out
    model, groups = build_model(config, components, accelerator.device, spec, encoded=phased)
    trainable = [p for group in groups for p in group["params"]]
    prepare_inputs(config, accelerator, output_dir, data, components, model, trainable, vae_dtype, bool(prompts),
                   caching, phased)
    dataloader = data.dataloader(config.max_data_loader_n_workers, config.persistent_data_loader_workers,
                                 config.gradient_accumulation_steps)
    optimizer = build_optimizer(config.optimizer_type, groups, config.learning_rate, config.optimizer_args,
                                use_8bit_adam=config.use_8bit_adam, use_lion_optimizer=config.use_lion_optimizer)
    state = TrainState(seed=seed, world_size=accelerator.num_processes,
                       fingerprint=run_fingerprint(config, spec, components, model),
                       path_settings=path_settings(config, seed, data), versions=library_versions())
    # Batches are dealt round-robin to the processes.
    plan = make_plan(config, math.ceil(len(data.sampler) / accelerator.num_processes))
    data.dataset.total_steps = plan.total_steps  # a token warm-up given as a fraction of the run
    lr_scheduler = schedule(config, optimizer, plan, state, resumed is None)
    # prepare wraps the module (DDP, a DeepSpeed engine, torch.compile) but keeps this very object inside; holding
    # it spares accelerate's unwrap_model, which imports deepspeed (half a second) just to check for an engine.
    unwrapped = model
    model, optimizer, dataloader, lr_scheduler = prepare(accelerator, plan, model, optimizer, dataloader,
                                                         lr_scheduler)
    ema = (adapter_training.AdapterEMA(lora_modules(unwrapped, config), config.ema_decay,
                                       [adapter.name for adapter in unwrapped.family.lora_adapters()],
                                       rename=unwrapped.family.kohya_module_path)
           if config.ema_decay is not None else None)
    checkpointer = make_checkpointer(config, accelerator, unwrapped, spec, trainable, ema)
    metrics = StepMetrics(TimestepLoss(config.min_timestep, config.max_timestep, config.loss_timestep_bins),
                          plan.steps_per_epoch)
    if resumed is not None:
        restore(config, accelerator, resume_dir, resumed, state, checkpointer, metrics, optimizer)
    return Session(config, accelerator, output_dir, seed, started_at, weight_dtype, vae_dtype, spec, prompts, data,
                   components, settings, objective, model, unwrapped, trainable, lr_names(groups), optimizer,
                   lr_scheduler, dataloader, plan, state, metrics, ema, checkpointer)


def resume_point(config: Config, accelerator: Accelerator, output_dir: Path) -> tuple[Path | None, TrainState | None]:
    """The state folder the run resumes from (a local one, or one downloaded from the Hub) and its train state."""
    if config.resume_from_huggingface and config.resume:  # sd-scripts' owner/repo/path[:revision[:type]]
        local = output_dir / HUB_STATE_FOLDER
        on_main_process(accelerator, lambda: download_state(config, local))
        resume_dir = resolve_resume(str(local / parse_hub_state(config.resume)[1]), output_dir)
    else:
        resume_dir = resolve_resume(config.resume, output_dir)
    if resume_dir is None:
        return None, None
    on_main_process(accelerator, lambda: check_free_space_for_resume(output_dir, resume_dir))
    return resume_dir, TrainState.read(resume_dir)


def prepare_inputs(config: Config, accelerator: Accelerator, output_dir: Path, data: TrainingData,
                   components: Components, model: DiffusionModel, trainable: list[torch.nn.Parameter],
                   vae_dtype: torch.dtype, sampling: bool, caching: CachePlan, encoded: bool = False) -> None:
    """Before the first step: compile the denoiser's blocks if asked, check the disk has room for what the run
    saves, cache latents and text-encoder outputs (unless `encoded`: the first phase of a run by phase did), and
    free the encoders no longer needed."""
    if config.torch_compile and config.dynamo_backend != "no":
        compile_repeated_blocks(model.denoiser, config.dynamo_backend)
    on_main_process(accelerator, lambda: check_free_space(
        output_dir, sum(p.numel() * p.element_size() for p in trainable),
        config.save_state or config.save_state_on_train_end or config.save_state_on_preemption))
    if not encoded:
        train_text_encoder = trained_parts(config, components.family)[1]
        cache_inputs(config, data, components, accelerator, vae_dtype, caching)
        release_encoders(components, model, caching, train_text_encoder, sampling, accelerator.device,
                         validating=data.validation is not None)
    give_back_memory(accelerator.device)  # the encoders' work and what of their weights was freed
    if zero3(accelerator):
        zero3_refusals(config, sampling, data.validation is not None, data.has_prior_reg)


def schedule(config: Config, optimizer: torch.optim.Optimizer, plan: Plan, state: TrainState,
             fresh: bool) -> Any:
    """The learning-rate schedule, built before prepare so that DeepSpeed owns and checkpoints it, and put at
    kohya's initial_step / initial_epoch for a fresh run (a resumed one gets its position from the state)."""
    lr_scheduler = build_lr_scheduler(config.lr_scheduler, optimizer, plan.total_steps, config.lr_warmup_steps,
                                      config.lr_scheduler_num_cycles, config.lr_scheduler_power,
                                      lr_decay_steps=config.lr_decay_steps,
                                      min_lr_ratio=config.lr_scheduler_min_lr_ratio,
                                      timescale=config.lr_scheduler_timescale,
                                      scheduler_type=config.lr_scheduler_type,
                                      scheduler_args=config.lr_scheduler_args)
    start = initial_position(config, plan.steps_per_epoch, config.gradient_accumulation_steps,
                             plan.total_steps) if fresh else None
    if start is not None:
        fast_forward(lr_scheduler, start[0])  # before prepare, which may hand the schedule to DeepSpeed
        state.global_step, state.epoch, state.batch_in_epoch = start
        logger.info("starting at step %d (epoch %d, batch %d): initial_step / initial_epoch%s", start[0],
                    start[1] + 1, start[2],
                    ", data skipped to that step" if config.skip_until_initial_step else "")
    return lr_scheduler


def prepare(accelerator: Accelerator, plan: Plan, model: DiffusionModel, optimizer: torch.optim.Optimizer,
            dataloader: Any, lr_scheduler: Any) -> tuple[Any, Any, Any, Any]:
    """accelerate's prepare (DDP, DeepSpeed, compile), checked against the plan's batch count."""
    adapters = model.family.lora_adapters()
    if len(adapters) > 1:  # each batch trains one of them, and each process draws its own
        allow_unused_parameters(accelerator, f"a run that trains {len(adapters)} LoRAs, one per batch "
                                             f"({', '.join(adapter.name for adapter in adapters)})")
    model, optimizer, dataloader, lr_scheduler = accelerator.prepare(model, optimizer, dataloader, lr_scheduler)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # DeepSpeed may swap in its own optimizer (CPU Adam for offload) and replaces its param groups when a state
        # is loaded; the schedule must set the learning rate of the optimizer that actually steps.
        lr_scheduler.scheduler.optimizer = optimizer.optimizer
    if len(dataloader) != plan.batches_per_epoch:
        raise RuntimeError(f"planned {plan.batches_per_epoch} batches per process, the loader has {len(dataloader)}")
    return model, optimizer, dataloader, lr_scheduler


def make_checkpointer(config: Config, accelerator: Accelerator, unwrapped: DiffusionModel, spec: NetworkSpec,
                      trainable: list[torch.nn.Parameter],
                      ema: adapter_training.AdapterEMA | None) -> Checkpointer:
    """Saving and loading the run's state: the adapter file (and its EMA) beside accelerate's own state."""
    return Checkpointer(
        accelerator,
        write_adapter=lambda path: save_lora(config, unwrapped, spec, path, {}, None),
        read_adapter=lambda path: load_lora_files(config, unwrapped, path),
        write_ema=adapter_training.ema_writer(ema) if ema else None,
        read_ema=adapter_training.ema_reader(ema) if ema else None,
        gather=lambda modify: gathered(accelerator, trainable, modify))


def restore(config: Config, accelerator: Accelerator, resume_dir: Path, resumed: TrainState, state: TrainState,
            checkpointer: Checkpointer, metrics: StepMetrics, optimizer: Any) -> None:
    """Continue from a saved state: its position, adapter, optimizer, schedule and metrics."""
    note = resume_note(config, resumed.global_step)
    if note:
        logger.warning(note)
    resume(resume_dir, resumed, state, checkpointer, metrics)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        restore_nvme_optimizer_state(accelerator.deepspeed_engine_wrapped.engine, resume_dir)
        realign_cpu_adam(optimizer)


def claim_output_dir(output_dir: Path, accelerator: Accelerator) -> OutputLock | None:
    """Create and lock output_dir (main process), then remove what killed runs left there: only once the lock is
    held, so that the clean-up never touches the files of another run that is still writing."""
    locks: list[OutputLock] = []

    def claim() -> None:
        locks.append(prepare_output_dir(output_dir))
        remove_stale_temporaries(output_dir, "sample")

    on_main_process(accelerator, claim)
    return locks[0] if locks else None


def on_main_process(accelerator: Accelerator, check: Callable[[], None]) -> None:
    """Run `check` on the main process; a UserError it raises is raised on every process, so that none is left
    waiting for the others at the next collective."""
    problems: list[str] | None = None
    if accelerator.is_main_process:
        try:
            check()
        except UserError as e:
            problems = e.problems
    if accelerator.num_processes > 1:
        problems = broadcast_object_list([problems])[0]
    if problems:
        raise UserError(problems)


def resume(resume_dir: Path, resumed: TrainState, state: TrainState, checkpointer: Checkpointer,
           metrics: StepMetrics) -> None:
    problems = incompatibilities(resumed, state)
    if problems:
        raise UserError([f"cannot resume from {resume_dir}: it was saved by an incompatible run"] + problems)
    for change in path_changes(resumed, state):
        logger.warning("resuming with a changed setting; the run will not follow the original path: %s", change)
    checkpointer.load(resume_dir)
    state.epoch, state.global_step, state.batch_in_epoch = resumed.epoch, resumed.global_step, resumed.batch_in_epoch
    metrics.load_state_dict(resumed.metrics)
    logger.info("resumed from %s at step %d (epoch %d, batch %d)", resume_dir, state.global_step, state.epoch + 1,
                state.batch_in_epoch)


def resolve_seed(config: Config, accelerator: Accelerator, resumed: TrainState | None) -> int:
    """The resumed run's seed, the configured one, or one random seed shared by every process."""
    if resumed is not None and config.seed is None:
        return resumed.seed
    seed = config.seed if config.seed is not None else secrets.randbelow(2**31)
    if accelerator.num_processes > 1 and config.seed is None:
        seed = broadcast_object_list([seed])[0]
    return seed


def sample_prompts(config: Config) -> list[SamplePrompt]:
    if config.sample_prompts is None:
        if config.sample_every_n_steps or config.sample_every_n_epochs or config.sample_at_first:
            logger.warning("sample_every_n_steps / sample_every_n_epochs / sample_at_first do nothing without "
                           "sample_prompts")
        return []
    if not (config.sample_every_n_steps or config.sample_every_n_epochs or config.sample_at_first):
        # sd-scripts reads the file only when it samples; the kohya_ss GUI names one in every config.
        logger.warning("sample_prompts is set but no sample_every_n_steps, sample_every_n_epochs or "
                       "sample_at_first: no samples will be made (the file is not read)")
        return []
    return load_prompts(config.sample_prompts, config.resolution)


def training_metadata(session: Session) -> dict[str, str]:
    config, plan, data, state = session.config, session.plan, session.data, session.state
    model = Path(config.pretrained_model_name_or_path)
    # A folder has no single file to hash; kohya writes "IsADirectory" there, which helps nobody.
    model_hashes = model_file_hashes(str(model.resolve())) if model.is_file() else {}
    return lora_metadata(
        NetworkFacts.from_config(config, session.spec.dim, session.spec.alpha),
        training=TrainingFacts.from_config(config, seed=session.seed, sd_model_name=model.name,
                                           lr_warmup_steps=warmup_steps(config.lr_warmup_steps, plan.total_steps)),
        progress=RunProgress(steps=state.global_step, epoch=state.epoch, num_epochs=plan.num_epochs,
                             max_train_steps=plan.total_steps, started_at=session.started_at, finished_at=time.time()),
        dataset=DatasetFacts(data.num_train_images, data.num_reg_images, plan.batches_per_epoch,
                             config.train_batch_size, config.resolution),
        family=FamilyFlags(**session.components.family.metadata_flags(session.components.v_prediction)),
        card=ModelCard.from_config(config), family_fields=session.components.family.metadata_fields(session.settings),
        extra={**kohya_dataset_fields(data), **model_hashes, **precision_metadata(config)},
    )


def precision_metadata(config: Config) -> dict[str, str]:
    """The frozen base's storage precision, recorded only when it is lowered (kohya's ss_fp8_base names)."""
    if not BasePrecision.from_config(config, torch.float32).lowered:
        return {}
    return {"ss_fp8_base": str(config.fp8_base), "ss_fp8_base_unet": str(config.fp8_base_unet),
            "ss_base_model_precision": config.base_model_precision}
