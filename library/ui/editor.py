"""The config editor: load a TOML file into the form, check the form with the command line's checks, save it."""
from __future__ import annotations

import asyncio
import html
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse

from library.core.atomic import write_atomically
from library.ui import examples, preflight, schema
from library.ui.model_family import model_family
from library.ui.web import MODEL_OPTION, RootsDep, form_page, form_values

router = APIRouter(prefix="/config")


def beside_the_box(problem: str, status_code: int) -> HTMLResponse:
    """A file that cannot be loaded: its problem beside the TOML box; the form and its edits stay."""
    return HTMLResponse(f'<span class="problem">{html.escape(problem)}</span>', status_code=status_code,
                        headers={"HX-Retarget": "#config-path-problem", "HX-Reswap": "innerHTML"})


@router.get("/load", response_class=HTMLResponse)
async def load_config(request: Request, roots: RootsDep, path: str = Query("", alias="_config_path")) -> HTMLResponse:
    path = path.strip()
    if not path:
        return beside_the_box("type the path of a .toml file to load", 400)
    real = roots.resolve(path)
    if real is None:
        return beside_the_box(roots.problem("load", path) or "", 403)
    if not real.is_file():
        return beside_the_box(f"{path}: no such file", 404)
    state = schema.file_problems(real, roots.problem)
    if state.unreadable:
        return beside_the_box(f"{path}: " + "; ".join(state.general), 400)
    count = len({p for ps in state.problems.values() for p in ps}) + len(state.general)
    message = f"loaded {path}" + ("" if state.ok else f": {count} problem(s)")
    return form_page(request, state, message, config_path=path)


@router.get("/example", response_class=HTMLResponse)
async def example(request: Request, roots: RootsDep, name: str = Query("", alias="_example")) -> HTMLResponse:
    """A new config from a shipped example: its values in the form, saved nowhere until Save names a file."""
    path = examples.example_path(name)
    if path is None:
        return beside_the_box(f"{name or '(none)'}: not one of the shipped examples", 404)
    state = schema.file_problems(path, roots.problem)
    # Its family is the entry's that names it, even while its model path is still a placeholder.
    picked = {"_family": examples.example_family(name), "_family_model": state.values.get(MODEL_OPTION, "")}
    return form_page(request, state, f"new from {name}: {examples.description(path)} Set its paths, check it, then "
                                     "save it under a name of yours or start it", form=picked)


@router.get("/family")
async def family(roots: RootsDep, model: str = "") -> JSONResponse:
    """The family of a model folder or file under the roots, as the trainer's registry tells it, and that family's
    recommended settings (from its example config)."""
    real = roots.resolve(model.strip()) if model.strip() else None
    name = model_family(real) if real is not None else None
    config, defaults = examples.family_defaults(name) if name else ("", {})
    return JSONResponse({"family": name, "config": config, "defaults": defaults,
                         "required": preflight.required_fields(real)})


@router.post("/validate", response_class=HTMLResponse)
async def validate(request: Request, roots: RootsDep) -> HTMLResponse:
    form = await request.form()
    values = form_values(form)
    state, _ = schema.check(values, roots.problem, str(form.get("_prompts", "")))
    await asyncio.to_thread(preflight.look_ahead, state, values, roots)
    problems = sum(len(ps) for ps in state.problems.values()) + len(state.general)
    return form_page(request, state, "no problems found" if state.ok else f"{problems} problem(s) found:",
                     config_path=str(form.get("_config_path", "")), form=form)


@router.post("/save", response_class=HTMLResponse)
async def save(request: Request, roots: RootsDep) -> HTMLResponse:
    form = await request.form()
    target = str(form.get("_config_path", "")).strip()
    real = roots.resolve(target) if target else None
    # Prompts typed in the form go to a prompt file beside the config, which names it.
    prompts_file = str(Path(target).with_name(Path(target).stem + "_prompts.txt")) if target else ""
    state, text = schema.check(form_values(form), roots.problem, str(form.get("_prompts", "")), prompts_file)
    if real is None or real.suffix != ".toml":
        state.general.append(f"save as: {target or '(empty)'}: give a .toml path under the UI's folders")
        return form_page(request, state, "not saved", 400, config_path=target, form=form)
    if not state.ok:
        return form_page(request, state, "not saved: fix the problems first", 400, config_path=target, form=form)
    real.parent.mkdir(parents=True, exist_ok=True)
    if state.prompts:
        prompts = real.with_name(real.stem + "_prompts.txt")
        write_atomically(prompts, lambda tmp: tmp.write_text(state.prompts, encoding="utf-8"))
    write_atomically(real, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return form_page(request, state, f"saved {target}" + (f" and {prompts_file}" if state.prompts else ""),
                     config_path=target, form=form)
