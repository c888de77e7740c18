"""Video datasets in musubi-tuner's keys: the clips cut from each video against musubi-tuner's own rules (rewritten
below from its src/musubi_tuner/dataset/image_video_dataset.py and media_utils.py, not from ours), every format
and extraction mode through the dataset, the checks, images and videos in one dataset, and the TOML keys."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import library.families.registry  # noqa: F401 - the families' options are part of the schema
from library.config import ConfigError
from library.data.check import dataset_report
from library.data.dataset import build_training_data, collate
from library.data.dataset_config import resolve_datasets
from library.data.video import Extraction, clips
from library.families.entry import FramesRule
from tests.helpers.datasets import noise_image
from tests.helpers.runs import make_config
from tests.helpers.videos import frame_index, write_frame_folder, write_video

WAN = FramesRule(4, 16.0)
RUN = {"resolution": 32, "bucket_reso_steps": 16, "min_bucket_reso": 16, "max_bucket_reso": 64}


# --------------------------------------------------------------------------- musubi-tuner's rules, from its code

def musubi_load(frame_count: int, start: int | None, end: int | None, source_fps: float | None,
                target_fps: float | None) -> list[int]:
    """media_utils.load_video over a video whose frame i is i: the source frames it returns."""
    video = []
    if source_fps is None or target_fps is None:
        for i in range(frame_count):
            if start is not None and i < start:
                continue
            if end is not None and i >= end:
                break
            video.append(i)
        return video
    frame_index_delta = target_fps / source_fps
    frame_index_with_fraction = 0.0
    previous_frame_index = -1
    for i in range(frame_count):
        target_frame_index = int(frame_index_with_fraction)
        frame_index_with_fraction += frame_index_delta
        if target_frame_index == previous_frame_index:
            continue
        previous_frame_index = target_frame_index
        if start is not None and target_frame_index < start:
            continue
        if end is not None and target_frame_index >= end:
            break
        video.append(i)
    return video


def musubi_clips(frame_count: int, frame_extraction: str, target_frames: list[int], frame_stride: int,
                 frame_sample: int, max_frames: int, source_fps: float | None,
                 target_fps: float = 16.0) -> list[tuple[int, ...]]:
    """VideoDataset: __init__'s settings, then retrieve_latent_cache_batches' crop_pos_and_frames."""
    target_frames = sorted(set(target_frames))
    if frame_extraction == "uniform" and frame_sample == 1:
        frame_extraction = "head"
    start, end = (0, max(target_frames)) if frame_extraction == "head" else (None, None)
    video = musubi_load(frame_count, start, end, source_fps, target_fps if source_fps is not None else None)
    frame_count = len(video)
    crop_pos_and_frames = []
    if frame_extraction == "head":
        for target_frame in target_frames:
            if frame_count >= target_frame:
                crop_pos_and_frames.append((0, target_frame))
    elif frame_extraction == "chunk":
        for target_frame in target_frames:
            for i in range(0, frame_count, target_frame):
                if i + target_frame <= frame_count:
                    crop_pos_and_frames.append((i, target_frame))
    elif frame_extraction == "slide":
        for target_frame in target_frames:
            if frame_count >= target_frame:
                for i in range(0, frame_count - target_frame + 1, frame_stride):
                    crop_pos_and_frames.append((i, target_frame))
    elif frame_extraction == "uniform":
        for target_frame in target_frames:
            if frame_count >= target_frame:
                frame_indices = np.linspace(0, frame_count - target_frame, frame_sample, dtype=int)
                for i in frame_indices:
                    crop_pos_and_frames.append((i, target_frame))
    elif frame_extraction == "full":
        target_frame = min(frame_count, max_frames)
        target_frame = (target_frame - 1) // 4 * 4 + 1
        crop_pos_and_frames.append((0, target_frame))
    return [tuple(video[crop_pos:crop_pos + target_frame]) for crop_pos, target_frame in crop_pos_and_frames]


def ours(frames: int, mode: str, target_frames: tuple[int, ...], stride: int = 1, sample: int = 1,
         max_frames: int = 129, source_fps: float | None = None) -> list[tuple[int, ...]]:
    return clips(frames, Extraction(mode, target_frames, stride, sample, max_frames, source_fps, 4, 16.0))


@pytest.mark.parametrize("mode", ["head", "chunk", "slide", "uniform", "full"])
def test_clips_follow_musubi_tuner_rules(mode):
    cases = itertools.product((1, 4, 5, 9, 17, 21, 40, 61), ((1,), (5,), (1, 9, 13), (5, 9, 25)), (1, 3, 10),
                              (1, 2, 4), (5, 13, 129), (None, 30.0, 24.0, 16.0, 8.0))
    compared = 0
    for frames, targets, stride, sample, max_frames, fps in cases:
        expected = musubi_clips(frames, mode, list(targets), stride, sample, max_frames, fps)
        assert ours(frames, mode, targets, stride, sample, max_frames, fps) == expected, (
            frames, targets, stride, sample, max_frames, fps)
        compared += bool(expected)
    assert compared > 500  # most cases cut clips


def test_the_40_frame_examples_of_musubi_tuner_docs():
    """docs/dataset_config.md draws these for a video of 40 frames (starts and lengths read off its diagrams)."""
    def starts(cut):
        return [(c[0], len(c)) for c in cut]

    assert starts(ours(40, "head", (1, 13, 25))) == [(0, 1), (0, 13), (0, 25)]
    assert starts(ours(40, "chunk", (13, 25))) == [(0, 13), (13, 13), (26, 13), (0, 25)]
    assert starts(ours(40, "slide", (1, 13, 25), stride=10)) == [(0, 1), (10, 1), (20, 1), (30, 1), (0, 13),
                                                                 (10, 13), (20, 13), (0, 25), (10, 25)]
    assert starts(ours(40, "uniform", (1, 13, 25), sample=4)) == [(0, 1), (13, 1), (26, 1), (39, 1), (0, 13),
                                                                  (9, 13), (18, 13), (27, 13), (0, 25), (5, 25),
                                                                  (10, 25), (15, 25)]
    assert ours(40, "slide", (25, 1, 25), stride=10) == ours(40, "slide", (1, 25), stride=10)  # sorted, once each
    # The docs draw 31 frames for the third video; 31 is not 4n+1, and musubi-tuner's code rounds it down to 29.
    assert [len(ours(n, "full", (1,), max_frames=31)[0]) for n in (20, 25, 35)] == [17, 25, 29]


def test_source_fps_keeps_16_of_every_30_frames():
    (clip,) = ours(30, "full", (1,), source_fps=30.0)
    assert len(clip) == 13  # 16 kept, rounded down to 4n+1
    (kept,) = ours(30, "head", (16 + 1,), source_fps=30.0) or [()]
    assert kept == ()  # only 16 frames remain: no clip of 17
    (head,) = ours(30, "head", (13,), source_fps=30.0)
    steps = np.diff(head)
    assert head[:4] == (0, 2, 4, 6) and set(steps) == {1, 2} and (steps == 1).sum() == 1  # 13 of the first 24


# -------------------------------------------------------------------------------------------- the dataset

def dataset_toml(tmp_path: Path, body: str, general: str = "") -> Path:
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[general]\nresolution = [32, 32]\ncaption_extension = ".txt"\nbatch_size = 2\n{general}\n'
                    f'{body}', encoding="utf-8")
    return toml


def config_for(tmp_path: Path, toml: Path, *extra: str):
    return make_config(tmp_path, None, tmp_path / "out", "--dataset_config", str(toml), *extra, run=RUN)


def write_clip(folder: Path, name: str, frames: int, caption: str | None = None) -> Path:
    path = (write_frame_folder(folder / name, frames) if "." not in name else write_video(folder / name, frames))
    path.with_name(Path(name).stem + ".txt").write_text(caption or f"clip {name}", encoding="utf-8")
    return path


MODES = {"head": "target_frames = [1, 9]", "chunk": "target_frames = [5, 9]",
         "slide": "target_frames = [9]\nframe_stride = 6", "uniform": "target_frames = [5]\nframe_sample = 3",
         "full": "max_frames = 17"}


@pytest.mark.parametrize("name", ["clip.mp4", "clip.webm", "clip.gif", "clip"])
@pytest.mark.parametrize("mode", list(MODES))
def test_each_format_and_mode_gives_musubi_tuners_clips_with_their_frames(tmp_path, name, mode):
    videos = tmp_path / "videos"
    write_clip(videos, name, 21)
    toml = dataset_toml(tmp_path, f'[[datasets]]\nvideo_directory = "{videos}"\nframe_extraction = "{mode}"\n'
                                  f'{MODES[mode]}\n')
    data = build_training_data(config_for(tmp_path, toml), None, 0, 1, WAN)
    spec = data.specs[0].subsets[0]
    expected = musubi_clips(21, mode, list(spec.target_frames), spec.frame_stride, spec.frame_sample,
                            spec.max_frames, None)
    assert [r.frames for r in data.records] == expected
    assert all(r.path == videos / name and r.caption == f"clip {name}" for r in data.records)
    last = data.records[-1]
    item = data.dataset[data.dataset.samples.index(len(data.records) - 1)]
    assert item["pixels"].shape == (3, len(last.frames), 32, 32)
    assert [frame_index(item["pixels"][:, f].numpy()) for f in range(len(last.frames))] == list(last.frames)


def test_a_jsonl_names_videos_and_frame_folders_with_captions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # musubi-tuner opens relative video_path values from the working directory
    write_video(tmp_path / "v" / "a.mp4", 9)
    write_frame_folder(tmp_path / "v" / "b", 13)
    jsonl = tmp_path / "videos.jsonl"
    jsonl.write_text(json.dumps({"video_path": "v/a.mp4", "caption": "a walks"}) + "\n"
                     + json.dumps({"video_path": str(tmp_path / "v" / "b"), "caption": "b runs"}) + "\n",
                     encoding="utf-8")
    toml = dataset_toml(tmp_path, f'[[datasets]]\nvideo_jsonl_file = "{jsonl}"\ntarget_frames = [9]\n')
    data = build_training_data(config_for(tmp_path, toml), None, 0, 1, WAN)
    assert [(r.path.name, r.caption, len(r.frames)) for r in data.records] == [("a.mp4", "a walks", 9),
                                                                               ("b", "b runs", 9)]


def test_images_and_videos_in_one_dataset_batch_apart(tmp_path):
    folder = tmp_path / "mixed"
    for i in range(2):
        noise_image(folder / f"image{i}.png", seed=i)
        (folder / f"image{i}.txt").write_text(f"image {i}", encoding="utf-8")
        write_clip(folder, f"clip{i}.mp4", 9)
    toml = dataset_toml(tmp_path, f'[[datasets]]\nvideo_directory = "{folder}"\ntarget_frames = [1, 5]\n')
    data = build_training_data(config_for(tmp_path, toml), None, 0, 1, WAN)
    assert sorted((r.path.name, r.frames) for r in data.records) == [
        ("clip0.mp4", (0,)), ("clip0.mp4", (0, 1, 2, 3, 4)), ("clip1.mp4", (0,)), ("clip1.mp4", (0, 1, 2, 3, 4)),
        ("image0.png", None), ("image1.png", None)]
    shapes = sorted(tuple(collate([data.dataset[i] for i in batch])["pixels"].shape)
                    for batch in data.sampler.batches(0))
    # A one-frame clip is (3, 1, H, W) and never shares a batch with an image's (3, H, W).
    assert shapes == [(2, 3, 1, 32, 32), (2, 3, 5, 32, 32), (2, 3, 32, 32)]
    assert [b for _, b, _, _ in data.bucket_histogram()] == [(32, 32), (32, 32, 1), (32, 32, 5)]


def test_an_image_dataset_beside_a_video_dataset(tmp_path):
    images, videos = tmp_path / "images", tmp_path / "videos"
    noise_image(images / "a.png")
    (images / "a.txt").write_text("an image", encoding="utf-8")
    write_clip(videos, "b.webm", 9)
    toml = dataset_toml(tmp_path, f'[[datasets]]\nimage_directory = "{images}"\n\n'
                                  f'[[datasets]]\nvideo_directory = "{videos}"\ntarget_frames = [9]\n')
    data = build_training_data(config_for(tmp_path, toml), None, 0, 1, WAN)
    assert [(r.dataset_index, r.frames is None) for r in data.records] == [(0, True), (1, False)]


# ------------------------------------------------------------------------------------------------- checks

def bad_videos(folder: Path) -> dict[str, str | tuple[str, ...]]:
    """Broken and short videos, each with its caption, and the words the check must say about each."""
    write_clip(folder, "good.mp4", 9)
    for name, frames in (("truncated.mp4", 9), ("truncated.webm", 9), ("truncated.gif", 9)):
        path = write_clip(folder, name, frames)
        data = path.read_bytes()
        path.write_bytes(data[:int(len(data) * 0.9)])
    cut = write_video(folder / "cut.mp4", 21, faststart=True)
    (folder / "cut.txt").write_text("cut", encoding="utf-8")
    cut.write_bytes(cut.read_bytes()[:int(cut.stat().st_size * 0.7)])
    write_clip(folder, "empty.mp4", 1).write_bytes(b"")
    write_clip(folder, "corrupt.webm", 1).write_bytes(b"not a video at all" * 20)
    write_clip(folder, "short.mp4", 5)
    write_clip(folder, "still.gif", 1)
    write_frame_folder(folder / "gap", 9, skip=(4,))
    (folder / "gap.txt").write_text("a folder", encoding="utf-8")
    # Cut at 90 %, an mp4 loses its index at the end (unreadable) or, where the encoder wrote it otherwise, its last
    # frames: either message names it as cut short.
    return {"truncated.mp4": ("cannot read video (corrupt, or cut short)", "truncated or corrupt video"),
            "cut.mp4": "truncated or corrupt video: decoding stopped after",
            "truncated.webm": "truncated video", "truncated.gif": "truncated GIF",
            "empty.mp4": "an empty file (0 bytes)", "corrupt.webm": "cannot read video",
            "short.mp4": "5 frames, shorter than the shortest target_frames 9",
            "still.gif": "one frame only (a still GIF)",
            "gap": "a frame folder with a gap: frames numbered 1..9 lack 5"}


def test_the_check_names_each_broken_or_short_video(tmp_path):
    folder = tmp_path / "videos"
    expected = bad_videos(folder)
    toml = dataset_toml(tmp_path, f'[[datasets]]\nvideo_directory = "{folder}"\ntarget_frames = [9]\n')
    text, usable = dataset_report(config_for(tmp_path, toml), None, 1, WAN)
    assert not usable
    problems = text.split("problems (")[1].splitlines()[1:-1]
    assert len(problems) == len(expected), text
    for name, words in expected.items():
        said = (words,) if isinstance(words, str) else words
        assert any(line.startswith(f"  - {folder / name}: ") and any(w in line for w in said) for line in problems), \
            (name, text)
    assert "1 videos and images (9 left out) -> 1 clips" in text


def test_skip_bad_images_leaves_the_broken_videos_out(tmp_path):
    folder = tmp_path / "videos"
    bad_videos(folder)
    toml = dataset_toml(tmp_path, f'[[datasets]]\nvideo_directory = "{folder}"\ntarget_frames = [9]\n')
    data = build_training_data(config_for(tmp_path, toml, "--skip_bad_images"), None, 0, 1, WAN)
    assert [r.path.name for r in data.records] == ["good.mp4"]
    assert len(data.left_out) == 9


def test_frame_rate_and_target_frames_problems(tmp_path):
    write_clip(tmp_path / "a", "at16.mp4", 21)
    write_clip(tmp_path / "b", "folder", 21)
    toml = dataset_toml(tmp_path, f'[[datasets]]\nvideo_directory = "{tmp_path / "a"}"\nsource_fps = 30.0\n'
                                  f'target_frames = [5]\n\n'
                                  f'[[datasets]]\nvideo_directory = "{tmp_path / "b"}"\nsource_fps = 30.0\n'
                                  f'target_frames = [5]\n\n'
                                  f'[[datasets]]\nvideo_directory = "{tmp_path / "a"}"\ntarget_frames = [8, 9, 24]\n')
    text, usable = dataset_report(config_for(tmp_path, toml), None, 1, WAN)
    assert not usable
    assert (f"{tmp_path / 'a' / 'at16.mp4'}: its frame rate is 16 fps, and source_fps says 30: the frames would be "
            "resampled at the wrong rate") in text
    assert f"{tmp_path / 'b' / 'folder'}:" not in text  # a frame folder has no rate of its own: source_fps tells it
    assert (f"{tmp_path / 'a'}: target_frames 8, 24: the model takes 1 + 4 * n frames (1, 5, 9, 13, ...); "
            "musubi-tuner would round down (8 -> 5, 24 -> 21)") in text
    assert "5 clips" not in text


def test_a_video_at_another_rate_without_source_fps_is_a_warning(tmp_path):
    write_video(tmp_path / "v" / "at24.mp4", 9, fps=24)
    (tmp_path / "v" / "at24.txt").write_text("a clip", encoding="utf-8")
    toml = dataset_toml(tmp_path, f'[[datasets]]\nvideo_directory = "{tmp_path / "v"}"\ntarget_frames = [9]\n')
    text, usable = dataset_report(config_for(tmp_path, toml), None, 1, WAN)
    assert usable
    assert ("1 videos are not at the model's frame rate and source_fps is not set: every frame is used" in text
            and f"{tmp_path / 'v' / 'at24.mp4'} (24 fps)" in text)


def test_an_image_model_refuses_a_video_dataset_by_name(tmp_path):
    write_clip(tmp_path / "v", "a.mp4", 9)
    toml = dataset_toml(tmp_path, f'[[datasets]]\nvideo_directory = "{tmp_path / "v"}"\n')
    text, usable = dataset_report(config_for(tmp_path, toml), None, 1, None)
    assert not usable
    assert (f"{tmp_path / 'v'}: a video dataset, and the model's family trains images only (video datasets train a "
            "video family such as Wan)") in text


# ---------------------------------------------------------------------------------------------------- TOML

def toml_problems(tmp_path: Path, text: str) -> list[str]:
    toml = tmp_path / "dataset.toml"
    toml.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        resolve_datasets(config_for(tmp_path, toml))
    return [p.removeprefix(f"{toml}: ") for p in info.value.problems]


def test_video_keys_read_where_musubi_tuner_reads_them(tmp_path):
    toml = tmp_path / "dataset.toml"
    toml.write_text('[[datasets]]\nvideo_directory = "v"\ntarget_frames = [1, 25, 45]\nframe_extraction = "slide"\n'
                    'frame_stride = 10\nframe_sample = 4\nmax_frames = 45\nsource_fps = 30.0\nnum_repeats = 2\n',
                    encoding="utf-8")
    (spec,) = resolve_datasets(config_for(tmp_path, toml))
    subset = spec.subsets[0]
    assert (subset.image_dir, subset.is_video, subset.target_frames, subset.frame_extraction, subset.frame_stride,
            subset.frame_sample, subset.max_frames, subset.source_fps, subset.num_repeats) == (
        Path("v"), True, (1, 25, 45), "slide", 10, 4, 45, 30.0, 2)


def test_misplaced_and_wrong_video_keys_are_refused_together(tmp_path):
    problems = toml_problems(tmp_path, """
