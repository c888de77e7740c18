"""Video clips: decoding video files (PyAV, whose wheels bundle FFmpeg) and frame folders, and musubi-tuner's frame
extraction (its src/musubi_tuner/dataset/image_video_dataset.py and media_utils.py): which source frames each
training clip of a video is made of.

A video is read whole once when the dataset is checked (its frame count, size and rate, and whether it is cut
short); the frames of a clip are decoded again when the clip is encoded or trained.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import torch
from PIL import Image

from library.config import UserError
from library.data.images import IMAGE_EXTENSIONS, ImageProblem, fit_image, inspect_image, open_image, to_tensor

# musubi-tuner's video extensions, and GIF
VIDEO_EXTENSIONS = (".mp4", ".webm", ".gif", ".avi", ".mkv", ".mov", ".flv", ".wmv", ".m4v", ".mpg", ".mpeg")
_FPS_TOLERANCE = 0.01  # a file's rate within 1 % of source_fps is that rate (GIF delays are whole centiseconds)


class FramesRule(Protocol):
    """What the data reads of a video family's rule (library.families.entry.FramesRule)."""
    step: int
    fps: float


class VideoProblem(Exception):
    """A video that cannot be used; the message is the reason."""


def is_video_file(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_EXTENSIONS and not path.name.startswith(".")


# ----------------------------------------------------------------------------------------------------- reading

@dataclass(frozen=True)
class VideoFacts:
    frames: int  # decodable frames
    size: tuple[int, int]  # (width, height) of every frame
    fps: tuple[float, ...]  # the rates the file states (average, guessed); empty for a frame folder
    frame_files: tuple[Path, ...] | None = None  # a frame folder's images, in order


def _numbered(path: Path) -> int | None:
    match = re.search(r"(\d+)$", path.stem)
    return int(match.group(1)) if match else None


def frame_files(folder: Path) -> list[Path]:
    """A frame folder's images in order: by the number their names end with when all have one, else by name (as
    musubi-tuner sorts them)."""
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")
                   and p.is_file())
    numbers = [_numbered(p) for p in files]
    if files and all(n is not None for n in numbers):
        files = [p for _, p in sorted(zip(numbers, files, strict=True), key=lambda pair: (pair[0], pair[1].name))]
    return files


