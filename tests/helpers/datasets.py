"""Images for a test: kohya folders of the committed quickstart images (data/quickstart/10_sks shape), and noise."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from PIL import Image

QUICKSTART = "10_sks shape"
IMAGES = ("00_red_circle", "01_yellow_square", "02_white_triangle", "03_orange_diamond")


def copy_images(sample_data_dir: Path, root: Path, count: int) -> Path:
    """The first `count` quickstart images with their captions in a kohya folder `1_sks shape` under `root`;
    returns root."""
    subset = root / "1_sks shape"
    subset.mkdir(parents=True)
    for image in sorted((sample_data_dir / QUICKSTART).glob("*.png"))[:count]:
        shutil.copy(image, subset / image.name)
        shutil.copy(image.with_suffix(".txt"), subset / image.with_suffix(".txt").name)
    return root


def sample_images(sample_data_dir: Path, root: Path, names: tuple[str, ...] = IMAGES) -> Path:
    """The named images and their captions from the sample data, in a kohya folder `1_sks shape` under `root`;
    returns root."""
    data = root / "1_sks shape"
    data.mkdir()
    for name in names:
        for suffix in (".png", ".txt"):
            shutil.copy(sample_data_dir / QUICKSTART / f"{name}{suffix}", data / f"{name}{suffix}")
    return root


def noise_image(path: Path, size: tuple[int, int] = (32, 32), seed: int = 0, fmt: str | None = None) -> Path:
    """An image of seeded RGB noise (width, height) at `path`, its folders made; `fmt` saves it in another format
    than its suffix says."""
    array = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, format=fmt)
    return path
