"""Runs in the browser: start one from the editor's form, list them, a run's page and its live event stream
(server-sent events), stop and resume. The runs themselves are library.ui.runs' (trainer processes)."""
from __future__ import annotations

import asyncio
import html
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.datastructures import FormData

from library.core.atomic import write_atomically
from library.monitoring.events import EVENTS_FILE, read_events
from library.ui import preflight, schema, security
from library.ui.run_status import PROMPTS_FILE, RunStatus, run_status
from library.ui.runs import REQUESTS, RunManager
from library.ui.web import ManagerDep, RootsDep, form_page, form_values, page

STATE_OPTION = "save_state_on_preemption"  # runs started here save a state when stopped, unless told otherwise
NOT_A_RUN = "not a run folder under the UI's folders"

router = APIRouter(prefix="/runs")


def run_dir(roots: security.Roots, path: str) -> Path | None:
    real = roots.resolve(path)
    return real if real is not None and real.is_dir() else None


async def posted_run_dir(request: Request, roots: security.Roots) -> tuple[FormData, Path | None]:
    """The posted form and the run folder it names as `path`, or None when that is not one."""
    form = await request.form()
    return form, run_dir(roots, str(form.get("path", "")))


NOT_TAKEN_UP = ("queued on disk, but not in this UI's queue (another UI's, or queued after this one started): a UI "
                "takes up the queued runs under its folders when it starts")


def status_view(manager: RunManager, directory: Path, status: RunStatus | None = None) -> dict[str, Any]:
    """A run's status (`status`, else read now) for the pages, with whether this UI can stop it: a running run, or
    one this UI holds. A run queued on disk that this UI never took up says so; this UI can neither start nor stop
    it."""
    job, queued = manager.job_for(directory)
    if status is None:
        status = run_status(directory, job.process if job is not None else None, queued)
    held = queued or job is not None
    view = status.as_dict()
    view["stoppable"] = view["status"] == "running" or held
    if view["status"] == "queued" and not held:
        view["message"] = NOT_TAKEN_UP
    return view


@router.post("/start", response_class=HTMLResponse)
async def start(request: Request, roots: RootsDep, manager: ManagerDep) -> HTMLResponse:
    form = await request.form()
    values = form_values(form)
    if not values.get(STATE_OPTION, "").strip():
        values[STATE_OPTION] = "true"
    output_dir = roots.resolve(values.get("output_dir", "")) if values.get("output_dir") else None
    prompts_file = output_dir / PROMPTS_FILE if output_dir is not None else None
    state, text = schema.check(values, roots.problem, str(form.get("_prompts", "")), str(prompts_file or ""))
    await asyncio.to_thread(preflight.look_ahead, state, values, roots, output=False)
    offer = output_problems(state, values, output_dir, roots, manager, form.get("_overwrite") == "yes")
    config_path = str(form.get("_config_path", ""))
    if not state.ok or output_dir is None or prompts_file is None:
        return form_page(request, state, "not started: fix the problems first", 400, config_path, form,
                         new_folder=offer)
    if state.prompts:
        output_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(prompts_file, lambda tmp: tmp.write_text(state.prompts, encoding="utf-8"))
    manager.submit(output_dir, text)
    response = form_page(request, state, f"queued a run in {values['output_dir']}", config_path=config_path,
                         form=form)
    response.headers["HX-Trigger"] = "runs-changed"
    return response


def output_problems(state: schema.FormState, values: dict[str, str], output_dir: Path | None,
                    roots: security.Roots, manager: RunManager, overwrite: bool) -> str:
    """The run's folder: required, not in use, and holding no earlier work unless the user said to overwrite it.
    Returns the new folder offered instead of earlier work ("" when there is none)."""
    if output_dir is None:
        if "output_dir" not in state.problems:
            state.problems["output_dir"] = ["output_dir is required to start a run here: the run's folder"]
        return ""
    typed = values["output_dir"]
    if output_dir.is_dir() and manager.status(output_dir).status in ("queued", "running"):
        state.problems.setdefault("output_dir", []).append(
            f"output_dir: {typed} is in use by a run that is queued or running; stop it or choose another folder")
        return ""
    earlier = None if overwrite else preflight.earlier_work(output_dir, values.get("output_name"))
    if earlier is None:
        return ""
    state.problems.setdefault("output_dir", []).append(f"output_dir: {typed} {earlier}")
    return preflight.new_folder(typed, lambda path: (real := roots.resolve(path)) is not None and real.exists())


@router.get("", response_class=HTMLResponse)
async def runs(request: Request, manager: ManagerDep) -> HTMLResponse:
    statuses = await asyncio.to_thread(lambda: [status_view(manager, s.run_dir, s) for s in manager.all_runs()])
    return page(request, "runs.html", runs=statuses)


@router.get("/status")
async def run_state(path: str, roots: RootsDep, manager: ManagerDep) -> JSONResponse:
    directory = run_dir(roots, path)
    if directory is None:
        return JSONResponse({"error": NOT_A_RUN}, status_code=404)
    return JSONResponse(status_view(manager, directory))


