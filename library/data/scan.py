"""Scanning the datasets: every image decoded and every caption read once, every problem collected with its path."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from library.data.captions import subset_caption
from library.data.controls import (
    ControlImage,
    metadata_controls,
    missing_control,
    pair_by_stem,
    place_controls,
    read_controls,
    unpaired_control,
)
from library.data.dataset_config import DatasetSpec, SubsetSpec
from library.data.images import (
    FORMATS_BY_EXTENSION,
    IMAGE_EXTENSIONS,
    Bucketer,
    ImageProblem,
    center_crop,
    image_named,
    inspect_image,
    read_mask,
)
from library.data.metadata import image_path, metadata_caption, read_metadata
from library.data.scan_video import CheckResult, Listed, check_video, subset_videos, video_extraction
from library.data.video import (
    Extraction,
    FramesRule,
    is_video_file,
)

_SHOWN = 5  # paths listed per warning before "... and N more"


def list_images(directory: Path) -> list[Path]:
    """Image files by extension (any case)."""
    return sorted(p for p in directory.iterdir() if image_named(p) and p.is_file())


def dangling_links(directory: Path) -> list[str]:
    """Problems for image-named symlinks whose target is gone: left out silently, they shrink the dataset
    without anyone noticing (a moved or unmounted image folder)."""
    return [f"{p}: a symlink to {os.readlink(p)}, which does not exist"
            for p in sorted(directory.iterdir()) if image_named(p) and p.is_symlink() and not p.exists()]


# ------------------------------------------------------------------------------------------------------ records

@dataclass
class ImageRecord:
    """One usable image of one subset."""
    path: Path
    dataset_index: int
    subset_index: int  # within its dataset
    subset: SubsetSpec
    caption: str  # before per-use processing; the class tokens when there is no caption file
    caption_from_file: bool
    size: tuple[int, int]  # original (width, height), upright
    bucket: tuple[int, int]
    resized: tuple[int, int]
    repeats: int  # per epoch; for regularisation images after balancing against the training images
    is_reg: bool
    alpha: bool = False
    controls: tuple[ControlImage, ...] = ()  # edit datasets: the target's control images, in order
    frames: tuple[int, ...] | None = None  # a video clip: its source frames (path is the video); None: an image

    @property
    def bucket_key(self) -> tuple[int, ...]:
        """What a batch's items share: the bucket, and a clip's frame count (images and clips never mix)."""
        return self.bucket if self.frames is None else (*self.bucket, len(self.frames))

    @property
    def crop(self) -> tuple[int, int]:
        return center_crop(self.resized, self.bucket)

    @property
    def upscaled(self) -> bool:
        return self.resized[0] > self.size[0] or self.resized[1] > self.size[1]


@dataclass
class SubsetReport:
    dataset_index: int
    subset_index: int
    spec: SubsetSpec
    images: int = 0
    captions_from_file: int = 0
    left_out: int = 0
    used: bool = True
    clips: int = 0  # a video subset: the clips cut from its videos


@dataclass
class Scan:
    records: list[ImageRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    subsets: list[SubsetReport] = field(default_factory=list)


def listing(paths: Sequence[Any]) -> str:
    shown = ", ".join(str(p) for p in paths[:_SHOWN])
    return shown + (f" ... and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else "")


def _check_image(path: Path, subset: SubsetSpec, bucketer: Bucketer, given_caption: str | None = None,
                 controls: tuple[Path, ...] | None = None) -> tuple[dict[str, Any] | None, list[str], list[str]]:
    """(record fields or None, problems, notes) for one image file; runs in a worker thread. `given_caption`:
    the caption from fine-tuning metadata, instead of a caption file; `controls`: its control images (None in a
    subset without them, empty when they are missing)."""
    problems: list[str] = []
    notes: list[str] = []
    facts = None
    try:
        facts = inspect_image(path)
    except ImageProblem as e:
        problems.append(f"{path}: {e}")
    caption = subset_caption(path, subset, given_caption, subset.metadata_file, problems,
                             " and the subset has no class tokens")
    control_sizes, control_problems = read_controls(controls or ())
    problems += control_problems if controls != () else [missing_control(path, subset)]
    if facts is None or problems:
        return None, problems, notes
    if subset.conditioning_data_dir is not None:
        mask_path = subset.conditioning_data_dir / path.name
        try:
            mask_size = read_mask(mask_path, alpha=False).size if mask_path.is_file() else None
        except ImageProblem as e:
            return None, [f"{mask_path}: {e}"], notes
        if mask_size is None:
            return None, [f"{path}: no mask {mask_path} (masked_loss reads the mask with the image's file name "
                          "from conditioning_data_dir)"], notes
        if mask_size != facts.size:
            return None, [f"{mask_path}: the mask is {mask_size[0]}x{mask_size[1]}, its image "
                          f"{facts.size[0]}x{facts.size[1]}; they must be the same size"], notes
    expected = FORMATS_BY_EXTENSION.get(path.suffix.lower(), ())
    if facts.format not in expected:
        notes.append(f"wrong-extension:{path} is {facts.format} data with a {path.suffix} extension; decoded as "
                     f"{facts.format}")
    placement = bucketer.place(*facts.size)
    if placement.problem:
        return None, [f"{path}: {placement.problem}"], notes
    fields_ = {"path": path, "caption": caption.text if caption.text is not None else subset.class_tokens,
               "caption_from_file": caption.text is not None, "size": facts.size, "bucket": placement.bucket,
               "resized": placement.resized, "alpha": facts.alpha}
    if controls:
        fields_["controls"], problems = place_controls(controls, control_sizes, placement.bucket, subset,
                                                       bucketer.spec.bucket_reso_steps)
        if problems:
            return None, problems, notes
    return fields_, problems, notes


def scan_datasets(specs: Sequence[DatasetSpec], threads: int | None = None,
                  frames_rule: FramesRule | None = None) -> Scan:
    """Read every image, video and caption of every subset; collect usable records, problems and warnings.
    `frames_rule`: the clip lengths and rate the model's family takes (None: images only, videos are refused)."""
    scan = Scan()
    jobs = _list_jobs(specs, scan, frames_rule)
    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_run_job, jobs))
    notes: dict[str, list[str]] = {}
    class_token_users: dict[int, list[Path]] = {}
    for job, result in zip(jobs, results, strict=True):
        _add_result(scan, job, result, notes, class_token_users)
    scan.warnings += _summary_warnings(scan.subsets, class_token_users, notes)
    return scan


