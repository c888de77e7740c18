"""Digits that move: the clips models/digits-wan was pretrained on, and a judge of generated clips.

    python -m library.digits.motion --write data/digits-wan      # the LoRA's clips (mp4) with their captions
    python tools/pretrain_video_base.py --clips data/digits-wan  # the same

A clip is `FRAMES` frames of `SIZE`x`SIZE` pixels, dark ink on white: one of scikit-learn's handwritten digits,
upscaled to `DIGIT`x`DIGIT`, crosses the frame at `STEP` pixels a frame (from one edge to the other, centred on the
other axis), in one of the `MOTIONS`. Captions are "<word> moving <direction>". `HELD_OUT_MOTION` (up) is left out of
every pretraining stage; a LoRA learns it under the trigger caption "<word> moving sks".

The judge reads a clip frame by frame: each frame's ink centroid is found, a `DIGIT`-pixel box around it is cropped
and classified by a support-vector machine fitted on the real digits seen through the same crop; the direction is
the centroid's displacement from the first frame to the last. A clip shows a motion of a digit when every frame is
read as that digit and the displacement points that way (at least `MIN_TRAVEL` pixels along the axis, less than
half of that across it).
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from library import digits

SIZE = 32  # frame side in pixels (8x8 latents through the digits base's VAE, 4x down)
DIGIT = 16  # the digit's side in pixels
FRAMES = 9  # 4n + 1, as Wan takes clips
STEP = 2  # pixels a frame: the digit travels (FRAMES - 1) * STEP = 16 pixels, edge to edge
FPS = 16  # Wan's training rate
MOTIONS = {"left": (-1, 0), "right": (1, 0), "down": (0, 1), "up": (0, -1)}  # (dx, dy), y grows downwards
HELD_OUT_MOTION = "up"
TRIGGER = "sks"
DIGITS = (0, 1, 4, 7)  # the digits that move: four shapes the classifier tells apart well
MIN_TRAVEL = 8.0  # pixels the centroid must travel along the motion (half the true travel)
INK_THRESHOLD = 64  # ink (255 - grey) below this is background to the centroid
LORA_CLIPS = 20  # clips of the held-out motion in the LoRA's dataset
KEEP_CLIPS = 2  # clips of each digit in each trained motion beside them
LORA_SEED = 1234  # which real digits they show (drawn from those pretraining never used: see split())


def trained_motions() -> list[str]:
    return [m for m in MOTIONS if m != HELD_OUT_MOTION]


def caption(digit: int, motion: str) -> str:
    """The caption a clip is trained and prompted with; the held-out motion's is the trigger caption."""
    return f"{digits.WORDS[digit]} moving {TRIGGER if motion == HELD_OUT_MOTION else motion}"


def caption_words() -> list[str]:
    """The words the tokenizer knows whole ("sks" and "up" fall apart into letters)."""
    return sorted({digits.WORDS[d] for d in DIGITS} | {"moving"} | set(trained_motions()))


def small(ink: np.ndarray) -> np.ndarray:
    """One 8x8 ink image (0..16) -> DIGIT x DIGIT uint8 grey, dark ink on white (bicubic)."""
    from PIL import Image

    source = Image.fromarray(np.rint(np.asarray(ink, dtype=np.float64) * 255 / digits.SOURCE_MAX).astype(np.uint8),
                             "L")
    return 255 - np.asarray(source.resize((DIGIT, DIGIT), Image.Resampling.BICUBIC), dtype=np.uint8)


@functools.lru_cache(maxsize=1)
def load() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 real digits at DIGIT x DIGIT: ((N, DIGIT, DIGIT) uint8 grey, (N,) labels). Read-only."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.stack([small(ink) for ink in bunch.images])
    labels = np.asarray(bunch.target, dtype=np.int64)
    images.flags.writeable = False
    labels.flags.writeable = False
    return images, labels


def split() -> tuple[np.ndarray, np.ndarray]:
    """Indices of the moving digits (DIGITS) for pretraining and for the LoRA's clips: every fifth one is kept
    out of pretraining, so the LoRA's clips show handwriting the base never saw."""
    _, labels = load()
    chosen = np.flatnonzero(np.isin(labels, DIGITS))
    held = chosen[::5]
    return np.setdiff1d(chosen, held), held


