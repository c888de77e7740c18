"""A run's sample images with the prompt each was made from (the PNG's "parameters" text, as the trainer writes
it) and the step or epoch it was made at (its file name), for the run page to group them."""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from PIL import Image

# The trainer's sample names: {output_name}_{step:06d}_{index:02d}_{seed}.png, or e{epoch:06d} at an epoch's end.
SAMPLE_NAME = re.compile(r"(?:^|_)(e?)(\d{6})_(\d{2})_(\d+)\.png$")


def sample_views(run_dir: Path, names: list[str]) -> list[dict[str, Any]]:
    """Each sample (`names`: relative to the run folder) with its prompt and when it was made, oldest first."""
    views = []
    for name in names:
        path = run_dir / name
        match = SAMPLE_NAME.search(path.name)
        epoch, number, index = (match[1] == "e", int(match[2]), int(match[3])) if match else (False, 0, 0)
        try:
            stamp = path.stat().st_mtime_ns
        except OSError:
            continue
        views.append({"path": name, "when": f"{'epoch' if epoch else 'step'} {number}" if match else "",
                      "order": [int(epoch), number, index],  # steps, then epochs (their files are apart)
                      "prompt": prompt_of(str(path), stamp)})
    return sorted(views, key=lambda view: view["order"])


@functools.lru_cache(maxsize=4096)
def prompt_of(path: str, stamp: int) -> str:
    """The prompt a sample was made from (the first line of its "parameters" text); "" when it has none.
    `stamp` (the file's mtime) keys the cache."""
    try:
        with Image.open(path) as image:
            parameters = image.info.get("parameters", "")
    except (OSError, ValueError):
        return ""
    return parameters.split("\n", 1)[0].strip() if isinstance(parameters, str) else ""
