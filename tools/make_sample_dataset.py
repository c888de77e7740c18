"""Regenerate the quickstart sample dataset: simple coloured shapes with kohya-style captions.

    python tools/make_sample_dataset.py            # writes data/quickstart/10_sks shape/
    python tools/make_sample_dataset.py --check    # exit 1 if the files on disk differ from what we'd write

Deterministic (PIL + numpy only, no random numbers), so the committed images can always be rebuilt.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools import image_folders  # noqa: E402
from tools.image_folders import check_folder, write_folder  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "data" / "quickstart"
CONCEPT_DIR = "10_sks shape"  # kohya: 10 repeats, class/trigger "sks shape"
SIZE = 64
SUPERSAMPLE = 4  # draw large, then downsample, for anti-aliased edges

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 210),
    "yellow": (240, 210, 40),
    "orange": (245, 140, 30),
    "purple": (140, 60, 190),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "pink": (240, 130, 180),
    "gray": (128, 128, 128),
}

# (shape, foreground, background): every shape twice, never the same colour pair twice.
ITEMS: tuple[tuple[str, str, str], ...] = (
    ("circle", "red", "blue"),
    ("square", "yellow", "purple"),
    ("triangle", "white", "green"),
    ("diamond", "orange", "black"),
    ("star", "yellow", "blue"),
    ("cross", "red", "white"),
    ("ring", "blue", "yellow"),
    ("hexagon", "green", "pink"),
    ("circle", "white", "black"),
    ("square", "blue", "orange"),
    ("triangle", "purple", "yellow"),
    ("diamond", "pink", "gray"),
    ("star", "red", "green"),
    ("cross", "black", "orange"),
    ("ring", "white", "purple"),
    ("hexagon", "orange", "blue"),
)


def _polygon(cx: float, cy: float, radius: float, sides: int, rotation: float) -> list[tuple[float, float]]:
    return [
        (cx + radius * math.cos(rotation + 2 * math.pi * k / sides),
         cy + radius * math.sin(rotation + 2 * math.pi * k / sides))
        for k in range(sides)
    ]


def _star(cx: float, cy: float, radius: float) -> list[tuple[float, float]]:
    points = []
    for k in range(10):
        r = radius if k % 2 == 0 else radius * 0.45
        a = -math.pi / 2 + math.pi * k / 5
        points.append((cx + r * math.cos(a), cy + r * math.sin(a)))
    return points


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill: tuple) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "ring":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), outline=fill, width=round(r * 0.35))
    elif shape == "square":
        draw.rectangle((cx - r * 0.85, cy - r * 0.85, cx + r * 0.85, cy + r * 0.85), fill=fill)
    elif shape == "triangle":
        draw.polygon(_polygon(cx, cy + r * 0.15, r, 3, -math.pi / 2), fill=fill)
    elif shape == "diamond":
        draw.polygon(_polygon(cx, cy, r, 4, -math.pi / 2), fill=fill)
    elif shape == "hexagon":
        draw.polygon(_polygon(cx, cy, r, 6, 0.0), fill=fill)
    elif shape == "star":
        draw.polygon(_star(cx, cy, r), fill=fill)
    elif shape == "cross":
        w = r * 0.33
        draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
        draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def render(index: int, shape: str, fg: str, bg: str) -> Image.Image:
    """One 64x64 RGB image; position and size vary with `index` so no two images share a layout."""
    big = SIZE * SUPERSAMPLE
    # A gentle top-to-bottom shading keeps the background from being one flat value.
    shade = np.linspace(1.1, 0.8, big, dtype=np.float32)[:, None, None]
    background = np.clip(np.array(COLORS[bg], dtype=np.float32)[None, None, :] * shade, 0, 255)
    canvas = np.broadcast_to(background, (big, big, 3)).astype(np.uint8)
    image = Image.fromarray(canvas)

    cx = big * (0.5 + 0.12 * math.sin(index * 2.4))
    cy = big * (0.5 + 0.12 * math.cos(index * 1.7))
    radius = big * (0.24 + 0.06 * ((index * 5) % 4) / 3)
    _draw_shape(ImageDraw.Draw(image), shape, cx, cy, radius, COLORS[fg])
    return image.resize((SIZE, SIZE), Image.Resampling.LANCZOS)


def caption(shape: str, fg: str, bg: str) -> str:
    return f"sks shape, a {fg} {shape} on a {bg} background"


def dataset() -> list[tuple[str, Image.Image, str]]:
    """(file stem, image, caption) for every sample."""
    return [
        (f"{i:02d}_{fg}_{shape}", render(i, shape, fg, bg), caption(shape, fg, bg))
        for i, (shape, fg, bg) in enumerate(ITEMS)
    ]


def write(out: Path) -> Path:
    """Write the concept folder under `out`, replacing any previous one atomically."""
    return write_folder(out / CONCEPT_DIR, dataset())


def check(out: Path) -> list[str]:
    """Differences between the files on disk and what `write` would produce (pixels, not PNG bytes)."""
    return check_folder(out / CONCEPT_DIR, dataset())


def main(argv: list[str] | None = None) -> int:
    return image_folders.main(__doc__.splitlines()[0], DEFAULT_OUT, lambda out: [write(out)], check, argv)


if __name__ == "__main__":
    sys.exit(main())
