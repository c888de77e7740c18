"""The start page (config editor, dataset and runs sections) and logging in on a LAN bind."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from library.ui import schema, security
from library.ui.web import RootsDep, SettingsDep, form_context, page

router = APIRouter()


@router.get("/", response_class=HTMLResponse)
async def index(request: Request, roots: RootsDep) -> HTMLResponse:
    return page(request, "index.html", **form_context(request, schema.FormState()), roots=roots.paths, cwd=roots.cwd)


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
