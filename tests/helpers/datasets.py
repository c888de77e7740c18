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


def write_pairs(root: Path, count: int = 4, controls_per_item: int = 1, extra: str = "") -> Path:
    """An edit dataset: `count` 64x64 targets captioned "make it blue", each with `controls_per_item` control images
    (`i.png`, or `i_0.png`, `i_1.png` ... for several; seeded noise, drawn target first), and its kohya-shape
    dataset TOML with control_directory (none without controls; `extra` appended); returns the TOML."""
    rng = np.random.default_rng(0)
    images, starts = root / "targets", root / "controls"
    images.mkdir(parents=True)
    starts.mkdir()
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text("make it blue", encoding="utf-8")
        for j in range(controls_per_item):
            name = f"{i}.png" if controls_per_item == 1 else f"{i}_{j}.png"
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(starts / name)
    toml = root / "dataset.toml"
    toml.write_text('[general]\ncaption_extension = ".txt"\n[[datasets]]\nresolution = 64\nbatch_size = 2\n'
                    f'  [[datasets.subsets]]\n  image_dir = "{images}"\n'
                    + (f'  control_directory = "{starts}"\n' if controls_per_item else "") + extra, encoding="utf-8")
    return toml
