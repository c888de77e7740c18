"""The FLUX digits base (models/digits-flux), judged as digits-base is, and a FLUX LoRA that learns the held-out
digit under the trigger (tests/digits/test_quality.py holds the SD side and the judge itself)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from library import digits
from library.config import parse_config
from library.digits import judge
from tests.helpers import family_checks
from tools import pretrain_flux_base

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "models" / "digits-flux"
CONFIG = REPO / "configs" / "digits_flux_lora.toml"


def test_flux_base_is_what_the_recipe_builds_and_holds_the_digit_out():
    pipe = family_checks.load_small_base(BASE)
    assert judge.is_flux(pipe) and pipe.transformer.config.guidance_embeds  # FLUX.1 dev-shaped
    built = pretrain_flux_base.build_parts(0)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        saved, fresh = family_checks.config_dict(getattr(pipe, name)), family_checks.config_dict(built[name])
        if name == "vae":  # measured on the trained VAE
            assert saved.pop("shift_factor") is not None and saved.pop("scaling_factor") != fresh["scaling_factor"]
            fresh.pop("shift_factor"), fresh.pop("scaling_factor")
        differ = family_checks.differing_config(saved, fresh)
        assert differ == set(), (name, differ)
    # 32 px -> 8x8x16 latents -> 16 packed tokens of 64.
    assert pipe.vae_scale_factor == 4 and pipe.vae.config.latent_channels == 16
    assert pipe.transformer.config.in_channels == 64
    # Each caption word is one token; the held-out digit's word and the trigger fall apart, in both tokenizers.
    for tokenizer, split in ((pipe.tokenizer, 1), (pipe.tokenizer_2, 1)):
        assert all(len(tokenizer.tokenize(digits.WORDS[d])) == split for d in digits.trained_digits())
        assert len(tokenizer.tokenize(digits.WORDS[digits.HELD_OUT])) > 1
        assert len(tokenizer.tokenize(digits.TRIGGER)) > 1
    lora_config = parse_config(["--config", str(CONFIG)])[0]
    assert pipe.tokenizer_2.model_max_length == lora_config.t5xxl_max_token_length == pretrain_flux_base.T5_LENGTH
    family_checks.assert_recipe_in_card(BASE, pretrain_flux_base.Recipe())


def test_flux_base_draws_the_digit_it_is_asked_for_and_not_the_held_out_one():
    family_checks.assert_draws_the_asked_digit_and_not_the_held_out_one(BASE)


@pytest.mark.slow  # about 130 s on 2 CPU cores
def test_a_flux_lora_learns_the_held_out_digit(tmp_path):
    """The recorded config as it stands (it trains in about a minute at one thread): the trigger prompt goes from
    (almost) never the held-out digit to at least 80 % of it, and no other digit's prompt loses more than 10
    points, judged on the same 50 seeds before and after (bench/quality.py's targets; it judges 100)."""
    env = {"OMP_NUM_THREADS": "1", **os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "train_network.py"), "--config", str(CONFIG), "--output_dir", str(tmp_path),
         "--output_name", "lora"],
        # A guard against a hung run, not a speed check (see test_a_lora_learns_the_held_out_digit).
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    settings = judge.Settings(n=50, seed=0)  # the first 50 of bench/quality.py's 100 images of each prompt
    asked = judge.prompts()
    before, _ = judge.rates(judge.load_pipeline(BASE), asked, settings)
    after, _ = judge.rates(judge.load_pipeline(BASE, tmp_path / "lora.safetensors"), asked, settings)
    assert before[digits.TRIGGER_CAPTION] <= 0.10, before
    assert after[digits.TRIGGER_CAPTION] >= 0.80, after
    drops = {p: before[p] - after[p] for p in asked if p != digits.TRIGGER_CAPTION}
    assert max(drops.values()) <= 0.10, (before, after)


def test_flux_pretraining_is_seeded():
    """Two short pretraining runs from the same seed give the same weights; another seed does not."""
    recipe = pretrain_flux_base.Recipe(vae_steps=2, vae_batch=4, steps=2, batch=4, warmup_steps=1)

    def train(parts, pixels, labels) -> None:
        pretrain_flux_base.train_vae(parts["vae"], pixels, recipe)
        means, stds = pretrain_flux_base.encode(parts["vae"], pixels)
        pretrain_flux_base.train_denoiser(parts, means, stds, labels, (0.0, 1.0), recipe)

    family_checks.assert_pretraining_is_seeded(pretrain_flux_base, recipe.threads, train,
                                               ("vae", "transformer", "text_encoder", "text_encoder_2"))