# One image or video to check: its subset's report, the file, its dataset's bucketer, its caption from metadata (or
# None), its control images (None in a subset without them), how clips are cut from it (None: an image).
_Job = tuple[SubsetReport, Path, Bucketer, "str | None", "tuple[Path, ...] | None", "Extraction | None"]


def _run_job(job: _Job) -> CheckResult:
    report, path, bucketer, caption, controls, extraction = job
    if extraction is not None and (path.is_dir() or is_video_file(path)):
        return check_video(path, report.spec, bucketer, caption, extraction)
    fields_, problems, notes = _check_image(path, report.spec, bucketer, caption, controls)
    return (None if fields_ is None else [fields_]), problems, notes


def _list_jobs(specs: Sequence[DatasetSpec], scan: Scan, frames_rule: FramesRule | None) -> list[_Job]:
    """Every image and video of every used subset; a report per subset is added to the scan."""
    jobs: list[_Job] = []
    for d, spec in enumerate(specs):
        bucketer = Bucketer(spec)
        seen: set[Path] = set()
        for s, subset in enumerate(spec.subsets):
            report = SubsetReport(d, s, subset)
            scan.subsets.append(report)
            extraction = None
            if subset.is_video:
                extraction = video_extraction(subset, frames_rule, scan.problems)
                listed = subset_videos(subset, d, seen, scan.problems, scan.warnings) if extraction is not None else []
            else:
                listed = _subset_images(subset, d, seen, scan)
            if not listed:
                report.used = False
                continue
            report.images = len(listed)
            jobs.extend((report, path, bucketer, caption, controls, extraction)
                        for path, caption, controls in listed)
    return jobs


