"""Image files and where they land: decoding by content to RGB, the pixels the VAE sees, aspect-ratio buckets."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps

from library.config import UserError
from library.data.dataset_config import DatasetSpec

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def image_named(path: Path) -> bool:
    # Hidden files such as macOS `._x.png` are not images.
    return path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")
# The decoders that may legitimately read a file with each extension; anything else gets a warning.
FORMATS_BY_EXTENSION = {".png": ("PNG",), ".jpg": ("JPEG", "MPO"), ".jpeg": ("JPEG", "MPO"), ".webp": ("WEBP",),
                        ".bmp": ("BMP",)}


# ------------------------------------------------------------------------------------------------------- images

class ImageProblem(Exception):
    """An image that cannot be used; the message is the reason."""


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode -> 8-bit RGB: transparency composited on white, 16-bit and float greyscale scaled, not clipped."""
    mode = image.mode
    if mode.startswith("I;16") or mode in ("I", "F"):
        array = np.asarray(image).astype(np.float64)
        if mode.startswith("I;16") or (mode == "I" and array.max(initial=0) > 255):
            array = array / 257.0  # 16-bit -> 8-bit; convert("L") would clip everything above 255 to white
        elif mode == "F" and array.max(initial=0) <= 1.0:
            array = array * 255.0
        image = Image.fromarray(np.clip(np.rint(array), 0, 255).astype(np.uint8), "L")
        mode = "L"
    if mode in ("P", "PA") or "transparency" in image.info:
        image = image.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        # Transparent pixels often hold black or garbage RGB; kohya's convert("RGB") trains on it.
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        background.alpha_composite(rgba)
        return background.convert("RGB")
    return image if mode == "RGB" else image.convert("RGB")


