"""Options from TOML + command line -> a validated, read-only Config (the schema is library/options.py).

Option names follow kohya-ss/sd-scripts so that a kohya config file works here. The TOML file and the command line
go through the same conversion and checks, and every problem is reported at once.
"""
from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import tomllib
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

from library.core.atomic import write_atomically
from library.config.network_args import network_option_problems
from library.config.kohya_compat import CHOICE_HINTS, IGNORED_KOHYA_OPTIONS, UNSUPPORTED_KOHYA_OPTIONS, ZERO_IS_UNSET
from library.config.options import ALIASES, GROUPS, OPTIONS, Option, _to_str


class UserError(Exception):
    """A user mistake (config, data, model files); carries every problem found. Ends the run with status 2."""

    def __init__(self, problems: str | Sequence[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class ConfigError(UserError):
    """A problem in the options."""


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
                f"folder): python -m library.models.single_file {path} {path.with_suffix('.safetensors')}; or, only for a "
                "file you trust, set allow_pickle_checkpoints = true")
    return (f"{path}: not a model folder or a known checkpoint file; give a diffusers model folder or a "
            f".safetensors checkpoint (pickles {', '.join(PICKLE_CHECKPOINT_SUFFIXES)} need "
            "allow_pickle_checkpoints)")


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
    if option.is_size:
        return f'"{value[0]},{value[1]}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_str(value)
    return "[" + ", ".join(repr(v) if isinstance(v, int) else _toml_str(v) for v in value) + "]"


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
            nargs = "+" if option.is_list else None
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
    if raw == "" and option.default is None and option.convert is _to_str:
        # kohya tests these with `if args.x:`, and configs saved by its GUI write unset paths as "".
        return None, None
    try:
        value = option.convert(raw)
    except ValueError as e:
        return None, f"{where}: {option.name} = {raw!r}: {e}"
    if option.name in ZERO_IS_UNSET and value == 0:
        return option.default, None
    if option.choices is not None and value not in option.choices:
        folded = {c.lower(): c for c in option.choices}
        if isinstance(value, str) and value.lower() in folded:
            return folded[value.lower()], None
        for prefix, hint in CHOICE_HINTS.get(option.name, {}).items():
            if str(value).lower().startswith(prefix):
                return None, f"{where}: {option.name} = {raw!r}: {hint}"
        return None, (f"{where}: {option.name} = {raw!r}: must be one of {', '.join(option.choices)}"
                      + _suggest(str(value), option.choices))
    return value, None


def _check_key(name: str, where: str) -> tuple[str | None, str | None, str | None]:
    """Returns (canonical name, problem, note) for an option name from a file or the command line."""
    if name in OPTIONS:
        return name, None, None
    if name in ALIASES:
        return ALIASES[name], None, None
    if name in IGNORED_KOHYA_OPTIONS:
        return None, None, f"{where}: {name} has no effect here: {IGNORED_KOHYA_OPTIONS[name]}"
    if name in UNSUPPORTED_KOHYA_OPTIONS:
        return None, f"{where}: {name} is a kohya option this trainer does not support yet; remove it", None
    return None, f"{where}: unknown option {name!r}" + _suggest(name, list(OPTIONS) + list(ALIASES)), None


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
            if problem and name in UNSUPPORTED_KOHYA_OPTIONS and raw in ("", False, 0, []):
                # Configs saved by kohya tools list options that are off; an option that asks for nothing is fine.
                problem, note = None, f"{source}: {name} = {raw!r} asks for nothing here and is ignored"
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
        if option.is_list and isinstance(raw, list):
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
    # Dataset options. With dataset_config they are only fallbacks; library.data.dataset_config checks each
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
    problems += _check_objective(v)
    need(not (v["network_train_unet_only"] and v["network_train_text_encoder_only"]),
         "network_train_unet_only and network_train_text_encoder_only cannot both be set")
    need(not v["full_fp16"] or v["mixed_precision"] == "fp16",
         f"full_fp16 needs mixed_precision = \"fp16\" (got {v['mixed_precision']!r})")
    need(not v["full_bf16"] or v["mixed_precision"] == "bf16",
         f"full_bf16 needs mixed_precision = \"bf16\" (got {v['mixed_precision']!r})")
    need(not v["fp16_master_weights_and_gradients"] or v["mixed_precision"] == "fp16",
         "fp16_master_weights_and_gradients needs mixed_precision = \"fp16\" "
         f"(got {v['mixed_precision']!r})")
    problems += _check_logging(v)
    problems += _check_sampling(v)
    need(v["clip_skip"] is None or v["clip_skip"] >= 1, f"clip_skip must be at least 1 (got {v['clip_skip']})")
    need(v["max_token_length"] in (None, 75, 150, 225),
         f"max_token_length must be 75, 150 or 225 (got {v['max_token_length']})")
    need(v["zero_stage"] in (0, 1, 2, 3), f"zero_stage must be 0, 1, 2 or 3 (got {v['zero_stage']})")
    need(v["ddp_timeout"] is None or v["ddp_timeout"] > 0, "ddp_timeout must be a positive number of minutes")
    for name in ("save_every_n_steps", "save_every_n_epochs", "save_last_n_steps", "save_last_n_epochs",
                 "save_last_n_steps_state", "save_last_n_epochs_state"):
        need(v[name] is None or v[name] >= 1, f"{name} must be at least 1 (got {v[name]})")
    need(not v["dim_from_weights"] or v["network_weights"] is not None,
         "dim_from_weights needs network_weights (the LoRA file to read dim and alpha from)")
    need(v["network_weights"] is None or Path(v["network_weights"]).is_file(),
         f"network_weights: {v['network_weights']} is not a file")
    for arg in v["optimizer_args"]:
        need("=" in arg, f"{arg!r}: optimizer_args entries must look like key=value")
    problems += network_option_problems(v)
    # Optimizer and schedule; checks that need the optimizer class or the step count run in library.training.optim.
    for arg in v["lr_scheduler_args"]:
        need("=" in arg, f"{arg!r}: lr_scheduler_args entries must look like key=value")
    need(not (v["use_8bit_adam"] and v["use_lion_optimizer"]),
         "use_8bit_adam and use_lion_optimizer cannot both be set")
    for flag, meant in (("use_8bit_adam", "AdamW8bit"), ("use_lion_optimizer", "Lion")):
        need(not v[flag] or v["optimizer_type"] in ("AdamW", meant),
             f"{flag} means optimizer_type {meant} and cannot be combined with optimizer_type {v['optimizer_type']}")
    need(v["lr_decay_steps"] >= 0 and (v["lr_decay_steps"] < 1 or float(v["lr_decay_steps"]).is_integer()),
         f"lr_decay_steps must be a whole number of steps or a fraction below 1 (got {v['lr_decay_steps']})")
    need(v["lr_scheduler_min_lr_ratio"] is None or 0 <= v["lr_scheduler_min_lr_ratio"] <= 1,
         f"lr_scheduler_min_lr_ratio must be in [0, 1] (got {v['lr_scheduler_min_lr_ratio']})")
    need(v["lr_scheduler_timescale"] is None or v["lr_scheduler_timescale"] >= 1,
         f"lr_scheduler_timescale must be at least 1 (got {v['lr_scheduler_timescale']})")
    need(not v["lr_scheduler_type"] or v["lr_warmup_steps"] == 0,
         f"lr_warmup_steps applies to lr_scheduler, not to lr_scheduler_type {v['lr_scheduler_type']}; remove it "
         "(give the class its own arguments in lr_scheduler_args)")
    need(v["lr_scheduler"] != "cosine_with_min_lr" or bool(v["lr_scheduler_type"])
         or v["lr_scheduler_min_lr_ratio"] is not None
         or any(arg.partition("=")[0].strip() == "min_lr" for arg in v["lr_scheduler_args"]),
         "lr_scheduler cosine_with_min_lr needs lr_scheduler_min_lr_ratio (the final learning rate as a fraction "
         "of the initial one) or min_lr=... in lr_scheduler_args")
    return problems


def _check_objective(v: dict[str, Any]) -> list[str]:
    """kohya's noise and loss options: ranges, and the combinations kohya refuses or that would do nothing. Whether
    the model predicts v is known only once it is loaded; model.Objective checks what depends on that."""
    problems: list[str] = []

    def need(condition: bool, message: str) -> None:
        if not condition:
            problems.append(message)

    need(v["adaptive_noise_scale"] is None or v["noise_offset"] is not None,
         "adaptive_noise_scale needs noise_offset (it is added to noise_offset, as in kohya)")
    need(not v["noise_offset_random_strength"] or bool(v["noise_offset"]),
         "noise_offset_random_strength needs noise_offset (the upper end of the random strength)")
    need(v["multires_noise_iterations"] is None or v["multires_noise_iterations"] >= 1,
         f"multires_noise_iterations must be at least 1 (got {v['multires_noise_iterations']})")
    need(v["multires_noise_discount"] > 0,
         f"multires_noise_discount must be positive (got {v['multires_noise_discount']})")
    need(v["ip_noise_gamma"] is None or v["ip_noise_gamma"] >= 0,
         f"ip_noise_gamma must not be negative (got {v['ip_noise_gamma']})")
    need(not v["ip_noise_gamma_random_strength"] or bool(v["ip_noise_gamma"]),
         "ip_noise_gamma_random_strength needs ip_noise_gamma (the upper end of the random strength)")
    if v["loss_type"] in ("huber", "smooth_l1"):
        for name in ("huber_c", "huber_scale"):
            need(v[name] > 0, f"{name} must be positive with loss_type {v['loss_type']} (got {v[name]})")
    need(v["v_pred_like_loss"] is None or v["v_pred_like_loss"] >= 0,
         f"v_pred_like_loss must not be negative (got {v['v_pred_like_loss']})")
    need(not (v["v_pred_like_loss"] and v["v_parameterization"]),
         "v_pred_like_loss cannot be combined with v_parameterization: it adds a v-prediction-like loss to a "
         "noise-prediction model (kohya refuses it too); remove one of them")
    need(not v["masked_loss"] or v["alpha_mask"] or v["dataset_config"] is not None,
         "masked_loss needs masks: alpha_mask = true (the images' alpha channel), or a dataset_config whose "
         "subsets set conditioning_data_dir or alpha_mask")
    return problems


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    with open(path, "rb") as f:
        return tomllib.load(f)


def _check_logging(v: dict[str, Any]) -> list[str]:
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


def _check_sampling(v: dict[str, Any]) -> list[str]:
    from library.config.samplers import canonical_sampler

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


def write_config(config: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as TOML, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda tmp: tmp.write_text(config.to_toml(), encoding="utf-8"))
