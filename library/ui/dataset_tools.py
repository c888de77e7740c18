"""Dataset tools: a new folder in kohya's layout (`<repeats>_<name>`) from uploaded images, bulk caption edits
(trigger word, prefix, suffix, find and replace) previewed before they are applied, and captions written by a model
the user has on disk (library.ui.captioning). Every folder and file is under the UI's roots."""
from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import unicodedata
import uuid
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import HTMLResponse

from library.core.atomic import fsync_dir, temporary_path
from library.data.images import IMAGE_EXTENSIONS, ImageProblem, inspect_image
from library.data.scan import list_images
from library.ui import captioning, security
from library.ui.web import RootsDep, page

router = APIRouter()
CAPTION_EXTENSIONS = (".txt", ".caption")  # what a folder's captions are guessed to use
UPLOADED_CAPTIONS = (".txt", ".caption")
MAX_REPEATS = 10000
CHUNK = 1 << 20


@router.get("/dataset/tools", response_class=HTMLResponse)
async def tools_page(request: Request, roots: RootsDep, folder: str = "") -> HTMLResponse:
    return page(request, "dataset_tools.html", folder=folder, parent=str(roots.paths[0]), roots=roots.paths,
                default_prompt=captioning.DEFAULT_PROMPT)


def problems_html(problems: list[str], status_code: int = 400, title: str = "") -> HTMLResponse:
    body = "".join(f"<li>{escape(p)}</li>" for p in problems)
    head = f'<p class="problem">{escape(title)}</p>' if title else ""
    return HTMLResponse(f'{head}<ul class="problems">{body}</ul>', status_code=status_code)


# ---------------------------------------------------------------------------------------------- a new folder

def concept_problem(name: str) -> str | None:
    if not name:
        return ("name: give the concept a name (the folder is <repeats>_<name>; kohya reads the name as its class "
                "tokens)")
    if name in (".", "..") or name.startswith(".") or any(c in name for c in "/\\") or \
            any(unicodedata.category(c) == "Cc" for c in name):
        return f"name: {name!r} cannot be a folder name (no / or \\, not starting with a dot)"
    return None


def repeats_problem(repeats: str) -> str | None:
    if not repeats.strip().isdigit() or not 1 <= int(repeats) <= MAX_REPEATS:
        return f"repeats: {repeats.strip() or '(empty)'} is not a whole number from 1 to {MAX_REPEATS}"
    return None


@router.post("/dataset/new", response_class=HTMLResponse)
async def new_dataset(request: Request, roots: RootsDep, parent: Annotated[str, Form()] = "",
                      name: Annotated[str, Form()] = "", repeats: Annotated[str, Form()] = "",
                      files: Annotated[list[UploadFile] | None, File()] = None) -> HTMLResponse:
    """`<parent>/<repeats>_<name>/` holding the uploaded images (and captions named after them), or every problem
    and nothing written."""
    name = name.strip()
    problems = [p for p in (concept_problem(name), repeats_problem(repeats)) if p]
    folder = roots.resolve(parent.strip()) if parent.strip() else None
    if folder is None:
        problems.append(f"folder: {parent or '(empty)'} is outside the folders this UI may use")
    elif not folder.is_dir():
        problems.append(f"folder: {folder} is not a folder")
    uploads = [f for f in files or [] if f.filename]
    if not uploads:
        problems.append("images: choose the images to put in the folder")
    target = folder / f"{repeats.strip()}_{name}" if folder is not None and not problems else None
    if target is not None and target.exists():
        problems.append(f"name: {target} exists already; choose another name, or caption that folder below")
    if problems or target is None:
        return problems_html(problems, title="nothing written")
    staging = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        staging.mkdir()
        problems = await write_uploads(uploads, staging)
        if problems:
            return problems_html(problems, title="nothing written: fix or leave out these files")
        os.rename(staging, target)  # the folder appears whole, or not at all
        fsync_dir(folder)
    except OSError as e:  # a folder that cannot be written, a full disk
        return problems_html([f"folder: {e}"], title="nothing written")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    count = len(list_images(target))
    return HTMLResponse(f'<p class="ok" id="new-dataset-made" data-folder="{escape(str(target))}">made '
                        f'{escape(str(target))} with {count} images. <a href="/dataset/tools?folder='
                        f'{quote(str(target))}">Caption it</a>; a config trains on it with '
                        f'<code>train_data_dir</code> = <code>{escape(str(folder))}</code> (the folder that holds '
                        "it).</p>")


