"""The start page (config editor, dataset and runs sections), its icon, and logging in on a LAN bind."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from library.ui import preflight, schema, security
from library.ui.run_status import PROMPTS_FILE, RUN_CONFIG
from library.ui.web import RootsDep, SettingsDep, form_context, page

router = APIRouter()
ICON = Path(__file__).resolve().parent / "static" / "favicon.ico"


@router.get("/", response_class=HTMLResponse)
async def index(request: Request, roots: RootsDep, clone: str = "") -> HTMLResponse:
    state, message = cloned(roots, clone) if clone else (schema.FormState(), "")
    return page(request, "index.html", **form_context(request, state, message), roots=roots.paths, cwd=roots.cwd)


def cloned(roots: security.Roots, run: str) -> tuple[schema.FormState, str]:
    """The form holding a run's config with a new output folder: a new run from it that overwrites nothing."""
    directory = roots.resolve(run)
    config = directory / RUN_CONFIG if directory is not None else None
    if config is None or not config.is_file():
        return schema.FormState(general=[f"{run}: no {RUN_CONFIG} of a run under the UI's folders to copy"]), ""
    state, _ = schema.from_file(config)
    folder = preflight.new_folder(str(directory), lambda path: Path(path).exists())
    state.values["output_dir"] = folder
    typed = directory / PROMPTS_FILE  # prompts typed in the form for that run
    if state.values.get("sample_prompts") == str(typed) and typed.is_file():
        state.prompts = typed.read_text(encoding="utf-8")
        del state.values["sample_prompts"]
    return state, f"a new run from {directory.name}'s config, into {folder}: check it, then start it"


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> FileResponse:
    # Browsers ask every page's host for it; a 404 there is an error in every page's console.
    return FileResponse(ICON, media_type="image/x-icon", headers={"Cache-Control": "max-age=86400"})


@router.get("/login", response_class=HTMLResponse)
async def login_page(request: Request) -> HTMLResponse:
    return page(request, "login.html", error="")


@router.post("/login")
async def login(request: Request, settings: SettingsDep) -> Response:
    if settings.token is None:
        return RedirectResponse("/", status_code=303)
    form = await request.form()
    if not security.token_matches(str(form.get("token", "")), settings.token):
        return page(request, "login.html", status_code=401, error="wrong token")
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(security.COOKIE, security.session_value(settings.token), httponly=True,
                        samesite="strict", secure=False, path="/")
    return response
