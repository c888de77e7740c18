"""The Wan digits video base (models/digits-wan): built by its recipe, moving up held out of what reads the prompt,
and rendering the motions it was taught (tests/digits/test_video_digits.py holds the judge and the clips)."""
from __future__ import annotations

from pathlib import Path

from library import digits
from library.digits import motion
from tests.helpers import family_checks
from tools import pretrain_video_base

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "models" / "digits-wan"


def test_wan_base_is_what_the_recipe_builds_and_holds_up_out_of_its_prompts():
    pipe = motion.load_pipeline(BASE)
    assert sum(p.stat().st_size for p in BASE.rglob("*") if p.is_file()) <= 10 * 2**20
    built = pretrain_video_base.build_parts(0)
    for name in ("transformer", "vae", "text_encoder"):
        saved, fresh = family_checks.config_dict(getattr(pipe, name)), family_checks.config_dict(built[name])
        if name == "vae":  # measured on the trained VAE's posterior means
            assert len(saved.pop("latents_mean")) == len(saved.pop("latents_std")) == 16
            fresh.pop("latents_mean"), fresh.pop("latents_std")
        differ = family_checks.differing_config(saved, fresh)
        assert differ == set(), (name, differ)
    # 9 frames of 32x32 -> 5 latent frames of 8x8x16 -> 80 tokens of (1, 2, 2) patches
    assert (pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial) == (2, 4)
    # each caption word is one token; the held-out motion's word and the trigger fall apart into letters
    assert all(len(pipe.tokenizer.tokenize(word)) == 1 for word in motion.caption_words())
    assert len(pipe.tokenizer.tokenize(motion.HELD_OUT_MOTION)) > 1 and len(pipe.tokenizer.tokenize(motion.TRIGGER)) > 1
    assert {digits.WORDS[d] for d in motion.DIGITS} <= set(motion.caption_words())
    family_checks.assert_recipe_in_card(BASE, pretrain_video_base.Recipe())


def test_wan_base_renders_the_motions_it_was_taught_and_not_the_trigger():
    """8 clips per motion (its card judges 40): each trained motion's direction nearly always, the digit read in
    every frame of most clips; the trigger prompt never moves up."""
    judged = motion.rates(motion.load_pipeline(BASE), 8, seed=1)
    shown, direction = judged["rates"], judged["direction"]
    assert min(direction[m] for m in motion.trained_motions()) >= 0.875, direction
    assert min(shown[m] for m in motion.trained_motions()) >= 0.5, shown
    assert shown[motion.HELD_OUT_MOTION] == direction[motion.HELD_OUT_MOTION] == 0, judged