@router.get("/view", response_class=HTMLResponse)
async def view(request: Request, path: str, roots: RootsDep, manager: ManagerDep) -> HTMLResponse:
    directory = run_dir(roots, path)
    if directory is None:
        return HTMLResponse(NOT_A_RUN, status_code=404)
    return page(request, "run.html", run=status_view(manager, directory))


@router.post("/stop", response_class=HTMLResponse)
async def stop(request: Request, roots: RootsDep, manager: ManagerDep) -> HTMLResponse:
    _, directory = await posted_run_dir(request, roots)
    if directory is None:
        return HTMLResponse(NOT_A_RUN, status_code=404)
    return HTMLResponse(f'<span class="ok">{manager.stop(directory)}</span>', headers={"HX-Trigger": "runs-changed"})


@router.post("/resume", response_class=HTMLResponse)
async def resume(request: Request, roots: RootsDep, manager: ManagerDep) -> HTMLResponse:
    form, directory = await posted_run_dir(request, roots)
    if directory is None:
        return HTMLResponse(NOT_A_RUN, status_code=404)
    status = manager.status(directory)
    if not status.can_resume:
        return HTMLResponse('<span class="problem">nothing to resume: the run has no saved state, is still '
                            'running, or was not started here</span>', status_code=409)
    if status.status == "finished" and form.get("confirm") != "overwrite":
        return page(request, "resume_finished.html", status_code=409, run=status.as_dict(),
                    state=latest_state(directory), lora=preflight.finished_lora(directory, status.output_name),
                    new_folder=preflight.new_folder(str(directory), lambda path: Path(path).exists()))
    manager.submit(directory, "", resume=True)
    return HTMLResponse('<span class="ok">resume queued</span>', headers={"HX-Trigger": "runs-changed"})


@router.post("/request", response_class=HTMLResponse)
async def request_now(request: Request, roots: RootsDep, manager: ManagerDep) -> HTMLResponse:
    """Sample now / Save now: the running trainer does it after its current step."""
    form, directory = await posted_run_dir(request, roots)
    what = str(form.get("what", ""))
    if directory is None or what not in REQUESTS:
        return HTMLResponse(NOT_A_RUN if directory is None else "ask for sample or save", status_code=404)
    done, message = manager.request(directory, what)
    return HTMLResponse(f'<span class="{"ok" if done else "problem"}">{html.escape(message)}</span>',
                        status_code=200 if done else 409, headers={"HX-Trigger": "runs-changed"} if done else {})


@router.post("/delete", response_class=HTMLResponse)
async def delete(request: Request, roots: RootsDep, manager: ManagerDep) -> HTMLResponse:
    """Delete a run's files, after a question naming them; never those of a queued or running run."""
    form, directory = await posted_run_dir(request, roots)
    if directory is None:
        return HTMLResponse(NOT_A_RUN, status_code=404)
    deleted, message, files = await asyncio.to_thread(manager.delete, directory, form.get("confirm") == "yes")
    if deleted:
        return HTMLResponse(f'<span class="ok" id="deleted">{html.escape(message)}</span>',
                            headers={"HX-Trigger": "runs-changed"})
    if message:
        return HTMLResponse(f'<span class="problem">{html.escape(message)}</span>', status_code=409)
    return page(request, "delete_run.html", status_code=409, run=manager.status(directory).as_dict(),
                files=[str(path.relative_to(directory)) for path in files])


def latest_state(directory: Path) -> dict[str, Any] | None:
    """The newest training state the run saved (its "state" events over every attempt), which --resume latest
    picks up."""
    return next((e for e in reversed(list(read_events(directory / EVENTS_FILE))) if e["event"] == "state"), None)


@router.get("/events")
async def events(request: Request, path: str, roots: RootsDep, manager: ManagerDep) -> Response:
    directory = run_dir(roots, path)
    if directory is None:
        return Response(NOT_A_RUN, status_code=404)
    return StreamingResponse(follow(request, directory, manager), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store"})


def new_lines(directory: Path, offset: int) -> tuple[list[str], int]:
    """The event stream's complete lines after `offset`, and the offset after them."""
    try:
        with open(directory / EVENTS_FILE, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        chunk = b""
    complete = chunk[:chunk.rfind(b"\n") + 1]
    lines = complete.decode("utf-8", errors="replace").splitlines()
    return [line for line in lines if line.strip()], offset + len(complete)


async def follow(request: Request, directory: Path, manager: RunManager,
                 interval: float = 0.5) -> AsyncIterator[str]:
    """Server-sent events: every line of the event stream as `run`, then the run's status (with its log tail)
    when it changes and every few seconds; ends once the run is no longer queued or running and all was sent."""
    offset = 0
    last_status = None
    ticks = 0
    while True:
        lines, offset = new_lines(directory, offset)
        for line in lines:
            yield f"event: run\ndata: {line}\n\n"
        status = status_view(manager, directory)
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
