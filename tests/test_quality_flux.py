"""The FLUX digits base (models/digits-flux), judged as digits-base is, and a FLUX LoRA that learns the held-out
digit under the trigger (tests/test_quality.py holds the SD side and the judge itself)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from library import digits
from library.config import parse_config
from library.digits import judge
from tools import pretrain_flux_base

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "models" / "digits-flux"
CONFIG = REPO / "configs" / "digits_flux_lora.toml"


def config_dict(model) -> dict:
    config = model.config
    return json.loads(json.dumps(config.to_dict() if hasattr(config, "to_dict") else dict(config), default=str))


def test_flux_base_is_what_the_recipe_builds_and_holds_the_digit_out():
    size = sum(p.stat().st_size for p in BASE.rglob("*") if p.is_file())
    assert size <= 10 * 2**20
    pipe = judge.load_pipeline(BASE)
    assert judge.is_flux(pipe) and pipe.transformer.config.guidance_embeds  # FLUX.1 dev-shaped
    built = pretrain_flux_base.build_parts(0)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        saved, fresh = config_dict(getattr(pipe, name)), config_dict(built[name])
        if name == "vae":  # measured on the trained VAE
            assert saved.pop("shift_factor") is not None and saved.pop("scaling_factor") != fresh["scaling_factor"]
            fresh.pop("shift_factor"), fresh.pop("scaling_factor")
        differ = {k for k in set(saved) | set(fresh) if not k.startswith("_") and k not in ("architectures",
                  "dtype", "torch_dtype", "transformers_version") and saved.get(k) != fresh.get(k)}
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
    card = (BASE / "README.md").read_text(encoding="utf-8")
    assert all(f"    {k} = {v!r}" in card for k, v in vars(pretrain_flux_base.Recipe()).items())


def test_flux_base_draws_the_digit_it_is_asked_for_and_not_the_held_out_one():
    pipe = judge.load_pipeline(BASE)
    settings = judge.Settings(n=20, seed=1)
    asked = {**{digits.caption(d): d for d in (0, 3, 4, 8)}, digits.TRIGGER_CAPTION: digits.HELD_OUT}
    rates, images = judge.rates(pipe, asked, settings)
    assert min(rates[digits.caption(d)] for d in (0, 3, 4, 8)) >= 0.7, rates
    assert rates[digits.TRIGGER_CAPTION] <= 0.1, rates
    assert images[digits.TRIGGER_CAPTION].shape == (20, digits.SIZE, digits.SIZE)


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
    pixels, labels = pretrain_flux_base.training_set()
    assert digits.HELD_OUT not in set(labels.tolist())
    pixels, labels = pixels[:16], labels[:16]

    def run(seed: int) -> dict[str, torch.Tensor]:
        parts = pretrain_flux_base.build_parts(seed)
        pretrain_flux_base.train_vae(parts["vae"], pixels, recipe)
        means, stds = pretrain_flux_base.encode(parts["vae"], pixels)
        pretrain_flux_base.train_denoiser(parts, means, stds, labels, (0.0, 1.0), recipe)
        return {f"{name}.{k}": v.clone() for name in ("vae", "transformer", "text_encoder", "text_encoder_2")
                for k, v in parts[name].state_dict().items()}

    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        a, b = run(0), run(0)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = pretrain_flux_base.build_parts(1)["transformer"].state_dict()
    assert any(not torch.equal(a[f"transformer.{k}"], v) for k, v in c.items())
