"""Tiny videos written in the tests (PyAV): each frame tells its own index, so a test can read back which source
frames a clip holds."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

CODECS = {".mp4": ("libx264", "yuv420p"), ".webm": ("libvpx-vp9", "yuv420p"), ".gif": ("gif", "rgb8")}


def frame_pixels(index: int, size: tuple[int, int] = (32, 32)) -> np.ndarray:
    """Frame `index`: a flat grey whose level is 8 * index + 16 (up to 29 frames tell apart after lossy coding)."""
    width, height = size
    return np.full((height, width, 3), min(255, 16 + 8 * index), dtype=np.uint8)


def frame_index(pixels: np.ndarray) -> int:
    """The index frame_pixels drew, read back from decoded RGB pixels (uint8, or [-1, 1] floats)."""
    values = np.asarray(pixels, dtype=np.float64)
    if values.max() <= 1.0:
        values = (values + 1.0) * 127.5
    return int(round((values.mean() - 16) / 8))


def write_video(path: Path, frames: int, size: tuple[int, int] = (32, 32), fps: int = 16,
                faststart: bool = False) -> Path:
    """A video of `frames` frames in the format its extension names (.mp4, .webm, .gif); `faststart`: an mp4 with
    its index first, so that a cut file still opens and decodes up to the cut."""
    import av

    codec, pixel_format = CODECS[path.suffix.lower()]
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", options={"movflags": "faststart"} if faststart else {}) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = pixel_format
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, size), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_frame_folder(folder: Path, frames: int, size: tuple[int, int] = (32, 32), skip: tuple[int, ...] = (),
                       start: int = 1) -> Path:
    """A frame folder of PNGs named frame_0001.png ...; `skip`: indices left out (a gap)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(frames):
        if i not in skip:
            Image.fromarray(frame_pixels(i, size)).save(folder / f"frame_{i + start:04d}.png")
    return folder
