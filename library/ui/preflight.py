"""What a run will meet that the config's checks do not see: earlier work in its output folder."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from library.monitoring.events import EVENTS_FILE
from library.ui.run_status import RUN_CONFIG, run_status

LORA_SUFFIXES = (".safetensors", ".ckpt", ".pt")
DEFAULT_OUTPUT_NAME = "last"  # the trainer's (kohya's) output_name when none is set


def finished_lora(output_dir: Path, output_name: str | None) -> Path | None:
    """The final LoRA file a finished run left in `output_dir` (its output name's, or last.*), if any."""
    names = dict.fromkeys((output_name or DEFAULT_OUTPUT_NAME, DEFAULT_OUTPUT_NAME))
    return next((output_dir / f"{name}{suffix}" for name in names for suffix in LORA_SUFFIXES
                 if (output_dir / f"{name}{suffix}").is_file()), None)


def earlier_work(output_dir: Path, output_name: str | None) -> str | None:
    """What a new run started in `output_dir` would overwrite: a finished LoRA, or an earlier run's config."""
    if not output_dir.is_dir():
        return None
    lora = finished_lora(output_dir, output_name)
    if lora is not None:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(lora.stat().st_mtime))
        return (f"holds a finished LoRA, {lora.name} ({when}): a new run here overwrites it and "
                f"{RUN_CONFIG}")
    if (output_dir / RUN_CONFIG).is_file() or (output_dir / EVENTS_FILE).is_file():
        earlier = run_status(output_dir)
        return (f"holds an earlier run ({earlier.status} at step {earlier.step}): a new run here starts from step 0 "
                f"and replaces its {RUN_CONFIG}; Resume latest on the run's page continues it instead")
    return None


def new_folder(typed: str, exists: Callable[[str], bool]) -> str:
    """`typed` with the first free -2, -3, ... suffix: the folder a new run is offered instead."""
    base = typed.rstrip("/\\")
    number = 2
    while exists(f"{base}-{number}"):
        number += 1
    return f"{base}-{number}"
