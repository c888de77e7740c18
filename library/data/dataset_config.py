"""What the user asked for: a dataset TOML (kohya's or musubi-tuner's shape) or train_data_dir / reg_data_dir folders
-> DatasetSpec objects.

A value is looked up as kohya does: subset -> dataset -> [general] -> command line / --config -> default. The TOML is
read and checked strictly by library.data.dataset_toml.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from library.config import Config, ConfigError
from library.config.dataset_checks import bucket_steps_problem
from library.data.dataset_toml import read_dataset_toml

logger = logging.getLogger(__name__)
# kohya's resize_interpolation choices (library.data.images maps them to PIL's filters)
RESIZE_INTERPOLATIONS = ("lanczos", "nearest", "bilinear", "linear", "bicubic", "cubic", "area")
# musubi-tuner's frame_extraction choices (library.data.video cuts the clips)
FRAME_EXTRACTIONS = ("head", "chunk", "slide", "uniform", "full")


@dataclass(frozen=True)
class SubsetSpec:
    """One image folder and how its images and captions are used."""
    image_dir: Path
    num_repeats: int = 1
    is_reg: bool = False
    class_tokens: str | None = None
    caption_extension: str = ".caption"
    shuffle_caption: bool = False
    caption_separator: str = ","
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    caption_prefix: str | None = None
    caption_suffix: str | None = None
    caption_dropout_rate: float = 0.0
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0
    flip_aug: bool = False
    random_crop: bool = False
    color_aug: bool = False  # kohya's: a random hue shift or gamma each time the image is used
    alpha_mask: bool = False  # the images' alpha channel weights the loss
    conditioning_data_dir: Path | None = None  # masked_loss: a mask image per image, under the same file name
    secondary_separator: str | None = None  # kohya's: becomes caption_separator after shuffling and dropping
    enable_wildcard: bool = False  # kohya's: {a|b|c} picks one each time; a caption file's lines are alternatives
    resize_interpolation: str | None = None  # kohya's: the resize filter (library.data.images.RESIZE_FILTERS)
    token_warmup_min: int = 1  # kohya's: tags used at step 0 ...
    token_warmup_step: float = 0.0  # ... growing to all of them by this step (a fraction of the run when below 1)
    metadata_file: Path | None = None  # kohya's fine-tuning metadata: the images and captions (no caption files)
    face_crop_aug_range: tuple[float, float] | None = None  # kohya's: face size range for crops around faces
    # musubi-tuner's edit datasets (library.data.controls). Left out of the repr, which the data fingerprint hashes,
    # so a dataset without control images keeps its fingerprint; the fingerprint adds them where they are used.
    control_directory: Path | None = field(default=None, repr=False)  # control images paired by file stem
    no_resize_control: bool = field(default=False, repr=False)  # keep their own size, rounded to bucket_reso_steps
    control_resolution: tuple[int, int] | None = field(default=None, repr=False)  # their own bucket at this area
    # The target of these samples is the base model's own prediction (library.training.model.diffusion_loss). Out of
    # the repr for the same reason; the fingerprint adds it when set.
    prior_reg: bool = field(default=False, repr=False)
    # musubi-tuner's video datasets (library.data.video), left out of the repr as the control fields are: image_dir
    # is a video_directory (videos, frame folders and images), or video_jsonl_file names the videos.
    videos: bool = field(default=False, repr=False)
    video_jsonl_file: Path | None = field(default=None, repr=False)
    target_frames: tuple[int, ...] = field(default=(1,), repr=False)
    frame_extraction: str = field(default="head", repr=False)
    frame_stride: int = field(default=1, repr=False)
    frame_sample: int = field(default=1, repr=False)
    max_frames: int = field(default=129, repr=False)
    source_fps: float | None = field(default=None, repr=False)

    @property
    def is_video(self) -> bool:
        return self.videos or self.video_jsonl_file is not None

    @property
    def caption_ops(self) -> bool:
        """Whether the caption changes from one use to the next in ways a text-encoder cache cannot follow."""
        return (self.shuffle_caption or self.caption_tag_dropout_rate > 0 or self.enable_wildcard
                or self.token_warmup_step > 0)


@dataclass(frozen=True)
class DatasetSpec:
    """Images sharing a resolution, batch size and bucket settings; each batch comes from one of its buckets."""
    subsets: tuple[SubsetSpec, ...]
    resolution: tuple[int, int] = (512, 512)
    batch_size: int = 1
    enable_bucket: bool = False
    min_bucket_reso: int = 256
    max_bucket_reso: int = 1024
    bucket_reso_steps: int = 64
    bucket_no_upscale: bool = False


# A TOML key -> the --config / command-line option that is its fallback.
_COMMAND_LINE_NAME = {"batch_size": "train_batch_size", "num_repeats": "dataset_repeats"}


def dataset_toml_problems(values: Mapping[str, Any]) -> list[str]:
    """The dataset TOML's own problems, for parse_config to report together with the option problems (a typo in
    the file must not hide behind a conflict between options)."""
    path = values.get("dataset_config")
    if path is None or not Path(path).is_file():
        return []  # a missing file is already an option problem
    try:
        read_dataset_toml(path)
    except ConfigError as e:
        return list(e.problems)
    return []


def _lookup(name: str, layers: list[Mapping[str, Any]], config: Config | None, default: Any) -> Any:
    """kohya's search order: the first layer that has the key, then the command line / --config, then default."""
    for layer in layers:
        if name in layer:
            return layer[name]
    option = _COMMAND_LINE_NAME.get(name, name)
    if config is not None:
        try:
            return getattr(config, option)
        except AttributeError:
            pass
    return default


