"""Kohya folders of the committed quickstart images (data/quickstart/10_sks shape) for a test."""
from __future__ import annotations

import shutil
from pathlib import Path

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
