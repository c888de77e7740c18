"""Range and cross-option checks on converted option values; every problem is collected, none is raised."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Mapping

import tomllib

from library.config.dataset_checks import command_line_dataset_problems, dataset_option_problems, unmet
from library.config.errors import UserError
from library.config.network_args import network_option_problems
from library.config.samplers import canonical_sampler

# Single-file checkpoints: safetensors is read as data; these suffixes are pickles, which can run code when read.
PICKLE_CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")


def checkpoint_file_problem(path: Path, allow_pickle: bool) -> str | None:
    """Why a model file cannot be read as a single-file checkpoint, or None when it can."""
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return None
    if suffix in PICKLE_CHECKPOINT_SUFFIXES:
        if allow_pickle:
            return None
        return (f"{path} is a pickle checkpoint ({suffix}); loading a pickle can run arbitrary code hidden in the "
                f"file, so it is refused. Convert it to safetensors without running its code (in this repository's "
                f"folder): python -m library.families.sd.single_file {path} {path.with_suffix('.safetensors')}; "
                "or, only for a file you trust, set allow_pickle_checkpoints = true")
    return (f"{path}: not a model folder or a known checkpoint file; give a diffusers model folder or a "
            f".safetensors checkpoint (pickles {', '.join(PICKLE_CHECKPOINT_SUFFIXES)} need "
            "allow_pickle_checkpoints)")


def check_values(v: Mapping[str, Any]) -> list[str]:
    """Cross-option and range checks on converted values; every problem, in this order of subjects."""
    problems: list[str] = []
    for check in (_file_problems, _output_name_problems, _count_problems, dataset_option_problems,
                  command_line_dataset_problems, _network_range_problems, _learning_rate_problems,
                  _objective_problems, _training_mode_problems, _base_precision_problems, _logging_problems,
                  _sampling_problems, _text_encoder_problems, _distributed_problems, _optional_count_problems,
                  _saving_problems, _hub_problems, _weights_problems, _optimizer_args_problems,
                  network_option_problems, _optimizer_and_schedule_problems):
        problems += check(v)
    return problems


def _file_problems(v: Mapping[str, Any]) -> list[str]:
    """The files and folders a run reads and writes; none is needed to only write the resolved config."""
    if v["output_config"] is not None:
        return []
    return _model_problems(v) + _data_location_problems(v) + _output_dir_problems(v)


def _model_problems(v: Mapping[str, Any]) -> list[str]:
    """The base model: a folder or a readable single-file checkpoint, and the separate files given with it."""
    problems: list[str] = []
    model = v["pretrained_model_name_or_path"]
    if model is None:
        problems.append("pretrained_model_name_or_path is required: a local diffusers model folder or "
                        ".safetensors checkpoint")
    elif not Path(model).exists():
        problems.append(f"pretrained_model_name_or_path: {model} does not exist "
                        "(models are read from local files only)")
    elif Path(model).is_file():
        problem = checkpoint_file_problem(Path(model), v["allow_pickle_checkpoints"])
        if problem:
            problems.append(f"pretrained_model_name_or_path: {problem}")
    elif v["model_config"] is not None:
        problems.append("model_config describes a single-file checkpoint; pretrained_model_name_or_path is a "
                        "folder, which has its own configs: remove model_config")
    if v["model_config"] is not None and not Path(v["model_config"]).is_dir():
        problems.append(f"model_config: {v['model_config']} is not a folder")
    if v["vae"] is not None and not Path(v["vae"]).exists():
        problems.append(f"vae: {v['vae']} does not exist (a VAE folder or .safetensors file)")
    for name in ("clip_l", "t5xxl", "ae"):  # FLUX.1's separate files
        if v[name] is not None and not Path(v[name]).is_file():
            problems.append(f"{name}: {v[name]} is not a file")
    return problems


def _data_location_problems(v: Mapping[str, Any]) -> list[str]:
    """Where the images are: train_data_dir (+ reg_data_dir), dataset_config or in_json, one of them."""
    problems: list[str] = []
    data, dataset_config = v["train_data_dir"], v["dataset_config"]
    if v["in_json"] is not None:
        problems += unmet(
            (Path(v["in_json"]).is_file(), f"in_json: {v['in_json']} is not a file"),
            (dataset_config is None, "in_json cannot be combined with dataset_config (a subset there takes "
                                     "metadata_file); remove one of them"),
            (v["reg_data_dir"] is None, "in_json is a fine-tuning dataset without regularisation images "
                                        "(sd-scripts ignores reg_data_dir with it); remove reg_data_dir"))
    if dataset_config is not None:
        if not Path(dataset_config).is_file():
            problems.append(f"dataset_config: {dataset_config} is not a file")
        problems += unmet(*((v[name] is None, f"{name} cannot be combined with dataset_config, whose subsets name "
                                               "the image folders (kohya ignores it there); remove one of them")
                             for name in ("train_data_dir", "reg_data_dir")))
    elif data is None:
        problems.append("train_data_dir is required: a folder of kohya-style image folders "
                        "(or give dataset_config)")
    elif not Path(data).is_dir():
        problems.append(f"train_data_dir: {data} is not a folder")
    if dataset_config is None and v["reg_data_dir"] is not None and not Path(v["reg_data_dir"]).is_dir():
        problems.append(f"reg_data_dir: {v['reg_data_dir']} is not a folder")
    return problems


def _output_dir_problems(v: Mapping[str, Any]) -> list[str]:
    if v["output_dir"] is None:
        return ["output_dir is required: where the LoRA file is written"]
    if Path(v["output_dir"]).exists() and not Path(v["output_dir"]).is_dir():
        return [f"output_dir: {v['output_dir']} exists and is not a folder"]
    return []


def _output_name_problems(v: Mapping[str, Any]) -> list[str]:
    # The name becomes file and state-dir names beside each other in output_dir; a path here fails only at the
    # first save, after the training it would have kept.
    name = v["output_name"]
    return unmet((bool(name) and "/" not in name and os.sep not in name
                   and (os.altsep is None or os.altsep not in name) and name not in (".", "..")
                   and not name.startswith("."),
                   f"output_name = {name!r}: must be a plain file name without folders (put folders in output_dir) "
                   "and not starting with '.'"))


def _count_problems(v: Mapping[str, Any]) -> list[str]:
    """The network's rank, the batches, the run's length and the loader's workers."""
    return unmet(
        *((v[name] >= 1, f"{name} must be at least 1 (got {v[name]})")
          for name in ("network_dim", "train_batch_size", "gradient_accumulation_steps", "max_train_steps",
                       "lr_scheduler_num_cycles")),
        (v["initial_step"] is None or v["initial_step"] >= 0,
         f"initial_step must not be negative (got {v['initial_step']})"),
        (v["initial_epoch"] is None or v["initial_epoch"] >= 1,
         f"initial_epoch must be at least 1, the first epoch (got {v['initial_epoch']})"),
        (v["max_train_epochs"] is None or v["max_train_epochs"] >= 1,
         f"max_train_epochs must be at least 1 (got {v['max_train_epochs']})"),
        (v["max_data_loader_n_workers"] >= 0, "max_data_loader_n_workers must be 0 or more"),
        (v["dataset_repeats"] >= 1, f"dataset_repeats must be at least 1 (got {v['dataset_repeats']})"))


