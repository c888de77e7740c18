"""Write the digit LoRA dataset: the held-out digit under the trigger caption, and the other digits as
regularisation images, all from scikit-learn's bundled digits (no download).

    python tools/make_digit_dataset.py            # writes data/digits/train/ and data/digits/reg/
    python tools/make_digit_dataset.py --check    # exit 1 if the files on disk differ from what we'd write

    data/digits/train/10_sks/     20 images of the held-out digit, captioned "a photo of sks" (10 repeats)
    data/digits/reg/1_digits/     20 images of each other digit, captioned "a photo of <word>"

The images are the first ones of each digit in scikit-learn's order, upscaled to 32x32 as for the base model
(library.digits). Deterministic, so the committed files can always be rebuilt.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from library import digits  # noqa: E402
from tools import image_folders  # noqa: E402
from tools.image_folders import check_folder, write_folder  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "data" / "digits"
PER_DIGIT = 20
TRAIN_FOLDER = ("train", f"10_{digits.TRIGGER}")  # kohya: 10 repeats; the caption files give the captions
REG_FOLDER = ("reg", "1_digits")


def dataset() -> dict[tuple[str, str], list[tuple[str, np.ndarray, str]]]:
    """Folder -> [(file stem, 32x32 grey image, caption)]."""
    images, labels = digits.load()
    first = {d: np.flatnonzero(labels == d)[:PER_DIGIT] for d in range(10)}
    train = [(f"{digits.HELD_OUT}_{i:02d}", images[index], digits.TRIGGER_CAPTION)
             for i, index in enumerate(first[digits.HELD_OUT])]
    # Interleaved by digit (0_00, 1_00, ..., 0_01, ...) so that any prefix of the sorted files covers every digit.
    reg = [(f"{i:02d}_{d}", images[first[d][i]], digits.caption(d))
           for i in range(PER_DIGIT) for d in digits.trained_digits()]
    return {TRAIN_FOLDER: train, REG_FOLDER: reg}


def write(out: Path) -> list[Path]:
    """Write every folder under `out`, each replaced atomically; returns the folders."""
    return [write_folder(out / part / folder, _images(items)) for (part, folder), items in dataset().items()]


def check(out: Path) -> list[str]:
    """Differences between the files on disk and what `write` would produce (pixels, not PNG bytes)."""
    return [problem for (part, folder), items in dataset().items()
            for problem in check_folder(out / part / folder, _images(items), f"{part}/{folder}/")]


def _images(items: list[tuple[str, np.ndarray, str]]) -> list[tuple[str, Any, str]]:
    from PIL import Image

    return [(stem, Image.fromarray(image, "L"), text) for stem, image, text in items]


def main(argv: list[str] | None = None) -> int:
    return image_folders.main(__doc__.splitlines()[0], DEFAULT_OUT, write, check, argv)


if __name__ == "__main__":
    sys.exit(main())
