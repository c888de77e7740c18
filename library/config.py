"""The one option schema: TOML + command line -> a validated, read-only Config.

Option names follow kohya-ss/sd-scripts so that a kohya config file works here. The TOML file and the command line
go through the same conversion and checks, and every problem is reported at once.
"""
from __future__ import annotations

import argparse
import difflib
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence


class UserError(Exception):
    """A user mistake (config, data, model files); carries every problem found. Ends the run with status 2."""

    def __init__(self, problems: str | Sequence[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class ConfigError(UserError):
    """A problem in the options."""


# --- value converters: each takes a raw value (TOML value or command-line string) and returns the typed value or
# raises ValueError with a short reason. The same converter serves both sources.

def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
        try:
            as_float = float(value)
        except ValueError:
            pass
        else:
            if as_float.is_integer():
                return int(as_float)
    raise ValueError("expected an integer")


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    if isinstance(value, (int, float)):
        result = float(value)
    elif isinstance(value, str):
        try:
            result = float(value.strip())
        except ValueError:
            raise ValueError("expected a number") from None
    else:
        raise ValueError("expected a number")
    if not math.isfinite(result):
        raise ValueError("expected a finite number")
    return result


def _to_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError("expected a string")


def _to_str_list(value: Any) -> list[str]:
    # kohya writes network_args / optimizer_args as TOML arrays; on the command line they are space-separated.
    if isinstance(value, str):
        return value.split()
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError("expected a list of strings")


def _to_resolution(value: Any) -> tuple[int, int]:
    """kohya accepts "512", "512,768" (width,height) or a number; also a [w, h] array here."""
    if isinstance(value, bool):
        raise ValueError("expected a size like 512 or \"512,768\"")
    if isinstance(value, int):
        parts: list[Any] = [value, value]
    elif isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        parts = parts * 2 if len(parts) == 1 else parts
    elif isinstance(value, (list, tuple)):
        parts = list(value) * 2 if len(value) == 1 else list(value)
    else:
        raise ValueError("expected a size like 512 or \"512,768\"")
    if len(parts) != 2:
        raise ValueError("expected a size like 512 or \"512,768\"")
    try:
        width, height = (_to_int(p) for p in parts)
    except ValueError:
        raise ValueError("expected a size like 512 or \"512,768\"") from None
    if width <= 0 or height <= 0:
        raise ValueError("sizes must be positive")
    return width, height


_TYPE_NAMES: dict[Callable, str] = {
    _to_bool: "bool", _to_int: "int", _to_float: "float", _to_str: "str", _to_str_list: "list of str",
    _to_resolution: "size",
}


@dataclass(frozen=True)
class Option:
    name: str
    convert: Callable[[Any], Any]
    default: Any
    help: str
    group: str
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()
    secret: bool = False  # never sent to trackers, metadata or the resolved-config dump
    is_path: bool = False  # trackers get the base name only
    metavar: str | None = None

    @property
    def is_flag(self) -> bool:
        return self.convert is _to_bool


def _opt(name: str, convert: Callable, default: Any, help: str, **kw: Any) -> Option:
    return Option(name, convert, default, help, _current_group, **kw)


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
    "distributed": "Accelerator, multi-process and DeepSpeed",
    "config": "Configuration file",
}

_current_group = "model"
_MODEL = [
    _opt("pretrained_model_name_or_path", _to_str, None,
         "local diffusers model folder (StableDiffusionPipeline layout)", is_path=True, metavar="PATH"),
    _opt("v2", _to_bool, False, "the base model is Stable Diffusion 2.x"),
    _opt("v_parameterization", _to_bool, False,
         "train with v-prediction (SD2.x 768-v); read from the scheduler config when not set"),
    _opt("no_half_vae", _to_bool, False, "keep the VAE in float32 under fp16/bf16 mixed precision"),
]
_current_group = "dataset"
_DATASET = [
    _opt("train_data_dir", _to_str, None,
         "folder of image folders named like kohya's '10_sks dog' (10 repeats, class tokens 'sks dog')",
         is_path=True, metavar="PATH"),
    _opt("resolution", _to_resolution, (512, 512), "training size: 512 or \"width,height\"", metavar="SIZE"),
    _opt("caption_extension", _to_str, ".caption",
         "caption file extension; a .txt caption is used when this one is missing",
         aliases=("caption_extention",)),
    _opt("dataset_config", _to_str, None,
         "kohya dataset TOML ([general], [[datasets]], [[datasets.subsets]]); replaces train_data_dir",
         is_path=True, metavar="PATH"),
    _opt("reg_data_dir", _to_str, None, "folder of regularisation image folders (kohya names)", is_path=True,
         metavar="PATH"),
    _opt("prior_loss_weight", _to_float, 1.0, "loss weight of regularisation images"),
    _opt("dataset_check", _to_bool, False,
         "check the dataset without loading the UNet: counts, buckets, captions, problems; exit 0 when usable"),
    _opt("skip_bad_images", _to_bool, False,
         "leave out unusable images (listed in the log) instead of stopping with status 2"),
    _opt("enable_bucket", _to_bool, False, "aspect-ratio buckets"),
    _opt("min_bucket_reso", _to_int, 256, "smallest bucket side"),
    _opt("max_bucket_reso", _to_int, 1024, "largest bucket side"),
    _opt("bucket_reso_steps", _to_int, 64, "bucket sides are multiples of this"),
    _opt("bucket_no_upscale", _to_bool, False, "never enlarge an image to fit a bucket"),
    _opt("shuffle_caption", _to_bool, False, "shuffle the caption's tags each time it is used"),
    _opt("caption_separator", _to_str, ",", "separator between caption tags"),
    _opt("keep_tokens", _to_int, 0, "leading tags kept in place when shuffling or dropping"),
    _opt("keep_tokens_separator", _to_str, "", "tags before this separator are kept in place"),
    _opt("caption_prefix", _to_str, None, "text put before every caption"),
    _opt("caption_suffix", _to_str, None, "text put after every caption"),
    _opt("caption_dropout_rate", _to_float, 0.0, "probability of training an image with an empty caption"),
    _opt("caption_dropout_every_n_epochs", _to_int, 0, "use empty captions every n-th epoch"),
    _opt("caption_tag_dropout_rate", _to_float, 0.0, "probability of dropping each (non-kept) tag"),
    _opt("flip_aug", _to_bool, False, "random horizontal flips"),
    _opt("random_crop", _to_bool, False, "random instead of centred crops"),
    _opt("cache_latents", _to_bool, False, "encode every image with the VAE once, before training"),
    _opt("cache_latents_to_disk", _to_bool, False, "keep the latent cache on disk beside the images"),
    _opt("vae_batch_size", _to_int, 1, "images per VAE batch when caching latents"),
    _opt("cache_text_encoder_outputs", _to_bool, False,
         "encode every caption once (only with a frozen text encoder and fixed captions)"),
    _opt("train_batch_size", _to_int, 1, "images per batch on each process"),
    _opt("max_data_loader_n_workers", _to_int, 0, "data loader worker processes (0 loads in the main process)"),
    _opt("persistent_data_loader_workers", _to_bool, False, "keep data loader workers alive between epochs"),
]
_current_group = "network"
_NETWORK = [
    _opt("network_module", _to_str, "networks.lora", "LoRA implementation; only networks.lora (peft LoRA)",
         choices=("networks.lora",)),
    _opt("network_dim", _to_int, 4, "LoRA rank"),
    _opt("network_alpha", _to_float, 1.0, "LoRA alpha; the update is scaled by alpha / dim"),
    _opt("network_dropout", _to_float, 0.0, "dropout probability on the LoRA input (peft lora_dropout)"),
    _opt("network_args", _to_str_list, [], "extra network arguments as key=value strings", metavar="KEY=VALUE"),
    _opt("network_train_unet_only", _to_bool, False, "train LoRA on the UNet only"),
    _opt("network_train_text_encoder_only", _to_bool, False, "train LoRA on the text encoder only"),
    _opt("unet_lr", _to_float, None, "learning rate of the UNet LoRA (default: learning_rate)"),
    _opt("text_encoder_lr", _to_float, None, "learning rate of the text encoder LoRA (default: learning_rate)"),
]
_current_group = "training"
_TRAINING = [
    _opt("max_train_steps", _to_int, 1600, "optimizer steps to train"),
    _opt("max_train_epochs", _to_int, None, "epochs to train (overrides max_train_steps)"),
    _opt("gradient_accumulation_steps", _to_int, 1, "batches per optimizer step"),
    _opt("max_grad_norm", _to_float, 1.0, "clip the gradient norm to this (0 disables clipping)"),
    _opt("mixed_precision", _to_str, "no", "autocast precision; frozen weights are stored in it",
         choices=("no", "fp16", "bf16")),
    _opt("gradient_checkpointing", _to_bool, False, "recompute activations in backward to save memory"),
    _opt("seed", _to_int, None, "random seed (a random one is drawn and recorded when unset)"),
]
_current_group = "optimizer"
_OPTIMIZER = [
    _opt("optimizer_type", _to_str, "AdamW", "optimizer", choices=("AdamW",)),
    _opt("optimizer_args", _to_str_list, [], "optimizer keyword arguments, e.g. weight_decay=0.01 \"betas=(0.9,0.99)\"",
         metavar="KEY=VALUE"),
    _opt("learning_rate", _to_float, 2e-6, "base learning rate"),
    _opt("lr_scheduler", _to_str, "constant", "learning-rate schedule",
         choices=("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")),
    _opt("lr_warmup_steps", _to_float, 0,
         "warm-up steps, or a fraction of the total steps when below 1"),
    _opt("lr_scheduler_num_cycles", _to_int, 1, "restarts for cosine_with_restarts"),
    _opt("lr_scheduler_power", _to_float, 1.0, "power of the polynomial schedule"),
]
_current_group = "objective"
_OBJECTIVE = [
    _opt("min_snr_gamma", _to_float, None, "Min-SNR loss weighting gamma (5 is the paper's value)"),
    _opt("noise_offset", _to_float, None, "add this much per-channel offset noise"),
    _opt("min_timestep", _to_int, 0, "lowest timestep to train (inclusive)"),
    _opt("max_timestep", _to_int, 1000, "highest timestep to train (exclusive)"),
]
_current_group = "output"
_OUTPUT = [
    _opt("output_dir", _to_str, None, "where the LoRA file is written", is_path=True, metavar="PATH"),
    _opt("output_name", _to_str, "last", "base name of the LoRA file"),
    _opt("save_model_as", _to_str, "safetensors", "file format of the LoRA", choices=("safetensors",)),
    _opt("save_precision", _to_str, None, "dtype of the saved LoRA (default float)",
         choices=("float", "fp16", "bf16")),
    _opt("save_every_n_steps", _to_int, None, "also save a LoRA snapshot (name-step00000500) every n steps"),
    _opt("save_every_n_epochs", _to_int, None, "also save a LoRA snapshot (name-000003) every n epochs"),
    _opt("save_last_n_steps", _to_int, None,
         "keep only the step snapshots of the last n steps (older ones are removed)"),
    _opt("save_last_n_epochs", _to_int, None, "keep only the last n epoch snapshots"),
    _opt("save_state", _to_bool, False,
         "with each snapshot, also save a training state dir (name-...-state) to resume from"),
    _opt("save_last_n_steps_state", _to_int, None, "keep only the state dirs of the last n steps"),
    _opt("save_last_n_epochs_state", _to_int, None, "keep only the last n epoch state dirs"),
    _opt("save_state_on_train_end", _to_bool, False, "save a state dir when training ends"),
    _opt("resume", _to_str, None,
         "continue from a state dir, or 'latest' for the newest complete one in output_dir", metavar="DIR|latest"),
    _opt("network_weights", _to_str, None, "start from this kohya-format LoRA file", is_path=True,
         metavar="PATH"),
    _opt("dim_from_weights", _to_bool, False, "take network_dim and network_alpha from network_weights"),
    _opt("no_metadata", _to_bool, False, "write no ss_* training metadata into the LoRA file"),
    _opt("training_comment", _to_str, None, "free text stored as ss_training_comment"),
]
_current_group = "logging"
_LOGGING = [
    _opt("logging_dir", _to_str, None, "tracker log folder", is_path=True, metavar="PATH"),
    _opt("log_prefix", _to_str, None, "prefix of the tracker run name"),
    _opt("console_log_level", _to_str, "INFO", "console log level",
         choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")),
]
_current_group = "distributed"
_DISTRIBUTED = [
    _opt("ddp_timeout", _to_int, None, "process-group timeout in minutes"),
    _opt("ddp_gradient_as_bucket_view", _to_bool, False, "DDP gradient_as_bucket_view"),
    _opt("ddp_static_graph", _to_bool, False, "DDP static_graph"),
    _opt("torch_compile", _to_bool, False, "compile the UNet with torch.compile (dynamo_backend, default inductor)"),
    _opt("dynamo_backend", _to_str, "inductor", "torch.compile backend",
         choices=("inductor", "eager", "aot_eager", "cudagraphs", "aot_ts_nvfuser", "nvprims_nvfuser", "ofi",
                  "fx2trt", "onnxrt", "tensorrt", "aot_torchxla_trace_once", "torchxla_trace_once", "ipex", "tvm")),
    _opt("deepspeed", _to_bool, False, "train with DeepSpeed"),
    _opt("zero_stage", _to_int, 2, "DeepSpeed ZeRO stage", metavar="{0,1,2,3}"),
    _opt("offload_optimizer_device", _to_str, None, "DeepSpeed optimizer offload", choices=("cpu", "nvme")),
    _opt("offload_param_device", _to_str, None, "DeepSpeed parameter offload", choices=("cpu", "nvme")),
]
_current_group = "config"
_CONFIG = [
    _opt("config_file", _to_str, None, "TOML file of options (command-line flags override it)",
         aliases=("config",), is_path=True, metavar="PATH"),
    _opt("output_config", _to_str, None, "write the resolved configuration as TOML to PATH and exit",
         is_path=True, metavar="PATH"),
]

OPTIONS: dict[str, Option] = {
    o.name: o for o in _MODEL + _DATASET + _NETWORK + _TRAINING + _OPTIMIZER + _OBJECTIVE + _OUTPUT + _LOGGING
    + _DISTRIBUTED + _CONFIG
}
_ALIASES: dict[str, str] = {alias: o.name for o in OPTIONS.values() for alias in o.aliases}

# kohya options that have no effect here; accepted so kohya configs load, with the reason logged.
IGNORED_KOHYA_OPTIONS: dict[str, str] = {
    "xformers": "attention always uses PyTorch scaled_dot_product_attention",
    "sdpa": "attention always uses PyTorch scaled_dot_product_attention",
    "mem_eff_attn": "attention always uses PyTorch scaled_dot_product_attention",
    "lowram": "weights are loaded straight to their device",
    "highvram": "memory placement is automatic",
    "lowvram": "memory placement is automatic",
    "tokenizer_cache_dir": "the tokenizer is read from the model folder",
    "use_safetensors": "LoRA files are always safetensors",
    "console_log_simple": "console output is always plain",
    "disable_mmap_load_safetensors": "safetensors files are read with the library default",
}

# kohya options this trainer does not offer (yet): named so a kohya user learns exactly what to change.
UNSUPPORTED_KOHYA_OPTIONS: tuple[str, ...] = (
    "adaptive_noise_scale", "alpha_mask", "async_upload", "base_weights", "base_weights_multiplier", "cache_info",
    "cache_text_encoder_outputs_to_disk", "clip_skip", "color_aug", "conditioning_data_dir", "console_log_file",
    "cpu_offload_checkpointing", "dataset_class", "dataset_repeats", "debiased_estimation_loss", "debug_dataset",
    "enable_wildcard", "face_crop_aug_range", "fp16_master_weights_and_gradients", "fp8_base", "fp8_base_unet",
    "full_bf16", "full_fp16", "fused_backward_pass", "huber_c", "huber_scale", "huber_schedule",
    "huggingface_path_in_repo", "huggingface_repo_id", "huggingface_repo_type", "huggingface_repo_visibility",
    "huggingface_token", "in_json", "initial_epoch", "initial_step", "ip_noise_gamma",
    "ip_noise_gamma_random_strength", "log_config", "log_tracker_config", "log_tracker_name", "log_with",
    "loraplus_lr_ratio", "loraplus_text_encoder_lr_ratio", "loraplus_unet_lr_ratio", "loss_type", "lr_decay_steps",
    "lr_scheduler_args", "lr_scheduler_min_lr_ratio", "lr_scheduler_timescale", "lr_scheduler_type", "masked_loss",
    "max_token_length", "max_validation_steps", "metadata_author", "metadata_description", "metadata_license",
    "metadata_tags", "metadata_title", "multires_noise_discount", "multires_noise_iterations",
    "noise_offset_random_strength", "offload_optimizer_nvme_path", "offload_param_nvme_path",
    "resume_from_huggingface", "sample_at_first", "sample_every_n_epochs", "sample_every_n_steps", "sample_prompts",
    "sample_sampler", "save_n_epoch_ratio", "save_state_to_huggingface", "scale_v_pred_loss_like_noise_pred",
    "scale_weight_norms", "secondary_separator", "skip_cache_check", "skip_until_initial_step", "token_warmup_min",
    "token_warmup_step", "use_8bit_adam", "use_lion_optimizer", "v_pred_like_loss", "validate_every_n_epochs",
    "validate_every_n_steps", "validation_seed", "validation_split", "vae", "wandb_api_key", "wandb_run_name",
    "weighted_captions", "zero3_init_flag", "zero3_save_16bit_model", "zero_terminal_snr",
)


class Config:
    """Read-only resolved options. Attribute access like argparse's namespace; assignment is an error."""

    __slots__ = ("_values", "_explicit")

    def __init__(self, values: Mapping[str, Any], explicit: Iterable[str] = ()):
        object.__setattr__(self, "_values", MappingProxyType(dict(values)))
        object.__setattr__(self, "_explicit", frozenset(explicit))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no option named {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Config is read-only; keep derived values elsewhere")

    def __repr__(self) -> str:
        return f"Config({dict(self._values)!r})"

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def is_set(self, name: str) -> bool:
        """Whether the user gave this option (in the file or on the command line)."""
        return name in self._explicit

    def for_trackers(self) -> dict[str, Any]:
        """The options without secrets, with paths reduced to their last component."""
        clean: dict[str, Any] = {}
        for name, value in self._values.items():
            option = OPTIONS[name]
            if option.secret or value is None:
                continue
            if option.is_path:
                value = Path(value).name
            clean[name] = list(value) if isinstance(value, tuple) else value
        return clean

    def to_toml(self) -> str:
        """The resolved options grouped by topic; the file loads back to the same Config."""
        lines: list[str] = []
        for group in GROUPS:
            entries = [
                (o.name, self._values[o.name]) for o in OPTIONS.values()
                if o.group == group and not o.secret and o.name not in ("config_file", "output_config")
                and self._values.get(o.name) is not None
            ]
            if not entries:
                continue
            lines.append(f"[{group}]")
            lines.extend(f"{name} = {_toml_value(OPTIONS[name], value)}" for name, value in entries)
            lines.append("")
        return "\n".join(lines)


def _toml_value(option: Option, value: Any) -> str:
    if option.convert is _to_resolution:
        return f'"{value[0]},{value[1]}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_str(value)
    return "[" + ", ".join(_toml_str(v) for v in value) + "]"


def _toml_str(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


def _suggest(name: str, candidates: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def build_parser() -> argparse.ArgumentParser:
    """Command-line parser; every value stays a raw string so it gets the same checks as the TOML file."""
    parser = argparse.ArgumentParser(
        prog="train_network.py",
        description="Train a LoRA for Stable Diffusion. Options may come from a TOML file (--config) and the "
                    "command line; the command line wins.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    for option in OPTIONS.values():
        names = [f"--{option.name}"] + [f"--{alias}" for alias in option.aliases]
        help_text = option.help
        if option.default not in (None, [], ()) and not option.is_flag:
            shown = ",".join(map(str, option.default)) if isinstance(option.default, tuple) else option.default
            help_text += f" (default: {shown})"
        if option.is_flag:
            groups[option.group].add_argument(
                *names, dest=option.name, nargs="?", const="true", metavar="true|false", help=help_text)
            groups[option.group].add_argument(
                f"--no_{option.name}", dest=option.name, action="store_const", const="false",
                help=argparse.SUPPRESS)
        else:
            nargs = "+" if option.convert is _to_str_list else None
            groups[option.group].add_argument(
                *names, dest=option.name, nargs=nargs, metavar=option.metavar or option.name.upper(),
                choices=None, help=help_text + (f"; one of: {', '.join(option.choices)}" if option.choices else ""))
    return parser


def _read_toml(path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """Read a kohya-style config: top-level tables are flattened one level, as kohya does."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        return None, [f"config file not found: {path}"]
    except IsADirectoryError:
        return None, [f"config file is a directory: {path}"]
    except tomllib.TOMLDecodeError as e:
        return None, [f"{path}: not valid TOML: {e}"]
    except UnicodeDecodeError:
        return None, [f"{path}: not UTF-8 text"]
    flat: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in raw.items():
        entries = value.items() if isinstance(value, dict) else [(key, value)]
        for name, item in entries:
            if isinstance(item, dict):
                problems.append(f"{path}: [{key}] {name}: nested tables are not options")
            elif name in flat:
                problems.append(f"{path}: {name!r} is given more than once")
            else:
                flat[name] = item
    return flat, problems


def _convert(option: Option, raw: Any, where: str) -> tuple[Any, str | None]:
    try:
        value = option.convert(raw)
    except ValueError as e:
        return None, f"{where}: {option.name} = {raw!r}: {e}"
    if option.choices is not None and value not in option.choices:
        folded = {c.lower(): c for c in option.choices}
        if isinstance(value, str) and value.lower() in folded:
            return folded[value.lower()], None
        return None, (f"{where}: {option.name} = {raw!r}: must be one of {', '.join(option.choices)}"
                      + _suggest(str(value), option.choices))
    return value, None


def _check_key(name: str, where: str) -> tuple[str | None, str | None, str | None]:
    """Returns (canonical name, problem, note) for an option name from a file or the command line."""
    if name in OPTIONS:
        return name, None, None
    if name in _ALIASES:
        return _ALIASES[name], None, None
    if name in IGNORED_KOHYA_OPTIONS:
        return None, None, f"{where}: {name} has no effect here: {IGNORED_KOHYA_OPTIONS[name]}"
    if name in UNSUPPORTED_KOHYA_OPTIONS:
        return None, f"{where}: {name} is a kohya option this trainer does not support yet; remove it", None
    return None, f"{where}: unknown option {name!r}" + _suggest(name, list(OPTIONS) + list(_ALIASES)), None


def parse_config(argv: Sequence[str] | None = None) -> tuple[Config, list[str]]:
    """Resolve options from --config TOML and the command line; raise ConfigError listing every problem.

    Returns the Config and notes (ignored kohya options) to log once logging is set up.
    """
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(argv)
    problems: list[str] = []
    notes: list[str] = []
    index = 0
    while index < len(unknown):
        token = unknown[index]
        index += 1
        if not token.startswith("--"):
            problems.append(f"command line: unexpected argument {token!r}")
            continue
        name = token[2:].split("=", 1)[0]
        _, problem, note = _check_key(name, "command line")
        problems += [problem] if problem else []
        notes += [note] if note else []
        # An unknown option's value must not be reported as a second problem.
        if "=" not in token and index < len(unknown) and not unknown[index].startswith("--"):
            index += 1

    values: dict[str, Any] = {name: option.default for name, option in OPTIONS.items()}
    explicit: set[str] = set()
    config_unreadable = False

    cli_raw = vars(namespace)
    config_path = cli_raw.get("config_file")
    if config_path is not None:
        file_values, file_problems = _read_toml(Path(config_path))
        problems += file_problems
        config_unreadable = file_values is None
        source = str(config_path)
        for name, raw in (file_values or {}).items():
            canonical, problem, note = _check_key(name, source)
            if problem:
                problems.append(problem)
            if note:
                notes.append(note)
            if canonical is None:
                continue
            if canonical in ("config_file", "output_config"):
                problems.append(f"{source}: {name} belongs on the command line, not in the config file")
                continue
            value, problem = _convert(OPTIONS[canonical], raw, source)
            if problem:
                problems.append(problem)
            else:
                values[canonical] = value
                explicit.add(canonical)

    for name, raw in cli_raw.items():
        option = OPTIONS[name]
        if option.convert is _to_str_list and isinstance(raw, list):
            raw = list(raw)
        value, problem = _convert(option, raw, "command line")
        if problem:
            problems.append(problem)
        else:
            values[name] = value
            explicit.add(name)

    if not config_unreadable:
        # Checked even after other problems so that one run reports everything.
        problems += _check_values(values)
    if problems:
        raise ConfigError(problems)
    return Config(values, explicit), notes


def _check_values(v: dict[str, Any]) -> list[str]:
    """Cross-option and range checks on converted values."""
    problems: list[str] = []

    def need(condition: bool, message: str) -> None:
        if not condition:
            problems.append(message)

    writing_config_only = v["output_config"] is not None
    if not writing_config_only:
        model = v["pretrained_model_name_or_path"]
        if model is None:
            problems.append("pretrained_model_name_or_path is required: a local diffusers model folder")
        elif not Path(model).exists():
            problems.append(f"pretrained_model_name_or_path: {model} does not exist "
                            "(models are read from local folders only)")
        data, dataset_config = v["train_data_dir"], v["dataset_config"]
        if dataset_config is not None:
            if not Path(dataset_config).is_file():
                problems.append(f"dataset_config: {dataset_config} is not a file")
            for name in ("train_data_dir", "reg_data_dir"):
                need(v[name] is None, f"{name} cannot be combined with dataset_config, whose subsets name the image "
                                      "folders (kohya ignores it there); remove one of them")
        elif data is None:
            problems.append("train_data_dir is required: a folder of kohya-style image folders "
                            "(or give dataset_config)")
        elif not Path(data).is_dir():
            problems.append(f"train_data_dir: {data} is not a folder")
        if dataset_config is None and v["reg_data_dir"] is not None and not Path(v["reg_data_dir"]).is_dir():
            problems.append(f"reg_data_dir: {v['reg_data_dir']} is not a folder")
        if v["output_dir"] is None:
            problems.append("output_dir is required: where the LoRA file is written")
        elif Path(v["output_dir"]).exists() and not Path(v["output_dir"]).is_dir():
            problems.append(f"output_dir: {v['output_dir']} exists and is not a folder")

    for name in ("network_dim", "train_batch_size", "gradient_accumulation_steps", "max_train_steps",
                 "lr_scheduler_num_cycles"):
        need(v[name] >= 1, f"{name} must be at least 1 (got {v[name]})")
    need(v["max_train_epochs"] is None or v["max_train_epochs"] >= 1,
         f"max_train_epochs must be at least 1 (got {v['max_train_epochs']})")
    need(v["max_data_loader_n_workers"] >= 0, "max_data_loader_n_workers must be 0 or more")
    # Dataset options. With dataset_config they are only fallbacks; library.dataset_config checks each
    # dataset's resolved values the same way.
    need(v["prior_loss_weight"] >= 0, f"prior_loss_weight must not be negative (got {v['prior_loss_weight']})")
    need(v["vae_batch_size"] >= 1, f"vae_batch_size must be at least 1 (got {v['vae_batch_size']})")
    need(v["bucket_reso_steps"] >= 8 and v["bucket_reso_steps"] % 8 == 0,
         f"bucket_reso_steps must be a positive multiple of 8 (got {v['bucket_reso_steps']})")
    need(1 <= v["min_bucket_reso"] <= v["max_bucket_reso"],
         f"need 1 <= min_bucket_reso <= max_bucket_reso (got {v['min_bucket_reso']}, {v['max_bucket_reso']})")
    need(v["keep_tokens"] >= 0, f"keep_tokens must not be negative (got {v['keep_tokens']})")
    need(v["caption_dropout_every_n_epochs"] >= 0,
         f"caption_dropout_every_n_epochs must not be negative (got {v['caption_dropout_every_n_epochs']})")
    for name in ("caption_dropout_rate", "caption_tag_dropout_rate"):
        need(0 <= v[name] <= 1, f"{name} must be in [0, 1] (got {v[name]})")
    need(v["caption_separator"] != "", "caption_separator must not be empty")
    need(not v["cache_text_encoder_outputs"] or v["network_train_unet_only"],
         "cache_text_encoder_outputs needs a frozen text encoder: set network_train_unet_only")
    if v["dataset_config"] is None:
        width, height = v["resolution"]
        if v["enable_bucket"]:
            need(v["min_bucket_reso"] <= min(width, height),
                 f"min_bucket_reso {v['min_bucket_reso']} is larger than the resolution's shorter side "
                 f"{min(width, height)}")
            need(v["max_bucket_reso"] >= max(width, height),
                 f"max_bucket_reso {v['max_bucket_reso']} is smaller than the resolution's longer side "
                 f"{max(width, height)}")
        else:
            need(width % 8 == 0 and height % 8 == 0,
                 f"resolution {width}x{height}: sides must be multiples of 8 (the VAE downsamples 8x)")
        need(not (v["random_crop"] and (v["cache_latents"] or v["cache_latents_to_disk"])),
             "random_crop draws a new crop each time and cannot use cached latents; turn off random_crop or "
             "cache_latents / cache_latents_to_disk")
        need(not (v["cache_text_encoder_outputs"] and (v["shuffle_caption"] or v["caption_tag_dropout_rate"] > 0)),
             "shuffle_caption and caption_tag_dropout_rate change the caption each time and cannot use "
             "cache_text_encoder_outputs; turn off one")
    need(v["network_alpha"] > 0, f"network_alpha must be positive (got {v['network_alpha']})")
    need(0 <= v["network_dropout"] < 1, f"network_dropout must be in [0, 1) (got {v['network_dropout']})")
    for name in ("learning_rate", "unet_lr", "text_encoder_lr"):
        need(v[name] is None or v[name] >= 0, f"{name} must not be negative (got {v[name]})")
    need(v["max_grad_norm"] >= 0, f"max_grad_norm must not be negative (got {v['max_grad_norm']})")
    need(v["lr_warmup_steps"] >= 0, f"lr_warmup_steps must not be negative (got {v['lr_warmup_steps']})")
    need(v["lr_warmup_steps"] < 1 or float(v["lr_warmup_steps"]).is_integer(),
         f"lr_warmup_steps must be a whole number of steps or a fraction below 1 (got {v['lr_warmup_steps']})")
    need(v["min_snr_gamma"] is None or v["min_snr_gamma"] > 0, "min_snr_gamma must be positive")
    need(v["noise_offset"] is None or v["noise_offset"] >= 0, "noise_offset must not be negative")
    need(0 <= v["min_timestep"] < v["max_timestep"] <= 1000,
         f"need 0 <= min_timestep < max_timestep <= 1000 (got {v['min_timestep']}, {v['max_timestep']})")
    need(not (v["network_train_unet_only"] and v["network_train_text_encoder_only"]),
         "network_train_unet_only and network_train_text_encoder_only cannot both be set")
    need(v["zero_stage"] in (0, 1, 2, 3), f"zero_stage must be 0, 1, 2 or 3 (got {v['zero_stage']})")
    need(v["ddp_timeout"] is None or v["ddp_timeout"] > 0, "ddp_timeout must be a positive number of minutes")
    for name in ("save_every_n_steps", "save_every_n_epochs", "save_last_n_steps", "save_last_n_epochs",
                 "save_last_n_steps_state", "save_last_n_epochs_state"):
        need(v[name] is None or v[name] >= 1, f"{name} must be at least 1 (got {v[name]})")
    need(not v["dim_from_weights"] or v["network_weights"] is not None,
         "dim_from_weights needs network_weights (the LoRA file to read dim and alpha from)")
    need(v["network_weights"] is None or Path(v["network_weights"]).is_file(),
         f"network_weights: {v['network_weights']} is not a file")
    for arg in v["network_args"] + v["optimizer_args"]:
        need("=" in arg, f"{arg!r}: network_args and optimizer_args entries must look like key=value")
    need(not v["network_args"],
         "network_args: no network arguments are supported yet; remove " + " ".join(v["network_args"]))
    return problems


def write_config(config: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as TOML, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(config.to_toml(), encoding="utf-8")
    os.replace(tmp, path)
