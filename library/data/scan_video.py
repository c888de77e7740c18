"""Scanning video subsets (library.data.scan): listing a subset's videos, frame folders and images (or musubi-tuner's
video JSONL), and checking one video: readable, its frame rate, long enough for a clip of target_frames, its size
placed in a bucket; one record's fields per clip cut from it."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from library.data.captions import subset_caption
from library.data.dataset_config import SubsetSpec
from library.data.images import Bucketer, image_named
from library.data.video import (
    VIDEO_EXTENSIONS,
    Extraction,
    FramesRule,
    VideoProblem,
    clips,
    is_video_file,
    probe_video,
    rate_problem,
    resampled,
    target_frames_problems,
)

# One image or video of a subset: the file, its caption from metadata (or None), the control images its entry names
# (or None).
Listed = tuple[Path, "str | None", "tuple[Path, ...] | None"]
# What checking one file gives: one record's fields per clip (or None), its problems, its notes.
CheckResult = tuple["list[dict[str, Any]] | None", list[str], list[str]]


def video_extraction(subset: SubsetSpec, rule: FramesRule | None, problems: list[str]) -> Extraction | None:
    """How the subset's clips are cut for the model's family; None (with the problem) when they cannot be."""
    where = subset.video_jsonl_file or subset.image_dir
    if rule is None:
        problems.append(f"{where}: a video dataset, and the model's family trains images only (video datasets "
                        "train a video family such as Wan)")
        return None
    wrong = target_frames_problems(subset.target_frames, subset.frame_extraction, rule)
    problems.extend(f"{where}: {p}" for p in wrong)
    if wrong:
        return None
    return Extraction(subset.frame_extraction, subset.target_frames, subset.frame_stride, subset.frame_sample,
                      subset.max_frames, subset.source_fps, rule.step, rule.fps)


def subset_videos(subset: SubsetSpec, dataset_index: int, seen: set[Path], problems: list[str],
                  warnings: list[str]) -> list[Listed]:
    """(video file, frame folder or image; caption from the JSONL or None; None) of one video subset."""
    if subset.num_repeats == 0:
        warnings.append(f"{subset.video_jsonl_file or subset.image_dir}: num_repeats is 0; the dataset is not "
                             "used")
        return []
    if subset.video_jsonl_file is not None:
        return _video_jsonl(subset.video_jsonl_file, subset.image_dir, problems)
    directory = subset.image_dir
    if directory.resolve() in seen:
        warnings.append(f"{directory}: the same folder is already a subset of dataset {dataset_index}; "
                             "this one is ignored")
        return []
    seen.add(directory.resolve())
    if not directory.is_dir():
        problems.append(f"{directory}: video_directory " + ("is not a folder" if directory.exists()
                                                                 else "not found"))
        return []
    entries = sorted(p for p in directory.iterdir() if not p.name.startswith("."))
    listed: list[Listed] = [(p, None, None) for p in entries
                             if (p.is_dir() or (p.is_file() and (is_video_file(p) or image_named(p))))]
    problems.extend(f"{p}: a symlink to {os.readlink(p)}, which does not exist" for p in entries
                         if p.is_symlink() and not p.exists() and (is_video_file(p) or image_named(p)))
    if not listed:
        problems.append(f"{directory}: no videos (extensions {', '.join(VIDEO_EXTENSIONS)}), frame folders or "
                             "images")
    return listed


def _video_jsonl(path: Path, base: Path, problems: list[str]) -> list[Listed]:
    """musubi-tuner's video JSONL: {"video_path": ..., "caption": ...} per line; a video_path may be a frame
    folder."""
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except FileNotFoundError:
        problems.append(f"{path}: video_jsonl_file not found")
        return []
    except (OSError, UnicodeDecodeError) as e:
        problems.append(f"{path}: cannot read the video_jsonl_file: {e}")
        return []
    listed: list[Listed] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            video, caption = entry["video_path"], entry["caption"]
            if not isinstance(video, str) or not isinstance(caption, str):
                raise TypeError("video_path and caption must be strings")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            problems.append(f"{path}: line {number}: not a video entry {{\"video_path\": ..., \"caption\": ...}} "
                            f"({type(e).__name__}: {e})")
            continue
        video_path = Path(video) if Path(video).is_absolute() else base / video
        if not video_path.exists():
            problems.append(f"{path}: line {number}: no video or frame folder {video_path}")
            continue
        listed.append((video_path, caption, None))
    if not listed and not problems:
        problems.append(f"{path}: no video entries")
    return listed


def check_video(path: Path, subset: SubsetSpec, bucketer: Bucketer, given_caption: str | None,
                extraction: Extraction) -> CheckResult:
    """(one record's fields per clip, or None; problems; notes) for a video file or frame folder."""
    problems: list[str] = []
    notes: list[str] = []
    facts = None
    try:
        facts = probe_video(path)
    except VideoProblem as e:
        problems.append(f"{path}: {e}")
    caption = subset_caption(path, subset, given_caption, subset.video_jsonl_file, problems)
    if facts is None or problems:
        return None, problems, notes
    rate = rate_problem(facts, extraction.source_fps)
    if rate:
        return None, [f"{path}: {rate}"], notes
    cut = clips(facts.frames, extraction)
    if not cut:
        return None, [f"{path}: {_too_short(path, facts.frames, extraction)}"], notes
    lengths = {len(c) for c in cut}
    if extraction.effective_mode != "full" and set(extraction.target_frames) - lengths:
        notes.append(f"short:{path} ({facts.frames} frames: no clip of "
                     f"{', '.join(map(str, sorted(set(extraction.target_frames) - lengths)))})")
    if extraction.source_fps is None and facts.fps and not any(
            abs(r - extraction.target_fps) <= extraction.target_fps * 0.01 for r in facts.fps):
        notes.append(f"fps:{path} ({facts.fps[0]:.3g} fps)")
    placement = bucketer.place(*facts.size)
    if placement.problem:
        return None, [f"{path}: {placement.problem}"], notes
    text = caption.text if caption.text is not None else subset.class_tokens
    return [{"path": path, "caption": text, "caption_from_file": caption.text is not None, "size": facts.size,
             "bucket": placement.bucket, "resized": placement.resized, "frames": frames} for frames in cut], [], notes


def _too_short(path: Path, frames: int, extraction: Extraction) -> str:
    shortest = min(extraction.target_frames)
    if frames == 1:
        return (f"one frame only (a still {'GIF' if path.suffix.lower() == '.gif' else 'image'}), shorter than "
                f"target_frames {shortest}; put it with the images")
    kept = ""
    if extraction.source_fps is not None:
        kept = (f", {len(resampled(frames, extraction.source_fps, extraction.target_fps))} after resampling "
                f"{extraction.source_fps:g} -> {extraction.target_fps:g} fps")
    return f"{frames} frames{kept}, shorter than the shortest target_frames {shortest}: no clip can be cut"