def _network_range_problems(v: Mapping[str, Any]) -> list[str]:
    return unmet((v["network_alpha"] > 0, f"network_alpha must be positive (got {v['network_alpha']})"),
                  (0 <= v["network_dropout"] < 1, f"network_dropout must be in [0, 1) (got {v['network_dropout']})"))


def _learning_rate_problems(v: Mapping[str, Any]) -> list[str]:
    return unmet(
        *((v[name] is None or v[name] >= 0, f"{name} must not be negative (got {v[name]})")
          for name in ("learning_rate", "unet_lr", "text_encoder_lr")),
        (v["max_grad_norm"] >= 0, f"max_grad_norm must not be negative (got {v['max_grad_norm']})"),
        (v["lr_warmup_steps"] >= 0, f"lr_warmup_steps must not be negative (got {v['lr_warmup_steps']})"),
        (v["lr_warmup_steps"] < 1 or float(v["lr_warmup_steps"]).is_integer(),
         f"lr_warmup_steps must be a whole number of steps or a fraction below 1 (got {v['lr_warmup_steps']})"))


def _training_mode_problems(v: Mapping[str, Any]) -> list[str]:
    """Which parts train, and the full-precision modes, each of which needs its mixed precision."""
    precision = v["mixed_precision"]
    return unmet(
        (not (v["network_train_unet_only"] and v["network_train_text_encoder_only"]),
         "network_train_unet_only and network_train_text_encoder_only cannot both be set"),
        (not v["full_fp16"] or precision == "fp16", f"full_fp16 needs mixed_precision = \"fp16\" (got {precision!r})"),
        (not v["full_bf16"] or precision == "bf16", f"full_bf16 needs mixed_precision = \"bf16\" (got {precision!r})"),
        (not v["fp16_master_weights_and_gradients"] or precision == "fp16",
         f"fp16_master_weights_and_gradients needs mixed_precision = \"fp16\" (got {precision!r})"))


