"""Control images of edit datasets (FLUX.1 Kontext, Qwen-Image-Edit, FLUX.2 reference images), as musubi-tuner's
dataset config has them.

A target image `a.png` in a subset's image folder pairs with `a.<ext>` in its `control_directory`, or with several
numbered `a_0.<ext>`, `a_1.<ext>` ... (any number of digits, ordered by number; the unnumbered one first when both
exist). Longer target names pair first, so target `a_1.png` takes `a_1.png` before target `a` could take it as its
second control. A metadata JSONL entry names its controls itself: `control_path`, or `control_path_0`,
`control_path_1` ... (relative paths are taken from the subset's image folder, as the entry's image is).

Sizes follow musubi: by default a control is resized (to cover, then centre-cropped) to its target's bucket;
`no_resize_control` keeps its own size, cropped down to multiples of bucket_reso_steps; `control_resolution` gives it
its own bucket at that area (with `no_resize_control` too, only when it is larger than that area). Controls are
flipped with their target.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from library.data.dataset_config import SubsetSpec
from library.data.images import ImageProblem, center_crop, inspect_image, prepare_image

_NUMBERED = re.compile(r"^(.+)_(\d+)$")
_PATH_KEY = re.compile(r"^control_path(?:_(\d+))?$")


@dataclass(frozen=True)
class ControlImage:
    """One control image of one target, and the size it is fed at."""
    path: Path
    size: tuple[int, int]  # original (width, height), upright
    resized: tuple[int, int]  # resized to this, then centre-cropped to `target`
    target: tuple[int, int]  # (width, height) the VAE sees

    @property
    def crop(self) -> tuple[int, int]:
        return center_crop(self.resized, self.target)


# ------------------------------------------------------------------------------------------------------ pairing

def pair_by_stem(images: Sequence[Path],
                 controls: Sequence[Path]) -> tuple[dict[Path, tuple[Path, ...]], list[Path], dict[Path, str]]:
    """(target -> its control images in order, control images no target takes, target -> why its controls cannot
    be ordered) for one subset."""
    candidates: dict[str, list[tuple[int, Path]]] = {}
    for control in controls:
        candidates.setdefault(control.stem, []).append((-1, control))
        numbered = _NUMBERED.match(control.stem)
        if numbered:
            candidates.setdefault(numbered.group(1), []).append((int(numbered.group(2)), control))
    taken: set[Path] = set()
    pairs: dict[Path, tuple[Path, ...]] = {}
    problems: dict[Path, str] = {}
    for image in sorted(images, key=lambda p: (-len(p.stem), p)):
        found = sorted((i, c) for i, c in candidates.get(image.stem, []) if c not in taken)
        if not found:
            continue
        taken.update(c for _, c in found)
        numbers = [i for i, _ in found]
        if len(set(numbers)) < len(numbers):
            same = [c.name for i, c in found if numbers.count(i) > 1]
            problems[image] = (f"{image}: control images {', '.join(same)} claim the same place (one file per "
                               "number, and one unnumbered)")
            continue
        pairs[image] = tuple(c for _, c in found)
    return pairs, sorted(set(controls) - taken), problems


def metadata_controls(entry: Mapping[str, Any], image_dir: Path) -> tuple[tuple[Path, ...] | None, list[str]]:
    """The control images a metadata entry names (None when it names none), and the problems with its keys."""
    found: list[tuple[int, Path]] = []
    problems = []
    for key, value in entry.items():
        match = _PATH_KEY.match(key)
        if match is None:
            continue
        if not isinstance(value, str) or not value:
            problems.append(f"{key} must be a file path (got {value!r})")
            continue
        path = Path(value)
        found.append((-1 if match.group(1) is None else int(match.group(1)),
                      path if path.is_absolute() else image_dir / path))
    if not found:
        return None, problems
    return tuple(path for _, path in sorted(found)), problems


def missing_control(image: Path, subset: SubsetSpec) -> str:
    if subset.control_directory is not None:
        return (f"{image}: no control image in {subset.control_directory} (named {image.stem}.<ext>, or "
                f"{image.stem}_0.<ext>, {image.stem}_1.<ext> ... for several)")
    return (f"{image}: its entry in {subset.metadata_file} names no control_path, while other entries of the "
            "subset do")


def unpaired_control(control: Path, subset: SubsetSpec) -> str:
    return (f"{control}: a control image without a target image in {subset.image_dir} (a control pairs with the "
            "target of the same file stem, or the stem before _<number>)")


# -------------------------------------------------------------------------------------------------------- sizes

def area_bucket(size: tuple[int, int], resolution: tuple[int, int], steps: int) -> tuple[int, int]:
    """musubi's bucket for a control at control_resolution: sides in multiples of `steps`, about the resolution's
    area, the aspect ratio nearest the image's among five widths around the ideal one."""
    area = resolution[0] * resolution[1]
    ratio = size[0] / size[1]
    ideal = int(math.sqrt(area * ratio)) // steps * steps
    best: tuple[float, tuple[int, int]] | None = None
    for width in (ideal + i * steps for i in range(-2, 3)):
        height = area // width // steps * steps if width >= steps else 0
        if height < steps:
            continue
        error = abs(width / height - ratio)
        if best is None or error < best[0]:
            best = (error, (width, height))
    return best[1] if best is not None else (steps, steps)


