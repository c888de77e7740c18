"""The web app: config editor, dataset view, runs. HTML from Jinja2 templates, HTMX for the form, server-sent
events for a run's live view. No endpoint takes a command line; paths are checked against the roots."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.datastructures import FormData

from library.config import Config, ConfigError, parse_config
from library.config.options import GROUPS
from library.core.atomic import write_atomically
from library.data.captions import read_caption
from library.data.dataset_config import resolve_datasets
from library.data.scan import list_images
from library.monitoring.events import EVENTS_FILE
from library.ui import schema, security
from library.ui.runs import TRAINER, RunManager

HERE = Path(__file__).resolve().parent
STATE_OPTION = "save_state_on_preemption"  # runs started here save a state when stopped, unless told otherwise
THUMBNAILS_PER_SUBSET = 60
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
               ".bmp": "image/bmp", ".gif": "image/gif"}


@dataclass
class Settings:
    roots: list[Path]
    cwd: Path
    host: str = "127.0.0.1"
    port: int = 7860
    token: str | None = None  # required on a non-loopback bind
    python: str = sys.executable


def create_app(settings: Settings) -> FastAPI:
    app = FastAPI(title="lora-trainer", docs_url=None, redoc_url=None, openapi_url=None)
    roots = security.Roots(settings.roots, settings.cwd)
    manager = RunManager(roots.paths, python=settings.python, cwd=roots.cwd)
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    app.state.manager = manager
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if not security.host_allowed(request.headers.get("host"), settings.host, settings.port):
            return Response("unknown host", status_code=400)
        if settings.token is not None and request.url.path not in ("/login",) and not \
                request.url.path.startswith("/static/") and \
                not security.cookie_matches(request.cookies.get(security.COOKIE), settings.token):
            if request.method == "GET" and request.url.path == "/":
                return RedirectResponse("/login", status_code=303)
            return Response("log in first: /login", status_code=401)
        if request.method not in ("GET", "HEAD") and not security.origin_allowed(
                request.headers.get("origin"), request.headers.get("host")):
            return Response("cross-origin request refused", status_code=403)
        response = await call_next(request)
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Content-Security-Policy"] = ("default-src 'self'; img-src 'self' data:; "
                                                       "style-src 'self' 'unsafe-inline'")
        response.headers["Referrer-Policy"] = "no-referrer"
        return response

    def page(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
        return templates.TemplateResponse(request, name, context, status_code=status_code)

    def form_page(request: Request, state: schema.FormState, message: str = "", status_code: int = 200,
                  config_path: str = "") -> HTMLResponse:
        return page(request, "form.html", status_code, state=state, groups=schema.fields_by_group(),
                    group_titles=GROUPS, families=schema.families(), message=message, config_path=config_path,
                    command_line_only=schema.COMMAND_LINE_ONLY)

    def form_values(form: FormData) -> dict[str, str]:
        return {k: str(v) for k, v in form.items() if not k.startswith("_")}

    def refused(what: str) -> HTMLResponse:
        return HTMLResponse(f'<p class="problem">{what} is outside the folders this UI may use</p>',
                            status_code=403)

    # --- pages -------------------------------------------------------------------------------------------------
    @app.get("/", response_class=HTMLResponse)
    async def index(request: Request) -> HTMLResponse:
        return page(request, "index.html", state=schema.FormState(), groups=schema.fields_by_group(),
                    group_titles=GROUPS, families=schema.families(), message="", config_path="",
                    command_line_only=schema.COMMAND_LINE_ONLY, roots=roots.paths, cwd=roots.cwd)

    @app.get("/login", response_class=HTMLResponse)
    async def login_page(request: Request) -> HTMLResponse:
        return page(request, "login.html", error="")

    @app.post("/login")
    async def login(request: Request) -> Response:
        if settings.token is None:
            return RedirectResponse("/", status_code=303)
        form = await request.form()
        if not security.token_matches(str(form.get("token", "")), settings.token):
            return page(request, "login.html", status_code=401, error="wrong token")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(security.COOKIE, security.session_value(settings.token), httponly=True,
                            samesite="strict", secure=False, path="/")
        return response

    # --- config editor -----------------------------------------------------------------------------------------
    @app.get("/config/load", response_class=HTMLResponse)
    async def load_config(request: Request, path: str = Query(alias="_config_path")) -> HTMLResponse:
        real = roots.resolve(path)
        if real is None:
            return refused(path)
        if not real.is_file():
            return form_page(request, schema.FormState(general=[f"{path}: no such file"]), status_code=404)
        state = schema.file_problems(real, roots.problem)
        count = len({p for ps in state.problems.values() for p in ps}) + len(state.general)
        message = f"loaded {path}" + ("" if state.ok else f": {count} problem(s)")
        return form_page(request, state, message, config_path=path)

    @app.post("/config/validate", response_class=HTMLResponse)
    async def validate(request: Request) -> HTMLResponse:
        form = await request.form()
        state, _ = schema.check(form_values(form), roots.problem)
        return form_page(request, state, "no problems found" if state.ok else "problems found",
                         config_path=str(form.get("_config_path", "")))

    @app.post("/config/save", response_class=HTMLResponse)
    async def save(request: Request) -> HTMLResponse:
        form = await request.form()
        target = str(form.get("_config_path", "")).strip()
        state, text = schema.check(form_values(form), roots.problem)
        real = roots.resolve(target) if target else None
        if real is None or real.suffix != ".toml":
            state.general.append(f"save as: {target or '(empty)'}: give a .toml path under the UI's folders")
            return form_page(request, state, "not saved", 400, config_path=target)
        if not state.ok:
            return form_page(request, state, "not saved: fix the problems first", 400, config_path=target)
        real.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(real, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        return form_page(request, state, f"saved {target}", config_path=target)

    # --- dataset -----------------------------------------------------------------------------------------------
    @app.post("/dataset", response_class=HTMLResponse)
    async def dataset(request: Request) -> HTMLResponse:
        form = await request.form()
        state, text = schema.check(form_values(form), roots.problem)
        data_problems = {k: v for k, v in state.problems.items() if k not in ("output_dir",)}
        if data_problems or state.general:
            return page(request, "dataset.html", report="", subsets=[],
                        problems=[p for ps in data_problems.values() for p in ps] + state.general)
        config = _config_from(text)
        subsets = []
        for spec in resolve_datasets(config):
            for subset in spec.subsets:
                directory = roots.resolve(subset.image_dir)
                if directory is None:
                    continue
                images = list_images(directory)
                items = []
                for image in images[:THUMBNAILS_PER_SUBSET]:
                    caption = read_caption(image, subset.caption_extension)
                    items.append({"path": str(image), "caption": caption.text or "",
                                  "problem": caption.problem or ""})
                subsets.append({"dir": str(directory), "repeats": subset.num_repeats, "is_reg": subset.is_reg,
                                "count": len(images), "items": items, "extension": subset.caption_extension})
        report = await asyncio.to_thread(_dataset_check, text, settings.python, roots.cwd)
        return page(request, "dataset.html", report=report, subsets=subsets, problems=[])

    @app.post("/caption", response_class=HTMLResponse)
    async def caption(request: Request) -> HTMLResponse:
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

    @app.get("/files")
    async def files(path: str) -> Response:
        real = roots.resolve(path)
        if real is None:
            return Response("outside the UI's folders", status_code=403)
        if real.suffix.lower() not in IMAGE_TYPES or not real.is_file():
            return Response("not an image", status_code=404)
        return FileResponse(real, media_type=IMAGE_TYPES[real.suffix.lower()])

    @app.get("/lora")
    async def lora(path: str) -> Response:
        real = roots.resolve(path)
        if real is None:
            return JSONResponse({"error": "outside the UI's folders"}, status_code=403)
        if real.suffix != ".safetensors" or not real.is_file():
            return JSONResponse({"error": "not a .safetensors file"}, status_code=404)
        return JSONResponse({"path": str(real), "bytes": real.stat().st_size, "metadata": _metadata(real)})

    # --- runs --------------------------------------------------------------------------------------------------
    @app.post("/runs/start", response_class=HTMLResponse)
    async def start(request: Request) -> HTMLResponse:
        form = await request.form()
        values = form_values(form)
        if not values.get(STATE_OPTION, "").strip():
            values[STATE_OPTION] = "true"
        state, text = schema.check(values, roots.problem)
        output_dir = roots.resolve(values.get("output_dir", "")) if values.get("output_dir") else None
        if output_dir is None and "output_dir" not in state.problems:
            state.problems["output_dir"] = ["output_dir is required to start a run here: the run's folder"]
        elif output_dir is not None and output_dir.is_dir() and manager.status(output_dir).status in (
                "queued", "running"):
            state.problems.setdefault("output_dir", []).append(
                f"output_dir: {values['output_dir']} is in use by a run that is queued or running; stop it or "
                "choose another folder")
        if not state.ok:
            return form_page(request, state, "not started: fix the problems first", 400,
                             config_path=str(form.get("_config_path", "")))
        manager.submit(output_dir, text)
        response = form_page(request, state, f"queued a run in {values['output_dir']}",
                             config_path=str(form.get("_config_path", "")))
        response.headers["HX-Trigger"] = "runs-changed"
        return response

    def run_dir(path: str) -> Path | None:
        real = roots.resolve(path)
        return real if real is not None and real.is_dir() else None

    @app.get("/runs", response_class=HTMLResponse)
    async def runs(request: Request) -> HTMLResponse:
        statuses = await asyncio.to_thread(manager.all_runs)
        return page(request, "runs.html", runs=[s.as_dict() for s in statuses])

    @app.get("/runs/status")
    async def run_state(path: str) -> JSONResponse:
        directory = run_dir(path)
        if directory is None:
            return JSONResponse({"error": "not a run folder under the UI's folders"}, status_code=404)
        return JSONResponse(manager.status(directory).as_dict())

    @app.get("/runs/view", response_class=HTMLResponse)
    async def view(request: Request, path: str) -> HTMLResponse:
        directory = run_dir(path)
        if directory is None:
            return HTMLResponse("not a run folder under the UI's folders", status_code=404)
        return page(request, "run.html", run=manager.status(directory).as_dict())

    @app.post("/runs/stop", response_class=HTMLResponse)
    async def stop(request: Request) -> HTMLResponse:
        form = await request.form()
        directory = run_dir(str(form.get("path", "")))
        if directory is None:
            return HTMLResponse("not a run folder under the UI's folders", status_code=404)
        return HTMLResponse(f'<span class="ok">{manager.stop(directory)}</span>',
                            headers={"HX-Trigger": "runs-changed"})

    @app.post("/runs/resume", response_class=HTMLResponse)
    async def resume(request: Request) -> HTMLResponse:
        form = await request.form()
        directory = run_dir(str(form.get("path", "")))
        if directory is None:
            return HTMLResponse("not a run folder under the UI's folders", status_code=404)
        status = manager.status(directory)
        if not status.can_resume:
            return HTMLResponse('<span class="problem">nothing to resume: the run has no saved state, is still '
                                'running, or was not started here</span>', status_code=409)
        manager.submit(directory, "", resume=True)
        return HTMLResponse('<span class="ok">resume queued</span>', headers={"HX-Trigger": "runs-changed"})

    @app.get("/runs/events")
    async def events(request: Request, path: str) -> Response:
        directory = run_dir(path)
        if directory is None:
            return Response("not a run folder under the UI's folders", status_code=404)
        return StreamingResponse(_follow(request, directory, manager), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    return app


async def _follow(request: Request, directory: Path, manager: RunManager, interval: float = 0.5):
    """Server-sent events: every line of the event stream as `event`, then the run's status (with its log tail)
    every second; ends once the run is no longer queued or running and everything was sent."""
    offset = 0
    last_status = None
    ticks = 0
    while True:
        try:
            with open(directory / EVENTS_FILE, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        complete = chunk[:chunk.rfind(b"\n") + 1]
        offset += len(complete)
        for line in complete.decode("utf-8", errors="replace").splitlines():
            if line.strip():
                yield f"event: run\ndata: {line}\n\n"
        status = manager.status(directory).as_dict()
        text = json.dumps(status)
        if text != last_status or ticks % 10 == 0:
            yield f"event: status\ndata: {text}\n\n"
            last_status = text
        if status["status"] not in ("queued", "running"):
            yield "event: done\ndata: {}\n\n"
            return
        if await request.is_disconnected():
            return
        ticks += 1
        await asyncio.sleep(interval)


def _config_from(text: str) -> Config:
    with tempfile.TemporaryDirectory(prefix="lora-ui-") as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(text, encoding="utf-8")
        config, _ = parse_config(["--config", str(path)])
    return config


def _dataset_check(text: str, python: str, cwd: Path) -> str:
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


def _metadata(path: Path) -> dict[str, str]:
    """The safetensors header's __metadata__ (ss_* and modelspec.*), read without loading any tensor."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size > 100 * 2**20:
                return {}
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return {}
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    return {k: v for k, v in metadata.items() if isinstance(v, str) and len(v) < 4000}


__all__ = ["ConfigError", "Settings", "create_app"]
