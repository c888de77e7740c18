"""The dataset view: the trainer's own --dataset_check report, thumbnails with their captions, and caption edits."""
from __future__ import annotations

import asyncio
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from library.config import Config, parse_config
from library.core.atomic import write_atomically
from library.data.captions import read_caption
from library.data.dataset_config import resolve_datasets
from library.data.scan import list_images
from library.ui import schema, security
from library.ui.runs import TRAINER
from library.ui.web import RootsDep, SettingsDep, form_values, page, refused

THUMBNAILS_PER_SUBSET = 60
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
               ".bmp": "image/bmp", ".gif": "image/gif"}

router = APIRouter()


@router.post("/dataset", response_class=HTMLResponse)
async def dataset(request: Request, roots: RootsDep, settings: SettingsDep) -> HTMLResponse:
    form = await request.form()
    state, text = schema.check(form_values(form), roots.problem)
    data_problems = {k: v for k, v in state.problems.items() if k not in ("output_dir",)}
    if data_problems or state.general:
        return page(request, "dataset.html", report="", subsets=[],
                    problems=[p for ps in data_problems.values() for p in ps] + state.general)
    subsets = subset_views(config_from(text), roots)
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
    existing = read_caption(image, extension).path
    target = existing if existing is not None else image.with_name(image.stem + extension)
    if roots.resolve(target) is None:
        return refused(str(target))
    text = " ".join(str(form.get("caption", "")).split())
    write_atomically(target, lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"))
    return HTMLResponse(f'<span class="ok">saved {target.name}</span>')


def subset_views(config: Config, roots: security.Roots) -> list[dict[str, Any]]:
    """Each subset under the roots: its folder, repeats, image count and the first images with their captions."""
    subsets = []
    for spec in resolve_datasets(config):
        for subset in spec.subsets:
            directory = roots.resolve(subset.image_dir)
            if directory is None:
                continue
            images = list_images(directory)
            items = []
            for image in images[:THUMBNAILS_PER_SUBSET]:
                found = read_caption(image, subset.caption_extension)
                items.append({"path": str(image), "caption": found.text or "", "problem": found.problem or ""})
            subsets.append({"dir": str(directory), "repeats": subset.num_repeats, "is_reg": subset.is_reg,
                            "count": len(images), "items": items, "extension": subset.caption_extension})
    return subsets


def config_from(text: str) -> Config:
    with tempfile.TemporaryDirectory(prefix="lora-ui-") as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(text, encoding="utf-8")
        config, _ = parse_config(["--config", str(path)])
    return config


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
