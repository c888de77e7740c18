"""The option schema: every option's name (kohya's where kohya has it), type, default, choices and help.

The same converters (library.config.option_types) serve the TOML file and the command line, so both get the same
checks.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import library.config.choices as choices
from library.config.distributed_options import DISTRIBUTED_OPTIONS
from library.config.option_types import (
    OPTIMIZER_TYPES,
    Option,
    canonical_optimizer_type,
    to_bool,
    to_float,
    to_float_list,
    to_int,
    to_int_list,
    to_lr,
    to_optimizer_type,
    to_path_list,
    to_resolution,
    to_str,
    to_str_list,
)

# The optimizer names are imported from here by library.training.optim and the tests.
__all__ = ["ALIASES", "GROUPS", "OPTIMIZER_TYPES", "OPTIONS", "Option", "canonical_optimizer_type"]


def _opt(name: str, convert: Callable, default: Any, help: str, **kw: Any) -> Option:
    return Option(name, convert, default, help, **kw)


# kohya's own network modules, for every family; each family's entry adds the names its reference trainer uses.
KOHYA_NETWORK_MODULES = ("networks.lora", "lycoris.kohya", "networks.dylora")
NETWORK_MODULE_HELP = (
    "networks.lora (kohya's targets and defaults), lycoris.kohya (LyCORIS' preset and conv defaults), "
    "networks.dylora (kohya's DyLoRA, SD UNets), or the name the family's reference trainer uses (kohya's "
    "networks.lora_flux for FLUX.1, musubi-tuner's networks.lora_qwen_image for Qwen-Image ...), the same here; "
    "each writes the family's file format")

# Groups in --help order.
GROUPS = {
    "model": "Base model",
    "dataset": "Dataset",
    "network": "LoRA network",
    "training": "Training",
    "optimizer": "Optimizer and learning rate",
    "objective": "Noise and loss",
    "output": "Output",
    "logging": "Logging",
    "validation": "Validation",
    "sampling": "Sample images",
    "distributed": "Accelerator, multi-process and DeepSpeed",
    "config": "Configuration file",
}

_MODEL = [
    _opt("pretrained_model_name_or_path", to_str, None,
         "local diffusers model folder (StableDiffusionPipeline layout) or single-file .safetensors checkpoint "
         "(original SD layout, as shared on model sites), or a transformer file with its separate files "
         "(musubi-tuner's dit)", is_path=True, metavar="PATH", aliases=("dit",)),
    _opt("no_half_vae", to_bool, False, "keep the VAE in float32 under fp16/bf16 mixed precision"),
    _opt("model_config", to_str, None,
         "for a single-file checkpoint: a diffusers folder whose unet/vae/text_encoder/scheduler configs and "
         "tokenizer describe it (weights there are ignored); default: the shipped config of the SD1.x / SD2.x / "
         "SDXL architecture found in the file", is_path=True, metavar="PATH"),
]
_DATASET = [
    _opt("train_data_dir", to_str, None,
         "folder of image folders named like kohya's '10_sks dog' (10 repeats, class tokens 'sks dog')",
         is_path=True, metavar="PATH"),
    _opt("resolution", to_resolution, (512, 512), "training size: 512 or \"width,height\"", metavar="SIZE"),
    _opt("caption_extension", to_str, ".caption",
         "caption file extension; a .txt caption is used when this one is missing",
         aliases=("caption_extention",)),
    _opt("dataset_config", to_str, None,
         "kohya dataset TOML ([general], [[datasets]], [[datasets.subsets]]); replaces train_data_dir",
         is_path=True, metavar="PATH"),
    _opt("in_json", to_str, None,
         "kohya's fine-tuning metadata (.json, or .jsonl lines with image_path): captions and tags per image key; "
         "train_data_dir is then the folder of the images themselves (keys may leave out the extension)",
         is_path=True, metavar="PATH"),
    _opt("dataset_repeats", to_int, 1,
         "kohya's: repeats of the in_json images, and of dataset_config subsets that set no num_repeats"),
    _opt("reg_data_dir", to_str, None, "folder of regularisation image folders (kohya names)", is_path=True,
         metavar="PATH"),
    _opt("prior_loss_weight", to_float, 1.0, "loss weight of regularisation images and of prior_reg samples"),
    _opt("dataset_check", to_bool, False,
         "check the dataset without loading the UNet: counts, buckets, captions, problems; exit 0 when usable "
         "(kohya's debug_dataset: look at the data, do not train)", aliases=("debug_dataset",)),
    _opt("skip_bad_images", to_bool, False,
         "leave out unusable images (listed in the log) instead of stopping with status 2"),
    _opt("resize_interpolation", to_str, None,
         "kohya's: the filter images are resized with (default: Lanczos); area averages the covered pixels",
         choices=choices.RESIZE_INTERPOLATIONS),
    _opt("color_aug", to_bool, False,
         "kohya's: a random hue shift (up to 8 of 180 steps) or gamma (0.95-1.05) on a third of the uses of an image; "
         "latents are then not cached"),
    _opt("enable_bucket", to_bool, False, "aspect-ratio buckets"),
    _opt("min_bucket_reso", to_int, 256, "smallest bucket side"),
    _opt("max_bucket_reso", to_int, 1024, "largest bucket side"),
    _opt("bucket_reso_steps", to_int, 64, "bucket sides are multiples of this"),
    _opt("bucket_no_upscale", to_bool, False, "never enlarge an image to fit a bucket"),
    _opt("shuffle_caption", to_bool, False, "shuffle the caption's tags each time it is used"),
    _opt("caption_separator", to_str, ",", "separator between caption tags"),
    _opt("secondary_separator", to_str, None,
         "kohya's: a separator that shuffling and tag dropout leave alone (it joins tags into one), replaced by "
         "caption_separator afterwards"),
    _opt("enable_wildcard", to_bool, False,
         "kohya's: {a|b|c} in a caption picks one each time it is used, and a caption file's lines are alternatives "
         "({{ and }} are literal braces)"),
    _opt("token_warmup_min", to_int, 1,
         "kohya's caption warm-up: train on only the first this many tags (after the kept ones) at step 0 ..."),
    _opt("token_warmup_step", to_float, 0.0,
         "... and on more of them step by step, all from this step on (a fraction of the run's steps when below 1; "
         "0: no warm-up)"),
    _opt("keep_tokens", to_int, 0, "leading tags kept in place when shuffling or dropping"),
    _opt("keep_tokens_separator", to_str, "", "tags before this separator are kept in place"),
    _opt("caption_prefix", to_str, None, "text put before every caption"),
    _opt("caption_suffix", to_str, None, "text put after every caption"),
    _opt("caption_dropout_rate", to_float, 0.0, "probability of training an image with an empty caption"),
    _opt("caption_dropout_every_n_epochs", to_int, 0, "use empty captions every n-th epoch"),
    _opt("caption_tag_dropout_rate", to_float, 0.0, "probability of dropping each (non-kept) tag"),
    _opt("flip_aug", to_bool, False, "random horizontal flips"),
    _opt("face_crop_aug_range", to_float_list, None,
         "kohya's \"low,high\": without buckets, images named like name_cx_cy_w_h (the face's centre and size) "
         "are scaled so the face is 1/high to 1/low of the training size (drawn each use) and cropped around it",
         metavar="LOW,HIGH"),
    _opt("random_crop", to_bool, False, "random instead of centred crops"),
    _opt("alpha_mask", to_bool, False,
         "weight the loss by the images' alpha channel (transparent pixels are not learned)"),
    _opt("cache_latents", to_bool, False, "encode every image with the VAE once, before training"),
    _opt("cache_latents_to_disk", to_bool, False, "keep the latent cache on disk beside the images"),
    _opt("vae_batch_size", to_int, 1, "images per VAE batch when caching latents"),
    _opt("cache_text_encoder_outputs", to_bool, False,
         "encode every caption once (only with a frozen text encoder and fixed captions)"),
    _opt("text_encoder_batch_size", to_int, None,
         "captions per text-encoder batch when its outputs are cached (default 16)"),
    _opt("cache_text_encoder_outputs_to_disk", to_bool, False,
         "kohya's: turns on cache_text_encoder_outputs; the outputs are kept in memory (encoded once at start), "
         "no cache file is written"),
    _opt("train_batch_size", to_int, 1, "images per batch on each process"),
    _opt("max_data_loader_n_workers", to_int, 0, "data loader worker processes (0 loads in the main process)"),
    _opt("persistent_data_loader_workers", to_bool, False, "keep data loader workers alive between epochs"),
]
_NETWORK = [
    _opt("network_module", to_str, "networks.lora", NETWORK_MODULE_HELP, choices=KOHYA_NETWORK_MODULES),
    _opt("network_dim", to_int, 4, "LoRA rank"),
    _opt("network_alpha", to_float, 1.0, "LoRA alpha; the update is scaled by alpha / dim"),
    _opt("network_dropout", to_float, 0.0, "dropout probability on lora_down's output (kohya's)"),
    _opt("network_args", to_str_list, [],
         "kohya / LyCORIS network arguments as key=value strings: conv_dim, conv_alpha, algo (lora, locon, loha, "
         "lokr), dora_wd, rank_dropout, module_dropout, loraplus_*, factor, decompose_both, block_dims, "
         "block_alphas, conv_block_dims, conv_block_alphas, down/mid/up_lr_weight, block_lr_zero_threshold",
         metavar="KEY=VALUE"),
    _opt("network_train_unet_only", to_bool, False, "train LoRA on the UNet only"),
    _opt("unet_lr", to_float, None, "learning rate of the UNet LoRA (default: learning_rate)"),
    _opt("text_encoder_lr", to_lr, None, "learning rate of the text encoder LoRA (default: learning_rate)"),
    _opt("loraplus_lr_ratio", to_float, None,
         "LoRA+: train the LoRA up weights at learning rate x this (kohya reads it from network_args; either "
         "place works)"),
    _opt("loraplus_unet_lr_ratio", to_float, None, "LoRA+ ratio for the UNet (default: loraplus_lr_ratio)"),
    _opt("loraplus_text_encoder_lr_ratio", to_float, None,
         "LoRA+ ratio for the text encoder (default: loraplus_lr_ratio)"),
    _opt("scale_weight_norms", to_float, None,
         "after each optimizer step, scale down every LoRA module whose up @ down * alpha / dim has a norm above "
         "this (kohya's max-norm regularisation; 1.0 is kohya's suggestion)"),
    _opt("ema_decay", to_float, None,
         "keep an exponential moving average of the LoRA weights, updated after each optimizer step with this "
         "decay (e.g. 0.999); kept in state dirs"),
    _opt("ema_for_saved_file", to_bool, False, "save the EMA weights (not the last ones) in the LoRA files"),
]
_TRAINING = [
    _opt("max_train_steps", to_int, 1600, "optimizer steps to train"),
    _opt("max_train_epochs", to_int, None, "epochs to train (overrides max_train_steps)"),
    _opt("gradient_accumulation_steps", to_int, 1, "batches per optimizer step"),
    _opt("max_grad_norm", to_float, 1.0, "clip the gradient norm to this (0 disables clipping)"),
    _opt("mixed_precision", to_str, "no", "autocast precision; frozen weights are stored in it",
         choices=("no", "fp16", "bf16")),
    _opt("full_fp16", to_bool, False,
         "keep the LoRA weights and their gradients in fp16 too (needs mixed_precision fp16); with DeepSpeed "
         "ZeRO-2 and CPU optimizer offload, fp16 master weights and gradients"),
    _opt("full_bf16", to_bool, False, "keep the LoRA weights and their gradients in bf16 too (needs "
         "mixed_precision bf16)"),
    _opt("gradient_checkpointing", to_bool, False, "recompute activations in backward to save memory"),
    _opt("base_model_precision", to_str, "no_change",
         "storage of the frozen base's linear and conv weights: no_change (mixed_precision's dtype), fp8 "
         "(float8_e4m3fn, kohya's fp8_base; the text encoders too), int8 or nf4 (bitsandbytes weight-only, the "
         "text encoders in fp8); computed in mixed_precision's dtype, LoRA weights stay fp32",
         choices=("no_change", "fp8", "int8", "nf4")),
    _opt("fp8_base", to_bool, False,
         "kohya's switch for base_model_precision fp8: denoiser and text encoders stored as float8_e4m3fn"),
    _opt("fp8_base_unet", to_bool, False,
         "kohya's: the denoiser (UNet / transformer) stored as float8_e4m3fn, the text encoders as they are"),
    _opt("cpu_offload_checkpointing", to_bool, False,
         "CUDA: keep the activations gradient checkpointing saves in CPU memory (turns on gradient_checkpointing; "
         "not with blocks_to_swap); without CUDA it has no effect"),
    _opt("seed", to_int, None, "random seed (a random one is drawn and recorded when unset)"),
    _opt("initial_step", to_int, None,
         "kohya's: start counting at this optimizer step (e.g. to continue from a LoRA given as network_weights): "
         "saves, samples, logs, the learning-rate schedule and per-step noise go on from there, and the run ends "
         "at max_train_steps; overrides initial_epoch; with resume the state's own step is used"),
    _opt("initial_epoch", to_int, None,
         "kohya's: start at this epoch (1 is the first), that is at initial_step (epoch - 1) x steps per epoch"),
    _opt("skip_until_initial_step", to_bool, False,
         "kohya's: with initial_step / initial_epoch, also start the data where a run from step 0 would be at that "
         "step (same images, same order; nothing is loaded to be skipped); without it the data starts at the "
         "beginning of that step's epoch"),
]
_OPTIMIZER = [
    _opt("optimizer_type", to_optimizer_type, "AdamW",
         f"optimizer: {', '.join(OPTIMIZER_TYPES)} (any case); or a torch.optim class (RAdam) or \"module.Class\""),
    _opt("use_8bit_adam", to_bool, False, "kohya's older switch for optimizer_type AdamW8bit"),
    _opt("use_lion_optimizer", to_bool, False, "kohya's older switch for optimizer_type Lion"),
    _opt("optimizer_args", to_str_list, [], "optimizer keyword arguments, e.g. weight_decay=0.01 \"betas=(0.9,0.99)\"",
         metavar="KEY=VALUE"),
    _opt("learning_rate", to_float, 2e-6, "base learning rate"),
    _opt("lr_scheduler", to_str, "constant", "learning-rate schedule (unused when lr_scheduler_type is set)",
         choices=choices.LR_SCHEDULERS),
    _opt("lr_warmup_steps", to_float, 0,
         "warm-up steps, or a fraction of the total steps when below 1"),
    _opt("lr_decay_steps", to_float, 0,
         "decay steps of warmup_stable_decay, or a fraction of the total steps when below 1"),
    _opt("lr_scheduler_num_cycles", to_int, 1,
         "cycles of cosine_with_restarts; half-waves of the cosine in cosine_with_min_lr and warmup_stable_decay"),
    _opt("lr_scheduler_power", to_float, 1.0, "power of the polynomial schedule"),
    _opt("lr_scheduler_timescale", to_int, None,
         "timescale of inverse_sqrt (default: the warm-up steps, or 10000 without warm-up)"),
    _opt("lr_scheduler_min_lr_ratio", to_float, None,
         "final learning rate as a fraction of the initial one: cosine_with_min_lr (required), "
         "warmup_stable_decay (default 0)"),
    _opt("lr_scheduler_type", to_str, None,
         "a scheduler class instead of lr_scheduler: a torch.optim.lr_scheduler name (StepLR) or \"module.Class\"; "
         "stepped once per optimizer step"),
    _opt("lr_scheduler_args", to_str_list, [],
         "keyword arguments of lr_scheduler_type or lr_scheduler, e.g. step_size=100 gamma=0.5", metavar="KEY=VALUE"),
]
_OBJECTIVE = [
    _opt("ip_noise_gamma", to_float, None,
         "input perturbation: extra noise of this scale on the noisy latents only (0.1 is usual)"),
    _opt("ip_noise_gamma_random_strength", to_bool, False,
         "scale the input perturbation by a uniform draw in [0, ip_noise_gamma) per batch"),
    _opt("loss_type", to_str, "l2", "loss function", choices=choices.LOSS_TYPES),
    _opt("huber_schedule", to_str, "snr",
         "how huber_c changes with the timestep for loss_type huber / smooth_l1", choices=choices.HUBER_SCHEDULES),
    _opt("huber_c", to_float, 0.1, "Huber threshold (loss_type huber / smooth_l1); the schedules' low end"),
    _opt("huber_scale", to_float, 1.0,
         "multiplies huber_c in the constant and exponential schedules (kohya leaves it out of snr)"),
    _opt("masked_loss", to_bool, False,
         "weight the loss by masks: alpha_mask, or conditioning_data_dir in the dataset_config subsets (a mask "
         "image per image, same file name, red channel)"),
]

_OUTPUT = [
    _opt("output_dir", to_str, None, "where the LoRA file is written", is_path=True, metavar="PATH"),
    _opt("output_name", to_str, "last", "base name of the LoRA file"),
    _opt("save_model_as", to_str, "safetensors", "file format of the LoRA", choices=("safetensors",)),
    _opt("save_precision", to_str, None, "dtype of the saved LoRA (default float)",
         choices=("float", "fp16", "bf16")),
    _opt("save_every_n_steps", to_int, None, "also save a LoRA snapshot (name-step00000500) every n steps"),
    _opt("save_every_n_epochs", to_int, None, "also save a LoRA snapshot (name-000003) every n epochs"),
    _opt("save_n_epoch_ratio", to_int, None,
         "kohya's: save a snapshot every floor(epochs / n) epochs (at least every epoch), about n in all; replaces "
         "save_every_n_epochs"),
    _opt("save_last_n_steps", to_int, None,
         "keep only the step snapshots of the last n steps (older ones are removed)"),
    _opt("save_last_n_epochs", to_int, None, "keep only the last n epoch snapshots"),
    _opt("save_state", to_bool, False,
         "with each snapshot, also save a training state dir (name-...-state) to resume from"),
    _opt("save_last_n_steps_state", to_int, None, "keep only the state dirs of the last n steps"),
    _opt("save_last_n_epochs_state", to_int, None, "keep only the last n epoch state dirs"),
    _opt("save_state_on_train_end", to_bool, False, "save a state dir when training ends"),
    _opt("save_state_on_preemption", to_bool, False,
         "on SIGTERM / SIGINT, finish the step and save a state dir (also done when save_state or "
         "save_state_on_train_end is set)"),
    _opt("resume", to_str, None,
         "continue from a state dir, or 'latest' for the newest complete one in output_dir", metavar="DIR|latest"),
    _opt("network_weights", to_str, None, "start from this kohya-format LoRA file", is_path=True,
         metavar="PATH"),
    _opt("base_weights", to_path_list, [],
         "kohya's: LoRA files merged into the base model before training (and before any cache is made); the "
         "trained LoRA is a difference from that merged model", metavar="PATH"),
    _opt("base_weights_multiplier", to_float_list, [],
         "strength of each base_weights file (default 1.0 each)", metavar="X"),
    _opt("dim_from_weights", to_bool, False, "take network_dim and network_alpha from network_weights"),
    _opt("huggingface_repo_id", to_str, None,
         "upload each saved LoRA file to this Hugging Face Hub repository (created when missing)"),
    _opt("huggingface_repo_type", to_str, None, "the repository's type (model by default)",
         choices=("model", "dataset", "space")),
    _opt("huggingface_path_in_repo", to_str, None, "folder in the repository the files go to (default: its root)"),
    _opt("huggingface_token", to_str, None, "Hub token (default: the one huggingface-cli login stored)",
         secret=True),
    _opt("huggingface_repo_visibility", to_str, None,
         "visibility of a repository the upload creates: private (default) or public", choices=("public", "private")),
    _opt("save_state_to_huggingface", to_bool, False, "also upload each saved state dir"),
    _opt("resume_from_huggingface", to_bool, False,
         "resume names a state dir in a Hub repository: owner/repository/path[:revision[:repo_type]] (downloaded "
         "into output_dir/.hub_state first)"),
    _opt("async_upload", to_bool, False,
         "upload in the background while training goes on (the last file is uploaded before the run ends)"),
    _opt("no_metadata", to_bool, False, "write no ss_* training metadata into the LoRA file"),
    _opt("training_comment", to_str, None, "free text stored as ss_training_comment"),
    _opt("metadata_title", to_str, None, "modelspec.title of the LoRA file (default: output_name)"),
    _opt("metadata_author", to_str, None, "modelspec.author of the LoRA file"),
    _opt("metadata_description", to_str, None, "modelspec.description of the LoRA file"),
    _opt("metadata_license", to_str, None, "modelspec.license of the LoRA file"),
    _opt("metadata_tags", to_str, None, "modelspec.tags of the LoRA file (comma-separated)"),
]
_LOGGING = [
    _opt("log_with", to_str, None, "trackers to log to (logging_dir alone means tensorboard)",
         choices=("tensorboard", "wandb", "all")),
    _opt("logging_dir", to_str, None, "tracker log folder (default output_dir/logs when log_with is set)",
         is_path=True, metavar="PATH"),
    _opt("log_prefix", to_str, None, "prefix of the run's folder name under logging_dir"),
    _opt("log_tracker_name", to_str, None, "tracker project / run name (default network_train)"),
    _opt("log_tracker_config", to_str, None,
         "TOML of per-tracker init arguments: [wandb] entity = ..., [tensorboard] flush_secs = ...",
         is_path=True, metavar="PATH"),
    _opt("wandb_run_name", to_str, None, "wandb run name"),
    _opt("wandb_api_key", to_str, None, "wandb API key (never written to any file or tracker)", secret=True),
    _opt("log_config", to_bool, False, "send the resolved config to the trackers (no secrets, no full paths)"),
    _opt("console_log_file", to_str, None,
         "kohya's: write the log to this file (anew each run) instead of the console; the progress bar stays",
         is_path=True, metavar="PATH"),
    _opt("loss_timestep_bins", to_int, 10, "log the training loss binned by timestep into this many bins"),
    _opt("console_log_level", to_str, "INFO", "console log level",
         choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")),
]
_VALIDATION = [
    _opt("validation_split", to_float, 0.0, "fraction of the training images held out for validation"),
    _opt("validation_seed", to_int, None, "seed of the split and of the validation noise (default: seed)"),
    _opt("max_validation_steps", to_int, None,
         "measure the validation loss on at most this many held-out images (default: all of them)"),
    _opt("validate_every_n_steps", to_int, None, "validate every n optimizer steps"),
    _opt("validate_every_n_epochs", to_int, None,
         "validate every n epochs (default: every epoch when neither interval is set)"),
    _opt("validation_timesteps", to_int_list, [100, 300, 500, 700, 900],
         "the fixed timesteps the validation loss is measured at", metavar="T,T,..."),
]
_SAMPLING = [
    _opt("sample_prompts", to_str, None,
         "prompts to sample while training: kohya's .txt (--n --w --h --d --s --l --ss per line), .toml or .json",
         is_path=True, metavar="PATH"),
    _opt("sample_every_n_steps", to_int, None, "sample every n optimizer steps"),
    _opt("sample_every_n_epochs", to_int, None, "sample every n epochs (overrides sample_every_n_steps, as kohya)"),
    _opt("sample_at_first", to_bool, False, "sample before the first step"),
]
_DISTRIBUTED = DISTRIBUTED_OPTIONS
_CONFIG = [
    _opt("config_file", to_str, None, "TOML file of options (command-line flags override it)",
         aliases=("config",), is_path=True, metavar="PATH"),
    _opt("output_config", to_str, None, "write the resolved configuration as TOML to PATH and exit",
         is_path=True, metavar="PATH"),
]

_BY_GROUP = {"model": _MODEL, "dataset": _DATASET, "network": _NETWORK, "training": _TRAINING,
             "optimizer": _OPTIMIZER, "objective": _OBJECTIVE, "output": _OUTPUT, "logging": _LOGGING,
             "validation": _VALIDATION, "sampling": _SAMPLING,
             "distributed": _DISTRIBUTED, "config": _CONFIG}
CORE_OPTIONS: dict[str, Option] = {
    o.name: dataclasses.replace(o, group=group) for group, options in _BY_GROUP.items() for o in options}
# The schema: the core options, and once library.families.registry is imported, the options the families read.
# Both dicts are updated in place, so what imported them sees the families' options too.
OPTIONS: dict[str, Option] = dict(CORE_OPTIONS)
ALIASES: dict[str, str] = {alias: o.name for o in OPTIONS.values() for alias in o.aliases}
_FAMILIES: list[str] = []


def add_family_options(family: str, options: Iterable[Option], network_modules: Iterable[str] = ()) -> None:
    """Add the options family `family` reads, and the network_module names that train it, to the schema (the
    registry calls this once per family). An option several families read is one declaration, listed by each:
    its `families` then names them all. Options stay in group order, the core ones first within a group."""
    found = dict(OPTIONS)
    for option in options:
        if option.group not in GROUPS:
            raise ValueError(f"{family}: option {option.name!r} has no group of GROUPS ({option.group!r})")
        known = found.get(option.name)
        if known is not None and dataclasses.replace(known, families=()) != option:
            raise ValueError(f"{family}: option {option.name!r} is declared differently elsewhere; declare it once")
        families = (*(known.families if known else ()), family)
        found[option.name] = dataclasses.replace(option, families=families)
    module = found["network_module"]
    added = tuple(name for name in network_modules if name not in module.choices)
    found["network_module"] = dataclasses.replace(module, choices=(*module.choices, *added))
    OPTIONS.clear()
    OPTIONS.update({name: option for group in GROUPS for name, option in found.items() if option.group == group})
    ALIASES.clear()
    ALIASES.update({alias: o.name for o in OPTIONS.values() for alias in o.aliases})
    _FAMILIES.append(family)


def require_families() -> None:
    """The schema is only whole once the families' options are in: parse with library.families.registry imported."""
    if not _FAMILIES:
        raise RuntimeError("the families' options are not in the schema: import library.families.registry before "
                           "parsing a configuration")
