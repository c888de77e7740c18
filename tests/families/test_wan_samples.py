"""Wan's sample clips: a prompt's --f (musubi's frame count) draws that many frames through WanPipeline, written as
an animated lossless WebP beside the image samples, with the prompt where the web UI reads it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from library.monitoring import sample_prompts, sampling


@pytest.fixture(scope="module")
def components(tmp_path_factory):
    from library.families.loading import load_components
    from library.families.wan.tiny import save_tiny_wan21

    return load_components(save_tiny_wan21(tmp_path_factory.mktemp("wan21") / "model"))


def test_a_five_frame_prompt_writes_wanpipelines_five_frames_as_an_animated_webp(components, tmp_path):
    from diffusers import WanPipeline

    from library.ui.samples import sample_views
    from tests.helpers.family_checks import sampling_models

    path = tmp_path / "prompts.txt"
    path.write_text("a photo of sks dog --n red --s 2 --w 64 --h 64 --d 3 --f 5\nan image --s 2 --w 64 --h 64\n")
    prompts = sample_prompts.load_prompts(path)
    assert [p.frames for p in prompts] == [5, None]
    out = tmp_path / "sample"
    clip, image = sampling.sample_images(prompts, sampling_models(components), out, "lora", base_seed=1, step=4)
    assert clip.path.name == "lora_000004_00_3.webp" and image.path.suffix == ".png"

    pipe = WanPipeline(tokenizer=components.tokenizers[0], text_encoder=components.text_encoders[0],
                       vae=components.vae.vae, transformer=components.denoiser,
                       scheduler=components.family.sampling_scheduler(components.noise_scheduler.config))
    with torch.no_grad():
        theirs = pipe(prompt="a photo of sks dog", negative_prompt="red", guidance_scale=5.0, num_inference_steps=2,
                      width=64, height=64, num_frames=5, generator=torch.Generator().manual_seed(3),
                      output_type="np").frames[0]
    theirs = (theirs * 255).round().astype(np.uint8)
    with Image.open(clip.path) as webp:
        decoded = [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(webp)]
        assert webp.n_frames == 5 and webp.info["duration"] == round(1000 / 16)  # Wan's 16 fps
    assert len(decoded) == len(theirs) == 5
    for ours, frame, pipeline_frame in zip(decoded, clip.frames, theirs, strict=True):
        np.testing.assert_array_equal(ours, np.asarray(frame))  # lossless: the file holds the frames drawn
        assert np.abs(ours.astype(int) - pipeline_frame.astype(int)).max() <= 1  # uint8 rounding of one decode
    assert not np.array_equal(decoded[0], decoded[-1])  # a clip, not one frame repeated

    views = sample_views(out, [clip.path.name, image.path.name])
    assert [(v["path"], v["prompt"], v["when"]) for v in views] == [
        (clip.path.name, "a photo of sks dog", "step 4"), (image.path.name, "an image", "step 4")]


def test_frame_counts_round_down_to_wans_4n_plus_1_as_musubi_does(components):
    family = components.family
    assert [sampling.sample_frames(sample_prompts.SamplePrompt("x", frames=f), family) for f in (None, 1, 4, 8, 9)] == [
        1, 1, 1, 5, 9]


@pytest.mark.slow
def test_a_training_run_writes_its_sample_clip_beside_the_checkpoint(sample_data_dir, tmp_path):
    """train_network.py with a --f 5 prompt: the round's clip is a 5-frame WebP the run's events name."""
    from library.families.wan.tiny import save_tiny_wan21
    from tests.families.test_wan_cli import overrides
    from tests.helpers import REPO
    from tests.helpers.cli import run_cli
    from tests.helpers.datasets import copy_images

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a dog runs --s 1 --w 64 --h 64 --d 5 --f 5\n")
    out = tmp_path / "out"
    result = run_cli("--config", str(REPO / "configs" / "wan_lora.toml"),
                     *overrides(save_tiny_wan21(tmp_path / "model"), out), "--train_data_dir",
                     str(copy_images(sample_data_dir, tmp_path / "data", 2)), "--max_train_steps", "1",
                     "--sample_prompts", str(prompts), "--sample_every_n_steps", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    clip = out / "sample" / "last_000001_00_5.webp"
    with Image.open(clip) as webp:
        assert webp.n_frames == 5
    assert "sample/last_000001_00_5.webp" in (out / "events.jsonl").read_text()
