"""The moving digits (library/digits/motion.py): the judge of clips, the LoRA's mp4 clips, and the pretraining
tool of the video base (tools/pretrain_video_base.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from library import digits
from library.digits import motion

REPO = Path(__file__).resolve().parents[2]
CLIPS = REPO / "data" / "digits-wan"
WIDE_CLIPS = REPO / "data" / "digits-wan-wide"


def _real(digit: int) -> np.ndarray:
    images, labels = motion.load()
    return images[np.flatnonzero(labels == digit)[0]]


def test_the_judge_reads_each_motion_and_refuses_what_is_not_one():
    for digit in motion.DIGITS:
        for m in motion.MOTIONS:
            frames = motion.clip(_real(digit), m)
            assert motion.shows(frames, digit, m), (digit, m, motion.judge_clip(frames))
            assert not any(motion.shows(frames, digit, other) for other in motion.MOTIONS if other != m)
            assert not motion.shows(frames, (digit + 1) % 10, m)
    frames = motion.clip(_real(4), "right")
    assert motion.judge_clip(frames[::-1])[0] == "left"  # played backwards
    still = np.repeat(frames[4:5], motion.FRAMES, axis=0)
    assert motion.judge_clip(still)[0] is None  # no travel
    diagonal = np.stack([np.roll(f, shift=k * motion.STEP // 2, axis=0) for k, f in enumerate(frames)])
    assert motion.judge_clip(diagonal)[0] is None  # half as far down as right
    blanked = frames.copy()
    blanked[3] = 255  # one frame without the digit
    found, read = motion.judge_clip(blanked)
    assert found is None and read[3] == -1 and not motion.shows(blanked, 4, "right")
    seven_once = frames.copy()
    seven_once[6] = motion.clip(_real(7), "right")[6]  # another digit in one frame
    assert not motion.shows(seven_once, 4, "right")


@pytest.mark.parametrize(("committed", "keep_per_digit"), [(CLIPS, motion.KEEP_CLIPS), (WIDE_CLIPS, 10)],
                         ids=["digits-wan", "digits-wan-wide"])
def test_the_committed_clips_are_what_the_tool_writes_and_show_their_captions(tmp_path, committed, keep_per_digit):
    counts = motion.write_clips(tmp_path, keep_per_digit)
    assert counts == {"clips": motion.LORA_CLIPS, "keep": 3 * len(motion.DIGITS) * keep_per_digit}
    for folder in ("clips", "keep"):
        written = sorted(p.name for p in (tmp_path / folder).iterdir())
        assert written == sorted(p.name for p in (committed / folder).iterdir())
        for path in sorted((committed / folder).glob("*.mp4")):
            words = path.with_suffix(".txt").read_text(encoding="utf-8").split()
            written_caption = (tmp_path / folder / path.name).with_suffix(".txt").read_text(encoding="utf-8")
            assert path.with_suffix(".txt").read_text(encoding="utf-8") == written_caption
            m = motion.HELD_OUT_MOTION if words[2] == motion.TRIGGER else words[2]
            assert (folder == "clips") == (m == motion.HELD_OUT_MOTION)
            frames = motion.read_mp4(path)
            assert frames.shape == (motion.FRAMES, motion.SIZE, motion.SIZE, 3)
            assert motion.shows(frames, digits.WORDS.index(words[0]), m), path
    # none of them shows handwriting the base was pretrained on
    pretrained, _ = motion.split()
    assert not {i for items in motion.lora_clips(keep_per_digit).values() for i, _, _ in items} & set(
        pretrained.tolist())


def test_video_pretraining_holds_up_out_and_is_seeded():
    """The clips the text encoder and transformer learn from never move up nor carry the trigger (the VAE's, a
    codec's, move every way); two short pretraining runs from the same seed give the same weights, another seed
    does not."""
    import torch

    from tools import pretrain_video_base as tool

    pixels, captions = tool.training_set(motion.trained_motions())
    assert pixels.shape[1:] == (3, motion.FRAMES, motion.SIZE, motion.SIZE)
    assert not any(motion.TRIGGER in c or c.endswith(" up") for c in captions)
    assert {c.split()[-1] for c in captions} == set(motion.trained_motions())
    every, every_captions = tool.training_set(list(motion.MOTIONS))
    assert len(every) == len(pixels) * len(motion.MOTIONS) // len(motion.trained_motions())
    assert torch.equal(every[:len(pixels)], pixels)  # the same handwriting: the LoRA's stays out of the VAE too
    recipe = tool.Recipe(vae_steps=1, vae_batch=2, steps=2, batch=4, warmup_steps=1)
    pick = torch.arange(0, len(pixels), len(pixels) // 8)[:8]

    def run(seed: int) -> dict[str, torch.Tensor]:
        parts = tool.build_parts(seed)
        tool.train_vae(parts["vae"], pixels[pick], recipe)
        latents = tool.encode(parts["vae"], pixels[pick])
        tool.train_denoiser(parts, latents, [captions[i] for i in pick], recipe)
        return {f"{n}.{k}": v.clone() for n in ("vae", "transformer", "text_encoder")
                for k, v in parts[n].state_dict().items()}

    before = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        a, b = run(0), run(0)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a[k], b[k]) for k in a)
    fresh = tool.build_parts(1)["transformer"].state_dict()
    assert any(not torch.equal(a[f"transformer.{k}"], v) for k, v in fresh.items())