_SUBSET_DEFAULTS = {f.name: f.default for f in fields(SubsetSpec) if f.name != "image_dir"}
_DATASET_DEFAULTS = {f.name: f.default for f in fields(DatasetSpec) if f.name != "subsets"}


def _resolve_subset(layers: list[Mapping[str, Any]], config: Config | None,
                    image_dir: Path | None = None) -> SubsetSpec:
    values = {name: _lookup(name, layers, config, default) for name, default in _SUBSET_DEFAULTS.items()}
    extension = values["caption_extension"]
    if extension and not extension.startswith("."):
        values["caption_extension"] = "." + extension  # kohya adds the dot
    if values["class_tokens"] is not None and not values["class_tokens"].strip():
        values["class_tokens"] = None
    for name in ("conditioning_data_dir", "metadata_file", "control_directory", "video_jsonl_file"):
        if values[name] is not None:
            values[name] = Path(values[name])
    face = values["face_crop_aug_range"]
    values["face_crop_aug_range"] = tuple(face) if face else None  # kohya's GUI writes "" for none
    values["target_frames"] = tuple(values["target_frames"])
    directory = image_dir if image_dir is not None else Path(layers[0]["image_dir"])
    return SubsetSpec(image_dir=directory, **values)


def _resolve_dataset(layers: list[Mapping[str, Any]], config: Config | None,
                     subsets: tuple[SubsetSpec, ...]) -> DatasetSpec:
    values = {name: _lookup(name, layers, config, default) for name, default in _DATASET_DEFAULTS.items()}
    if values["enable_bucket"] and any(s.face_crop_aug_range for s in subsets):
        logger.warning("face_crop_aug_range has no effect with enable_bucket (kohya crops around faces only "
                       "without buckets)")
        subsets = tuple(replace(s, face_crop_aug_range=None) for s in subsets)
    return DatasetSpec(subsets=subsets, **values)


def datasets_from_toml(path: str | Path, config: Config | None,
                       notes: list[str] | None = None) -> list[DatasetSpec]:
    """DatasetSpecs from a dataset TOML in kohya's or musubi-tuner's shape; the config supplies the command-line
    layer. Keys read but ignored are appended to `notes` (logged when it is None)."""
    found: list[str] = []
    general, datasets = read_dataset_toml(path, found)
    if notes is None:
        for note in found:
            logger.info(note)
    else:
        notes += found
    specs = []
    for dataset in datasets:
        subsets = tuple(_resolve_subset([subset, dataset["values"], general], config) for subset in dataset["subsets"])
        specs.append(_resolve_dataset([dataset["values"], general], config, subsets))
    problems = [p for i, spec in enumerate(specs) for p in check_dataset_spec(spec, config, f"{path}: datasets[{i}]")]
    if config is not None and config.masked_loss and not any(
            s.alpha_mask or s.conditioning_data_dir for spec in specs for s in spec.subsets):
        problems.append(f"{path}: masked_loss needs masks, and no subset sets conditioning_data_dir or alpha_mask")
    if problems:
        raise ConfigError(problems)
    return specs


_KOHYA_FOLDER = re.compile(r"^(\d+)(?:_(.*))?$", re.DOTALL)


def parse_kohya_folder_name(name: str) -> tuple[int, str] | None:
    """`10_sks dog` -> (10, "sks dog"); `5` -> (5, ""); None when the name has no repeat count."""
    match = _KOHYA_FOLDER.match(name)
    if match is None:
        return None
    return int(match.group(1)), (match.group(2) or "").strip()