def _text_encoder_problems(v: Mapping[str, Any]) -> list[str]:
    return unmet(
        (v["clip_skip"] is None or v["clip_skip"] >= 1, f"clip_skip must be at least 1 (got {v['clip_skip']})"),
        (v["max_token_length"] in (None, 75, 150, 225),
         f"max_token_length must be 75, 150 or 225 (got {v['max_token_length']})"))


def _distributed_problems(v: Mapping[str, Any]) -> list[str]:
    """DeepSpeed's ZeRO stage and NVMe offload, and the process group's timeout."""
    return (unmet((v["zero_stage"] in (0, 1, 2, 3), f"zero_stage must be 0, 1, 2 or 3 (got {v['zero_stage']})"))
            + _nvme_offload_problems(v)
            + unmet((v["ddp_timeout"] is None or v["ddp_timeout"] > 0,
                      "ddp_timeout must be a positive number of minutes")))


def _optional_count_problems(v: Mapping[str, Any]) -> list[str]:
    return unmet(*((v[name] is None or v[name] >= 1, f"{name} must be at least 1 (got {v[name]})")
                    for name in ("save_n_epoch_ratio", "max_validation_steps", "text_encoder_batch_size")))


def _saving_problems(v: Mapping[str, Any]) -> list[str]:
    return unmet(*((v[name] is None or v[name] >= 1, f"{name} must be at least 1 (got {v[name]})")
                    for name in ("save_every_n_steps", "save_every_n_epochs", "save_last_n_steps",
                                 "save_last_n_epochs", "save_last_n_steps_state", "save_last_n_epochs_state")))


def _hub_problems(v: Mapping[str, Any]) -> list[str]:
    """Resuming from and uploading to the Hugging Face Hub."""
    return unmet(
        (not v["resume_from_huggingface"] or (v["resume"] is not None and v["resume"] != "latest"),
         "resume_from_huggingface needs resume = \"owner/repository/path of the state dir[:revision[:repo_type]]\""),
        *((not v[name] or v["huggingface_repo_id"] is not None
           or (name == "huggingface_token" and v["resume_from_huggingface"]),
           f"{name} is about uploads to the Hugging Face Hub, which need huggingface_repo_id")
          for name in ("huggingface_repo_type", "huggingface_path_in_repo", "huggingface_token",
                       "huggingface_repo_visibility", "save_state_to_huggingface", "async_upload")))


def _weights_problems(v: Mapping[str, Any]) -> list[str]:
    """Weights read at start: base_weights merged into the base, network_weights to continue from."""
    return unmet(
        *((Path(path).is_file(), f"base_weights: {path} is not a file") for path in v["base_weights"]),
        (len(v["base_weights_multiplier"]) <= len(v["base_weights"]),
         f"base_weights_multiplier gives {len(v['base_weights_multiplier'])} strengths for "
         f"{len(v['base_weights'])} base_weights files"),
        (not v["base_weights"] or v["base_model_precision"] not in ("int8", "nf4"),
         f"base_weights are merged into the base's weights, which base_model_precision "
         f"\"{v['base_model_precision']}\" quantizes; use fp8 or no_change with base_weights"),
        (not v["dim_from_weights"] or v["network_weights"] is not None,
         "dim_from_weights needs network_weights (the LoRA file to read dim and alpha from)"),
        (v["network_weights"] is None or Path(v["network_weights"]).is_file(),
         f"network_weights: {v['network_weights']} is not a file"))


def _optimizer_args_problems(v: Mapping[str, Any]) -> list[str]:
    return unmet(*(("=" in arg, f"{arg!r}: optimizer_args entries must look like key=value")
                    for arg in v["optimizer_args"]))


