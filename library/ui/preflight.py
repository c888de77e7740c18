"""What a run will meet that the config's checks do not see, read the way the trainer reads it: the model's folder or
file (its family, from the registry's detectors: no weights loaded), the dataset (the dataset check's scan) and
earlier work in the output folder."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import tomllib

from library.config import Config, ConfigError
from library.data.dataset_config import resolve_datasets
from library.data.images import IMAGE_EXTENSIONS
from library.data.scan import listing, scan_datasets
from library.families.entry import FramesRule
from library.families.registry import ENTRIES, entry_for
from library.monitoring.events import EVENTS_FILE
from library.ui import schema, security
from library.ui.model_family import model_family
from library.ui.run_status import RUN_CONFIG, run_status

LORA_SUFFIXES = (".safetensors", ".ckpt", ".pt")
DEFAULT_OUTPUT_NAME = "last"  # the trainer's (kohya's) output_name when none is set
MODEL_OPTION = "pretrained_model_name_or_path"
NOT_MODELS = (*IMAGE_EXTENSIONS, ".txt", ".caption", ".toml", ".json", ".md")  # files that are surely no model


def look_ahead(state: schema.FormState, values: dict[str, str], roots: security.Roots, output: bool = True) -> None:
    """Add to `state` what the run would meet: a model no family reads, a dataset the check calls not usable (as
    problems), and, with `output`, earlier work in the output folder (a warning: Start run asks about it)."""
    model = values.get(MODEL_OPTION, "").strip()
    real = roots.resolve(model) if model and MODEL_OPTION not in state.problems else None
    problem = model_problem(real, model) if real is not None and real.exists() else None
    if problem:
        state.problems.setdefault(MODEL_OPTION, []).append(problem)
    if state.config is not None:
        name = "dataset_config" if state.config.dataset_config else "train_data_dir"
        verdict = dataset_verdict(state.config, frames_rule(real))
        if verdict and name not in state.problems:
            state.problems.setdefault(name, []).append(f"{name}: {verdict}")
    elif not model and names_videos(roots.resolve(values.get("dataset_config", "").strip() or ".")):
        state.warnings.setdefault("dataset_config", []).append(f"dataset_config: {NO_MODEL_FOR_VIDEO}")
    typed = values.get("output_dir", "").strip()
    folder = roots.resolve(typed) if output and typed else None
    earlier = earlier_work(folder, values.get("output_name")) if folder is not None else None
    if earlier:
        state.warnings.setdefault("output_dir", []).append(f"output_dir: {typed} {earlier}; Start run asks first")


REQUIRED = {MODEL_OPTION: "every run needs its base model: a diffusers folder or a checkpoint file",
            "train_data_dir": "every run needs its images: a folder of kohya-style image folders (or dataset_config)",
            "output_dir": "a run started here needs its own folder"}


def required_fields(model: Path | None) -> dict[str, str]:
    """The fields a run needs, with why: those of every run, and with a single-file model the separate files its
    family loads it with (unless the file carries them)."""
    needed = dict(REQUIRED)
    family = model_family(model) if model is not None and model.is_file() else None
    entry = next((e for e in ENTRIES if e.name == family), None)
    for name in entry.file_options if entry is not None else ():
        needed[name] = f"a {entry.title} single file is loaded with its {name} file (unless the file carries it)"
    return needed


def model_problem(path: Path, typed: str) -> str | None:
    """What is wrong with a model folder or file no family recognises, naming what it is instead."""
    if model_family(path) is not None:
        return None
    if path.is_dir():
        return (f"{MODEL_OPTION}: {typed} is {folder_contents(path)}, not a model: no family reads it (a model is a "
                "diffusers folder, with model_index.json and its unet/ or transformer/, or a checkpoint file)")
    if path.suffix.lower() in NOT_MODELS:
        return f"{MODEL_OPTION}: {typed} is a {path.suffix} file, not a model checkpoint"
    return None  # a file of another kind: the trainer's reader names what it is


def folder_contents(path: Path) -> str:
    """What a folder holds, in a few words."""
    entries = sorted(p for p in path.iterdir() if not p.name.startswith("."))
    images = [p for p in entries if p.suffix.lower() in IMAGE_EXTENSIONS]
    captions = [p for p in entries if p.suffix.lower() in (".txt", ".caption")]
    folders = [p for p in entries if p.is_dir()]
    if not entries:
        return "an empty folder"
    if images:
        return f"a folder of {len(images)} image{'s' * (len(images) > 1)}" + (
            f" and {len(captions)} caption{'s' * (len(captions) > 1)} (a dataset?)" if captions else "")
    if folders and all(p.name.split("_", 1)[0].isdigit() for p in folders):
        return f"a dataset folder in kohya's layout ({listing([p.name for p in folders])})"
    return f"a folder holding {listing([p.name for p in entries])}"


def dataset_verdict(config: Config, rule: FramesRule | None = None) -> str | None:
    """The dataset check's verdict when the dataset is not usable (its problems, the first few), else None.
    `rule`: the model's family's frames rule (None: it trains images only, and video datasets are refused)."""
    problems: list[str] = []
    try:
        specs = resolve_datasets(config, [], problems)
    except ConfigError:
        return None  # the config's checks name it
    scan = scan_datasets(specs, frames_rule=rule)
    problems += scan.problems
    if scan.records and (config.skip_bad_images or not problems):
        return None
    problems = problems or ["no usable images"]
    return (f"the dataset check finds it NOT USABLE, {len(problems)} problem(s): {'; '.join(problems[:3])}"
            + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "") + " (Check dataset shows each)")


def frames_rule(model: str | Path | None) -> FramesRule | None:
    """The clip lengths and rate the model's family takes (its registry entry's, read without loading the model);
    None for an image family, or without a model."""
    path = Path(model) if model else None
    if path is None or not path.exists():
        return None
    try:
        return entry_for(path).frames_rule
    except (OSError, ValueError):
        return None


NO_MODEL_FOR_VIDEO = ("a video dataset: its clips are cut by the model's family (the clip lengths and frame rate it "
                      "takes), so the videos cannot be checked until the model is set")


def names_videos(dataset_config: Path | None) -> bool:
    """Whether a dataset TOML names a video dataset (musubi-tuner's video_directory or video_jsonl_file)."""
    if dataset_config is None or not dataset_config.is_file():
        return False
    try:
        datasets = tomllib.loads(dataset_config.read_text(encoding="utf-8")).get("datasets", [])
    except (OSError, ValueError):  # a TOML decode error and UnicodeDecodeError are ValueErrors
        return False  # the config's checks name it
    return isinstance(datasets, list) and any(
        isinstance(d, dict) and ("video_directory" in d or "video_jsonl_file" in d) for d in datasets)


def finished_lora(output_dir: Path, output_name: str | None) -> Path | None:
    """The final LoRA file a finished run left in `output_dir` (its output name's, or last.*), if any."""
    names = dict.fromkeys((output_name or DEFAULT_OUTPUT_NAME, DEFAULT_OUTPUT_NAME))
    return next((output_dir / f"{name}{suffix}" for name in names for suffix in LORA_SUFFIXES
                 if (output_dir / f"{name}{suffix}").is_file()), None)


def earlier_work(output_dir: Path, output_name: str | None) -> str | None:
    """What a new run started in `output_dir` would overwrite: a finished LoRA, or an earlier run's config."""
    if not output_dir.is_dir():
        return None
    lora = finished_lora(output_dir, output_name)
    if lora is not None:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(lora.stat().st_mtime))
        return (f"holds a finished LoRA, {lora.name} ({when}): a new run here overwrites it and "
                f"{RUN_CONFIG}")
    if (output_dir / RUN_CONFIG).is_file() or (output_dir / EVENTS_FILE).is_file():
        earlier = run_status(output_dir)
        return (f"holds an earlier run ({earlier.status} at step {earlier.step}): a new run here starts from step 0 "
                f"and replaces its {RUN_CONFIG}; Resume latest on the run's page continues it instead")
    return None


def new_folder(typed: str, exists: Callable[[str], bool]) -> str:
    """`typed` with the first free -2, -3, ... suffix: the folder a new run is offered instead."""
    base = typed.rstrip("/\\")
    number = 2
    while exists(f"{base}-{number}"):
        number += 1
    return f"{base}-{number}"