def subsets_from_folder(root: Path, is_reg: bool, config: Config | None,
                        warnings: list[str], problems: list[str]) -> list[SubsetSpec]:
    """kohya folders under root: `<repeats>_<class tokens>`; other folders are ignored with a warning."""
    what = "reg_data_dir" if is_reg else "train_data_dir"
    if not root.is_dir():
        problems.append(f"{what}: {root} is not a folder")
        return []
    subsets, ignored = [], []
    for directory in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        parsed = parse_kohya_folder_name(directory.name)
        if parsed is None:
            ignored.append(directory.name)
            continue
        repeats, class_tokens = parsed
        layer = {"num_repeats": repeats, "is_reg": is_reg, "class_tokens": class_tokens}
        subsets.append(_resolve_subset([layer], config, image_dir=directory))
    if ignored:
        warnings.append(f"{what} {root}: folders without a repeat count are ignored (name them like "
                        f"'10_sks dog'): {', '.join(ignored)}")
    if not subsets:
        problems.append(f"{what} {root}: no images found in folders named like '10_sks dog' (no folder name "
                        "starts with a repeat count)")
    return subsets


def check_dataset_spec(spec: DatasetSpec, config: Config | None, where: str) -> list[str]:
    """Ranges and cache conflicts of resolved values (the command-line values get the same checks in config)."""
    problems: list[str] = []

    def need(condition: bool, message: str) -> None:
        if not condition:
            problems.append(f"{where}: {message}")

    width, height = spec.resolution
    need(spec.batch_size >= 1, f"batch_size must be at least 1 (got {spec.batch_size})")
    need(spec.bucket_reso_steps >= 8 and spec.bucket_reso_steps % 8 == 0,
         f"bucket_reso_steps must be a positive multiple of 8 (got {spec.bucket_reso_steps})")
    need(1 <= spec.min_bucket_reso <= spec.max_bucket_reso,
         f"need 1 <= min_bucket_reso <= max_bucket_reso (got {spec.min_bucket_reso}, {spec.max_bucket_reso})")
    if spec.enable_bucket:
        steps_problem = bucket_steps_problem((width, height), spec.bucket_reso_steps)
        need(steps_problem is None, steps_problem or "")
        need(spec.min_bucket_reso <= min(width, height),
             f"min_bucket_reso {spec.min_bucket_reso} is larger than the resolution's shorter side "
             f"{min(width, height)}")
        need(spec.max_bucket_reso >= max(width, height),
             f"max_bucket_reso {spec.max_bucket_reso} is smaller than the resolution's longer side "
             f"{max(width, height)}")
    else:
        need(width % 8 == 0 and height % 8 == 0,
             f"resolution {width}x{height}: sides must be multiples of 8 (the VAE downsamples 8x)")
    caching_latents = config is not None and (config.cache_latents or config.cache_latents_to_disk)
    caching_text = config is not None and config.cache_text_encoder_outputs
    for j, subset in enumerate(spec.subsets):
        at = f"subsets[{j}] ({subset.image_dir})"
        need(subset.num_repeats >= 0, f"{at}: num_repeats must not be negative (got {subset.num_repeats})")
        need(subset.keep_tokens >= 0, f"{at}: keep_tokens must not be negative (got {subset.keep_tokens})")
        need(subset.caption_dropout_every_n_epochs >= 0,
             f"{at}: caption_dropout_every_n_epochs must not be negative")
        for name in ("caption_dropout_rate", "caption_tag_dropout_rate"):
            rate = getattr(subset, name)
            need(0 <= rate <= 1, f"{at}: {name} must be in [0, 1] (got {rate})")
        need(subset.caption_separator != "", f"{at}: caption_separator must not be empty")
        need(not (subset.metadata_file and subset.is_reg),
             f"{at}: metadata_file describes training images; a regularisation subset takes an image folder")
        need(subset.token_warmup_min >= 0, f"{at}: token_warmup_min must not be negative")
        need(subset.token_warmup_step >= 0, f"{at}: token_warmup_step must not be negative")
        need(subset.resize_interpolation in (None, *RESIZE_INTERPOLATIONS),
             f"{at}: resize_interpolation {subset.resize_interpolation!r} must be one of "
             f"{', '.join(RESIZE_INTERPOLATIONS)}")
        if subset.conditioning_data_dir is not None:
            need(subset.conditioning_data_dir.is_dir(),
                 f"{at}: conditioning_data_dir {subset.conditioning_data_dir} is not a folder")
            # kohya reads these masks only for masked_loss and refuses the key otherwise.
            need(config is None or config.masked_loss,
                 f"{at}: conditioning_data_dir holds loss masks, which need masked_loss = true")
        problems += _control_problems(subset, spec.bucket_reso_steps, f"{where}: {at}")
        if subset.is_video:
            problems += [f"{where}: {at}: {p}" for p in _video_problems(subset)]
        for cached, changing, why in (
                (caching_latents, subset.color_aug, "color_aug changes the pixels each time and cannot use cached "
                 "latents; turn off color_aug or cache_latents / cache_latents_to_disk"),
                (caching_latents, subset.face_crop_aug_range, "face_crop_aug_range crops around the face anew each "
                 "time and cannot use cached latents; turn off one"),
                (caching_latents, subset.random_crop, "random_crop draws a new crop each time and cannot use cached "
                 "latents; turn off random_crop or cache_latents"),
                (caching_text, subset.caption_ops, "shuffle_caption, caption_tag_dropout_rate, enable_wildcard and "
                 "token_warmup_step change the caption each time and cannot use cache_text_encoder_outputs; turn "
                 "off one")):
            need(not (cached and changing), f"{at}: {why}")
    return problems


