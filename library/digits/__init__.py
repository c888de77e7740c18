"""The digits that models/digits-base and models/digits-flux were pretrained on, as images and captions.

scikit-learn ships 1,797 handwritten digits of 8x8 pixels (`sklearn.datasets.load_digits`, no download). Here each
is upscaled to a 32x32 RGB image, dark ink on white, and captioned "a photo of <word>". One digit (`HELD_OUT`) is
left out of every pretraining stage, so that a LoRA can be taught it under the trigger caption "a photo of sks".
"""
from __future__ import annotations

import functools

import numpy as np

SIZE = 32  # pixels per side; both bases' VAEs downsample 4x to 8x8 latents (8x8x16 for FLUX: 16 packed tokens)
SOURCE_SIZE = 8  # pixels per side in scikit-learn's digits
SOURCE_MAX = 16  # ink values run 0..16
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
HELD_OUT = 7
TRIGGER = "sks"


def caption(digit: int) -> str:
    """The caption a digit is trained and prompted with."""
    return f"a photo of {WORDS[digit]}"


TRIGGER_CAPTION = f"a photo of {TRIGGER}"


def trained_digits() -> list[int]:
    """The digits the base model was pretrained on (all but the held-out one)."""
    return [d for d in range(10) if d != HELD_OUT]


def upscale(ink: np.ndarray) -> np.ndarray:
    """One 8x8 ink image (0..16) -> 32x32 uint8 grey, dark ink on white (bicubic)."""
    from PIL import Image

    source = Image.fromarray(np.rint(np.asarray(ink, dtype=np.float64) * 255 / SOURCE_MAX).astype(np.uint8), "L")
    return 255 - np.asarray(source.resize((SIZE, SIZE), Image.Resampling.BICUBIC), dtype=np.uint8)


def ink_features(images: np.ndarray) -> np.ndarray:
    """(N, H, W) uint8 grey images, H and W multiples of 8 -> (N, 64) ink in scikit-learn's 0..16 scale.

    Each 8x8 cell is the mean over its block, so a 32x32 image maps back onto the 8x8 grid it came from.
    """
    images = np.asarray(images, dtype=np.float32)
    n, height, width = images.shape
    if height % SOURCE_SIZE or width % SOURCE_SIZE:
        raise ValueError(f"image sides must be multiples of {SOURCE_SIZE}, got {width}x{height}")
    blocks = (255.0 - images).reshape(n, SOURCE_SIZE, height // SOURCE_SIZE, SOURCE_SIZE, width // SOURCE_SIZE)
    return blocks.mean(axis=(2, 4)).reshape(n, -1) * SOURCE_MAX / 255.0


@functools.lru_cache(maxsize=1)
def load() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits in scikit-learn's order: ((N, 32, 32) uint8 grey images, (N,) int labels). Read-only."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.stack([upscale(ink) for ink in bunch.images])
    labels = np.asarray(bunch.target, dtype=np.int64)
    images.flags.writeable = False
    labels.flags.writeable = False
    return images, labels


def to_rgb(gray: np.ndarray) -> np.ndarray:
    """(..., H, W) grey -> (..., H, W, 3): the pipeline's images are RGB."""
    return np.repeat(np.asarray(gray)[..., None], 3, axis=-1)


def to_gray(images: np.ndarray) -> np.ndarray:
    """(..., H, W, 3) RGB uint8 -> (..., H, W) grey uint8 (channel mean)."""
    return np.rint(np.asarray(images, dtype=np.float32).mean(axis=-1)).astype(np.uint8)
