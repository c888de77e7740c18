"""What every page's routes share: the app's state as FastAPI dependencies (set once by create_app on app.state),
and rendering the templates, the config editor's form among them."""
from __future__ import annotations

import time
from typing import Annotated, Any, Mapping

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse
from starlette.datastructures import FormData

from library.config.options import GROUPS
from library.ui import examples, preflight, schema, security
from library.ui.model_family import FAMILIES, model_family
from library.ui.runs import RunManager
from library.ui.settings import Settings

MODEL_OPTION = "pretrained_model_name_or_path"  # the editor's family filter follows the model's family


def settings_of(request: Request) -> Settings:
    return request.app.state.settings


def roots_of(request: Request) -> security.Roots:
    return request.app.state.roots


def manager_of(request: Request) -> RunManager:
    return request.app.state.manager


SettingsDep = Annotated[Settings, Depends(settings_of)]
RootsDep = Annotated[security.Roots, Depends(roots_of)]
ManagerDep = Annotated[RunManager, Depends(manager_of)]


def page(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    return request.app.state.templates.TemplateResponse(request, name, context, status_code=status_code)


def when(seconds: float | None) -> str:
    """A time as the runs list shows it (the UI's local time)."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds)) if seconds else ""


def duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    whole = int(round(seconds))
    hours, minutes = whole // 3600, whole % 3600 // 60
    return (f"{hours}h " if hours else "") + (f"{minutes}m " if hours or minutes else "") + f"{whole % 60}s"


def form_context(request: Request, state: schema.FormState, message: str = "", config_path: str = "",
                 form: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What form.html shows: the fields by group, the state, the family filter's choice and the fields a run
    needs (those of every run; a single-file model's separate files)."""
    model = state.values.get(MODEL_OPTION, "")
    real = roots_of(request).resolve(model) if model.strip() else None
    return {"required": preflight.required_fields(real), "state": state, "groups": schema.fields_by_group(),
            "group_titles": GROUPS, "families": schema.families(), "message": message, "config_path": config_path,
            "command_line_only": schema.COMMAND_LINE_ONLY, "family_model": model, "examples": examples.examples(),
            "family": chosen_family(model, form or {}, roots_of(request))}


def chosen_family(model: str, form: Mapping[str, Any], roots: security.Roots) -> str:
    """The family filter's choice: the one picked for this model in the page, else the family of the model's folder
    or file (under the roots only), else the one picked; "" for every family."""
    picked = str(form.get("_family", ""))
    picked = picked if picked in FAMILIES else ""
    if "_family" in form and str(form.get("_family_model", "")) == model:
        return picked
    folder = roots.resolve(model) if model.strip() else None
    return (model_family(folder) if folder is not None else None) or picked


def form_page(request: Request, state: schema.FormState, message: str = "", status_code: int = 200,
              config_path: str = "", form: Mapping[str, Any] | None = None, new_folder: str = "") -> HTMLResponse:
    """The editor's form; `new_folder`: the folder offered instead of an output folder holding earlier work."""
    return page(request, "form.html", status_code, new_folder=new_folder,
                **form_context(request, state, message, config_path, form))


def form_values(form: FormData) -> dict[str, str]:
    """The option fields of a posted form (fields named with a leading _ are the page's own)."""
    return {k: str(v) for k, v in form.items() if not k.startswith("_")}


def refused(what: str) -> HTMLResponse:
    return HTMLResponse(f'<p class="problem">{what} is outside the folders this UI may use</p>', status_code=403)