def control_target(size: tuple[int, int], bucket: tuple[int, int], subset: SubsetSpec,
                   steps: int) -> tuple[int, int]:
    """The (width, height) a control of `size` is fed at, for a target in `bucket` (see the module's rule)."""
    width, height = size
    limit = subset.control_resolution
    if subset.no_resize_control:
        if limit is not None and width * height > limit[0] * limit[1]:
            return area_bucket(size, limit, steps)
        # musubi keeps a control within control_resolution at its exact size; it is cropped to the steps here too,
        # as the VAE and the patching need.
        return width - width % steps, height - height % steps
    if limit is not None:
        return area_bucket(size, limit, steps)
    return bucket


def cover(size: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """The size that covers `target` keeping the aspect ratio (the crop then takes the middle)."""
    scale = max(target[0] / size[0], target[1] / size[1])
    return max(target[0], int(size[0] * scale + 0.5)), max(target[1], int(size[1] * scale + 0.5))


def read_controls(paths: Sequence[Path]) -> tuple[list[tuple[int, int]], list[str]]:
    """Each control decoded once, as training will: (sizes, problems naming the files)."""
    sizes, problems = [], []
    for path in paths:
        if not path.is_file():
            problems.append(f"{path}: control image not found")
            continue
        try:
            sizes.append(inspect_image(path).size)
        except ImageProblem as e:
            problems.append(f"{path}: {e}")
    return sizes, problems


def place_controls(paths: Sequence[Path], sizes: Sequence[tuple[int, int]], bucket: tuple[int, int],
                   subset: SubsetSpec, steps: int) -> tuple[tuple[ControlImage, ...], list[str]]:
    """The controls of a target in `bucket`, with the sizes they are fed at; problems for those too small."""
    controls, problems = [], []
    for path, size in zip(paths, sizes, strict=True):
        target = control_target(size, bucket, subset, steps)
        if min(target) < steps and subset.no_resize_control:
            problems.append(f"{path}: the control image is {size[0]}x{size[1]}, smaller than bucket_reso_steps "
                            f"{steps}, and no_resize_control keeps its size")
        elif min(target) < steps:
            problems.append(f"{path}: the control image would be fed at {target[0]}x{target[1]} (its target's "
                            f"bucket), smaller than bucket_reso_steps {steps}: lower bucket_reso_steps or raise "
                            "the resolution")
            continue
        controls.append(ControlImage(path, size, cover(size, target), target))
    return tuple(controls), problems


# -------------------------------------------------------------------------------------------------------- items

def control_inputs(controls: Sequence[ControlImage], subset: SubsetSpec, flipped: bool,
                   latents: Any) -> dict[str, list[torch.Tensor]]:
    """An item's controls: `control_latents` from the control latent cache (library.data.control_cache), else
    `control_pixels`, one tensor per control in order."""
    if latents is not None:
        return {"control_latents": [latents.get(c, flipped, subset.resize_interpolation) for c in controls]}
    return {"control_pixels": [prepare_image(c.path, c.size, c.resized, c.target, c.crop, flipped,
                                             subset.resize_interpolation) for c in controls]}
