"""Who may use the UI and which files it may touch.

- Bound to a loopback address, the UI trusts the local machine; any other address needs the token: generated on
  first start, kept in a file only its owner can read, compared in constant time, then carried in an HttpOnly,
  SameSite=Strict cookie.
- Requests that change something must come from the UI's own page (their Origin header names it), and every
  request must name the UI's host (the Host header), so that neither another site nor a DNS rebinding can drive it.
- Files are read and written only under the roots given at start, checked after the path is resolved (symlinks
  and `..` followed), so a link inside a root that points outside it is refused too.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

COOKIE = "lora_ui"
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_token_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "lora-trainer" / "ui_token"


def load_or_create_token(path: Path) -> tuple[str, bool]:
    """The token in `path`, or a new one written there readable by the owner only. Returns (token, created)."""
    try:
        token = path.read_text(encoding="utf-8").strip()
        if token:
            if path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)
            return token, False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return token, True


def session_value(token: str) -> str:
    """What the cookie holds: derived from the token, so the cookie never carries the token itself."""
    return hmac.new(token.encode(), b"lora-trainer ui session", hashlib.sha256).hexdigest()


def token_matches(given: str | None, token: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def cookie_matches(given: str | None, token: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), session_value(token).encode())


def origin_allowed(origin: str | None, host_header: str | None) -> bool:
    """A state-changing request's Origin must be this UI (scheme http, the host and port the browser used)."""
    if not origin or not host_header:
        return False
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host_header.lower()


def host_allowed(host_header: str | None, bound_host: str, port: int) -> bool:
    """On a loopback bind only loopback names may reach the UI (against DNS rebinding); a LAN bind is guarded by
    the token."""
    if not is_loopback(bound_host):
        return True
    parts = urlsplit("//" + (host_header or ""))
    try:
        given_port = parts.port
    except ValueError:
        return False
    return is_loopback(parts.hostname or "") and given_port in (None, port)


class Roots:
    """The folders the UI may read and write under; paths relative to `cwd` (the trainer's working folder)."""

    def __init__(self, roots: list[Path], cwd: Path):
        self.cwd = cwd.resolve()
        self.paths = [Path(os.path.realpath(self.cwd / r)) for r in roots]

    def resolve(self, path: str | os.PathLike) -> Path | None:
        """The real path of `path` when it lies under a root, else None."""
        if not str(path) or "\x00" in str(path):
            return None
        real = Path(os.path.realpath(self.cwd / Path(path).expanduser()))
        return real if any(real == root or real.is_relative_to(root) for root in self.paths) else None

    def problem(self, option: str, value: str) -> str | None:
        if self.resolve(value) is None:
            return (f"{option}: {value} is outside the folders this UI may use ("
                    f"{', '.join(map(str, self.paths))}); start train_ui.py with --root for it")
        return None
