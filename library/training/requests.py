"""Requests a running trainer takes after its current step: a `sample_now` or `save_now` file in its output folder
(the web UI writes them; `touch OUTPUT_DIR/save_now` works as well). Each is removed once it has been done, so a
reader sees a request pending until then."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from library.core.run_files import SAMPLE_NOW, SAVE_NOW

REQUESTS = (SAMPLE_NOW, SAVE_NOW)


def seen(output_dir: Path) -> list[bool]:
    """Whether each of REQUESTS waits in `output_dir`, as this process sees it (library.training.faults.agree
    makes every process act on what any one saw, as sampling and saving need them all)."""
    return [(output_dir / name).exists() for name in REQUESTS]


def wanted(agreed: Sequence[bool]) -> list[str]:
    """The requests to take, from the flags every process agreed on."""
    return [name for name, flag in zip(REQUESTS, agreed, strict=True) if flag]


def done(accelerator, output_dir: Path, name: str) -> None:
    """The request is answered: its file goes (by the main process, once every process is past it)."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (output_dir / name).unlink(missing_ok=True)