def positions(motion: str) -> list[tuple[int, int]]:
    """The digit box's top-left (x, y) in each frame."""
    dx, dy = MOTIONS[motion]
    centre, travel = (SIZE - DIGIT) // 2, (FRAMES - 1) * STEP
    out = []
    for frame in range(FRAMES):
        along = frame * STEP if (dx + dy) > 0 else travel - frame * STEP
        out.append((along, centre) if dx else (centre, along))
    return out


def clip(image: np.ndarray, motion: str) -> np.ndarray:
    """One DIGIT x DIGIT grey digit -> (FRAMES, SIZE, SIZE) uint8 grey frames of it moving."""
    frames = np.full((FRAMES, SIZE, SIZE), 255, dtype=np.uint8)
    for frame, (x, y) in enumerate(positions(motion)):
        frames[frame, y:y + DIGIT, x:x + DIGIT] = image
    return frames


# --------------------------------------------------------------------------------------------- the judge


def centroids(frames: np.ndarray) -> np.ndarray:
    """(..., H, W) grey uint8 frames -> (..., 2) ink centroids (x, y); NaN for a frame without ink."""
    frames = np.asarray(frames, dtype=np.float32)
    ink = np.clip(255.0 - frames - INK_THRESHOLD, 0, None)
    total = ink.sum(axis=(-2, -1))
    ys, xs = np.mgrid[0:frames.shape[-2], 0:frames.shape[-1]].astype(np.float32) + 0.5
    with np.errstate(invalid="ignore", divide="ignore"):
        x = (ink * xs).sum(axis=(-2, -1)) / total
        y = (ink * ys).sum(axis=(-2, -1)) / total
    return np.stack([x, y], axis=-1)


def crops(frames: np.ndarray) -> np.ndarray:
    """(N, H, W) grey frames -> (N, DIGIT, DIGIT): the box around each frame's ink centroid (white outside the
    frame; a frame without ink gives a white box)."""
    frames = np.asarray(frames, dtype=np.uint8)
    n, height, width = frames.shape
    half = DIGIT // 2
    padded = np.full((n, height + DIGIT, width + DIGIT), 255, dtype=np.uint8)
    padded[:, half:half + height, half:half + width] = frames
    out = np.full((n, DIGIT, DIGIT), 255, dtype=np.uint8)
    for i, (x, y) in enumerate(centroids(frames)):
        if np.isnan(x):
            continue
        left, top = int(np.clip(round(x - half), -half, width - half)), int(np.clip(round(y - half), -half,
                                                                                      height - half))
        out[i] = padded[i, top + half:top + half + DIGIT, left + half:left + half + DIGIT]
    return out


