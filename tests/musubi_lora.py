"""musubi-tuner's LoRA module rule and a random LoRA over our targets, for the Z-Image and Qwen-Image tests."""
from __future__ import annotations

import re
from typing import Iterable

import torch


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
