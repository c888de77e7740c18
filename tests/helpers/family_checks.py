"""Checks the model family tests run alike: sampling against the family's diffusers pipeline, ComfyUI's key rule on a
native layout, and the digits bases (models/digits-*) against the recipe that builds them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tests.helpers.lora_files import deltas, file_delta

# --- sampling -----------------------------------------------------------------------------------------------------


def sampling_models(components, family=None):
    """SamplingModels over the loaded components, each prompt encoded alone by `family` (the components' own unless
    given) as training encodes it."""
    from library.monitoring.sampling import SamplingModels

    family = family or components.family
    tokenize = family.tokenizer(components, None)

    def encode_text(text):
        return family.encode_text(components.text_encoders, {k: v[None] for k, v in tokenize(text).items()}, None)

    return SamplingModels(components.denoiser, components.text_encoders, components.vae, components.tokenizers,
                          components.noise_scheduler.config, family, None, encode_text)


def sample(models, tmp_path: Path, lines: str) -> tuple[list, list[np.ndarray]]:
    """The prompts of a prompt file holding `lines`, and the image our sampler draws for each (seed 3)."""
    from library.monitoring.sample_prompts import load_prompts
    from library.monitoring.sampling import generate_image

    path = tmp_path / "prompts.txt"
    path.write_text(lines)
    prompts = load_prompts(path)
    with torch.no_grad():
        return prompts, [np.asarray(generate_image(p, models, seed=3)) for p in prompts]


def pipeline_scheduler(components):
    """A fresh FlowMatchEulerDiscreteScheduler from the training schedule's config, for the family's pipeline."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler.from_config(components.noise_scheduler.config)


def assert_same_image(ours: np.ndarray, theirs) -> None:
    theirs = np.asarray(theirs)
    assert ours.shape == (64, 64, 3)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1  # uint8 rounding of the same decode


# --- ComfyUI ------------------------------------------------------------------------------------------------------


def assert_comfyui_key_rule_patches_our_change(state: dict[str, torch.Tensor], model: torch.nn.Module,
                                               base: torch.nn.Module,
                                               native_state_dict: Callable[[torch.nn.Module], dict]) -> None:
    """ComfyUI (comfy/lora.py model_lora_keys_unet) names every weight `diffusion_model.<path>.weight` of its native
    model `lora_unet_<path, . -> _>` and adds up @ down * alpha / rank to it: every module of the file `state` must
    name such a weight of `native_state_dict(base)`, and the patched weights must equal `model`'s (`base` with our
    LoRA attached) in that layout. Loads the merged weights into `base`."""
    native = native_state_dict(base)
    key_map = {"lora_unet_" + k[:-len(".weight")].replace(".", "_"): k for k in native if k.endswith(".weight")}
    names = {key.split(".")[0] for key in state}
    assert names <= set(key_map)
    patched = dict(native)
    for name in names:
        patched[key_map[name]] = native[key_map[name]] + file_delta(state, name)
    merged = base.state_dict()
    for path, delta in deltas(model).items():
        merged[f"{path}.weight"] = merged[f"{path}.weight"] + delta
    base.load_state_dict(merged)
    for key, tensor in native_state_dict(base).items():
        torch.testing.assert_close(patched[key], tensor, rtol=1e-5, atol=1e-6)


# --- the digits bases ---------------------------------------------------------------------------------------------


def config_dict(model) -> dict:
    config = model.config
    return json.loads(json.dumps(config.to_dict() if hasattr(config, "to_dict") else dict(config), default=str))


def differing_config(saved: dict, fresh: dict) -> set[str]:
    """The config keys whose values differ, but for the private ones and those naming library versions."""
    return {k for k in set(saved) | set(fresh) if not k.startswith("_") and k not in ("architectures", "dtype",
            "torch_dtype", "transformers_version") and saved.get(k) != fresh.get(k)}


def load_small_base(base: Path):
    """The base folder, at most 10 MiB, loaded as the judge loads it."""
    from library.digits import judge

    size = sum(p.stat().st_size for p in base.rglob("*") if p.is_file())
    assert size <= 10 * 2**20
    return judge.load_pipeline(base)


def assert_recipe_in_card(base: Path, recipe) -> None:
    """The base's README.md lists every field of the recipe it was built with."""
    card = (base / "README.md").read_text(encoding="utf-8")
    assert all(f"    {k} = {v!r}" in card for k, v in vars(recipe).items())


def assert_draws_the_asked_digit_and_not_the_held_out_one(base: Path) -> None:
    from library import digits
    from library.digits import judge

    pipe = judge.load_pipeline(base)
    settings = judge.Settings(n=20, seed=1)
    asked = {**{digits.caption(d): d for d in (0, 3, 4, 8)}, digits.TRIGGER_CAPTION: digits.HELD_OUT}
    rates, images = judge.rates(pipe, asked, settings)
    assert min(rates[digits.caption(d)] for d in (0, 3, 4, 8)) >= 0.7, rates
    assert rates[digits.TRIGGER_CAPTION] <= 0.1, rates
    assert images[digits.TRIGGER_CAPTION].shape == (20, digits.SIZE, digits.SIZE)


def assert_pretraining_is_seeded(tool, threads: int, train: Callable, parts: tuple[str, ...],
                                 denoiser: str = "transformer") -> None:
    """Two short pretraining runs of `tool` (a tools/pretrain_* module) from the same seed give the same weights of
    `parts`; another seed's `denoiser` differs. `train(parts, pixels, labels)` trains freshly built parts on 16
    images of the training set (which holds the digit out), at `threads` threads as the script runs."""
    from library import digits

    pixels, labels = tool.training_set()
    assert digits.HELD_OUT not in set(labels.tolist())
    pixels, labels = pixels[:16], labels[:16]

    def run(seed: int) -> dict[str, torch.Tensor]:
        built = tool.build_parts(seed)
        train(built, pixels, labels)
        return {f"{name}.{k}": v.clone() for name in parts for k, v in built[name].state_dict().items()}

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = run(0), run(0)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = tool.build_parts(1)[denoiser].state_dict()
    assert any(not torch.equal(a[f"{denoiser}.{k}"], v) for k, v in c.items())