def _probe_folder(folder: Path) -> VideoFacts:
    files = frame_files(folder)
    if not files:
        raise VideoProblem(f"a frame folder without images (extensions {', '.join(IMAGE_EXTENSIONS)})")
    numbers = [_numbered(p) for p in files]
    if all(n is not None for n in numbers):
        missing = sorted(set(range(numbers[0], numbers[-1] + 1)) - set(numbers))  # type: ignore[arg-type]
        if missing:
            shown = ", ".join(map(str, missing[:5])) + (f" ... and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise VideoProblem(f"a frame folder with a gap: frames numbered {numbers[0]}..{numbers[-1]} lack {shown}")
        if len(set(numbers)) < len(numbers):
            raise VideoProblem("a frame folder with two images of the same frame number")
    sizes = {}
    for path in files:
        try:
            sizes.setdefault(inspect_image(path).size, path)
        except ImageProblem as e:
            raise VideoProblem(f"frame {path.name}: {e}") from None
    if len(sizes) > 1:
        raise VideoProblem("frames of different sizes: " + ", ".join(f"{w}x{h} ({p.name})"
                                                                       for (w, h), p in sizes.items()))
    return VideoFacts(len(files), next(iter(sizes)), (), tuple(files))


def _open(path: Path) -> Any:
    import av

    try:
        return av.open(str(path))
    except (av.error.FFmpegError, OSError, EOFError) as e:
        raise VideoProblem(f"cannot read video (corrupt, or cut short): {_reason(e)}") from None


def _reason(error: BaseException) -> str:
    return getattr(error, "strerror", None) or str(error) or type(error).__name__


def _probe_file(path: Path) -> VideoFacts:
    import av

    if path.stat().st_size == 0:
        raise VideoProblem("an empty file (0 bytes)")
    container = _open(path)
    try:
        if not container.streams.video:
            raise VideoProblem("no video stream in the file")
        stream = container.streams.video[0]
        count, size, last_end = 0, None, 0.0
        try:
            for frame in container.decode(stream):
                count += 1
                if size is None:
                    size = (frame.width, frame.height)
                elif (frame.width, frame.height) != size:
                    raise VideoProblem(f"the frame size changes ({size[0]}x{size[1]} -> {frame.width}x{frame.height} "
                                       f"at frame {count - 1})")
                if frame.time is not None:
                    last_end = frame.time
        except av.error.FFmpegError as e:
            raise VideoProblem(f"truncated or corrupt video: decoding stopped after {count} frames "
                               f"({_reason(e)})") from None
        rates = tuple(float(r) for r in (stream.average_rate, stream.guessed_rate) if r)
        if count == 0:
            raise VideoProblem("truncated or corrupt video: no frame decodes")
        stated = stream.frames
        # A couple of frames fewer is an edit list trimming the start (phone videos), not a cut file.
        if stated and count < stated - 2:
            raise VideoProblem(f"truncated video: {count} of the {stated} frames its header lists decode")
        if not stated and rates and len(container.streams) == 1 and container.duration:
            # No frame count in the header (WebM): the container's duration tells how far the frames should reach.
            duration = container.duration / 1_000_000
            interval = 1 / rates[0]
            if last_end + interval < duration - interval / 2:
                raise VideoProblem(f"truncated video: the frames end at {last_end + interval:.3f} s of the "
                                   f"{duration:.3f} s the file states")
        if path.suffix.lower() == ".gif" and not _gif_complete(path):
            raise VideoProblem(f"truncated GIF: it lacks the end marker ({count} frames decode)")
        assert size is not None
        return VideoFacts(count, size, rates)
    finally:
        container.close()


def _gif_complete(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b";"


def probe_video(path: Path) -> VideoFacts:
    """Decode the whole video file (or check every image of a frame folder) once; raises VideoProblem."""
    try:
        return _probe_folder(path) if path.is_dir() else _probe_file(path)
    except OSError as e:
        raise VideoProblem(f"cannot read video: {_reason(e)}") from None


def read_frames(path: Path, indices: Sequence[int]) -> list[Image.Image]:
    """The source frames `indices` (ascending) of a video file or frame folder, as RGB images."""
    wanted = set(indices)
    if path.is_dir():
        files = frame_files(path)
        try:
            return [open_image(files[i]) for i in indices]
        except (ImageProblem, IndexError) as e:
            raise UserError(f"{path}: {e} (it was readable when the dataset was checked)") from None
    import av

    frames: dict[int, Image.Image] = {}
    last = max(indices)
    try:
        container = _open(path)
        try:
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    frames[i] = frame.to_image().convert("RGB")
                if i >= last:
                    break
        finally:
            container.close()
    except (VideoProblem, av.error.FFmpegError) as e:
        raise UserError(f"{path}: {e} (it was readable when the dataset was checked)") from None
    if len(frames) < len(wanted):
        raise UserError(f"{path}: has fewer frames than when the dataset was checked; restart training")
    return [frames[i] for i in indices]


def prepare_clip(path: Path, indices: Sequence[int], size: tuple[int, int], resized: tuple[int, int],
                 bucket: tuple[int, int], crop_left_top: tuple[int, int], flipped: bool,
                 interpolation: str | None = None) -> torch.Tensor:
    """The clip's frames resized, cropped and flipped as an image is (library.data.images.prepare_image): a
    (3, frames, height, width) tensor in [-1, 1]."""
    frames = [fit_image(frame, path, size, resized, bucket, crop_left_top, flipped, interpolation)
              for frame in read_frames(path, indices)]
    return torch.stack([to_tensor(frame) for frame in frames], dim=1)


# ---------------------------------------------------------------------------------------- musubi's extraction

def resampled(frames: int, source_fps: float | None, target_fps: float | None,
              end: int | None = None) -> list[int]:
    """The source frames musubi-tuner keeps of a video of `frames` frames: all of them without a source_fps, else a
    frame each time the target rate's frame index advances (16 of every 30 for 30 -> 16 fps). `end`: it stops at this
    index of the kept sequence (head extraction reads no further than its longest clip)."""
    if source_fps is None or target_fps is None:
        return list(range(frames if end is None else min(frames, end)))
    delta = target_fps / source_fps
    kept, position, previous = [], 0.0, -1
    for i in range(frames):
        index = int(position)
        position += delta
        if index == previous:
            continue
        previous = index
        if end is not None and index >= end:
            break
        kept.append(i)
    return kept


def windows(frame_count: int, extraction: str, target_frames: Sequence[int], stride: int, samples: int,
            max_frames: int, step: int) -> list[tuple[int, int]]:
    """(start, length) of each clip musubi-tuner cuts from `frame_count` (kept) frames: head, chunk, slide and
    uniform per target_frames length, full once (the whole video up to max_frames, rounded down to the rule)."""
    cuts: list[tuple[int, int]] = []
    for length in ([] if extraction == "full" else target_frames):
        if extraction == "head" and frame_count >= length:
            cuts.append((0, length))
        elif extraction == "chunk":
            cuts += [(i, length) for i in range(0, frame_count, length) if i + length <= frame_count]
        elif extraction == "slide" and frame_count >= length:
            cuts += [(i, length) for i in range(0, frame_count - length + 1, stride)]
        elif extraction == "uniform" and frame_count >= length:
            cuts += [(int(i), length) for i in np.linspace(0, frame_count - length, samples, dtype=int)]
    if extraction == "full" and frame_count:
        length = min(frame_count, max_frames)
        cuts.append((0, (length - 1) // step * step + 1))
    return cuts


@dataclass(frozen=True)
class Extraction:
    """A video subset's extraction settings (musubi-tuner's keys) with the family's rule."""
    mode: str
    target_frames: tuple[int, ...]
    stride: int
    samples: int
    max_frames: int
    source_fps: float | None
    step: int
    target_fps: float

    @property
    def effective_mode(self) -> str:
        # musubi-tuner: uniform with one sample is head
        return "head" if self.mode == "uniform" and self.samples == 1 else self.mode


def clips(frames: int, extraction: Extraction) -> list[tuple[int, ...]]:
    """The source frame indices of each clip of a video of `frames` frames."""
    mode = extraction.effective_mode
    lengths = sorted(set(extraction.target_frames))  # musubi-tuner sorts them and drops repeats
    end = max(lengths) if mode == "head" else None
    target_fps = extraction.target_fps if extraction.source_fps is not None else None
    kept = resampled(frames, extraction.source_fps, target_fps, end)
    return [tuple(kept[start:start + length]) for start, length in
            windows(len(kept), mode, lengths, extraction.stride, extraction.samples, extraction.max_frames,
                    extraction.step)]


def target_frames_problems(target_frames: Sequence[int], mode: str, rule: FramesRule) -> list[str]:
    """target_frames values the family cannot take (musubi-tuner rounds them down with a warning; here they are
    refused, so the clip lengths trained are the ones written)."""
    if mode == "full":
        return []
    wrong = [n for n in target_frames if n < 1 or (n - 1) % rule.step]
    if not wrong:
        return []
    fixes = ", ".join(f"{n} -> {max(1, (n - 1) // rule.step * rule.step + 1)}" for n in wrong)
    return [f"target_frames {', '.join(map(str, wrong))}: the model takes 1 + {rule.step} * n frames "
            f"({', '.join(str(1 + rule.step * k) for k in range(4))}, ...); musubi-tuner would round down ({fixes})"]


def rate_problem(facts: VideoFacts, source_fps: float | None) -> str | None:
    """source_fps against the rate the file states: a frame folder states none (source_fps tells it), a file whose
    rate differs from source_fps would be resampled wrongly."""
    if source_fps is None or not facts.fps:
        return None
    if any(math.isclose(rate, source_fps, rel_tol=_FPS_TOLERANCE) for rate in facts.fps):
        return None
    return (f"its frame rate is {facts.fps[0]:.3g} fps, and source_fps says {source_fps:g}: the frames would be "
            f"resampled at the wrong rate; set source_fps to the file's rate (or leave it out to use every frame)")