def _subset_images(subset: SubsetSpec, dataset_index: int, seen: set[Path], scan: Scan) -> Sequence[Listed]:
    """(image, caption from fine-tuning metadata or None, its control images or None) of one subset; none when the
    subset is not used, with the warning or problem that says why. `seen`: the dataset's folders so far."""
    directory = subset.image_dir
    if directory.resolve() in seen:
        scan.warnings.append(f"{directory}: the same folder is already a subset of dataset {dataset_index}; "
                             "this one is ignored (kohya does the same)")
        return []
    seen.add(directory.resolve())
    if subset.num_repeats == 0:
        scan.warnings.append(f"{directory}: num_repeats is 0; the subset is not used")
        return []
    if not directory.exists():
        scan.problems.append(f"{directory}: image folder not found")
        return []
    if not directory.is_dir():
        scan.problems.append(f"{directory}: not a folder")
        return []
    if subset.metadata_file is not None:
        listed = _metadata_jobs(subset, scan.problems)
    else:
        listed = [(path, None, None) for path in list_images(directory)]
        scan.problems.extend(dangling_links(directory))
        if not listed:
            scan.problems.append(f"{directory}: no images (extensions {', '.join(IMAGE_EXTENSIONS)})")
    return _pair_controls(subset, listed, scan.problems)


def _pair_controls(subset: SubsetSpec, listed: list[Listed], problems: list[str]) -> list[Listed]:
    """The subset's images with their control images: those their metadata entry names, else those paired by stem
    in control_directory. Every image of a subset with control images needs some (an empty tuple: missing)."""
    named = {path: controls for path, _, controls in listed if controls is not None}
    if subset.control_directory is None and not named:
        return listed
    changing = [name for name, on in (("random_crop", subset.random_crop), ("color_aug", subset.color_aug),
                                      ("face_crop_aug_range", subset.face_crop_aug_range)) if on]
    if changing:
        problems.append(f"{subset.image_dir}: {', '.join(changing)} would change the target image alone and "
                        "break its match with its control images; turn it off for a subset with control images")
        return []
    paired: dict[Path, tuple[Path, ...]] = {}
    clashes: dict[Path, str] = {}
    if subset.control_directory is not None:
        files = list_images(subset.control_directory)
        problems.extend(dangling_links(subset.control_directory))
        if not files:
            problems.append(f"{subset.control_directory}: control_directory holds no images (extensions "
                            f"{', '.join(IMAGE_EXTENSIONS)})")
            return []
        paired, unpaired, clashes = pair_by_stem([p for p, _, _ in listed if p not in named], files)
        problems.extend(clashes.values())
        used = {c.resolve() for controls in named.values() for c in controls}
        problems.extend(unpaired_control(c, subset) for c in unpaired if c.resolve() not in used)
    return [(path, caption, named.get(path, paired.get(path, ()))) for path, caption, _ in listed
            if path not in clashes]


