"""The web app: config editor, dataset view, runs. HTML from Jinja2 templates, HTMX for the form, server-sent
events for a run's live view. No endpoint takes a command line; paths are checked against the roots.

create_app puts what the routes share on app.state (settings, roots, the run manager, the templates) and includes
one router per page; library.ui.web hands that state to the routes as FastAPI dependencies."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from library.ui import dataset, editor, files, home, run_pages, security, web
from library.ui.runs import RunManager
from library.ui.settings import Settings

HERE = Path(__file__).resolve().parent
CONTENT_SECURITY_POLICY = "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'"


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Starting, the UI takes up the runs queued on disk; stopping, it starts nothing more (the queue stays)."""
    await asyncio.to_thread(app.state.manager.adopt)
    yield
    app.state.manager.close()


def create_app(settings: Settings) -> FastAPI:
    app = FastAPI(title="lora-trainer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    roots = security.Roots(settings.roots, settings.cwd)
    app.state.settings = settings
    app.state.roots = roots
    app.state.manager = RunManager(roots.paths, python=settings.python, cwd=roots.cwd)
    app.state.templates = Jinja2Templates(directory=str(HERE / "templates"))
    app.state.templates.env.filters.update(when=web.when, duration=web.duration)
    app.middleware("http")(guard)
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    for page in (home, editor, dataset, files, run_pages):
        app.include_router(page.router)
    return app


async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Every request: the UI's own host name, the token's cookie on a LAN bind, the UI's own origin for changes;
    every response: no framing, scripts from this server only, no referrer."""
    settings: Settings = request.app.state.settings
    if not security.host_allowed(request.headers.get("host"), settings.host, settings.port):
        return Response("unknown host", status_code=400)
    path = request.url.path
    public = path in ("/login", "/favicon.ico") or path.startswith("/static/")
    if settings.token is not None and not public and \
            not security.cookie_matches(request.cookies.get(security.COOKIE), settings.token):
        if request.method == "GET" and path == "/":
            return RedirectResponse("/login", status_code=303)
        return Response("log in first: /login", status_code=401)
    if request.method not in ("GET", "HEAD") and not security.origin_allowed(
            request.headers.get("origin"), request.headers.get("host")):
        return Response("cross-origin request refused", status_code=403)
    response = await call_next(request)
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["Referrer-Policy"] = "no-referrer"
    return response


__all__ = ["Settings", "create_app"]  # Settings is library.ui.settings', imported from here by train_ui.py
