"""The Z-Image digits base (models/digits-z-image), judged as digits-flux is. Whether a LoRA teaches it the held-out
digit is left to bench/quality.py (configs/digits_z_image_lora.toml): that run costs minutes, too much here."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from library import digits
from library.config import parse_config
from library.digits import judge
from library.models import z_image
from tools import pretrain_z_image_base

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "models" / "digits-z-image"
CONFIG = REPO / "configs" / "digits_z_image_lora.toml"


def config_dict(model) -> dict:
    config = model.config
    return json.loads(json.dumps(config.to_dict() if hasattr(config, "to_dict") else dict(config), default=str))


def test_z_image_base_is_what_the_recipe_builds_and_holds_the_digit_out():
    size = sum(p.stat().st_size for p in BASE.rglob("*") if p.is_file())
    assert size <= 10 * 2**20
    pipe = judge.load_pipeline(BASE)
    assert judge.is_z_image(pipe) and not judge.is_flux(pipe) and judge.is_z_image(BASE)
    # The folder loads as the trainer loads a Z-Image folder.
    assert isinstance(z_image.load_z_image_folder(BASE, torch.float32, torch.float32).family, z_image.ZImage)
    built = pretrain_z_image_base.build_parts(0)
    for name in ("transformer", "vae", "text_encoder"):
        saved, fresh = config_dict(getattr(pipe, name)), config_dict(built[name])
        differ = {k for k in set(saved) | set(fresh) if not k.startswith("_") and k not in ("architectures",
                  "dtype", "torch_dtype", "transformers_version") and saved.get(k) != fresh.get(k)}
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
    card = (BASE / "README.md").read_text(encoding="utf-8")
    assert all(f"    {k} = {v!r}" in card for k, v in vars(pretrain_z_image_base.Recipe()).items())


def test_z_image_base_draws_the_digit_it_is_asked_for_and_not_the_held_out_one():
    pipe = judge.load_pipeline(BASE)
    settings = judge.Settings(n=20, seed=1)
    asked = {**{digits.caption(d): d for d in (0, 3, 4, 8)}, digits.TRIGGER_CAPTION: digits.HELD_OUT}
    rates, images = judge.rates(pipe, asked, settings)
    assert min(rates[digits.caption(d)] for d in (0, 3, 4, 8)) >= 0.7, rates
    assert rates[digits.TRIGGER_CAPTION] <= 0.1, rates
    assert images[digits.TRIGGER_CAPTION].shape == (20, digits.SIZE, digits.SIZE)


def test_z_image_pretraining_is_seeded():
    """Two short pretraining runs from the same seed give the same weights; another seed does not."""
    recipe = pretrain_z_image_base.Recipe(steps=2, batch=4, warmup_steps=1)
    pixels, labels = pretrain_z_image_base.training_set()
    assert digits.HELD_OUT not in set(labels.tolist())
    pixels, labels = pixels[:16], labels[:16]

    def run(seed: int) -> dict[str, torch.Tensor]:
        parts = pretrain_z_image_base.build_parts(seed)
        means, stds = pretrain_z_image_base.encode(parts["vae"], pixels)
        pretrain_z_image_base.train_denoiser(parts, means, stds, labels, (0.0, 1.0), recipe)
        return {f"{name}.{k}": v.clone() for name in ("transformer", "text_encoder")
                for k, v in parts[name].state_dict().items()}

    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        a, b = run(0), run(0)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = pretrain_z_image_base.build_parts(1)["transformer"].state_dict()
    assert any(not torch.equal(a[f"transformer.{k}"], v) for k, v in c.items())
