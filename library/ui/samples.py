"""A run's samples, images and videos, with the prompt each was made from and the step or epoch it was made at (its
file name), for the run page to group them. The prompt is the first line of the "parameters" text the trainer
writes: a PNG's text chunk, an animated WebP's EXIF ImageDescription, an MP4's or WebM's "comment" tag."""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from PIL import Image

VIDEO_SAMPLES = (".mp4", ".webm")  # played in a <video>; an animated .webp plays as an image
SAMPLE_SUFFIXES = (".png", ".webp", *VIDEO_SAMPLES)
# The trainer's sample names: {output_name}_{step:06d}_{index:02d}_{seed}.png (.webp, .mp4, .webm for a video
# family's), or e{epoch:06d} at an epoch's end.
SAMPLE_NAME = re.compile(r"(?:^|_)(e?)(\d{6})_(\d{2})_(\d+)\.(?:png|webp|mp4|webm)$")
IMAGE_DESCRIPTION = 0x010E  # the EXIF tag


def sample_views(run_dir: Path, names: list[str]) -> list[dict[str, Any]]:
    """Each sample (`names`: relative to the run folder) with its prompt, when it was made and whether it plays as a
    video, oldest first."""
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
                      "video": path.suffix.lower() in VIDEO_SAMPLES, "prompt": prompt_of(str(path), stamp)})
    return sorted(views, key=lambda view: view["order"])


@functools.lru_cache(maxsize=4096)
def prompt_of(path: str, stamp: int) -> str:
    """The prompt a sample was made from (the first line of its "parameters" text); "" when it has none.
    `stamp` (the file's mtime) keys the cache."""
    parameters = video_comment(path) if path.lower().endswith(VIDEO_SAMPLES) else image_parameters(path)
    return parameters.split("\n", 1)[0].strip() if isinstance(parameters, str) else ""


def image_parameters(path: str) -> object:
    try:
        with Image.open(path) as image:
            return image.info.get("parameters") or image.getexif().get(IMAGE_DESCRIPTION, "")
    except (OSError, ValueError):
        return ""


def video_comment(path: str) -> object:
    """A video's "comment" tag (its container's metadata), read without decoding a frame."""
    import av

    try:
        with av.open(path) as container:
            return container.metadata.get("comment", "")
    except (OSError, av.error.FFmpegError):
        return ""
