"""musubi-tuner's LoRA module rule, a random LoRA over our targets, and the checks the Z-Image and Qwen-Image tests
run alike: diffusers' loader taking our file, and ComfyUI's split files loading as the folder."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import pytest
import torch

from library.config import UserError
from tests.helpers.lora_files import file_delta


def musubi_lora_names(transformer: torch.nn.Module, block_class: str, exclude: str) -> set[str]:
    """musubi's networks.lora create_modules: every Linear inside the target block class whose dotted path does not
    match the exclude pattern, named lora_unet_<path with underscores>."""
    pattern = re.compile(exclude)
    names = set()
    for name, module in transformer.named_modules():
        if module.__class__.__name__ != block_class:
            continue
        for child_name, child in module.named_modules():
            original = (name + "." if name else "") + child_name
            if child.__class__.__name__ == "Linear" and not pattern.fullmatch(original):
                names.add(f"lora_unet.{original}".replace(".", "_"))
    return names


def random_lora(transformer: torch.nn.Module, targets: Iterable[str], rank: int = 4, alpha: float = 2.0,
                seed: int = 0) -> dict[str, torch.Tensor]:
    """A kohya-named LoRA with random down and up weights on each target layer."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name in targets:
        layer = transformer.get_submodule(name)
        key = "lora_unet_" + name.replace(".", "_")
        state[f"{key}.lora_down.weight"] = torch.randn(rank, layer.in_features, generator=g)
        state[f"{key}.lora_up.weight"] = torch.randn(layer.out_features, rank, generator=g)
        state[f"{key}.alpha"] = torch.tensor(alpha)
    return state


def assert_diffusers_layers_change_as_ours(transformer: torch.nn.Module, ours: dict[str, torch.Tensor]) -> None:
    """After a pipeline's load_lora_weights of our file (adapter "ours"): every module of `ours` (kohya-named) is a
    LoRA layer of `transformer`, and its weight change equals ours (alpha / rank applied), to 1e-6."""
    loaded = {name: module for name, module in transformer.named_modules() if hasattr(module, "lora_A")}
    assert {"lora_unet_" + name.replace(".", "_") for name in loaded} == {k.split(".")[0] for k in ours}
    for name, module in loaded.items():
        expected = file_delta(ours, "lora_unet_" + name.replace(".", "_"))
        torch.testing.assert_close(module.get_delta_weight("ours"), expected, rtol=1e-5, atol=1e-6)


def load_split_files(files: dict, folder: Path):
    """ComfyUI's split files (diffusion_models/, text_encoders/, vae/) with the folder as model_config: refused
    without the text encoder's file, loaded with it."""
    from library.families.loading import load_components

    assert {p.parent.name for p in files.values()} == {"diffusion_models", "text_encoders", "vae"}
    with pytest.raises(UserError, match="text_encoder"):
        load_components(files["transformer"], model_config=folder, ae=str(files["ae"]))
    return load_components(files["transformer"], model_config=folder, text_encoder=str(files["text_encoder"]),
                           ae=str(files["ae"]))


def assert_same_weights(loaded, components) -> None:
    """The transformer, the VAE and the text encoder of `loaded` hold the weights of `components`'."""
    for ours, reference in ((loaded.denoiser, components.denoiser), (loaded.vae, components.vae),
                            (loaded.text_encoders[0], components.text_encoders[0])):
        a, b = ours.state_dict(), reference.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def encode_captions(components, captions: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The batched token ids of `captions` as the family tokenizes them, and its text encoder's outputs for them."""
    family = components.family
    tokenize = family.tokenizer(components, None)
    tokens = [tokenize(c) for c in captions]
    batch = {k: torch.stack([t[k] for t in tokens]) for k in tokens[0]}
    with torch.no_grad():
        return batch, family.encode_text(components.text_encoders, batch, None)
