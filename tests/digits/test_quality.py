"""The digits base model, its judge, and a LoRA that learns the digit the base never saw."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from library import digits
from library.config import parse_config
from library.digits import judge
from tests.helpers import family_checks
from tools import make_digit_dataset, pretrain_base

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "models" / "digits-base"


def test_judge_recognises_real_digits_it_was_not_fitted_on():
    accuracy = judge.real_accuracy()
    assert min(accuracy.values()) >= 0.9, accuracy
    assert np.mean(list(accuracy.values())) >= 0.97, accuracy


def test_judge_reads_images_the_way_the_pipeline_writes_them():
    images, labels = digits.load()
    picked = np.concatenate([np.flatnonzero(labels == d)[-5:] for d in range(10)])
    assert (judge.judge(images[picked]) == labels[picked]).mean() >= 0.9
    # RGB as the pipeline returns it, and an 8-cell grid read back exactly.
    assert np.array_equal(judge.judge(digits.to_rgb(images[picked])), judge.judge(images[picked]))
    ink = np.arange(64, dtype=np.float64).reshape(8, 8) % 17
    block = 255 - np.kron(np.rint(ink * 255 / 16), np.ones((4, 4))).astype(np.uint8)
    assert np.allclose(digits.ink_features(block[None])[0], (np.rint(ink * 255 / 16) * 16 / 255).ravel())


def test_committed_dataset_is_what_the_tool_writes():
    assert make_digit_dataset.check(make_digit_dataset.DEFAULT_OUT) == []


def test_the_dataset_holds_out_one_digit_under_the_trigger():
    data = make_digit_dataset.dataset()
    train = data[make_digit_dataset.TRAIN_FOLDER]
    reg = data[make_digit_dataset.REG_FOLDER]
    assert {text for _, _, text in train} == {digits.TRIGGER_CAPTION}
    assert set(judge.judge(np.stack([image for _, image, _ in train]))) <= {digits.HELD_OUT}
    assert {text for _, _, text in reg} == {digits.caption(d) for d in digits.trained_digits()}


def test_base_model_loads_offline_and_holds_the_digit_out():
    from transformers import CLIPTokenizer

    size = sum(p.stat().st_size for p in BASE.rglob("*") if p.is_file())
    assert size < 10 * 2**20
    pipe = judge.load_pipeline(BASE)
    assert 2 ** (len(pipe.vae.config.block_out_channels) - 1) == 4
    assert pipe.unet.config.sample_size * 4 == digits.SIZE
    # Each pretraining caption word is one token; the held-out digit's word and the trigger are not.
    tokenizer = CLIPTokenizer.from_pretrained(BASE, subfolder="tokenizer", local_files_only=True)
    assert all(len(tokenizer.tokenize(digits.WORDS[d])) == 1 for d in digits.trained_digits())
    assert len(tokenizer.tokenize(digits.WORDS[digits.HELD_OUT])) > 1
    assert len(tokenizer.tokenize(digits.TRIGGER)) > 1


def test_base_model_draws_the_digit_it_is_asked_for():
    pipe = judge.load_pipeline(BASE)
    settings = judge.Settings(n=20, seed=1)
    asked = {digits.caption(d): d for d in (0, 3, 4, 8)}
    rates, images = judge.rates(pipe, asked, settings)
    assert min(rates.values()) >= 0.7, rates
    assert all(image.shape == (digits.SIZE, digits.SIZE) for prompt_images in images.values()
               for image in prompt_images)


def test_render_is_fixed_by_the_seed_not_the_batch():
    pipe = judge.load_pipeline(BASE)
    first = judge.render(pipe, digits.caption(3), judge.Settings(n=3, seed=5, steps=4))
    again = judge.render(pipe, digits.caption(3), judge.Settings(n=5, seed=5, steps=4))
    other = judge.render(pipe, digits.caption(3), judge.Settings(n=3, seed=6, steps=4))
    assert np.array_equal(first, again[:3])
    assert not np.array_equal(first, other)


def test_quickstart_trains_what_the_recorded_config_trains(monkeypatch):
    monkeypatch.chdir(REPO)  # the configs' paths are relative to the repository root
    best = parse_config(["--config", "configs/digits_lora.toml"])[0].as_dict()
    quick = parse_config(["--config", "configs/quickstart.toml"])[0].as_dict()
    assert {name for name in best if best[name] != quick[name]} == {"config_file", "output_dir", "output_name"}


@pytest.mark.slow  # 150 steps: about 100 s on 2 CPU cores
def test_a_lora_learns_the_held_out_digit(tmp_path):
    """A short run of the recorded config (150 of its 800 steps): the trigger prompt goes from (almost) never the
    held-out digit to mostly it, judged on the same 100 seeds before and after."""
    steps = 150
    # One thread unless the caller chose: with two threads on a loaded 2-core machine each step ran many times
    # slower (NOTES.md), which is what pushed this run past its old 600 s limit. The result does not depend on it.
    env = {"OMP_NUM_THREADS": "1", **os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "train_network.py"), "--config", str(REPO / "configs" / "digits_lora.toml"),
         "--output_dir", str(tmp_path), "--output_name", "lora", "--max_train_steps", str(steps)],
        # A guard against a hung run, not a speed check: about 40 CPU-seconds (70 s wall at load 3) when quiet;
        # 30 minutes leaves room for a machine 25x slower than that.
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    lora = tmp_path / "lora.safetensors"

    settings = judge.Settings(n=100, seed=0)
    asked = {digits.TRIGGER_CAPTION: digits.HELD_OUT}
    before, _ = judge.rates(judge.load_pipeline(BASE), asked, settings)
    after, _ = judge.rates(judge.load_pipeline(BASE, lora), asked, settings)
    assert before[digits.TRIGGER_CAPTION] <= 0.10, before
    assert after[digits.TRIGGER_CAPTION] >= 0.50, after


def test_pretraining_is_seeded(tmp_path):
    """Two short pretraining runs from the same seed give the same weights; another seed does not."""
    recipe = pretrain_base.Recipe(vae_steps=2, vae_batch=4, steps=2, batch=4, warmup_steps=1)

    def train(parts, pixels, labels) -> None:
        pretrain_base.train_vae(parts["vae"], pixels, recipe)
        means, stds = pretrain_base.encode(parts["vae"], pixels)
        pretrain_base.train_denoiser(parts["unet"], parts["text_encoder"], parts["tokenizer"], parts["scheduler"],
                                     means, stds, labels, 1.0, recipe)

    family_checks.assert_pretraining_is_seeded(pretrain_base, recipe.threads, train, ("vae", "unet", "text_encoder"),
                                               denoiser="unet")
