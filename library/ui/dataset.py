"""The dataset view: the trainer's own --dataset_check report, thumbnails with their captions (an edit dataset's
targets beside their control images, paired as the trainer pairs them; a video dataset's videos playing, frame
folders as a strip, each with the clips the model's family cuts from it), and caption edits. The dataset tools (a new
folder, bulk caption edits, captioning with a model) are library.ui.dataset_tools'."""
from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from library.config import Config
from library.core.atomic import write_atomically
from library.data.captions import read_caption
from library.data.controls import metadata_controls, pair_by_stem
from library.data.dataset_config import SubsetSpec, resolve_datasets
from library.data.metadata import image_path, read_metadata
from library.data.scan import ImageRecord, list_images, scan_datasets
from library.data.video import VideoProblem, frame_files, is_video_file, probe_video
from library.families.entry import FramesRule
from library.ui import dataset_tools, preflight, schema, security
from library.ui.runs import TRAINER
from library.ui.web import RootsDep, SettingsDep, form_values, page, refused

THUMBNAILS_PER_SUBSET = 60
STRIP_FRAMES = 5  # a frame folder is shown as this many of its frames, spread over it
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
               ".bmp": "image/bmp", ".gif": "image/gif"}
VIDEO_TYPES = {".mp4": "video/mp4", ".m4v": "video/mp4", ".webm": "video/webm"}  # what a <video> plays

router = APIRouter()
router.include_router(dataset_tools.router)


@router.post("/dataset", response_class=HTMLResponse)
async def dataset(request: Request, roots: RootsDep, settings: SettingsDep) -> HTMLResponse:
    form = await request.form()
    values = form_values(form)
    if not values.get("output_dir", "").strip():  # the dataset needs none; the config's checks do
        values["output_dir"] = str(roots.paths[0] / "output")
    model = values.get(preflight.MODEL_OPTION, "").strip()
    with tempfile.TemporaryDirectory(prefix="lora-ui-model-") as stand_in:
        if not model:  # the images can be looked at before a model is chosen; a video's clips cannot
            values[preflight.MODEL_OPTION] = stand_in
        state, text = schema.check(values, lambda name, typed: None if typed == stand_in else roots.problem(name,
                                                                                                           typed))
        data_problems = {k: v for k, v in state.problems.items() if k not in ("output_dir",)}
        if data_problems or state.general or state.config is None:
            return page(request, "dataset.html", report="", subsets=[],
                        problems=[p for ps in (data_problems or state.problems).values() for p in ps] + state.general)
        real = roots.resolve(model) if model else None
        rule = preflight.frames_rule(real)
        subsets = await asyncio.to_thread(subset_views, state.config, roots, rule, bool(model))
    report = await asyncio.to_thread(dataset_check, text, settings.python, roots.cwd) if model else (
        "no model set: the trainer's --dataset_check report needs the model (its tokenizer, and for videos its "
        "family's clip lengths); the images are shown below")
    return page(request, "dataset.html", report=report, subsets=subsets, problems=[])