def _add_result(scan: Scan, job: _Job, result: CheckResult, notes: dict[str, list[str]],
                class_token_users: dict[int, list[Path]]) -> None:
    """One checked image or video: its problems, its notes by kind, and its records when it is usable."""
    report, path = job[0], job[1]
    fields_list, problems, item_notes = result
    scan.problems.extend(problems)
    for note in item_notes:
        kind, text = note.split(":", 1)
        notes.setdefault(kind, []).append(text)
    if fields_list is None:
        report.left_out += 1
        return
    records = [ImageRecord(dataset_index=report.dataset_index, subset_index=report.subset_index,
                           subset=report.spec, repeats=report.spec.num_repeats, is_reg=report.spec.is_reg, **fields_)
               for fields_ in fields_list]
    scan.records.extend(records)
    record = records[0]
    if record.frames is not None:
        report.clips += len(records)
    if record.caption_from_file:
        report.captions_from_file += 1
    else:
        class_token_users.setdefault(id(report), []).append(path)
    if record.upscaled:
        notes.setdefault("upscaled", []).append(
            f"{path} ({record.size[0]}x{record.size[1]} -> bucket {record.bucket[0]}x{record.bucket[1]})")
    if record.alpha:
        notes.setdefault("alpha", []).append(str(path))


def _summary_warnings(subsets: list[SubsetReport], class_token_users: dict[int, list[Path]],
                      notes: dict[str, list[str]]) -> list[str]:
    """One warning per subset with images captioned by their class tokens, then one per kind of note."""
    warnings = []
    for report in subsets:
        users = class_token_users.get(id(report), [])
        if users:
            warnings.append(
                f"{report.spec.image_dir}: {len(users)} of {report.images} images have no caption file "
                f"({report.spec.caption_extension}); they use the class tokens {report.spec.class_tokens!r}: "
                + listing(users))
    if "wrong-extension" in notes:
        warnings.append(f"{len(notes['wrong-extension'])} images have an extension that does not match "
                        "their content (decoded by content): " + listing(notes["wrong-extension"]))
    if "upscaled" in notes:
        warnings.append(f"{len(notes['upscaled'])} images are smaller than their bucket and are enlarged "
                        "(set bucket_no_upscale to keep them small): " + listing(notes["upscaled"]))
    if "alpha" in notes:
        warnings.append(f"{len(notes['alpha'])} images have transparency; it is composited on white: "
                        + listing(notes["alpha"]))
    if "short" in notes:
        warnings.append(f"{len(notes['short'])} videos are shorter than some of their target_frames and give "
                        "fewer clips: " + listing(notes["short"]))
    if "fps" in notes:
        warnings.append(f"{len(notes['fps'])} videos are not at the model's frame rate and source_fps is not set: "
                        "every frame is used, so their motion trains faster or slower than it plays (set "
                        "source_fps to resample them, as musubi-tuner does): " + listing(notes["fps"]))
    return warnings


def _metadata_jobs(subset: SubsetSpec, problems: list[str]) -> list[Listed]:
    """(image, caption, control images or None) of each entry of a subset's fine-tuning metadata; missing images
    are problems."""
    assert subset.metadata_file is not None
    entries, found = read_metadata(subset.metadata_file)
    problems.extend(found)
    listed = []
    for key, entry in entries.items():
        path = image_path(key, subset.image_dir)
        if path is None:
            problems.append(f"{subset.metadata_file}: {key!r}: no image {subset.image_dir / key} (with or without "
                            f"an extension {', '.join(IMAGE_EXTENSIONS)})")
            continue
        controls, key_problems = metadata_controls(entry, subset.image_dir)
        problems.extend(f"{subset.metadata_file}: {key!r}: {p}" for p in key_problems)
        listed.append((path, metadata_caption(entry, subset.caption_separator, subset.enable_wildcard), controls))
    return listed


def balance_regularisation(records: list[ImageRecord]) -> None:
    """kohya: regularisation images are repeated (round-robin) until they match the training images per epoch;
    when there are more, the ones past that count are not used."""
    num_train = sum(r.repeats for r in records if not r.is_reg)
    reg = [r for r in records if r.is_reg]
    for r in reg:
        r.repeats = 0
    if not reg:
        return
    total, first_pass = 0, True
    while total < num_train:
        for r in reg:
            added = r.subset.num_repeats if first_pass else 1
            r.repeats += added
            total += added
            if total >= num_train:
                break
        first_pass = False
