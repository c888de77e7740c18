"""Images and captions: kohya folder names, caption files, resize and crop, a resumable seeded batch sampler."""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image, ImageOps

from library.config import UserError

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_KOHYA_FOLDER = re.compile(r"^(\d+)_(.*)$")


@dataclass(frozen=True)
class ImageItem:
    path: Path
    caption: str


@dataclass(frozen=True)
class Subset:
    """One image folder: its images, how often each is repeated per epoch, and its class tokens."""
    directory: Path
    num_repeats: int
    class_tokens: str
    items: tuple[ImageItem, ...]


def parse_kohya_folder_name(name: str) -> tuple[int, str] | None:
    """`10_sks dog` -> (10, "sks dog"); None when the name has no repeat count."""
    match = _KOHYA_FOLDER.match(name)
    if match is None:
        return None
    return int(match.group(1)), match.group(2).strip()


def read_caption(image_path: Path, caption_extension: str) -> str | None:
    """The caption beside an image, trying `caption_extension` first, then `.txt`."""
    stem = image_path.with_suffix("")
    for extension in dict.fromkeys((caption_extension, ".txt")):
        candidate = stem.with_name(stem.name + extension)
        if candidate.is_file():
            try:
                return candidate.read_text(encoding="utf-8-sig").strip()
            except UnicodeDecodeError:
                raise UserError(f"{candidate}: caption is not UTF-8 text") from None
    return None


def list_images(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def discover_subsets(train_data_dir: str | Path, caption_extension: str) -> list[Subset]:
    """Find kohya-style subsets (`<repeats>_<class tokens>` folders) under train_data_dir."""
    root = Path(train_data_dir)
    subsets: list[Subset] = []
    skipped: list[str] = []
    for directory in sorted(p for p in root.iterdir() if p.is_dir()):
        parsed = parse_kohya_folder_name(directory.name)
        if parsed is None:
            skipped.append(directory.name)
            continue
        repeats, class_tokens = parsed
        images = list_images(directory)
        items = []
        missing = 0
        for image in images:
            caption = read_caption(image, caption_extension)
            if caption is None:
                missing += 1
                caption = class_tokens
            items.append(ImageItem(image, caption))
        if missing:
            logger.warning("%s: %d of %d images have no caption file; their class tokens %r are used",
                           directory, missing, len(images), class_tokens)
        if repeats == 0 or not items:
            logger.warning("%s: no training images (repeats %d, %d images)", directory, repeats, len(items))
            continue
        subsets.append(Subset(directory, repeats, class_tokens, tuple(items)))
    if skipped:
        logger.warning("%s: folders without a repeat count are ignored (name them like '10_sks dog'): %s",
                       root, ", ".join(skipped))
    if not subsets:
        raise UserError(f"train_data_dir {root}: no images found in folders named like '10_sks dog' "
                        f"(extensions {', '.join(IMAGE_EXTENSIONS)})")
    return subsets


def load_image(path: Path) -> Image.Image:
    """Open an image upright (EXIF orientation) as RGB."""
    try:
        with Image.open(path) as image:
            image = ImageOps.exif_transpose(image)
            return image.convert("RGB")
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read image: {e}") from None


def resize_and_center_crop(image: Image.Image, width: int, height: int) -> Image.Image:
    """Scale so the image covers width x height, then crop the centre."""
    scale = max(width / image.width, height / image.height)
    resized_w = max(width, round(image.width * scale))
    resized_h = max(height, round(image.height * scale))
    if (resized_w, resized_h) != image.size:
        image = image.resize((resized_w, resized_h), Image.Resampling.LANCZOS)
    left = (resized_w - width) // 2
    top = (resized_h - height) // 2
    return image.crop((left, top, left + width, top + height))


def to_tensor(image: Image.Image) -> torch.Tensor:
    """HWC uint8 -> CHW float in [-1, 1]."""
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array.transpose(2, 0, 1).copy())


class ImageCaptionDataset(torch.utils.data.Dataset):
    """Every image once per repeat; items are (pixels, token ids)."""

    def __init__(self, subsets: Sequence[Subset], resolution: tuple[int, int],
                 tokenize: Callable[[str], torch.Tensor]):
        self.subsets = list(subsets)
        self.resolution = resolution
        self.tokenize = tokenize
        self.entries: list[ImageItem] = [
            item for subset in self.subsets for _ in range(subset.num_repeats) for item in subset.items]

    @property
    def num_images(self) -> int:
        return sum(len(s.items) for s in self.subsets)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.entries[index]
        width, height = self.resolution
        pixels = to_tensor(resize_and_center_crop(load_image(item.path), width, height))
        return {"pixels": pixels, "input_ids": self.tokenize(item.caption)}


class SeededBatchSampler(torch.utils.data.Sampler):
    """Shuffled batches whose order in epoch e depends only on (seed, e); can start at batch k of an epoch."""

    def __init__(self, num_items: int, batch_size: int, seed: int, shuffle: bool = True):
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int | None = None) -> None:
        """Without start_batch the start is kept for the same epoch: accelerate's loader calls set_epoch(epoch)
        again when iteration begins."""
        if start_batch is None:
            start_batch = self.start_batch if epoch == self.epoch else 0
        self.epoch, self.start_batch = epoch, start_batch

    def batches(self, epoch: int) -> list[list[int]]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.num_items, generator=generator).tolist()
        else:
            order = list(range(self.num_items))
        return [order[i:i + self.batch_size] for i in range(0, self.num_items, self.batch_size)]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches(self.epoch)[self.start_batch:]

    def __len__(self) -> int:
        return math.ceil(self.num_items / self.batch_size) - self.start_batch