def _video_problems(subset: SubsetSpec) -> list[str]:
    """musubi-tuner's video keys out of range, and the image options a video clip does not take."""
    problems = []
    if subset.frame_extraction not in FRAME_EXTRACTIONS:
        problems.append(f"frame_extraction {subset.frame_extraction!r} must be one of {', '.join(FRAME_EXTRACTIONS)}")
    if not subset.target_frames:
        problems.append("target_frames is empty; give the clip lengths, like [1, 25, 45]")
    if any(n < 1 for n in subset.target_frames):
        problems.append(f"target_frames {list(subset.target_frames)}: every length must be at least 1")
    if subset.frame_extraction == "chunk" and 1 in subset.target_frames:
        problems.append("target_frames holds 1 with frame_extraction = \"chunk\": every frame would become a clip "
                        "of its own (musubi-tuner warns against it); remove 1")
    for name in ("frame_stride", "frame_sample", "max_frames"):
        if getattr(subset, name) < 1:
            problems.append(f"{name} must be at least 1 (got {getattr(subset, name)})")
    if subset.source_fps is not None and not subset.source_fps > 0:
        problems.append(f"source_fps must be positive (got {subset.source_fps})")
    image_only = [name for name, on in (("alpha_mask", subset.alpha_mask), ("color_aug", subset.color_aug),
                                        ("face_crop_aug_range", subset.face_crop_aug_range),
                                        ("conditioning_data_dir", subset.conditioning_data_dir),
                                        ("control_directory", subset.control_directory)) if on]
    if image_only:
        problems.append(f"{', '.join(image_only)}: not offered for video datasets; remove them")
    return problems


def _control_problems(subset: SubsetSpec, steps: int, at: str) -> list[str]:
    problems = []
    directory = subset.control_directory
    if directory is not None and not directory.is_dir():
        problems.append(f"{at}: control_directory {directory} " + ("is not a folder" if directory.exists() else
                                                                     "not found"))
    if subset.control_resolution is not None:
        width, height = subset.control_resolution
        if math.isqrt(width * height) < steps:
            problems.append(f"{at}: control_resolution {width}x{height} is smaller than bucket_reso_steps {steps}: "
                            "no control size fits")
    return problems


def resolve_datasets(config: Config, warnings: list[str] | None = None,
                     problems: list[str] | None = None) -> list[DatasetSpec]:
    """The datasets to train on: from dataset_config, or from train_data_dir (+ reg_data_dir) folder names.

    TOML mistakes raise ConfigError. Folder-level data problems (no kohya folders) are appended to `problems`, as
    are warnings, so that the dataset check can list them with everything else.
    """
    warnings = [] if warnings is None else warnings
    problems = [] if problems is None else problems
    if config.dataset_config is not None:
        return datasets_from_toml(config.dataset_config, config, warnings)
    if config.in_json is not None:  # kohya's fine-tuning dataset: train_data_dir holds the images themselves
        subset = _resolve_subset([{"metadata_file": config.in_json}], config, image_dir=Path(config.train_data_dir))
        spec = _resolve_dataset([], config, (subset,))
        check = check_dataset_spec(spec, config, "dataset")
        if check:
            raise ConfigError(check)
        return [spec]
    subsets = subsets_from_folder(Path(config.train_data_dir), False, config, warnings, problems)
    if config.reg_data_dir is not None:
        subsets += subsets_from_folder(Path(config.reg_data_dir), True, config, warnings, problems)
    spec = _resolve_dataset([], config, tuple(subsets))
    check = check_dataset_spec(spec, config, "dataset")
    if check:
        raise ConfigError(check)
    return [spec]
