"""Wan LoRA targets and file keys, as pure functions on module names and tensors.

Targets are musubi-tuner's networks.lora_wan: every Linear inside a WanAttentionBlock whose dotted path does not
match its exclude pattern `.*(patch_embedding|text_embedding|time_embedding|time_projection|norm|head).*`, so per
block self_attn.q / k / v / o, cross_attn.q / k / v / o and ffn.0 / ffn.2 (10 modules; the I2V blocks' k_img and
v_img would be two more). Here the model is diffusers' WanTransformer3DModel, whose block names differ:
attn1.to_q / to_k / to_v / to_out.0, attn2.*, ffn.net.0.proj / ffn.net.2 (the same Linear layers, as diffusers'
Wan single-file converter maps them).

The file is musubi's: the original Wan names, `lora_unet_blocks_<i>_self_attn_q.lora_down.weight`, `.lora_up.weight`
and `.alpha`. It is the layout both other readers take as it is: ComfyUI's Wan model keeps the original names, and
comfy/lora.py maps `lora_unet_<path with _>` onto `diffusion_model.<path>.weight`; diffusers'
WanPipeline.load_lora_weights converts keys starting with `lora_unet_` (_convert_musubi_wan_lora_to_diffusers) and
raises on any key left over. Both scale by alpha / rank.

That converter also raises on a missing layer: it needs every layer of blocks 0 to n - 1. So a LoRA with layers
left out (musubi's exclude_patterns) is written in the original names behind `diffusion_model.`, with diffusers'
`lora_A` / `lora_B` and `.alpha` (`diffusion_model.blocks.0.cross_attn.k.lora_A.weight`): ComfyUI maps every
`diffusion_model.<path>` onto its weight and reads lora_A / lora_B, and diffusers converts `diffusion_model.` keys
with _convert_non_diffusers_wan_lora_to_diffusers, which takes the layers present. `from_file` reads both layouts
and the diffusers / peft one (`transformer.` or `diffusion_model.` + either naming, `lora_A` / `lora_B`; alpha = rank
when absent).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from library.families.shared import target_patterns
from library.families.shared.lora_keys import ALPHA, DOWN, TO_PEFT_ROLES, UP, add_missing_alphas, from_peft_key
from library.families.shared.musubi_flow import plain_lora_problems

PREFIX = "lora_unet"
FILE_PREFIX = "diffusion_model."  # the layout of a file with layers left out
BLOCK_CLASS = "WanTransformerBlock"
EXCLUDE = re.compile(r".*(patch_embedding|text_embedding|time_embedding|time_projection|norm|head).*")
# diffusers' name inside a block -> the original (musubi's, ComfyUI's) name
ORIGINAL = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
            "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
            "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "attn2.add_k_proj": "cross_attn.k_img",
            "attn2.add_v_proj": "cross_attn.v_img", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}
DIFFUSERS = {original: name for name, original in ORIGINAL.items()}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_OURS = re.compile(rf"^{PREFIX}_blocks_(\d+)_(.+)$")
_UNDERSCORED = {original.replace(".", "_"): original for original in DIFFUSERS}


def targets(transformer: nn.Module, net: Any) -> list[str]:
    """musubi's lora_wan targets in a diffusers WanTransformer3DModel (its module paths), narrowed by the run's
    exclude / include patterns on the original names."""
    problems = plain_lora_problems(net, "Wan", "networks.lora_wan")
    if problems:
        raise ValueError("; ".join(problems))
    candidates = []
    for name, block in transformer.named_modules():
        if type(block).__name__ != BLOCK_CLASS:
            continue
        for child_name, child in block.named_modules():
            if isinstance(child, nn.Linear) and child_name in ORIGINAL:
                original = f"{name}.{ORIGINAL[child_name]}"
                candidates.append((f"{name}.{child_name}", original, bool(EXCLUDE.fullmatch(original))))
    return target_patterns.selected(candidates, net, "Wan")


def original_path(path: str) -> str:
    """diffusers' `blocks.3.attn1.to_out.0` -> the original `blocks.3.self_attn.o` (other paths stay)."""
    match = _BLOCK.match(path)
    if match is None or match.group(2) not in ORIGINAL:
        return path
    return f"blocks.{match.group(1)}.{ORIGINAL[match.group(2)]}"


def diffusers_path(original: str) -> str | None:
    """The original `blocks.3.self_attn.o` -> diffusers' `blocks.3.attn1.to_out.0`, or None."""
    match = _BLOCK.match(original)
    if match is None or match.group(2) not in DIFFUSERS:
        return None
    return f"blocks.{match.group(1)}.{DIFFUSERS[match.group(2)]}"


def module_path(kohya_name: str) -> str | None:
    """`lora_unet_blocks_3_self_attn_o` -> diffusers' `blocks.3.attn1.to_out.0`, or None."""
    match = _OURS.match(kohya_name)
    if match is None or match.group(2) not in _UNDERSCORED:
        return None
    return diffusers_path(f"blocks.{match.group(1)}.{_UNDERSCORED[match.group(2)]}")


def to_file(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our export is musubi's layout already (the family names modules by their original paths), written as it is
    when it holds every layer of blocks 0 to n - 1; one with layers left out (exclude_patterns) is written in the
    original names behind `diffusion_model.` (see the module's doc). A key it cannot name is a programming error."""
    names = set()
    for key in state_dict:
        name, _, role = key.partition(".")
        if module_path(name) is None or role not in (DOWN, UP, ALPHA):
            raise ValueError(f"{key}: not a Wan LoRA key this trainer writes")
        names.add(name)
    if _every_layer(names):
        return dict(state_dict)
    out = {}
    for key, tensor in state_dict.items():
        name, _, role = key.partition(".")
        out[f"{FILE_PREFIX}{original_path(module_path(name))}.{TO_PEFT_ROLES[role]}"] = tensor
    return out


def _every_layer(names: set[str]) -> bool:
    """Whether diffusers' musubi converter reads a file of these modules: it takes the count of block numbers as
    the blocks and pops each one's ten layers (twelve in an I2V LoRA), raising on a missing one."""
    inner = [original.replace(".", "_") for original in DIFFUSERS]
    image = [name for name in inner if name.endswith("_img")]
    per_block = [name for name in inner if name not in image]
    if any(name.endswith(tuple(image)) for name in names):
        per_block += image
    blocks = {int(_OURS.match(name).group(1)) for name in names}
    return all(f"{PREFIX}_blocks_{block}_{layer}" in names for block in range(len(blocks)) for layer in per_block)


def from_file(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Wan LoRA file -> musubi's `lora_unet_blocks_...` keys: musubi's layout as it is; diffusers / peft keys (with
    diffusers' or the original module names) renamed, alpha = rank when absent, as diffusers reads them. Unknown keys
    pass through and are reported by the loader."""
    out = {}
    for key, tensor in state_dict.items():
        renamed = from_peft_key(key)
        if renamed is not None:
            name, _, role = renamed.partition(".")
            path = name.removeprefix(f"{PREFIX}_")
            diffusers = re.sub(r"^blocks_(\d+)_", r"blocks.\1.", path)
            inner = diffusers.partition(".")[2].partition(".")[2]
            candidates = {n.replace(".", "_"): n for n in ORIGINAL}
            if inner in candidates:  # diffusers' names: back to the original ones
                block = diffusers.split(".")[1]
                renamed = f"{PREFIX}_{original_path(f'blocks.{block}.{candidates[inner]}').replace('.', '_')}.{role}"
        out[renamed or key] = tensor
    add_missing_alphas(out)
    return out
