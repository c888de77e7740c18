"""Requests a running trainer takes after its current step: a `sample_now` or `save_now` file in its output folder
(the web UI writes them; `touch OUTPUT_DIR/save_now` works as well). Each is removed once it has been done, so a
reader sees a request pending until then."""
from __future__ import annotations

from pathlib import Path

import torch

from library.core.run_files import SAMPLE_NOW, SAVE_NOW

REQUESTS = (SAMPLE_NOW, SAVE_NOW)


def pending(accelerator, output_dir: Path) -> list[str]:
    """The requests waiting in `output_dir`, agreed by every process (one collective, only with several): a
    process that saw one makes every process act on it, as sampling and saving need them all."""
    seen = [(output_dir / name).exists() for name in REQUESTS]
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(torch.tensor([float(s) for s in seen], device=accelerator.device), "sum")
        seen = [count > 0 for count in counts.tolist()]
    return [name for name, wanted in zip(REQUESTS, seen, strict=True) if wanted]


def done(accelerator, output_dir: Path, name: str) -> None:
    """The request is answered: its file goes (by the main process, once every process is past it)."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (output_dir / name).unlink(missing_ok=True)
