"""kohya's base_weights: LoRA files merged into the frozen base before training, each at its multiplier."""
from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import nn

from library.config import UserError
from library.families.family import Components
from library.network.kohya_format import kohya_lora_name, load_kohya_lora

logger = logging.getLogger(__name__)
_MERGED_ROLES = {"lora_down.weight", "lora_up.weight", "alpha"}


def base_modules(components: Components) -> dict[str, nn.Module]:
    """kohya module name -> the base's Linear / Conv2d it names, over the denoiser and the text encoders."""
    family = components.family
    parts = family.lora_prefixes(True, True, components.denoiser, components.text_encoders)
    names: dict[str, nn.Module] = {}
    for prefix, model in parts.items():
        for path, module in model.named_modules():
            if not isinstance(module, (nn.Linear, nn.Conv2d)):
                continue
            try:
                names[kohya_lora_name(prefix, family.kohya_module_path(prefix, path, model))] = module
            except (ValueError, KeyError):
                continue  # a module the family's kohya layout has no name for takes no LoRA
    return names


def lora_delta(down: torch.Tensor, up: torch.Tensor, scale: float, shape: torch.Size) -> torch.Tensor:
    """up @ down x scale in the base weight's shape (Linear, 1x1 or kxk conv), in float32, as kohya merges."""
    down, up = down.float(), up.float()
    if len(shape) == 2:
        return (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)) * scale
    if down.dim() == 4 and tuple(down.shape[2:]) != (1, 1):  # kxk down, 1x1 up
        return nn.functional.conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3) * scale
    return (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)).reshape(shape) * scale


def merge_base_weights(components: Components, paths: Sequence[str], multipliers: Sequence[float]) -> None:
    """Add each file's LoRA, x its multiplier (1.0 when not given), to the base weights it names."""
    if not paths:
        return
    modules = base_modules(components)
    for i, path in enumerate(paths):
        multiplier = multipliers[i] if i < len(multipliers) else 1.0
        state_dict, _ = load_kohya_lora(path)
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in state_dict.items():
            name, _, role = key.partition(".")
            by_module.setdefault(name, {})[role] = tensor
        problems = [f"{name}: {', '.join(sorted((set(roles) ^ _MERGED_ROLES) - {'alpha'}))}"
                    for name, roles in by_module.items() if (set(roles) ^ _MERGED_ROLES) - {"alpha"}]
        if problems:
            raise UserError([f"base_weights {path}: only plain LoRA modules (lora_down and lora_up, alpha) can be "
                             "merged, as with kohya's networks.lora; these modules hold other or missing weights:"]
                            + problems[:5])
        unknown = sorted(name for name in by_module if name not in modules)
        if unknown:
            raise UserError([f"base_weights {path}: {len(unknown)} LoRA modules name nothing in this "
                             f"{components.family.name} model (a LoRA for another model family?), e.g. "
                             + ", ".join(unknown[:3])])
        with torch.no_grad():
            for name, roles in by_module.items():
                down, up = roles["lora_down.weight"], roles["lora_up.weight"]
                rank = down.shape[0]
                alpha = float(roles["alpha"].item()) if "alpha" in roles else float(rank)
                weight = modules[name].weight
                delta = lora_delta(down, up, multiplier * alpha / rank, weight.shape)
                weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))
        logger.info("base_weights: merged %s (%d modules) with multiplier %g", path, len(by_module), multiplier)
