"""LoRA on peft layers with random up weights, and the weight change each layer or kohya file entry holds."""
from __future__ import annotations

import torch

from library.network import lora


def attached(transformer, modules, overrides, seed, rank=4, alpha=2.0):
    """LoRA on `modules`, with random up weights."""
    lora.attach_lora(transformer, modules, rank, alpha, overrides=overrides)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora.lora_layers(transformer):
            layer.lora_B["default"].weight.copy_(torch.randn(layer.lora_B["default"].weight.shape, generator=g))
    return transformer


def deltas(transformer) -> dict[str, torch.Tensor]:
    """Module path -> the weight change of its peft LoRA."""
    return {name: layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
            for name, layer in lora.lora_layers(transformer)}


def file_delta(state_dict, name):
    """The weight change a kohya file's `name` entry holds."""
    down, up = state_dict[f"{name}.lora_down.weight"], state_dict[f"{name}.lora_up.weight"]
    return up @ down * (state_dict[f"{name}.alpha"] / down.shape[0])  # what every reader computes


def randomize_adapters(models, generator: torch.Generator, scale: float, magnitude_spread: float) -> None:
    """Every adapter tensor of `models` random, as after training, so that each factor shows in a comparison: a
    DoRA magnitude scaled by 1 + spread * U(0, 1) (it stays positive), every other tensor N(0, scale^2)."""

    with torch.no_grad():
        for model in models:
            for _, layer in lora.lora_layers(model):
                for role, param in lora.layer_parameters(layer).items():
                    if role == "dora_scale":
                        param.mul_(1 + magnitude_spread * torch.rand(param.shape, generator=generator))
                    else:
                        param.copy_(torch.randn(param.shape, generator=generator) * scale)