async def write_uploads(uploads: list[UploadFile], staging: Path) -> list[str]:
    """Write each upload into `staging` and check it as the dataset check will; the problems, by file name."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    images: set[str] = set()
    captions: list[Path] = []
    for upload in uploads:
        base = Path(str(upload.filename).replace("\\", "/")).name
        suffix = Path(base).suffix.lower()
        kind = "image" if suffix in IMAGE_EXTENSIONS else "caption" if suffix in UPLOADED_CAPTIONS else None
        if kind is None or base.startswith("."):
            problems.append(f"{base}: not an image ({', '.join(IMAGE_EXTENSIONS)}) nor a caption "
                            f"({', '.join(UPLOADED_CAPTIONS)})")
            continue
        key = (Path(base).stem.lower(), kind)
        if "/".join(key) in seen:
            problems.append(f"{base}: the same name as {seen['/'.join(key)]} (an image and its caption pair by name)")
            continue
        seen["/".join(key)] = base
        path = staging / (Path(base).stem + suffix)  # the trainer reads captions by the lower-case extension
        with open(path, "wb") as out:
            while chunk := await upload.read(CHUNK):
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())  # the folder's rename must not show files still being written
        if kind == "caption":
            captions.append(path)
            continue
        images.add(path.stem)
        try:
            await asyncio.to_thread(inspect_image, path)
        except ImageProblem as e:
            problems.append(f"{base}: {e}")
    for path in captions:
        problem = caption_file_problem(path, images)
        if problem:
            problems.append(f"{path.name}: {problem}")
    return problems


def caption_file_problem(path: Path, image_stems: set[str]) -> str | None:
    """Why an uploaded caption file cannot go in the folder (as the dataset check would say), or None."""
    if path.stem not in image_stems:
        return "a caption without an image of the same name"
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        return "caption is not UTF-8 text; re-save it as UTF-8"
    if not text.strip():
        return "caption file is empty"
    return None


# ------------------------------------------------------------------------------------------- bulk caption edits

@dataclass(frozen=True)
class Edits:
    trigger: str = ""
    old_trigger: str = ""
    prefix: str = ""
    suffix: str = ""
    find: str = ""
    replace: str = ""
    fill: bool = False  # images without a caption get one: the trigger word, prefix and suffix

    def any(self) -> bool:
        return any((self.trigger, self.prefix, self.suffix, self.find))


@dataclass
class Plan:
    changes: list[tuple[Path, str, str]] = field(default_factory=list)  # caption file, before, after
    problems: list[str] = field(default_factory=list)
    uncaptioned: list[str] = field(default_factory=list)
    extension: str = ".txt"

    def digest(self) -> str:
        """What the preview showed, so that an apply after the captions changed is refused."""
        text = "\x00".join(f"{p}\x01{b}\x01{a}" for p, b, a in self.changes)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def word(text: str) -> re.Pattern[str]:
    return re.compile(r"(?<![\w])" + re.escape(text) + r"(?![\w])")


def tidy(line: str) -> str:
    """One space between words, no empty comma-separated item (left where an edit removed a tag)."""
    line = " ".join(line.split())
    line = re.sub(r"\s*,(\s*,)+", ",", line)
    return re.sub(r"\s+,", ",", line).strip(" ,")


def join(*parts: str) -> str:
    return ", ".join(p.strip(" ,") for p in parts if p.strip(" ,"))


def edit_line(line: str, edits: Edits) -> str:
    """One caption line after the edits: find and replace, the old trigger word replaced by the new one, the
    trigger word added in front where it is missing, the prefix and suffix added where they are missing."""
    before = line
    if edits.find:
        line = line.replace(edits.find, edits.replace)
    trigger = edits.trigger.strip()
    if trigger and edits.old_trigger.strip():
        line = word(edits.old_trigger.strip()).sub(trigger, line)
    if trigger and not word(trigger).search(line):
        line = join(trigger, line)
    prefix, suffix = edits.prefix.strip(" ,"), edits.suffix.strip(" ,")
    if prefix and not line.startswith(prefix):
        line = join(prefix, line)
    if suffix and not line.endswith(suffix):
        line = join(line, suffix)
    return line if line == before else tidy(line)


def caption_extension(images: list[Path], given: str = "") -> str:
    """The extension asked for, else the one most of the folder's captions use, else .txt."""
    if given.strip():
        return given.strip() if given.strip().startswith(".") else "." + given.strip()
    counts = {e: sum(i.with_name(i.stem + e).is_file() for i in images) for e in CAPTION_EXTENSIONS}
    best = max(counts, key=lambda e: counts[e])
    return best if counts[best] else ".txt"


def extension_problem(extension: str) -> str | None:
    if "/" in extension or "\\" in extension or len(extension) > 16 or extension in IMAGE_EXTENSIONS:
        return f"caption extension: {extension!r} is not a caption extension (.txt, .caption ...)"
    return None


def plan_edits(folder: Path, edits: Edits, extension: str = "") -> Plan:
    images = list_images(folder)
    plan = Plan(extension=caption_extension(images, extension))
    for image in images:
        path = image.with_name(image.stem + plan.extension)
        if not path.is_file():
            new = edit_line("", edits) if edits.fill else ""
            if new:
                plan.changes.append((path, "", new))
            else:
                plan.uncaptioned.append(image.name)
            continue
        try:
            before = path.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError:
            plan.problems.append(f"{path.name}: caption is not UTF-8 text; re-save it as UTF-8")
            continue
        lines = [line.strip() for line in before.splitlines() if line.strip()]
        after = "\n".join(edit_line(line, edits) for line in lines)
        if not after.strip() or any(not line for line in after.split("\n")):
            plan.problems.append(f"{path.name}: the edits would leave it empty ({before.strip()!r})")
        elif after != before.strip():
            plan.changes.append((path, before.strip(), after))
    return plan


