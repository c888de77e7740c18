"""Reading kohya's dataset TOML strictly: [general], [[datasets]] and [[datasets.subsets]] tables with their typed
values; unknown keys (with a suggestion), keys at the wrong level and wrong types are all reported at once.
A [[datasets]] table in musubi-tuner's shape (image_directory or image_jsonl_file, no subsets) is read as a dataset
of one subset (library.data.musubi_toml). library.data.dataset_config resolves the values into DatasetSpecs.
"""
from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, Callable, Mapping

import tomllib

from library.config import ConfigError
from library.data.musubi_toml import (
    IMAGE_SOURCES,
    VIDEO_SOURCES,
    ignored_keys,
    is_musubi_dataset,
    misplaced,
    shape_problems,
    split_dataset,
)

# --- strict TOML value checks: (raw) -> value, or ValueError with a short reason

def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError("expected true or false")


def _int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError("expected an integer")


def _float(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise ValueError("expected a number")


def _float_pair(value: Any) -> tuple[float, float]:
    """kohya's face_crop_aug_range: [low, high], "low,high", or one number for both."""
    parts = value.replace(",", " ").split() if isinstance(value, str) else value
    parts = parts if isinstance(parts, list) else [parts]
    parts = [_float(p if not isinstance(p, str) else float(p)) for p in parts]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 0 < parts[0] <= parts[1]:
        raise ValueError("expected two positive numbers low <= high, like [2.0, 4.0]")
    return parts[0], parts[1]


def _positive_float(value: Any) -> float:
    number = _float(value)
    if number <= 0:
        raise ValueError("expected a positive number")
    return number


def _int_list(value: Any) -> tuple[int, ...]:
    """musubi-tuner's target_frames: a list of integers (one integer is taken as a list of one)."""
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError("expected a list of integers, like [1, 25, 45]")
    return tuple(values)


def _str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError("expected a string")


def _resolution(value: Any) -> tuple[int, int]:
    """kohya: a number or a [width, height] pair; "512,768" is also accepted."""
    parts: list[Any]
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        try:
            parts = [int(p) for p in parts]
        except ValueError:
            raise ValueError("expected a size like 512 or [512, 768]") from None
    elif isinstance(value, list):
        parts = list(value)
    else:
        parts = [value]
    parts = parts * 2 if len(parts) == 1 else parts
    if len(parts) != 2 or not all(isinstance(p, int) and not isinstance(p, bool) for p in parts):
        raise ValueError("expected a size like 512 or [512, 768]")
    if min(parts) <= 0:
        raise ValueError("sizes must be positive")
    return parts[0], parts[1]


# Keys a subset takes; kohya lets every one of them be set on the dataset or in [general] as a default.
SUBSET_KEYS: dict[str, Callable[[Any], Any]] = {
    "num_repeats": _int, "class_tokens": _str, "caption_extension": _str, "shuffle_caption": _bool,
    "caption_separator": _str, "keep_tokens": _int, "keep_tokens_separator": _str, "caption_prefix": _str,
    "caption_suffix": _str, "caption_dropout_rate": _float, "caption_dropout_every_n_epochs": _int,
    "caption_tag_dropout_rate": _float, "flip_aug": _bool, "random_crop": _bool, "alpha_mask": _bool,
    "color_aug": _bool,
    "secondary_separator": _str, "enable_wildcard": _bool, "resize_interpolation": _str,
    "token_warmup_min": _int, "token_warmup_step": _float, "face_crop_aug_range": _float_pair,
    # musubi-tuner's edit datasets: how control images are sized (library.data.controls)
    "no_resize_control": _bool, "control_resolution": _resolution,
    # ai-toolkit's prior_reg: these samples teach the adapter to keep the base model's own prediction
    "prior_reg": _bool,
}
SUBSET_ONLY_KEYS: dict[str, Callable[[Any], Any]] = {"image_dir": _str, "is_reg": _bool,
                                                     "conditioning_data_dir": _str, "metadata_file": _str,
                                                     "control_directory": _str}
DATASET_KEYS: dict[str, Callable[[Any], Any]] = {
    "resolution": _resolution, "batch_size": _int, "enable_bucket": _bool, "min_bucket_reso": _int,
    "max_bucket_reso": _int, "bucket_reso_steps": _int, "bucket_no_upscale": _bool,
}
_ALIASES = {"caption_extention": "caption_extension",  # kohya's misspelling, accepted on its command line
            # musubi-tuner's older names, which it still reads
            "flux_kontext_no_resize_control": "no_resize_control",
            "qwen_image_edit_no_resize_control": "no_resize_control",
            "qwen_image_edit_control_resolution": "control_resolution"}
# kohya dataset keys this trainer does not offer; named so the user knows exactly what to change.
UNSUPPORTED_KEYS = (
    "cache_info", "network_multiplier", "max_token_length", "debug_dataset",
)
# A [[datasets]] table in musubi-tuner's shape is its own subset: it names its images and control images itself.
MUSUBI_DATASET_KEYS: dict[str, Callable[[Any], Any]] = {
    "image_directory": _str, "image_jsonl_file": _str, "control_directory": _str,
    # its video datasets (library.data.video)
    "video_directory": _str, "video_jsonl_file": _str, "target_frames": _int_list, "frame_extraction": _str,
    "frame_stride": _int, "frame_sample": _int, "max_frames": _int, "source_fps": _positive_float,
}
_LEVEL_KEYS = {
    "general": {**DATASET_KEYS, **SUBSET_KEYS},
    "dataset": {**DATASET_KEYS, **SUBSET_KEYS},
    "subset": {**SUBSET_KEYS, **SUBSET_ONLY_KEYS},
    "musubi": {**DATASET_KEYS, **SUBSET_KEYS, **MUSUBI_DATASET_KEYS},
}


def _suggest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _check_table(table: Mapping[str, Any], level: str, where: str, problems: list[str],
                 notes: list[str]) -> dict[str, Any]:
    """Typed values of one [general] / [[datasets]] / [[datasets.subsets]] table; problems and notes appended."""
    allowed = _LEVEL_KEYS[level]
    handled, found_notes, found_problems = ignored_keys(table, where)
    notes += found_notes
    problems += found_problems
    values: dict[str, Any] = {}
    for raw_name, raw in table.items():
        name = _ALIASES.get(raw_name, raw_name)
        if raw_name in handled or (level in ("dataset", "musubi") and name == "subsets"):
            continue
        if name in allowed:
            try:
                values[name] = allowed[name](raw)
            except ValueError as e:
                problems.append(f"{where}: {raw_name} = {raw!r}: {e}")
        else:
            problems.append(f"{where}: {_wrong_key(raw_name, name, level)}")
    return values


def _wrong_key(raw_name: str, name: str, level: str) -> str:
    """Why a key is not taken at this level, with what to do instead."""
    if name in UNSUPPORTED_KEYS:
        return f"{raw_name} is a kohya dataset option this trainer does not support yet; remove it"
    musubi = misplaced(name, level)
    if musubi is not None:
        return musubi
    if name == "control_directory":
        return (f"{raw_name} belongs in a [[datasets.subsets]] table (a [[datasets]] table takes it in "
                "musubi-tuner's shape, with image_directory or image_jsonl_file)")
    if name in SUBSET_ONLY_KEYS:
        return f"{raw_name} belongs in a [[datasets.subsets]] table"
    if name in DATASET_KEYS:
        return f"{raw_name} is a dataset setting; put it in [[datasets]] or [general]"
    return f"unknown key {raw_name!r}" + _suggest(name, sorted(_LEVEL_KEYS[level]))


def read_dataset_toml(path: str | Path,
                      notes: list[str] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Parse and check a dataset TOML in kohya's or musubi-tuner's shape. Returns ([general] values,
    [{"values": ..., "subsets": [...]}]); keys read but ignored are appended to `notes`.

    Raises ConfigError listing every problem in the file.
    """
    path = Path(path)
    raw = _load(path)
    notes = [] if notes is None else notes
    problems: list[str] = []
    for key in raw:
        if key not in ("general", "datasets"):
            problems.append(f"{path}: unknown top-level key {key!r}" + _suggest(key, ["general", "datasets"])
                            + "; a dataset TOML has [general] and [[datasets]] with [[datasets.subsets]]")
    general_raw = raw.get("general", {})
    if not isinstance(general_raw, dict):
        problems.append(f"{path}: general must be a table ([general])")
        general_raw = {}
    general = _check_table(general_raw, "general", f"{path}: [general]", problems, notes)

    datasets_raw = raw.get("datasets", [])
    if not isinstance(datasets_raw, list) or not all(isinstance(d, dict) for d in datasets_raw):
        problems.append(f"{path}: datasets must be an array of tables ([[datasets]])")
        datasets_raw = []
    if not datasets_raw and not problems:
        problems.append(f"{path}: no [[datasets]] table; add one with at least one [[datasets.subsets]]")
    datasets = [_check_dataset(dataset_raw, f"{path}: datasets[{i}]", problems, notes)
                for i, dataset_raw in enumerate(datasets_raw)]
    if problems:
        raise ConfigError(problems)
    return general, datasets


def _load(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"dataset_config: {path} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"dataset_config: {path} is a folder, not a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None


def _check_dataset(dataset_raw: Mapping[str, Any], where: str, problems: list[str],
                   notes: list[str]) -> dict[str, Any]:
    """One [[datasets]] table and its [[datasets.subsets]]; problems and notes appended."""
    if is_musubi_dataset(dataset_raw):
        return _check_musubi_dataset(dataset_raw, where, problems, notes)
    values = _check_table(dataset_raw, "dataset", where, problems, notes)
    subsets_raw = dataset_raw.get("subsets", [])
    if not isinstance(subsets_raw, list) or not all(isinstance(s, dict) for s in subsets_raw):
        problems.append(f"{where}: subsets must be an array of tables ([[datasets.subsets]])")
        subsets_raw = []
    if not subsets_raw:
        problems.append(f"{where}: no [[datasets.subsets]] table; each dataset needs at least one image_dir (or, "
                        "in musubi-tuner's shape, an image_directory or image_jsonl_file of its own)")
    subsets = []
    for j, subset_raw in enumerate(subsets_raw):
        subset_where = f"{where}.subsets[{j}]"
        subsets.append(_check_table(subset_raw, "subset", subset_where, problems, notes))
        if "image_dir" not in subset_raw:
            problems.append(f"{subset_where}: image_dir is required")
    return {"values": values, "subsets": subsets}


def _check_musubi_dataset(dataset_raw: Mapping[str, Any], where: str, problems: list[str],
                          notes: list[str]) -> dict[str, Any]:
    """A [[datasets]] table in musubi-tuner's shape: a dataset of one subset, which its own keys describe."""
    problems += shape_problems(dataset_raw, where)
    values = _check_table(dataset_raw, "musubi", where, problems, notes)
    if not any(key in values for key in (*IMAGE_SOURCES, *VIDEO_SOURCES)):
        return {"values": values, "subsets": []}  # a wrong type, reported above
    dataset, subset = split_dataset(values)
    return {"values": dataset, "subsets": [subset]}
