"""Qwen-Image LoRA targets and file keys, as pure functions on module names and tensors.

Targets are musubi-tuner's networks.lora_qwen_image: every Linear inside the QwenImageTransformerBlocks, minus its
exclude pattern `.*(_mod_).*`, which musubi's networks.lora matches (fullmatch) against the module's dotted path
(`transformer_blocks.0.img_mod.1`). No path of the block contains "_mod_", so nothing is left out: per block
img_mod.1, attn.to_q / to_k / to_v / to_out.0, attn.add_q_proj / add_k_proj / add_v_proj / to_add_out,
img_mlp.net.0.proj / net.2, txt_mod.1 and txt_mlp.net.0.proj / net.2 (14 modules). The blocks' names are the same
in musubi's own model, diffusers' and ComfyUI's.

One difference: the transformer discards the text stream that its last block puts out, so that block's
attn.add_q_proj, attn.to_add_out and txt_mlp layers never get a gradient. musubi creates LoRA modules there anyway
(they stay at their start, lora_up = 0, and change nothing); they are left out here, which gives the same model and
keeps DDP from failing on parameters without gradients. Reading a file drops them too: whatever their values, they
cannot change an image.

The file is musubi's own layout, `lora_unet_transformer_blocks_<i>_attn_to_q.lora_down.weight`, `.lora_up.weight`
and `.alpha`. ComfyUI reads it as it is (comfy/lora.py maps `lora_unet_<path with _>` onto every
`diffusion_model.<path>.weight`, and its Qwen-Image model uses diffusers' module names), and so does diffusers'
QwenImagePipeline.load_lora_weights (_convert_non_diffusers_qwen_lora_to_diffusers), both scaling by
alpha / rank. `from_file` also reads diffusers / peft keys (`transformer.` or `diffusion_model.` + the module path,
`lora_A` / `lora_B`; alpha = rank when absent).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from library.families.shared import target_patterns
from library.families.shared.lora_keys import ALPHA, DOWN, UP, add_missing_alphas, from_peft_key
from library.families.shared.musubi_flow import plain_lora_problems

PREFIX = "lora_unet"
BLOCK_CLASS = "QwenImageTransformerBlock"
EXCLUDE = re.compile(r".*(_mod_).*")  # musubi's lora_qwen_image default exclude pattern
# The Linear layers of a block, as "."-paths; their "_" form is what the file's keys hold.
BLOCK_LINEARS = ("img_mod.1", "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                 "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2",
                 "txt_mod.1", "txt_mlp.net.0.proj", "txt_mlp.net.2")
# What the last block computes only for the discarded text stream.
DISCARDED_IN_LAST_BLOCK = ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
_DOTTED = {name.replace(".", "_"): name for name in BLOCK_LINEARS}
_OURS = re.compile(rf"^{PREFIX}_transformer_blocks_(\d+)_(.+)$")


def targets(transformer: nn.Module, net: Any) -> list[str]:
    """musubi's lora_qwen_image targets in a diffusers QwenImageTransformer2DModel."""
    problems = plain_lora_problems(net, "Qwen-Image", "networks.lora_qwen_image")
    if problems:
        raise ValueError("; ".join(problems))
    discarded = set(discarded_paths(len(transformer.transformer_blocks) - 1))
    candidates = []
    for name, block in transformer.named_modules():
        if type(block).__name__ != BLOCK_CLASS:
            continue
        for child_name, child in block.named_modules():
            path = f"{name}.{child_name}"
            if isinstance(child, nn.Linear) and path not in discarded:
                candidates.append((path, path, bool(EXCLUDE.fullmatch(path))))  # musubi's names are diffusers'
    return target_patterns.selected(candidates, net, "Qwen-Image")


def discarded_paths(last_block: int) -> list[str]:
    return [f"transformer_blocks.{last_block}.{name}" for name in DISCARDED_IN_LAST_BLOCK]


def module_path(kohya_name: str) -> str | None:
    """`lora_unet_transformer_blocks_3_attn_to_out_0` -> `transformer_blocks.3.attn.to_out.0`, or None."""
    match = _OURS.match(kohya_name)
    if match is None or match.group(2) not in _DOTTED:
        return None
    return f"transformer_blocks.{match.group(1)}.{_DOTTED[match.group(2)]}"


def to_file(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our export is musubi's layout already; a key it cannot name is a programming error."""
    for key in state_dict:
        name, _, role = key.partition(".")
        if module_path(name) is None or role not in (DOWN, UP, ALPHA):
            raise ValueError(f"{key}: not a Qwen-Image LoRA key this trainer writes")
    return dict(state_dict)


def from_file(state_dict: dict[str, torch.Tensor], last_block: int | None = None) -> dict[str, torch.Tensor]:
    """A Qwen-Image LoRA file -> our `lora_unet_...` keys: musubi's layout as it is, diffusers / peft keys renamed
    (alpha = rank when absent, as diffusers reads them), the modules of `last_block` that feed only the discarded
    text stream dropped. Unknown keys pass through and are reported by the loader."""
    out = {from_peft_key(key) or key: tensor for key, tensor in state_dict.items()}
    if last_block is not None:
        dropped = {f"{PREFIX}_{path.replace('.', '_')}" for path in discarded_paths(last_block)}
        out = {key: tensor for key, tensor in out.items() if key.partition(".")[0] not in dropped}
    add_missing_alphas(out)
    return out
