"""SD3 / SD3.5 LoRA targets and kohya's SD3 key names (networks.lora_sd3), as pure functions on module names and
tensors.

LoRA is attached through peft to diffusers' SD3Transformer2DModel, whose attention has separate q, k, v layers.
kohya's lora_sd3 targets every Linear of the MMDiT's x and context blocks (its SingleDiTBlock) and names them
after Stability's layout: `lora_unet_joint_blocks_<i>_x_block_attn_qkv`, `..._context_block_mlp_fc1`,
`..._x_block_adaLN_modulation_1`, and in SD3.5-M's dual-attention blocks `..._x_block_attn2_qkv`. q, k and v are
one fused Linear there, written as for FLUX (library.families.flux.lora): the parts' downs stacked, their ups
block-diagonal, alpha times 3 so that alpha / rank stays the parts' scale. The last block's context modulation
has its (shift, scale) halves in the other order in diffusers, so its up rows are swapped on the way out and in.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from library.config.network_args import target_pattern_problems
from library.families.shared.lora_keys import ALPHA, DOWN, UP, fuse, peft_state_dict, split_fused, split_key

PREFIX = "lora_unet"

# diffusers module path inside transformer_blocks.<i> ("." -> "_") -> (kohya name inside the block, part of qkv)
BLOCK = {
    "norm1_linear": ("x_block_adaLN_modulation_1", None),
    "norm1_context_linear": ("context_block_adaLN_modulation_1", None),
    "attn_to_q": ("x_block_attn_qkv", 0), "attn_to_k": ("x_block_attn_qkv", 1), "attn_to_v": ("x_block_attn_qkv", 2),
    "attn_to_out_0": ("x_block_attn_proj", None),
    "attn_add_q_proj": ("context_block_attn_qkv", 0), "attn_add_k_proj": ("context_block_attn_qkv", 1),
    "attn_add_v_proj": ("context_block_attn_qkv", 2), "attn_to_add_out": ("context_block_attn_proj", None),
    "ff_net_0_proj": ("x_block_mlp_fc1", None), "ff_net_2": ("x_block_mlp_fc2", None),
    "ff_context_net_0_proj": ("context_block_mlp_fc1", None), "ff_context_net_2": ("context_block_mlp_fc2", None),
    "attn2_to_q": ("x_block_attn2_qkv", 0), "attn2_to_k": ("x_block_attn2_qkv", 1),
    "attn2_to_v": ("x_block_attn2_qkv", 2), "attn2_to_out_0": ("x_block_attn2_proj", None),
}
UNFUSED = {(kohya, part): ours for ours, (kohya, part) in BLOCK.items()}
_OURS = re.compile(rf"^{PREFIX}_transformer_blocks_(\d+)_(.+)$")
_KOHYA = re.compile(rf"^{PREFIX}_joint_blocks_(\d+)_(.+)$")
SWAPPED = "context_block_adaLN_modulation_1"  # in the last (context_pre_only) block only


def kohya_name(module_name: str) -> tuple[str, int | None] | None:
    """diffusers path (`transformer_blocks.3.attn.to_q`) -> (`lora_unet_joint_blocks_3_x_block_attn_qkv`, 0)."""
    match = re.match(r"^transformer_blocks\.(\d+)\.(.+)$", module_name)
    found = BLOCK.get(match.group(2).replace(".", "_")) if match else None
    return None if found is None else (f"{PREFIX}_joint_blocks_{match.group(1)}_{found[0]}", found[1])


def targets(transformer: nn.Module, net: Any) -> list[str]:
    """kohya lora_sd3's default targets in a diffusers SD3 transformer: every Linear of the joint blocks."""
    problems = [f"network_args {key}: not for SD3" for key in (
        "conv_dim", "conv_alpha", "block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas",
        "down_lr_weight", "mid_lr_weight", "up_lr_weight") if getattr(net, key, None) is not None]
    problems += [f"network_args {key}: FLUX's (kohya's networks.lora_flux), not for SD3" for key in net.flux_keys
                 if key != "train_t5xxl"]
    if net.algo not in ("lora", "locon") or net.dora_wd:
        problems.append("network_args algo / dora_wd: SD3 trains plain LoRA here (kohya's lora_sd3 format)")
    problems += target_pattern_problems(net, "SD3", "networks.lora_sd3")
    if problems:
        raise ValueError("; ".join(problems))
    return [name for name, module in transformer.named_modules()
            if isinstance(module, nn.Linear) and kohya_name(name) is not None]