@router.post("/caption", response_class=HTMLResponse)
async def caption(request: Request, roots: RootsDep) -> HTMLResponse:
    form = await request.form()
    image = roots.resolve(str(form.get("image", "")))
    extension = str(form.get("extension", ".txt"))
    if image is None:
        return refused(str(form.get("image", "")))
    if not (image.suffix.lower() in IMAGE_TYPES and image.is_file() or is_video_file(image) and image.is_file()
            or image.is_dir() and frame_files(image)):
        return HTMLResponse('<p class="problem">not an image, a video or a frame folder</p>', status_code=400)
    if not extension.startswith(".") or "/" in extension or "\\" in extension or len(extension) > 16:
        return HTMLResponse('<p class="problem">not a caption extension</p>', status_code=400)
    text = " ".join(str(form.get("caption", "")).split())
    if not text:  # the dataset check rejects an empty caption file
        return HTMLResponse('<span class="problem">not saved: a caption file must not be empty; write a caption, or '
                            "delete the file to train with the folder's class tokens</span>", status_code=400)
    existing = read_caption(image, extension).path
    target = existing or image.with_name(image.stem + folder_extension(media_files(image.parent), extension))
    if roots.resolve(target) is None:
        return refused(str(target))
    write_atomically(target, lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"))
    return HTMLResponse(f'<span class="ok">saved {target.name}</span>')


def folder_extension(images: list[Path], configured: str) -> str:
    """The caption extension a folder uses: the configured one when any caption has it, else .txt when any caption
    has that (the trainer reads .txt when the configured one is missing), else the configured one."""
    for extension in dict.fromkeys((configured, ".txt")):
        if any(image.with_name(image.stem + extension).is_file() for image in images):
            return extension
    return configured


def subset_views(config: Config, roots: security.Roots, rule: FramesRule | None = None,
                 model_set: bool = True) -> list[dict[str, Any]]:
    """Each subset under the roots: its folder, repeats, image count and the first images with their captions and
    what the dataset check rejects them for. `rule`: the model's family's frames rule (None: an image family, or no
    model when not `model_set`: then a video subset's items are shown unchecked)."""
    specs = resolve_datasets(config)
    scan = scan_datasets(specs, frames_rule=rule)
    rejected = rejections(scan.problems, roots)
    cut = clips_by_video(scan.records)
    subsets = []
    for spec in specs:
        for subset in spec.subsets:
            if subset.is_video:
                view = video_subset_view(subset, roots, rejected, cut, rule, model_set)
                if view is not None:
                    subsets.append(view)
                continue
            directory = roots.resolve(subset.image_dir)
            if directory is None:
                continue
            images = list_images(directory)
            pairs, unpaired = controls_of(subset, images)
            items = []
            for image in images[:THUMBNAILS_PER_SUBSET]:
                found = read_caption(image, subset.caption_extension)
                controls = pairs.get(image, ()) if pairs is not None else ()
                keys = caption_keys(image, subset.caption_extension) + [str(c.resolve()) for c in controls]
                items.append({"path": str(image), "name": image.name, "caption": found.text or "",
                              "problems": [r for key in keys for r in rejected.get(key, [])],
                              "controls": [{"path": str(c), "name": c.name} for c in controls]})
            subsets.append({"dir": str(directory), "repeats": subset.num_repeats, "is_reg": subset.is_reg,
                            "prior_reg": subset.prior_reg,
                            "count": len(images), "items": items, "pairs": pairs is not None,
                            "control_dir": str(subset.control_directory or ""),
                            "unpaired": [c.name for c in unpaired],
                            "extension": folder_extension(images, subset.caption_extension),
                            "rejected": sum(bool(item["problems"]) for item in items)})
    return subsets


def media_files(directory: Path) -> list[Path]:
    """What a video_directory holds for training, as the dataset check lists it: video files, frame folders and
    images."""
    return sorted(p for p in directory.iterdir() if not p.name.startswith(".") and (
        p.is_dir() or p.is_file() and (is_video_file(p) or p.suffix.lower() in IMAGE_TYPES)))


def listed_videos(subset: SubsetSpec) -> list[tuple[Path, str | None]]:
    """(video file, frame folder or image; its caption from the JSONL, or None) of a video subset, in order."""
    if subset.video_jsonl_file is None:
        return [(p, None) for p in media_files(subset.image_dir)] if subset.image_dir.is_dir() else []
    listed: list[tuple[Path, str | None]] = []
    try:
        lines = subset.video_jsonl_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []  # the dataset check names it
    for line in lines:
        try:
            entry = json.loads(line)
            video, caption = Path(entry["video_path"]), entry["caption"]
        except (ValueError, TypeError, KeyError):
            continue
        listed.append((video if video.is_absolute() else subset.image_dir / video, caption))
    return listed


def clips_by_video(records: list[ImageRecord]) -> dict[str, list[tuple[int, ...]]]:
    """The clips the scan cut, by the real path of their video file or frame folder."""
    found: dict[str, list[tuple[int, ...]]] = {}
    for record in records:
        if record.frames is not None:
            found.setdefault(str(record.path.resolve()), []).append(record.frames)
    return found


def frames_text(frames: tuple[int, ...]) -> str:
    """A clip's source frames, runs of consecutive frames as first-last ("0-8", "0, 2, 4-6")."""
    runs: list[list[int]] = []
    for frame in frames:
        if runs and frame == runs[-1][-1] + 1:
            runs[-1].append(frame)
        else:
            runs.append([frame])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return ", ".join(parts[:8]) + (f" ... ({len(parts) - 8} more runs)" if len(parts) > 8 else "")


def video_item(path: Path, caption: str | None, extension: str, problems: list[str],
               clips: list[tuple[int, ...]]) -> dict[str, Any]:
    """A video file, frame folder or image of a video subset, as the view shows it."""
    kind = "folder" if path.is_dir() else "video" if is_video_file(path) else "image"
    item: dict[str, Any] = {"path": str(path), "name": path.name, "kind": kind, "problems": problems,
                            "caption": caption if caption is not None else read_caption(path, extension).text or "",
                            "editable": caption is None, "frames": None, "fps": "", "strip": [],
                            "media": VIDEO_TYPES.get(path.suffix.lower(), "image" if path.suffix.lower() in IMAGE_TYPES
                                                     else ""),
                            "clips": [{"count": len(c), "text": frames_text(c)} for c in clips]}
    if kind == "image":
        return item
    try:
        facts = probe_video(path)
    except VideoProblem:
        return item  # the dataset check's reason is among `problems`
    item["frames"] = facts.frames
    item["fps"] = f"{facts.fps[0]:.3g}" if facts.fps else ""
    if facts.frame_files:
        count = len(facts.frame_files)
        picks = sorted({round(i * (count - 1) / max(1, STRIP_FRAMES - 1)) for i in range(min(STRIP_FRAMES, count))})
        item["strip"] = [{"path": str(facts.frame_files[i]), "index": i} for i in picks]
    return item


def video_subset_view(subset: SubsetSpec, roots: security.Roots, rejected: dict[str, list[str]],
                      cut: dict[str, list[tuple[int, ...]]], rule: FramesRule | None,
                      model_set: bool) -> dict[str, Any] | None:
    """A video subset: its videos, frame folders and images, each with the clips the family cuts from it and what
    the dataset check rejects it for."""
    where = roots.resolve(subset.video_jsonl_file or subset.image_dir)
    if where is None:
        return None
    listed = [(path, caption) for path, caption in listed_videos(subset) if roots.resolve(path) is not None]
    folder = subset.image_dir if subset.video_jsonl_file is None else where.parent
    extension = folder_extension([p for p, _ in listed], subset.caption_extension)
    items = []
    for path, caption in listed[:THUMBNAILS_PER_SUBSET]:
        real = str(path.resolve())
        keys = [real] + caption_keys(path, subset.caption_extension)
        items.append(video_item(path, caption, extension, [r for key in dict.fromkeys(keys)
                                                           for r in rejected.get(key, [])], cut.get(real, [])))
    note = ""
    if rule is None:
        note = preflight.NO_MODEL_FOR_VIDEO if not model_set else (
            "a video dataset, and the model's family trains images only (video datasets train a video family such "
            "as Wan)")
    else:
        note = (f"clips as the model's family takes them: 1 + {rule.step} * n frames, at {rule.fps:g} fps; "
                f"frame_extraction {subset.frame_extraction}, " + (
                    f"max_frames {subset.max_frames}" if subset.frame_extraction == "full" else
                    f"target_frames {', '.join(map(str, subset.target_frames))}"))
    return {"dir": str(subset.video_jsonl_file or folder), "repeats": subset.num_repeats, "is_reg": subset.is_reg,
            "prior_reg": subset.prior_reg,
            "count": len(listed), "items": items, "pairs": False, "video": True, "note": note,
            "note_is_problem": rule is None and model_set, "control_dir": "", "unpaired": [], "extension": extension,
            "rejected": sum(bool(item["problems"]) for item in items)}


def controls_of(subset: SubsetSpec, images: list[Path]) -> tuple[dict[Path, tuple[Path, ...]] | None, list[Path]]:
    """(target -> its control images, control images no target takes) as the trainer pairs them
    (library.data.controls: by file stem in control_directory, or as the metadata entries name them); None for a
    subset without control images."""
    named: dict[Path, tuple[Path, ...]] = {}
    if subset.metadata_file is not None:
        entries, _ = read_metadata(subset.metadata_file)
        for key, entry in entries.items():
            path, (controls, _) = image_path(key, subset.image_dir), metadata_controls(entry, subset.image_dir)
            if path is not None and controls is not None:
                named[path.resolve()] = controls  # keyed as the listed images are: real paths
    if subset.control_directory is None or not subset.control_directory.is_dir():
        return (named or None), []
    paired, unpaired, _ = pair_by_stem([i for i in images if i not in named], list_images(subset.control_directory))
    used = {c.resolve() for controls in named.values() for c in controls}
    return {**paired, **named}, [c for c in unpaired if c.resolve() not in used]


def rejections(problems: list[str], roots: security.Roots) -> dict[str, list[str]]:
    """The dataset check's problems by the real path of the file they name (an image or its caption file), each
    without the path."""
    found: dict[str, list[str]] = {}
    for problem in problems:
        path, _, reason = problem.partition(": ")
        real = roots.resolve(path)
        found.setdefault(str(real) if real is not None else path, []).append(reason or problem)
    return found


def caption_keys(image: Path, extension: str) -> list[str]:
    """The files whose problems are an image's: itself and the caption files the trainer would read for it."""
    return list(dict.fromkeys([str(image)] + [str(image.with_name(image.stem + e)) for e in (extension, ".txt")]))


def dataset_check(text: str, python: str, cwd: Path) -> str:
    """The trainer's own --dataset_check report, from a process of its own (it reads the model's tokenizer)."""
    with tempfile.TemporaryDirectory(prefix="lora-ui-") as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(text, encoding="utf-8")
        try:
            done = subprocess.run([python, str(TRAINER), "--config", str(path), "--dataset_check"], cwd=cwd,
                                  capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return "the dataset check took longer than 5 minutes and was stopped"
    return (done.stdout + done.stderr).replace(str(path), "config").strip()