def _has_alpha(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info


def _decode(path: Path) -> tuple[Image.Image, str, bool]:
    """(upright RGB image, file format, had transparency); raises ImageProblem."""
    try:
        with Image.open(path) as image:
            image.load()
            file_format, alpha = image.format or "?", _has_alpha(image)
            if image.getexif().get(0x0112, 1) != 1:
                image = ImageOps.exif_transpose(image)
            return to_rgb(image), file_format, alpha
    except Image.DecompressionBombError as e:
        raise ImageProblem(f"image too large to decode safely: {e}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        reason = str(e) or type(e).__name__
        raise ImageProblem(("truncated image file: " if "truncated" in reason else "cannot read image: ")
                           + reason) from None


def open_image(path: Path) -> Image.Image:
    """Decode fully (by content, whatever the extension), upright by EXIF orientation, as RGB."""
    return _decode(path)[0]


@dataclass(frozen=True)
class ImageFacts:
    size: tuple[int, int]  # (width, height), upright
    format: str
    alpha: bool


def inspect_image(path: Path) -> ImageFacts:
    """Decode the whole file once (truncation only shows when decoding) the way training will; raises ImageProblem."""
    image, file_format, alpha = _decode(path)
    return ImageFacts(image.size, file_format, alpha)


def to_tensor(image: Image.Image) -> torch.Tensor:
    """HWC uint8 -> CHW float in [-1, 1]."""
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array.transpose(2, 0, 1).copy())


# kohya's resize_interpolation names -> PIL filters ("area" averages the covered pixels: PIL's box filter).
RESIZE_FILTERS = {"lanczos": Image.Resampling.LANCZOS, "nearest": Image.Resampling.NEAREST,
                  "bilinear": Image.Resampling.BILINEAR, "linear": Image.Resampling.BILINEAR,
                  "bicubic": Image.Resampling.BICUBIC, "cubic": Image.Resampling.BICUBIC,
                  "area": Image.Resampling.BOX}


def color_augment(image: Image.Image, rng: random.Random) -> Image.Image:
    """kohya's color_aug: a third of the time, half of those a hue shift of up to 8 of OpenCV's 180 hue steps,
    the other half a gamma in [0.95, 1.05] on the 0-255 values."""
    if rng.random() > 0.33:
        return image
    if rng.random() > 0.5:
        shift = rng.uniform(-8, 8) * 256 / 180  # PIL's hue runs over 256 steps
        hsv = np.asarray(image.convert("HSV")).copy()
        hsv[..., 0] = (hsv[..., 0].astype(np.float64) + shift).round().astype(np.int64) % 256
        return Image.fromarray(hsv, "HSV").convert("RGB")
    gamma = rng.uniform(0.95, 1.05)
    return Image.fromarray(np.clip(np.asarray(image, dtype=np.float64) ** gamma, 0, 255).astype(np.uint8), "RGB")


def prepare_image(path: Path, size: tuple[int, int], resized: tuple[int, int], bucket: tuple[int, int],
                  crop_left_top: tuple[int, int], flipped: bool, interpolation: str | None = None,
                  augment: Callable[[Image.Image], Image.Image] | None = None) -> torch.Tensor:
    """Decode, resize to `resized` (with `interpolation`, a RESIZE_FILTERS name; default Lanczos), crop `bucket` at
    crop_left_top, maybe flip, then `augment` (color_aug): the pixels the VAE sees."""
    try:
        image = open_image(path)
    except ImageProblem as e:
        raise UserError(f"{path}: {e} (it was readable when the dataset was checked)") from None
    image = fit_image(image, path, size, resized, bucket, crop_left_top, flipped, interpolation)
    return to_tensor(augment(image) if augment is not None else image)


def fit_image(image: Image.Image, path: Path, size: tuple[int, int], resized: tuple[int, int],
              bucket: tuple[int, int], crop_left_top: tuple[int, int], flipped: bool,
              interpolation: str | None = None) -> Image.Image:
    """Resize, crop and flip as training does; a mask (and each frame of a video clip) goes through the same steps
    so it stays on its pixels."""
    if image.size != size:
        raise UserError(f"{path}: the image changed since the dataset was checked ({size} -> {image.size}); "
                        "restart training")
    if resized != image.size:
        if interpolation is None:
            image = image.resize(resized, Image.Resampling.LANCZOS, reducing_gap=3.0)
        else:
            image = image.resize(resized, RESIZE_FILTERS[interpolation])
    left, top = crop_left_top
    if (left, top, left + bucket[0], top + bucket[1]) != (0, 0) + image.size:
        image = image.crop((left, top, left + bucket[0], top + bucket[1]))
    if flipped:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return image


def read_mask(path: Path, alpha: bool) -> Image.Image:
    """A loss mask as 8-bit greyscale, upright: the image's alpha channel (opaque everywhere when it has none), or
    the red channel of a mask image, as kohya reads them (a mask image's own transparency is dropped, not
    composited, as kohya's convert("RGB") does)."""
    try:
        with Image.open(path) as image:
            image.load()
            if image.getexif().get(0x0112, 1) != 1:
                image = ImageOps.exif_transpose(image)
            if alpha:
                return image.convert("RGBA").getchannel("A") if _has_alpha(image) else Image.new("L", image.size, 255)
            return (image.convert("RGB") if _has_alpha(image) else to_rgb(image)).getchannel("R")
    except Image.DecompressionBombError as e:
        raise ImageProblem(f"image too large to decode safely: {e}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageProblem(f"cannot read mask: {str(e) or type(e).__name__}") from None


def prepare_mask(path: Path, size: tuple[int, int], resized: tuple[int, int], bucket: tuple[int, int],
                 crop_left_top: tuple[int, int], flipped: bool, alpha: bool,
                 interpolation: str | None = None) -> torch.Tensor:
    """The (height, width) loss mask in [0, 1] that lines up with prepare_image's pixels (see read_mask)."""
    try:
        mask = read_mask(path, alpha)
    except ImageProblem as e:
        raise UserError(f"{path}: {e} (it was readable when the dataset was checked)") from None
    mask = fit_image(mask, path, size, resized, bucket, crop_left_top, flipped, interpolation)
    return torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0)

# ------------------------------------------------------------------------------------------------------ buckets

def make_bucket_resolutions(resolution: tuple[int, int], min_size: int, max_size: int,
                            steps: int) -> list[tuple[int, int]]:
    """kohya's bucket set: sides in multiples of `steps` within [min_size, max_size], area at most resolution's."""
    max_area = resolution[0] * resolution[1]
    side = int(math.sqrt(max_area) // steps) * steps
    resos = {(side, side)}
    # Sides start at the first multiple of steps (kohya starts at min_size, which gives sides the VAE cannot
    # take when min_size is not a multiple of steps).
    top = max_size // steps * steps
    width = math.ceil(min_size / steps) * steps
    while width <= top:
        height = min(top, int(max_area // width) // steps * steps)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += steps
    return sorted(resos)


class Placement(NamedTuple):
    bucket: tuple[int, int]  # (width, height) trained
    resized: tuple[int, int]  # the image is resized to this, then cropped to the bucket
    problem: str | None = None


class Bucketer:
    """Chooses each image's bucket and resize for one dataset (a single bucket when bucketing is off)."""

    def __init__(self, spec: DatasetSpec):
        self.spec = spec
        self.no_upscale = spec.enable_bucket and spec.bucket_no_upscale
        if not spec.enable_bucket:
            self.resos = [tuple(spec.resolution)]
        elif self.no_upscale:
            self.resos = []  # each image's own size, rounded down
        else:
            self.resos = make_bucket_resolutions(spec.resolution, spec.min_bucket_reso, spec.max_bucket_reso,
                                                 spec.bucket_reso_steps)
        self._ratios = [w / h for w, h in self.resos]

    def place(self, width: int, height: int) -> Placement:
        if self.no_upscale:
            return self._place_no_upscale(width, height)
        ratio = width / height
        if (width, height) in self.resos:
            bucket = (width, height)
        else:
            bucket = self.resos[min(range(len(self.resos)), key=lambda i: abs(self._ratios[i] - ratio))]
        # Scale to cover the bucket: the image's relatively longer side is cropped.
        scale = bucket[1] / height if ratio > bucket[0] / bucket[1] else bucket[0] / width
        resized = (max(bucket[0], int(width * scale + 0.5)), max(bucket[1], int(height * scale + 0.5)))
        return Placement(bucket, resized)

    def _place_no_upscale(self, width: int, height: int) -> Placement:
        spec, steps = self.spec, self.spec.bucket_reso_steps
        ratio = width / height
        max_area = spec.resolution[0] * spec.resolution[1]
        resized = (width, height)
        if width * height > max_area:  # shrink to the resolution's area, keeping the aspect ratio (kohya)
            def to_steps(x: float) -> int:
                x = int(x + 0.5)
                return x - x % steps

            resized_w = math.sqrt(max_area * ratio)
            by_width = to_steps(resized_w)
            by_height = to_steps(max_area / resized_w)
            error_w = abs(by_width / max(1, to_steps(by_width / ratio)) - ratio)
            error_h = abs(to_steps(by_height * ratio) / max(1, by_height) - ratio)
            resized = ((by_width, int(by_width / ratio + 0.5)) if error_w < error_h
                       else (int(by_height * ratio + 0.5), by_height))
        bucket = (resized[0] - resized[0] % steps, resized[1] - resized[1] % steps)
        if min(bucket) < max(spec.min_bucket_reso, steps):
            return Placement(bucket, resized,
                             f"{width}x{height} is smaller than the smallest bucket side "
                             f"{max(spec.min_bucket_reso, steps)} and bucket_no_upscale forbids enlarging it "
                             "(lower min_bucket_reso, or allow upscaling)")
        return Placement(bucket, resized)


def center_crop(resized: tuple[int, int], bucket: tuple[int, int]) -> tuple[int, int]:
    return (resized[0] - bucket[0]) // 2, (resized[1] - bucket[1]) // 2