[general]
target_frames = [1]

[[datasets]]
video_directory = "v"
video_jsonl_file = "v.jsonl"
control_directory = "c"
target_frames = "25"
frame_extraction = "middle"
frame_stride = 0

[[datasets]]
image_directory = "i"
source_fps = 30.0

[[datasets]]
  [[datasets.subsets]]
  image_dir = "i"
  max_frames = 9

[[datasets]]
video_directory = "v"
frame_extraction = "chunk"
target_frames = [1, 9]
color_aug = true
""")
    assert problems == [
        "[general]: target_frames belongs in a [[datasets]] table that names videos (video_directory or "
        "video_jsonl_file)",
        "datasets[0]: set video_directory or video_jsonl_file, not both",
        "datasets[0]: control_directory with videos: control videos are not read; remove it",
        "datasets[0]: target_frames = '25': expected a list of integers, like [1, 25, 45]",
        "datasets[1]: source_fps: video dataset keys, and this [[datasets]] table names no videos (video_directory "
        "or video_jsonl_file)",
        "datasets[2].subsets[0]: max_frames is musubi-tuner's video dataset key, for a [[datasets]] table without "
        "subsets that names its videos (video_directory or video_jsonl_file)",
    ]
    problems = toml_problems(tmp_path, """
[[datasets]]
video_directory = "v"
frame_extraction = "middle"
frame_stride = 0

