"""kohya's face_crop_aug_range: without buckets, an image whose file name ends in `_cx_cy_w_h` (the face's centre
and size in pixels, as kohya's face-detection tool names its crops) is scaled so that the face is 1 / range of
the training size, drawn within the range, and cropped around the face."""
from __future__ import annotations

import random
from pathlib import Path


def face_from_name(path: Path) -> tuple[int, int, int, int] | None:
    """(centre x, centre y, width, height) from a name like `img_120_80_64_64.png`, or None."""
    parts = path.stem.split("_")
    if len(parts) < 5:
        return None
    try:
        cx, cy, width, height = (int(p) for p in parts[-4:])
    except ValueError:
        return None
    return (cx, cy, width, height) if cx > 0 else None


def face_crop(size: tuple[int, int], target: tuple[int, int], face: tuple[int, int, int, int],
              aug_range: tuple[float, float], random_crop: bool,
              rng: random.Random) -> tuple[tuple[int, int], tuple[int, int]]:
    """kohya's crop_target: (resized (w, h), crop (left, top)) of a `size` image for a `target` (w, h) crop. The
    scale is drawn in the range, never below what covers the target (where kohya fails)."""
    (width, height), (target_w, target_h) = size, target
    if (width, height) == (target_w, target_h):
        return size, (0, 0)
    cx, cy, face_w, face_h = face
    face_size = max(face_w, face_h)
    short = min(target_w, target_h)
    cover = max(target_h / height, target_w / width)
    low = min(1.0, max(cover, short / (face_size * aug_range[1])))
    high = min(1.0, max(low, short / (face_size * aug_range[0])))
    scale = low if low >= high else rng.uniform(low, high)
    scale = max(scale, cover)
    resized = (max(target_w, int(width * scale + 0.5)), max(target_h, int(height * scale + 0.5)))
    centre = {"x": int(cx * scale + 0.5), "y": int(cy * scale + 0.5)}
    crop = {}
    for axis, target_len, length in (("y", target_h, resized[1]), ("x", target_w, resized[0])):  # kohya's order
        start = centre[axis] - target_len // 2
        if random_crop:  # off centre, favouring the face, to include background
            reach = max(length - centre[axis], centre[axis])
            start += rng.randint(0, reach) + rng.randint(0, reach) - reach
        elif aug_range[0] != aug_range[1] and face_size > short // 10 and face_size >= 40:
            start += rng.randint(-face_size // 20, face_size // 20)
        crop[axis] = max(0, min(start, length - target_len))
    return resized, (crop["x"], crop["y"])