def _optimizer_and_schedule_problems(v: Mapping[str, Any]) -> list[str]:
    """Optimizer and schedule; checks that need the optimizer class or the step count run in
    library.training.optim."""
    return unmet(
        *(("=" in arg, f"{arg!r}: lr_scheduler_args entries must look like key=value")
          for arg in v["lr_scheduler_args"]),
        (not (v["use_8bit_adam"] and v["use_lion_optimizer"]),
         "use_8bit_adam and use_lion_optimizer cannot both be set"),
        *((not v[flag] or v["optimizer_type"] in ("AdamW", meant),
           f"{flag} means optimizer_type {meant} and cannot be combined with optimizer_type {v['optimizer_type']}")
          for flag, meant in (("use_8bit_adam", "AdamW8bit"), ("use_lion_optimizer", "Lion"))),
        (v["lr_decay_steps"] >= 0 and (v["lr_decay_steps"] < 1 or float(v["lr_decay_steps"]).is_integer()),
         f"lr_decay_steps must be a whole number of steps or a fraction below 1 (got {v['lr_decay_steps']})"),
        (v["lr_scheduler_min_lr_ratio"] is None or 0 <= v["lr_scheduler_min_lr_ratio"] <= 1,
         f"lr_scheduler_min_lr_ratio must be in [0, 1] (got {v['lr_scheduler_min_lr_ratio']})"),
        (v["lr_scheduler_timescale"] is None or v["lr_scheduler_timescale"] >= 1,
         f"lr_scheduler_timescale must be at least 1 (got {v['lr_scheduler_timescale']})"),
        (not v["lr_scheduler_type"] or v["lr_warmup_steps"] == 0,
         f"lr_warmup_steps applies to lr_scheduler, not to lr_scheduler_type {v['lr_scheduler_type']}; remove it "
         "(give the class its own arguments in lr_scheduler_args)"),
        (v["lr_scheduler"] != "cosine_with_min_lr" or bool(v["lr_scheduler_type"])
         or v["lr_scheduler_min_lr_ratio"] is not None
         or any(arg.partition("=")[0].strip() == "min_lr" for arg in v["lr_scheduler_args"]),
         "lr_scheduler cosine_with_min_lr needs lr_scheduler_min_lr_ratio (the final learning rate as a fraction "
         "of the initial one) or min_lr=... in lr_scheduler_args"))


def _objective_problems(v: Mapping[str, Any]) -> list[str]:
    """kohya's timestep, noise and loss options: ranges, and the combinations kohya refuses or that would do
    nothing. Whether the model predicts v is known only once it is loaded; model.Objective checks what depends on
    that."""
    huber = ("huber_c", "huber_scale") if v["loss_type"] in ("huber", "smooth_l1") else ()
    return unmet(
        (v["min_snr_gamma"] is None or v["min_snr_gamma"] > 0, "min_snr_gamma must be positive"),
        (v["noise_offset"] is None or v["noise_offset"] >= 0, "noise_offset must not be negative"),
        (0 <= v["min_timestep"] < v["max_timestep"] <= 1000,
         f"need 0 <= min_timestep < max_timestep <= 1000 (got {v['min_timestep']}, {v['max_timestep']})"),
        (v["adaptive_noise_scale"] is None or v["noise_offset"] is not None,
         "adaptive_noise_scale needs noise_offset (it is added to noise_offset, as in kohya)"),
        (not v["noise_offset_random_strength"] or bool(v["noise_offset"]),
         "noise_offset_random_strength needs noise_offset (the upper end of the random strength)"),
        (v["multires_noise_iterations"] is None or v["multires_noise_iterations"] >= 1,
         f"multires_noise_iterations must be at least 1 (got {v['multires_noise_iterations']})"),
        (v["multires_noise_discount"] > 0,
         f"multires_noise_discount must be positive (got {v['multires_noise_discount']})"),
        (v["ip_noise_gamma"] is None or v["ip_noise_gamma"] >= 0,
         f"ip_noise_gamma must not be negative (got {v['ip_noise_gamma']})"),
        (not v["ip_noise_gamma_random_strength"] or bool(v["ip_noise_gamma"]),
         "ip_noise_gamma_random_strength needs ip_noise_gamma (the upper end of the random strength)"),
        *((v[name] > 0, f"{name} must be positive with loss_type {v['loss_type']} (got {v[name]})") for name in huber),
        (v["v_pred_like_loss"] is None or v["v_pred_like_loss"] >= 0,
         f"v_pred_like_loss must not be negative (got {v['v_pred_like_loss']})"),
        (not (v["v_pred_like_loss"] and v["v_parameterization"]),
         "v_pred_like_loss cannot be combined with v_parameterization: it adds a v-prediction-like loss to a "
         "noise-prediction model (kohya refuses it too); remove one of them"),
        (not v["masked_loss"] or v["alpha_mask"] or v["dataset_config"] is not None,
         "masked_loss needs masks: alpha_mask = true (the images' alpha channel), or a dataset_config whose "
         "subsets set conditioning_data_dir or alpha_mask"))


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    with open(path, "rb") as f:
        return tomllib.load(f)