def _swap_rows(up: torch.Tensor) -> torch.Tensor:
    first, second = up.chunk(2)
    return torch.cat([second, first])


def to_kohya(state_dict: dict[str, torch.Tensor], last_block: int) -> dict[str, torch.Tensor]:
    """Our export (`lora_unet_transformer_blocks_<i>_<diffusers path>`) -> kohya's SD3 keys, fusing q/k/v.
    `last_block` is the index of the context_pre_only block whose context modulation halves are swapped."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, tensor in state_dict.items():
        name, role = split_key(key)
        match = _OURS.match(name)
        found = BLOCK.get(match.group(2)) if match else None
        if found is None:
            out[key] = tensor
            continue
        kohya = f"{PREFIX}_joint_blocks_{match.group(1)}_{found[0]}"
        if found[1] is None:
            swap = found[0] == SWAPPED and int(match.group(1)) == last_block and role == UP
            out[f"{kohya}.{role}"] = _swap_rows(tensor) if swap else tensor
        else:
            fused.setdefault(kohya, {}).setdefault(found[1], {})[role] = tensor
    for kohya, parts in fused.items():
        if sorted(parts) != [0, 1, 2]:
            raise ValueError(f"{kohya}: LoRA on parts {sorted(parts)} of q, k, v; kohya's fused key needs all three")
        downs, ups = [parts[i][DOWN] for i in range(3)], [parts[i][UP] for i in range(3)]
        alphas, ranks = {float(parts[i][ALPHA]) for i in range(3)}, {d.shape[0] for d in downs}
        if len(alphas) != 1 or len(ranks) != 1:
            raise ValueError(f"{kohya}: q, k and v differ in rank or alpha ({sorted(ranks)}, {sorted(alphas)})")
        out.update(fuse(kohya, downs, ups, alphas.pop()))
    return out


def from_kohya(state_dict: dict[str, torch.Tensor], last_block: int) -> dict[str, torch.Tensor]:
    """kohya's SD3 keys -> ours (inverse of to_kohya). A fused qkv with a block-diagonal up splits into the parts'
    own matrices with alpha / 3; a dense one (kohya's default) gives each part the shared down and its rows of up
    with the same alpha, which is the same delta. Unknown keys pass through (the loader reports them)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        name, role = split_key(key)
        match = _KOHYA.match(name)
        if match is None:
            out[key] = tensor
            continue
        index, inner = match.groups()
        if inner.endswith("qkv"):
            fused.setdefault(name, {})[role] = tensor
            continue
        ours = UNFUSED.get((inner, None))
        if ours is None:
            out[key] = tensor
            continue
        swap = inner == SWAPPED and int(index) == last_block and role == UP
        out[f"{PREFIX}_transformer_blocks_{index}_{ours}.{role}"] = _swap_rows(tensor) if swap else tensor
    for name, tensors in fused.items():
        index, inner = _KOHYA.match(name).groups()
        parts = [UNFUSED.get((inner, i)) for i in range(3)]
        if None in parts or DOWN not in tensors or UP not in tensors:
            out.update({f"{name}.{role}": t for role, t in tensors.items()})
            continue
        out.update(split_fused(tensors, [tensors[UP].shape[0] // 3] * 3,
                               [f"{PREFIX}_transformer_blocks_{index}_{part}" for part in parts]))
    return out


def to_peft(state_dict: dict[str, torch.Tensor], transformer: nn.Module) -> dict[str, torch.Tensor]:
    """A kohya SD3 LoRA file's transformer tensors -> diffusers' peft keys (`transformer.<path>.lora_A.weight`)
    for `StableDiffusion3Pipeline.load_lora_weights`, which reads no kohya SD3 keys itself; alpha / rank is folded
    into B. Raises ValueError on a key no module of the transformer takes."""
    last = len(transformer.transformer_blocks) - 1
    names = {f"{PREFIX}_{path.replace('.', '_')}": f"transformer.{path}"
             for path, module in transformer.named_modules() if isinstance(module, nn.Linear)}
    return peft_state_dict(from_kohya(state_dict, last), names)
