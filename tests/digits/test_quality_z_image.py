"""The Z-Image digits base (models/digits-z-image), judged as digits-flux is. Whether a LoRA teaches it the held-out
digit is left to bench/quality.py (configs/digits_z_image_lora.toml): that run costs minutes, too much here."""
from __future__ import annotations

from pathlib import Path

import torch

from library import digits
from library.config import parse_config
from library.digits import judge
from library.families.loading import LoadRequest
from library.families.z_image import family as z_image
from tests.helpers import family_checks
from tools import pretrain_z_image_base

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "models" / "digits-z-image"
CONFIG = REPO / "configs" / "digits_z_image_lora.toml"


def test_z_image_base_is_what_the_recipe_builds_and_holds_the_digit_out():
    pipe = family_checks.load_small_base(BASE)
    assert judge.is_z_image(pipe) and not judge.is_flux(pipe) and judge.is_z_image(BASE)
    # The folder loads as the trainer loads a Z-Image folder.
    assert isinstance(z_image.load_z_image_folder(LoadRequest(BASE)).family, z_image.ZImage)
    built = pretrain_z_image_base.build_parts(0)
    for name in ("transformer", "vae", "text_encoder"):
        saved, fresh = family_checks.config_dict(getattr(pipe, name)), family_checks.config_dict(built[name])
        differ = family_checks.differing_config(saved, fresh)
        assert differ == set(), (name, differ)
    # The VAE is digits-flux's, as Z-Image's is FLUX.1's.
    flux_vae = built["vae"].state_dict()
    assert all(torch.equal(v, flux_vae[k]) for k, v in pipe.vae.state_dict().items())
    assert pipe.vae_scale_factor == 4 and pipe.vae.config.latent_channels == 16
    # Each caption word is one token; the held-out digit's word and the trigger fall apart.
    tokenizer = pipe.tokenizer
    assert all(len(tokenizer.tokenize(digits.WORDS[d])) == 1 for d in digits.trained_digits())
    assert len(tokenizer.tokenize(digits.WORDS[digits.HELD_OUT])) > 1
    assert len(tokenizer.tokenize(digits.TRIGGER)) > 1
    lora_config = parse_config(["--config", str(CONFIG)])[0]
    assert Path(lora_config.pretrained_model_name_or_path) == Path("models/digits-z-image")
    assert lora_config.discrete_flow_shift == pipe.scheduler.config.shift == pretrain_z_image_base.FLOW_SHIFT
    family_checks.assert_recipe_in_card(BASE, pretrain_z_image_base.Recipe())


def test_z_image_base_draws_the_digit_it_is_asked_for_and_not_the_held_out_one():
    family_checks.assert_draws_the_asked_digit_and_not_the_held_out_one(BASE)


def test_z_image_pretraining_is_seeded():
    """Two short pretraining runs from the same seed give the same weights; another seed does not."""
    recipe = pretrain_z_image_base.Recipe(steps=2, batch=4, warmup_steps=1)

    def train(parts, pixels, labels) -> None:
        means, stds = pretrain_z_image_base.encode(parts["vae"], pixels)
        pretrain_z_image_base.train_denoiser(parts, means, stds, labels, (0.0, 1.0), recipe)

    family_checks.assert_pretraining_is_seeded(pretrain_z_image_base, recipe.threads, train,
                                               ("transformer", "text_encoder"))