[[datasets]]
video_directory = "w"
frame_extraction = "chunk"
target_frames = [1, 9]
color_aug = true
""")
    assert problems == [
        "datasets[0]: subsets[0] (v): frame_extraction 'middle' must be one of head, chunk, slide, uniform, full",
        "datasets[0]: subsets[0] (v): frame_stride must be at least 1 (got 0)",
        "datasets[1]: subsets[0] (w): target_frames holds 1 with frame_extraction = \"chunk\": every frame would "
        "become a clip of its own (musubi-tuner warns against it); remove 1",
        "datasets[1]: subsets[0] (w): color_aug: not offered for video datasets; remove them",
    ]


def test_a_clip_item_stacks_to_a_five_dimensional_batch(tmp_path):
    write_clip(tmp_path / "v", "a.gif", 5)
    write_clip(tmp_path / "v", "b.mp4", 5)
    toml = dataset_toml(tmp_path, f'[[datasets]]\nvideo_directory = "{tmp_path / "v"}"\ntarget_frames = [5]\n'
                                  'flip_aug = true\n')
    data = build_training_data(config_for(tmp_path, toml), None, 0, 1, WAN)
    (batch,) = data.sampler.batches(0)
    pixels = collate([data.dataset[i] for i in batch])["pixels"]
    assert pixels.shape == (2, 3, 5, 32, 32) and pixels.dtype == torch.float32
    assert -1.0 <= float(pixels.min()) and float(pixels.max()) <= 1.0


def test_an_image_model_refuses_a_video_dataset_in_the_check_and_before_training(tmp_path, capsys):
    """The command's --dataset_check and a training run ask the model's registry entry for its frames rule: the
    digits base is an SD model, which trains images only."""
    import train_network
    from tests.helpers.runs import run_args

    repo = Path(__file__).resolve().parents[2]
    write_clip(tmp_path / "v", "a.mp4", 9)
    toml = dataset_toml(tmp_path, f'[[datasets]]\nvideo_directory = "{tmp_path / "v"}"\ntarget_frames = [9]\n')
    args = run_args(repo / "models" / "digits-base", None, tmp_path / "out", "--dataset_config", str(toml), run=RUN)
    refusal = f"{tmp_path / 'v'}: a video dataset, and the model's family trains images only"
    assert train_network.main([*args, "--dataset_check"]) == 2
    assert refusal in capsys.readouterr().out
    assert train_network.main(args) == 2
    assert refusal in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.safetensors"))  # no LoRA, no cache written
