"""What the UI is started with (train_ui.py's arguments)."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Settings:
    roots: list[Path]
    cwd: Path
    host: str = "127.0.0.1"
    port: int = 7860
    token: str | None = None  # required on a non-loopback bind
    python: str = sys.executable