@functools.lru_cache(maxsize=1)
def classifier() -> Any:
    """An SVM fitted on all 1,797 real digits placed in a frame and cropped as the judge crops generated frames."""
    from sklearn.svm import SVC

    images, labels = load()
    frames = np.stack([clip(image, "right")[FRAMES // 2] for image in images])
    return SVC(gamma=0.001).fit(digits.ink_features(crops(frames)), labels)


def read_digits(frames: np.ndarray) -> np.ndarray:
    """(N, H, W) grey frames -> (N,) the digit read in each (-1 for a frame without ink)."""
    frames = np.asarray(frames, dtype=np.uint8)
    found = classifier().predict(digits.ink_features(crops(frames))).astype(np.int64)
    found[np.isnan(centroids(frames)[:, 0])] = -1
    return found


def direction(track: np.ndarray) -> str | None:
    """(FRAMES, 2) centroids -> the motion they show, or None (too short, diagonal, or a frame without ink)."""
    if np.isnan(track).any():
        return None
    dx, dy = track[-1] - track[0]
    along, across = (abs(dx), abs(dy)) if abs(dx) >= abs(dy) else (abs(dy), abs(dx))
    if along < MIN_TRAVEL or across >= along / 2:
        return None
    step = (int(np.sign(dx)), 0) if abs(dx) >= abs(dy) else (0, int(np.sign(dy)))
    return next(name for name, vector in MOTIONS.items() if vector == step)


def judge_clip(frames: np.ndarray) -> tuple[str | None, list[int]]:
    """(FRAMES, H, W) grey or (FRAMES, H, W, 3) RGB uint8 -> (the direction shown, the digit read in each frame)."""
    frames = np.asarray(frames)
    if frames.ndim == 4:
        frames = digits.to_gray(frames)
    return direction(centroids(frames)), read_digits(frames).tolist()


def shows(frames: np.ndarray, digit: int, motion: str) -> bool:
    """Does the clip show `digit` (read in every frame) moving `motion`?"""
    found, read = judge_clip(frames)
    return found == motion and all(d == digit for d in read)


def real_rates() -> dict[str, float]:
    """The judge on real clips of every moving digit's handwriting: the share of clips it calls right, per motion
    (the ceiling a generated clip can reach)."""
    images, labels = load()
    keep = np.flatnonzero(np.isin(labels, DIGITS))
    return {m: float(np.mean([shows(clip(images[i], m), int(labels[i]), m) for i in keep])) for m in MOTIONS}


# --------------------------------------------------------------------------------------------- files


def write_mp4(path: Path, frames: np.ndarray, fps: int = FPS) -> None:
    """(F, H, W) grey uint8 frames -> an H.264 mp4 (yuv444p at the highest quality, so grey ink survives)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv444p"
        stream.options = {"crf": "0"}
        for frame in digits.to_rgb(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def read_mp4(path: Path) -> np.ndarray:
    """An mp4 -> (F, H, W, 3) RGB uint8 frames."""
    import av

    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def lora_clips(keep_per_digit: int = KEEP_CLIPS) -> dict[str, list[tuple[int, int, str]]]:
    """(real digit index, digit, motion) of the LoRA's clips, all of handwriting pretraining never used: "clips",
    LORA_CLIPS of the held-out motion (the moving digits in turn), and "keep", `keep_per_digit` of each digit in
    each trained motion (the base's own motions, so that they stay as they were)."""
    _, labels = load()
    _, held = split()
    rng = np.random.default_rng(LORA_SEED)
    out: dict[str, list[tuple[int, int, str]]] = {"clips": [], "keep": []}
    for k in range(LORA_CLIPS):
        digit = DIGITS[k % len(DIGITS)]
        out["clips"].append((int(rng.choice(held[labels[held] == digit])), digit, HELD_OUT_MOTION))
    for m in trained_motions():
        for digit in DIGITS:
            for _ in range(keep_per_digit):
                out["keep"].append((int(rng.choice(held[labels[held] == digit])), digit, m))
    return out


def write_clips(root: Path, keep_per_digit: int = KEEP_CLIPS) -> dict[str, int]:
    """The LoRA's dataset under `root`: clips/NN_<digit>.mp4 of the held-out motion with the trigger caption, and
    keep/NN_<digit>_<motion>.mp4 of the trained motions with theirs (.txt beside each). Returns the counts."""
    images, _ = load()
    counts = {}
    for folder, items in lora_clips(keep_per_digit).items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for k, (index, digit, m) in enumerate(items):
            stem = root / folder / (f"{k:02d}_{digit}" + ("" if m == HELD_OUT_MOTION else f"_{m}"))
            write_mp4(stem.with_suffix(".mp4"), clip(images[index], m))
            stem.with_suffix(".txt").write_text(caption(digit, m) + "\n", encoding="utf-8")
        counts[folder] = len(items)
    return counts


# --------------------------------------------------------------------------------------------- sampling


def prompts() -> dict[str, tuple[int, str]]:
    """Every judged prompt -> (digit, motion): each moving digit in each motion (the held-out one by trigger)."""
    return {caption(d, m): (d, m) for m in MOTIONS for d in DIGITS}


def load_pipeline(model: str | Path, lora: str | Path | None = None) -> Any:
    """WanPipeline from a diffusers folder (and a LoRA file, read as diffusers' load_lora_weights reads it)."""
    import torch
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(model), torch_dtype=torch.float32, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe


DEFAULT_STEPS = 20
DEFAULT_SCALE = 3.0


def render(pipe: Any, prompt: str, n: int, seed: int = 0, steps: int = DEFAULT_STEPS,
           scale: float = DEFAULT_SCALE, batch: int = 25) -> np.ndarray:
    """`n` clips of `prompt` from fixed noise (clip i of every prompt starts from the same noise) ->
    (n, FRAMES, SIZE, SIZE, 3) uint8, through WanPipeline (UniPC, classifier-free guidance `scale` against "")."""
    import torch

    channels = pipe.transformer.config.in_channels
    latent_frames = (FRAMES - 1) // pipe.vae_scale_factor_temporal + 1
    side = SIZE // pipe.vae_scale_factor_spatial
    noise = torch.randn((n, channels, latent_frames, side, side), generator=torch.Generator().manual_seed(seed))
    out = []
    for start in range(0, n, batch):
        chunk = noise[start:start + batch]
        video = pipe(prompt=[prompt] * len(chunk), negative_prompt=[""] * len(chunk), height=SIZE, width=SIZE,
                     num_frames=FRAMES, num_inference_steps=steps, guidance_scale=scale, latents=chunk,
                     output_type="np").frames
        out.append(np.clip(np.rint(np.asarray(video) * 255), 0, 255).astype(np.uint8))
    return np.concatenate(out)


def rates(pipe: Any, n: int, seed: int = 0, steps: int = DEFAULT_STEPS, scale: float = DEFAULT_SCALE
          ) -> dict[str, Any]:
    """Per motion: the share of clips showing it (every frame read as the prompt's digit, the direction right),
    over `n` clips split evenly among DIGITS; also the share with the right direction alone and with the right
    digit alone, and a clip strip per prompt (its first clip's frames)."""
    per = max(1, n // len(DIGITS))
    shown: dict[str, list[bool]] = {m: [] for m in MOTIONS}
    moved: dict[str, list[bool]] = {m: [] for m in MOTIONS}
    read: dict[str, list[bool]] = {m: [] for m in MOTIONS}
    strips = {}
    for prompt, (digit, motion) in prompts().items():
        clips = render(pipe, prompt, per, seed, steps, scale)
        strips[prompt] = clips[0]
        for frames in clips:
            found, digits_read = judge_clip(frames)
            moved[motion].append(found == motion)
            read[motion].append(all(d == digit for d in digits_read))
            shown[motion].append(found == motion and read[motion][-1])
    mean = {name: {m: float(np.mean(v)) for m, v in table.items()}
            for name, table in (("rates", shown), ("direction", moved), ("digit", read))}
    return {**mean, "clips_per_motion": per * len(DIGITS), "strips": strips}


def table(before: Mapping[str, float], after: Mapping[str, float] | None = None) -> str:
    lines = [f"   {'motion':<8} {'prompt':<22} {'before':>7}" + (f" {'after':>7} {'change':>7}" if after else "")]
    for motion in MOTIONS:
        prompt = caption(0, motion).replace(digits.WORDS[0], "<digit>")
        line = f"   {motion:<8} {prompt:<22} {before[motion]:>7.0%}"
        if after:
            line += f" {after[motion]:>7.0%} {100 * (after[motion] - before[motion]):>+6.0f}p"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, required=True, help="write the LoRA's clips and captions here")
    parser.add_argument("--keep-per-digit", type=int, default=KEEP_CLIPS,
                        help=f"clips of each digit in each trained motion beside them (default {KEEP_CLIPS})")
    args = parser.parse_args(argv)
    if args.keep_per_digit < 0:
        parser.error("--keep-per-digit must be 0 or more")
    counts = write_clips(args.write, args.keep_per_digit)
    print(f"wrote {counts['clips']} clips of digits moving {HELD_OUT_MOTION} to {args.write / 'clips'} and "
          f"{counts['keep']} of the trained motions to {args.write / 'keep'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
