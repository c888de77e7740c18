"""FLUX.2 LoRA targets and file keys, as pure functions on module names and tensors.

Targets are musubi-tuner's networks.lora_flux_2: every Linear inside BFL's DoubleStreamBlock and SingleStreamBlock,
less its exclude patterns (`.*(img_mod\\.lin|txt_mod\\.lin|modulation\\.lin).*`, which FLUX.2's blocks do not have:
their modulation is shared, outside the blocks, and `.*(norm).*`, which holds no Linear). Per double block that is
img_attn.qkv, img_attn.proj, img_mlp.0, img_mlp.2 and their txt_ twins (8 layers), per single block linear1 and
linear2. In diffusers' Flux2Transformer2DModel, with its double blocks' projections fused
(library.families.flux2.transformer), they are attn.to_qkv, attn.to_out.0, ff.linear_in, ff.linear_out,
attn.to_added_qkv, attn.to_add_out, ff_context.linear_in, ff_context.linear_out, and attn.to_qkv_mlp_proj,
attn.to_out: one LoRA on each fused layer, as musubi trains them.

The file is musubi's own layout: the BFL module path behind `lora_unet_`, "." -> "_"
(`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`, `.lora_up.weight`, `.alpha`). ComfyUI reads it as it
is (comfy/lora.py maps `lora_unet_<path with _>` onto every `diffusion_model.<path>.weight` of its FLUX.2 model,
which keeps BFL's names), and so does diffusers' Flux2KleinPipeline / Flux2Pipeline.load_lora_weights
(_convert_kohya_flux2_lora_to_diffusers: a fused qkv's down goes to each of q, k and v, its up is cut in three), all
scaling by alpha / rank. `from_file` also reads the dotted layout ai-toolkit writes and diffusers reads
(`diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight`; alpha = rank when absent).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from library.families.shared import target_patterns
from library.families.shared.lora_keys import ALPHA, DOWN, PEFT_ROLES, UP, add_missing_alphas, split_key
from library.families.shared.musubi_flow import plain_lora_problems

PREFIX = "lora_unet"
NETWORK_MODULE = "networks.lora_flux_2"
# diffusers' module path inside a block, "." -> "_" -> BFL's, the same way
DOUBLE = {"attn_to_qkv": "img_attn_qkv", "attn_to_out_0": "img_attn_proj", "ff_linear_in": "img_mlp_0",
          "ff_linear_out": "img_mlp_2", "attn_to_added_qkv": "txt_attn_qkv", "attn_to_add_out": "txt_attn_proj",
          "ff_context_linear_in": "txt_mlp_0", "ff_context_linear_out": "txt_mlp_2"}
SINGLE = {"attn_to_qkv_mlp_proj": "linear1", "attn_to_out": "linear2"}
BLOCKS = {"transformer_blocks": ("double_blocks", DOUBLE), "single_transformer_blocks": ("single_blocks", SINGLE)}
BFL_BLOCKS = {bfl: (ours, {v: k for k, v in table.items()}) for ours, (bfl, table) in BLOCKS.items()}
# The "."-paths of the targets inside a block: "attn.to_out.0" from "attn_to_out_0" needs the module's own names.
DOTTED = {"attn_to_qkv": "attn.to_qkv", "attn_to_out_0": "attn.to_out.0", "ff_linear_in": "ff.linear_in",
          "ff_linear_out": "ff.linear_out", "attn_to_added_qkv": "attn.to_added_qkv",
          "attn_to_add_out": "attn.to_add_out", "ff_context_linear_in": "ff_context.linear_in",
          "ff_context_linear_out": "ff_context.linear_out", "attn_to_qkv_mlp_proj": "attn.to_qkv_mlp_proj",
          "attn_to_out": "attn.to_out"}
# BFL's "."-paths inside a block (musubi's module names, which its exclude / include patterns match)
BFL_DOTTED = {"img_attn_qkv": "img_attn.qkv", "img_attn_proj": "img_attn.proj", "img_mlp_0": "img_mlp.0",
              "img_mlp_2": "img_mlp.2", "txt_attn_qkv": "txt_attn.qkv", "txt_attn_proj": "txt_attn.proj",
              "txt_mlp_0": "txt_mlp.0", "txt_mlp_2": "txt_mlp.2", "linear1": "linear1", "linear2": "linear2"}
_OURS = re.compile(rf"^{PREFIX}_(transformer_blocks|single_transformer_blocks)_(\d+)_(.+)$")
_MUSUBI = re.compile(rf"^{PREFIX}_(double_blocks|single_blocks)_(\d+)_(.+)$")
_DOTTED_BFL = re.compile(r"^(?:diffusion_model\.)?(double_blocks|single_blocks)\.(\d+)\.(.+)$")


def targets(transformer: nn.Module, net: Any) -> list[str]:
    """musubi's lora_flux_2 targets in a diffusers Flux2Transformer2DModel whose double blocks are fused, narrowed
    by the run's exclude / include patterns on BFL's names."""
    problems = plain_lora_problems(net, "FLUX.2", NETWORK_MODULE)
    if problems:
        raise ValueError("; ".join(problems))
    if not all(block.attn.fused_projections for block in transformer.transformer_blocks):
        raise RuntimeError("FLUX.2's double blocks must be fused first (transformer.fuse_attention_projections)")
    candidates = []
    for kind, (bfl_kind, table) in BLOCKS.items():
        for index in range(len(getattr(transformer, kind))):
            candidates += [(f"{kind}.{index}.{DOTTED[inner]}", f"{bfl_kind}.{index}.{BFL_DOTTED[bfl]}", False)
                           for inner, bfl in table.items()]
    return target_patterns.selected(candidates, net, "FLUX.2")


def to_file(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our export (`lora_unet_<diffusers path with _>.<role>`) -> musubi's keys (BFL paths)."""
    out = {}
    for key, tensor in state_dict.items():
        name, role = split_key(key)
        match = _OURS.match(name)
        bfl = None if match is None else BLOCKS[match.group(1)][1].get(match.group(3))
        if bfl is None or role not in (DOWN, UP, ALPHA):
            raise ValueError(f"{key}: not a FLUX.2 LoRA key this trainer writes")
        out[f"{PREFIX}_{BLOCKS[match.group(1)][0]}_{match.group(2)}_{bfl}.{role}"] = tensor
    return out


def from_file(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A FLUX.2 LoRA file -> our `lora_unet_...` keys: musubi's layout, the dotted BFL layout (ai-toolkit's,
    lora_A / lora_B, alpha = rank when absent) and ours. Unknown keys pass through and are reported by the
    loader."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        name, role = _musubi_name(key)
        match = _MUSUBI.match(name)
        ours = None if match is None else BFL_BLOCKS[match.group(1)][1].get(match.group(3))
        if ours is None:
            out[key] = tensor
        else:
            out[f"{PREFIX}_{BFL_BLOCKS[match.group(1)][0]}_{match.group(2)}_{ours}.{role}"] = tensor
    add_missing_alphas(out)
    return out


def _musubi_name(key: str) -> tuple[str, str]:
    """A key's (musubi-style module name, kohya role): a dotted BFL key (`double_blocks.0.img_attn.qkv.lora_A
    .weight`) is renamed, any other key split at its first "."."""
    match = _DOTTED_BFL.match(key)
    role = next((r for r in PEFT_ROLES if key.endswith("." + r)), None)
    if match is None or role is None:
        return split_key(key)
    kind, index, rest = match.groups()
    return f"{PREFIX}_{kind}_{index}_{rest[:-len(role) - 1].replace('.', '_')}", PEFT_ROLES[role]
