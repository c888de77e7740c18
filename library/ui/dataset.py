"""The dataset view: the trainer's own --dataset_check report, thumbnails with their captions (an edit dataset's
targets beside their control images, paired as the trainer pairs them), and caption edits. The dataset tools (a new
folder, bulk caption edits, captioning with a model) are library.ui.dataset_tools'."""
from __future__ import annotations

import asyncio
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
from library.data.scan import list_images, scan_datasets
from library.ui import dataset_tools, schema, security
from library.ui.runs import TRAINER
from library.ui.web import RootsDep, SettingsDep, form_values, page, refused

THUMBNAILS_PER_SUBSET = 60
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
               ".bmp": "image/bmp", ".gif": "image/gif"}

router = APIRouter()
router.include_router(dataset_tools.router)


@router.post("/dataset", response_class=HTMLResponse)
async def dataset(request: Request, roots: RootsDep, settings: SettingsDep) -> HTMLResponse:
    form = await request.form()
    values = form_values(form)
    if not values.get("output_dir", "").strip():  # the dataset needs none; the config's checks do
        values["output_dir"] = str(roots.paths[0] / "output")
    state, text = schema.check(values, roots.problem)
    data_problems = {k: v for k, v in state.problems.items() if k not in ("output_dir",)}
    if data_problems or state.general or state.config is None:
        return page(request, "dataset.html", report="", subsets=[],
                    problems=[p for ps in (data_problems or state.problems).values() for p in ps] + state.general)
    subsets = await asyncio.to_thread(subset_views, state.config, roots)
    report = await asyncio.to_thread(dataset_check, text, settings.python, roots.cwd)
    return page(request, "dataset.html", report=report, subsets=subsets, problems=[])


@router.post("/caption", response_class=HTMLResponse)
async def caption(request: Request, roots: RootsDep) -> HTMLResponse:
    form = await request.form()
    image = roots.resolve(str(form.get("image", "")))
    extension = str(form.get("extension", ".txt"))
    if image is None:
        return refused(str(form.get("image", "")))
    if image.suffix.lower() not in IMAGE_TYPES or not image.is_file():
        return HTMLResponse('<p class="problem">not an image</p>', status_code=400)
    if not extension.startswith(".") or "/" in extension or "\\" in extension or len(extension) > 16:
        return HTMLResponse('<p class="problem">not a caption extension</p>', status_code=400)
    text = " ".join(str(form.get("caption", "")).split())
    if not text:  # the dataset check rejects an empty caption file
        return HTMLResponse('<span class="problem">not saved: a caption file must not be empty; write a caption, or '
                            "delete the file to train with the folder's class tokens</span>", status_code=400)
    existing = read_caption(image, extension).path
    target = existing or image.with_name(image.stem + folder_extension(list_images(image.parent), extension))
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


def subset_views(config: Config, roots: security.Roots) -> list[dict[str, Any]]:
    """Each subset under the roots: its folder, repeats, image count and the first images with their captions and
    what the dataset check rejects them for."""
    specs = resolve_datasets(config)
    rejected = rejections(scan_datasets(specs).problems, roots)
    subsets = []
    for spec in specs:
        for subset in spec.subsets:
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
                            "count": len(images), "items": items, "pairs": pairs is not None,
                            "control_dir": str(subset.control_directory or ""),
                            "unpaired": [c.name for c in unpaired],
                            "extension": folder_extension(images, subset.caption_extension),
                            "rejected": sum(bool(item["problems"]) for item in items)})
    return subsets


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
