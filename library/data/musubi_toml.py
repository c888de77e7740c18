"""musubi-tuner's dataset TOML shape (its src/musubi_tuner/dataset/config_utils.py): no [[datasets.subsets]]; each
[[datasets]] table names its images itself (image_directory, or image_jsonl_file) with the keys kohya puts on a
subset, and [general] holds defaults. library.data.dataset_toml reads such a table as a dataset of one subset.

What this module knows is musubi's key names and what this trainer does with each; the typed checks are
dataset_toml's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

IMAGE_SOURCES = ("image_directory", "image_jsonl_file")
VIDEO_SOURCES = ("video_directory", "video_jsonl_file")
# musubi's video dataset keys (its VideoDatasetParams) besides the sources: only a [[datasets]] table naming videos
# takes them, as in musubi-tuner.
FRAME_KEYS = ("target_frames", "frame_extraction", "frame_stride", "frame_sample", "max_frames", "source_fps")
VIDEO_KEYS = (*VIDEO_SOURCES, *FRAME_KEYS)
# musubi's dataset-level keys that become the one subset's: musubi name -> this trainer's subset field.
SUBSET_FIELDS = {"image_directory": "image_dir", "image_jsonl_file": "metadata_file",
                 "control_directory": "control_directory", "video_directory": "image_dir",
                 "video_jsonl_file": "video_jsonl_file", **{key: key for key in FRAME_KEYS}}
# kohya subset keys that a musubi-shaped dataset, having no subsets, names otherwise or does not have.
KOHYA_SUBSET_NAMES = {"image_dir": "image_directory", "metadata_file": "image_jsonl_file"}


def is_musubi_dataset(table: Mapping[str, Any]) -> bool:
    """Whether a [[datasets]] table names its images (or videos) itself, as musubi-tuner's do."""
    return any(key in table for key in (*IMAGE_SOURCES, *VIDEO_SOURCES))


def ignored_keys(table: Mapping[str, Any], where: str) -> tuple[set[str], list[str], list[str]]:
    """(musubi keys handled here, notes, problems) for one table: cache_directory is noted and ignored; FramePack's
    fp_* keys and multiple_target = true are refused, each kind in one message naming its keys."""
    framepack = [key for key in table if key.startswith("fp_")]
    handled = {*framepack}
    notes, problems = [], []
    if "cache_directory" in table:
        handled.add("cache_directory")
        notes.append(f"{where}: cache_directory is ignored: this trainer caches latents in memory (cache_latents) "
                     "or in a file beside each image (cache_latents_to_disk), not in a folder of its own")
    if framepack:
        problems.append(f"{where}: {', '.join(framepack)}: FramePack's dataset keys; this trainer does not offer "
                        "FramePack: remove them")
    if "multiple_target" in table:
        handled.add("multiple_target")
        if table["multiple_target"] is not False:
            problems.append(f"{where}: multiple_target = {table['multiple_target']!r}: Qwen-Image-Layered's "
                            "several target images are not offered; remove it")
    return handled, notes, problems


def misplaced(name: str, level: str) -> str | None:
    """Why a musubi key, or a kohya subset key, is at the wrong level; None when it is neither."""
    if name in (*IMAGE_SOURCES, *VIDEO_KEYS) and level == "general":
        return f"{name} belongs in a [[datasets]] table" + (" that names videos (video_directory or "
                                                            "video_jsonl_file)" if name in FRAME_KEYS else "")
    if name in VIDEO_KEYS and level in ("subset", "dataset"):
        return (f"{name} is musubi-tuner's video dataset key, for a [[datasets]] table without subsets that names "
                "its videos (video_directory or video_jsonl_file)")
    if name in IMAGE_SOURCES and level == "subset":
        return (f"{name} is musubi-tuner's name, for a [[datasets]] table without subsets; a [[datasets.subsets]] "
                f"table takes {SUBSET_FIELDS[name]}")
    if level == "musubi" and name in KOHYA_SUBSET_NAMES:
        return (f"{name} is kohya's subset key; this [[datasets]] table is in musubi-tuner's shape, which names "
                f"it {KOHYA_SUBSET_NAMES[name]}")
    if level == "musubi" and name in ("is_reg", "conditioning_data_dir"):
        return (f"{name} is a kohya subset key, which a [[datasets]] table in musubi-tuner's shape (with "
                "image_directory or image_jsonl_file) does not take; use kohya's [[datasets.subsets]] for it")
    return None


def shape_problems(table: Mapping[str, Any], where: str) -> list[str]:
    """A [[datasets]] table in both shapes at once, or naming two image sources."""
    problems = []
    sources = [key for key in (*IMAGE_SOURCES, *VIDEO_SOURCES) if key in table]
    if "subsets" in table:
        problems.append(f"{where}: mixes the two dataset shapes: {', '.join(sources)} (musubi-tuner's: the dataset "
                        "is its own image folder) and [[datasets.subsets]] (kohya's); use one of them")
    images = [key for key in IMAGE_SOURCES if key in table]
    if len(images) > 1:
        problems.append(f"{where}: set image_directory or image_jsonl_file, not both")
    videos = [key for key in VIDEO_SOURCES if key in table]
    if len(videos) > 1:
        problems.append(f"{where}: set video_directory or video_jsonl_file, not both")
    if images and videos:
        problems.append(f"{where}: names images ({images[0]}) and videos ({videos[0]}); a [[datasets]] table is "
                        "one or the other (a video_directory may hold images too, each trained as one frame)")
    frame_keys = [key for key in FRAME_KEYS if key in table]
    if frame_keys and not videos:
        problems.append(f"{where}: {', '.join(frame_keys)}: video dataset keys, and this [[datasets]] table names "
                        "no videos (video_directory or video_jsonl_file)")
    if videos and "control_directory" in table:
        problems.append(f"{where}: control_directory with videos: control videos are not read; remove it")
    return problems


def split_dataset(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A musubi dataset's checked values -> (the dataset's values, its one subset's values). Relative image paths
    of an image_jsonl_file or video_jsonl_file are taken from the working directory, as musubi-tuner opens them."""
    dataset = {key: value for key, value in values.items() if key not in SUBSET_FIELDS}
    subset = {SUBSET_FIELDS[key]: value for key, value in values.items() if key in SUBSET_FIELDS}
    if "video_directory" in values:
        subset["videos"] = True
    if ("metadata_file" in subset or "video_jsonl_file" in subset) and "image_dir" not in subset:
        subset["image_dir"] = str(Path.cwd())
    return dataset, subset
