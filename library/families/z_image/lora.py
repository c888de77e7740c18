"""Z-Image LoRA targets and file keys, as pure functions on module names and tensors.

Targets are musubi-tuner's networks.lora_zimage: every Linear inside the ZImageTransformerBlocks of the main
`layers`, leaving out the refiners and adaLN_modulation (its exclude pattern `.*(_modulation|_refiner).*`), so
per block attention.to_q / to_k / to_v / to_out.0 and feed_forward.w1 / w2 / w3.

The file: musubi writes `lora_unet_layers_<i>_attention_to_q` (sd-scripts style), which ComfyUI does not read, and
ships two converters: convert_lora.py --target other (diffusers keys, which its docs recommend for ComfyUI) and
convert_z_image_lora_to_comfy.py (ComfyUI's fused qkv). Written here is the diffusers layout behind
`diffusion_model.`: `diffusion_model.layers.<i>.attention.to_q.lora_A.weight`, `.lora_B.weight` and `.alpha`.
ComfyUI maps those names onto its fused qkv itself (comfy.utils.z_image_to_diffusers) and diffusers'
ZImagePipeline.load_lora_weights reads them as they are; both scale by alpha / rank. Unlike musubi's converter,
alpha is kept as a key instead of being folded into the weights, so the file reads back exactly.
`from_file` reads this layout, musubi's own keys and its ComfyUI-converted fused keys.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from library.families.shared import target_patterns
from library.families.shared.lora_keys import (
    TO_PEFT_ROLES,
    UP,
    add_missing_alphas,
    from_peft_key,
    split_fused,
)
from library.families.shared.musubi_flow import plain_lora_problems

PREFIX = "lora_unet"
FILE_PREFIX = "diffusion_model."
# musubi's module names inside a block, as "."-paths (their "_" form is what kohya-style keys hold)
BLOCK_LINEARS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                 "feed_forward.w2", "feed_forward.w3")
_EXCLUDE = re.compile(r".*(_modulation|_refiner).*")  # musubi's lora_zimage exclude pattern
_OURS = re.compile(rf"^{PREFIX}_(layers|noise_refiner|context_refiner)_(\d+)_(.+)$")
_DOTTED = {name.replace(".", "_"): name for name in BLOCK_LINEARS} | {"adaLN_modulation_0": "adaLN_modulation.0"}
_BLOCK = re.compile(r"^(?:layers|noise_refiner|context_refiner)\.\d+\.(.+)$")
_COMFY_QKV = re.compile(rf"^{PREFIX}_(layers|noise_refiner|context_refiner)_(\d+)_attention_qkv$")


def targets(transformer: nn.Module, net: Any) -> list[str]:
    """musubi's lora_zimage targets in a diffusers ZImageTransformer2DModel, narrowed or widened (the refiners)
    by the run's exclude / include patterns."""
    problems = plain_lora_problems(net, "Z-Image", "networks.lora_zimage")
    if problems:
        raise ValueError("; ".join(problems))
    candidates = []
    for name, module in transformer.named_modules():
        block = _BLOCK.match(name)
        if isinstance(module, nn.Linear) and block is not None and block.group(1) in _DOTTED.values():
            candidates.append((name, name, bool(_EXCLUDE.fullmatch(name))))  # musubi's names are diffusers'
    return target_patterns.selected(candidates, net, "Z-Image")


def _module_path(kohya_name: str) -> str | None:
    match = _OURS.match(kohya_name)
    if match is None or match.group(3) not in _DOTTED:
        return None
    block, index, inner = match.groups()
    return f"{block}.{index}.{_DOTTED[inner]}"


def to_file(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our export (`lora_unet_<path with _>.lora_down.weight`, ...) -> the diffusers layout described above."""
    out = {}
    for key, tensor in state_dict.items():
        name, _, role = key.partition(".")
        path = _module_path(name)
        if path is None or role not in TO_PEFT_ROLES:
            raise ValueError(f"{key}: not a Z-Image LoRA key this trainer writes")
        out[f"{FILE_PREFIX}{path}.{TO_PEFT_ROLES[role]}"] = tensor
    return out


def from_file(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Z-Image LoRA file -> our `lora_unet_...` keys: the diffusers layout (behind `diffusion_model.`,
    `transformer.` or nothing; alpha = rank when absent, as musubi's convert_lora does), musubi's own keys (as
    they are) and its ComfyUI conversion (`attention_qkv` split into q, k, v; `attention_out`). Unknown keys pass
    through and are reported by the loader."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        renamed = from_peft_key(key)
        if renamed is not None:
            out[renamed] = tensor
            continue
        name, _, kohya_role = key.partition(".")
        if _COMFY_QKV.match(name):
            fused.setdefault(name, {})[kohya_role] = tensor
            continue
        if name.endswith("_attention_out"):
            name = name.removesuffix("_attention_out") + "_attention_to_out_0"
        out[f"{name}.{kohya_role}"] = tensor
    add_missing_alphas(out)
    for name, tensors in fused.items():
        out.update(_split_qkv(name, tensors))
    return out


def _split_qkv(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """musubi's convert_z_image_lora_to_comfy --reverse: the stacked downs and block-diagonal up of a fused qkv
    back to q, k, v with alpha / 3. A dense up (any other writer) gives each part the shared down and its rows of
    up, which is the same weight change."""
    base = name.removesuffix("_qkv")
    targets = [f"{base}_{part}" for part in ("to_q", "to_k", "to_v")]
    return split_fused(tensors, [tensors[UP].shape[0] // 3] * 3, targets)