def apply_plan(plan: Plan) -> None:
    """Every changed caption written beside its name first, then all renamed: a failure while writing leaves every
    caption as it was."""
    written: list[tuple[Path, Path]] = []
    try:
        for path, _, after in plan.changes:
            tmp = temporary_path(path)
            written.append((tmp, path))
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(after + "\n")
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, path in written:
        os.replace(tmp, path)
    if written:
        fsync_dir(written[0][1].parent)


async def edits_request(request: Request, roots: security.Roots) -> tuple[Path | None, Edits, str, list[str]]:
    form = await request.form()
    value = {k: str(v) for k, v in form.items()}
    edits = Edits(trigger=value.get("trigger", ""), old_trigger=value.get("old_trigger", ""),
                  prefix=value.get("prefix", ""), suffix=value.get("suffix", ""), find=value.get("find", ""),
                  replace=value.get("replace", ""), fill=value.get("fill") == "on")
    folder, problems = folder_of(value.get("folder", ""), roots)
    extension = value.get("extension", "")
    if extension.strip() and (problem := extension_problem(caption_extension([], extension))):
        problems.append(problem)
    if not edits.any():
        problems.append("nothing to do: give a trigger word, a prefix, a suffix or a text to find")
    if edits.old_trigger.strip() and not edits.trigger.strip():
        problems.append("trigger word: give the word that replaces the old one")
    return folder, edits, extension, problems


def folder_of(given: str, roots: security.Roots) -> tuple[Path | None, list[str]]:
    folder = roots.resolve(given.strip()) if given.strip() else None
    if folder is None:
        return None, [f"folder: {given.strip() or '(empty)'} is outside the folders this UI may use"]
    if not folder.is_dir():
        return None, [f"folder: {folder} is not a folder"]
    return folder, []


@router.post("/dataset/captions/preview", response_class=HTMLResponse)
async def preview(request: Request, roots: RootsDep) -> HTMLResponse:
    folder, edits, extension, problems = await edits_request(request, roots)
    if problems or folder is None:
        return problems_html(problems)
    plan = await asyncio.to_thread(plan_edits, folder, edits, extension)
    return page(request, "caption_preview.html", plan=plan, folder=folder, edits=edits, extension=extension)


@router.post("/dataset/captions/apply", response_class=HTMLResponse)
async def apply(request: Request, roots: RootsDep) -> HTMLResponse:
    form = await request.form()
    folder, edits, extension, problems = await edits_request(request, roots)
    if problems or folder is None:
        return problems_html(problems)
    plan = await asyncio.to_thread(plan_edits, folder, edits, extension)
    if plan.problems:
        return problems_html(plan.problems, title="nothing written")
    if plan.digest() != str(form.get("digest", "")):
        return problems_html(["the captions changed since the preview: preview again"], status_code=409)
    await asyncio.to_thread(apply_plan, plan)
    return HTMLResponse(f'<p class="ok" id="captions-applied">wrote {len(plan.changes)} caption(s) '
                        f"({escape(plan.extension)}) in {escape(str(folder))}</p>")


# ------------------------------------------------------------------------------------------ model captioning

@router.post("/dataset/captions/model", response_class=HTMLResponse)
async def caption_with_model(request: Request, roots: RootsDep) -> HTMLResponse:
    form = {k: str(v) for k, v in (await request.form()).items()}
    folder, problems = folder_of(form.get("folder", ""), roots)
    model = roots.resolve(form.get("model", "").strip()) if form.get("model", "").strip() else None
    if model is None:
        problems.append(f"model: {form.get('model', '').strip() or '(empty)'} is outside the folders this UI may "
                        "use")
    try:
        threshold = float(form.get("threshold", "") or 0.35)
        if not 0 < threshold < 1:
            raise ValueError
    except ValueError:
        problems.append(f"threshold: {form.get('threshold')} is not a number between 0 and 1")
        threshold = 0.35
    extension = form.get("extension", "")
    if extension.strip() and (problem := extension_problem(caption_extension([], extension))):
        problems.append(problem)
    if model is not None:
        try:
            captioning.model_kind(model)
        except captioning.CaptionerProblem as e:
            problems.append(f"model: {e}")
    if problems or folder is None or model is None:
        return problems_html(problems)
    images = list_images(folder)
    if not images:
        return problems_html([f"folder: {folder} holds no images"])
    chosen = caption_extension(images, extension)

    def run() -> captioning.Outcome:
        captioner = captioning.load(model, form.get("prompt", ""), threshold)
        return captioning.caption_folder(images, chosen, captioner, overwrite=form.get("overwrite") == "on",
                                         prefix=form.get("trigger", ""))

    try:
        outcome = await asyncio.to_thread(run)
    except captioning.CaptionerProblem as e:
        return problems_html([f"model: {e}"])
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:  # a folder transformers cannot read, or
        # one too large for the memory
        return problems_html([f"model: {model} could not be loaded: {e}"])
    return page(request, "caption_model_result.html", outcome=outcome, extension=chosen, folder=folder)