def _logging_problems(v: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    trackers = {"all": ("tensorboard", "wandb")}.get(v["log_with"], (v["log_with"],))
    if "wandb" in trackers and importlib.util.find_spec("wandb") is None:
        problems.append("log_with = \"%s\" needs wandb: pip install wandb" % v["log_with"])
    if "tensorboard" in trackers and importlib.util.find_spec("tensorboard") is None:
        problems.append("log_with = \"%s\" needs tensorboard: pip install tensorboard" % v["log_with"])
    path = v["log_tracker_config"]
    if path is not None:
        try:
            tables = read_toml(path)
        except (OSError, tomllib.TOMLDecodeError) as e:
            problems.append(f"log_tracker_config: cannot read {path}: {e}")
        else:
            for name, table in tables.items():
                if name not in ("tensorboard", "wandb") or not isinstance(table, dict):
                    problems.append(f"log_tracker_config {path}: [{name}] is not a tracker table; use [wandb] or "
                                    "[tensorboard] tables of init arguments")
    if not 1 <= v["loss_timestep_bins"] <= v["max_timestep"] - v["min_timestep"]:
        problems.append(f"loss_timestep_bins must be between 1 and the number of trained timesteps "
                        f"(got {v['loss_timestep_bins']})")
    if not 0 <= v["validation_split"] < 1:
        problems.append(f"validation_split must be in [0, 1) (got {v['validation_split']})")
    for name in ("validate_every_n_steps", "validate_every_n_epochs"):
        if v[name] is not None and v[name] < 1:
            problems.append(f"{name} must be at least 1 (got {v[name]})")
    bad = [t for t in v["validation_timesteps"] if not 0 <= t < 1000]
    if bad or not v["validation_timesteps"]:
        problems.append(f"validation_timesteps must be timesteps in [0, 1000) (got {v['validation_timesteps']})")
    return problems


def _sampling_problems(v: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    try:
        canonical_sampler(v["sample_sampler"])
    except UserError as e:
        problems += [f"sample_sampler: {p}" for p in e.problems]
    for name in ("sample_every_n_steps", "sample_every_n_epochs"):
        if v[name] is not None and v[name] < 1:
            problems.append(f"{name} must be at least 1 (got {v[name]})")
    if v["sample_prompts"] is not None and not Path(v["sample_prompts"]).is_file():
        problems.append(f"sample_prompts: {v['sample_prompts']} is not a file")
    return problems


def _base_precision_problems(v: Mapping[str, Any]) -> list[str]:
    """kohya's rules for fp8_base / fp8_base_unet, blocks_to_swap and cpu_offload_checkpointing. Unlike kohya, a
    low-precision base is allowed with mixed_precision = "no": it computes in float32 (a CPU or GPU without bf16
    instructions trains at its fp32 rate)."""
    problems = []
    if v["base_model_precision"] in ("int8", "nf4") and (v["fp8_base"] or v["fp8_base_unet"]):
        problems.append(f"base_model_precision = \"{v['base_model_precision']}\" and fp8_base / fp8_base_unet name two "
                        "precisions for the base; keep one")
    if v["base_model_precision"] in ("int8", "nf4") and v["network_module"] == "lycoris.kohya":
        problems.append(f"base_model_precision = \"{v['base_model_precision']}\" trains networks.lora only (peft's "
                        "bitsandbytes layers); use fp8 with lycoris.kohya")
    if v["blocks_to_swap"] is not None and v["blocks_to_swap"] < 0:
        problems.append(f"blocks_to_swap must not be negative (got {v['blocks_to_swap']})")
    if v["blocks_to_swap"] and v["cpu_offload_checkpointing"]:
        problems.append("blocks_to_swap and cpu_offload_checkpointing cannot be used together (kohya's rule); "
                        "keep one")
    return problems


def _nvme_offload_problems(v: Mapping[str, Any]) -> list[str]:
    """NVMe offload needs its folder, and a folder needs the nvme device (kohya passes both to accelerate)."""
    problems = []
    for part in ("optimizer", "param"):
        device, path = v[f"offload_{part}_device"], v[f"offload_{part}_nvme_path"]
        if device == "nvme" and path is None:
            problems.append(f"offload_{part}_device = \"nvme\" needs offload_{part}_nvme_path (a folder on the "
                            "NVMe drive)")
        if path is not None and device != "nvme":
            problems.append(f"offload_{part}_nvme_path is set but offload_{part}_device is {device!r}; set "
                            f"offload_{part}_device = \"nvme\" to use it")
        if path is not None and not Path(path).is_dir():
            problems.append(f"offload_{part}_nvme_path: {path} is not a folder")
    return problems
