"""What the transformer families' LoRA file formats share, as pure functions on tensors: a key's module name and
role, one fused layer's LoRA in kohya's split_qkv layout (FLUX.1's and SD3's kohya files, musubi's ComfyUI
conversion of Z-Image's) made from its parts' LoRAs and split back, the peft keys diffusers' `load_lora_weights`
reads, and reading diffusers / peft keys back (Z-Image's and Qwen-Image's files).

The fused layout: the parts' downs stacked ([k*r, in]) and their ups block-diagonal ([sum of outs, k*r]), so the
fused delta is exactly the parts' deltas stacked; alpha is k times the parts' alpha, so that alpha / rank (every
reader's scale) stays the parts' scale.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

PREFIX = "lora_unet"
DOWN, UP, ALPHA = "lora_down.weight", "lora_up.weight", "alpha"
PEFT_ROLES = {"lora_A.weight": DOWN, "lora_B.weight": UP, "alpha": ALPHA}
TO_PEFT_ROLES = {ours: peft for peft, ours in PEFT_ROLES.items()}


def split_key(key: str) -> tuple[str, str]:
    """`lora_unet_x.lora_down.weight` -> (`lora_unet_x`, `lora_down.weight`)."""
    name, _, role = key.partition(".")
    return name, role


def fuse(name: str, downs: Sequence[torch.Tensor], ups: Sequence[torch.Tensor],
         alpha: float) -> dict[str, torch.Tensor]:
    """The fused layer `name`'s keys from its parts' LoRAs (one rank, one `alpha`), in kohya's split_qkv layout."""
    count, rank = len(downs), downs[0].shape[0]
    up = torch.zeros(sum(u.shape[0] for u in ups), rank * count, dtype=ups[0].dtype)
    offset = 0
    for i, part_up in enumerate(ups):
        up[offset:offset + part_up.shape[0], i * rank:(i + 1) * rank] = part_up
        offset += part_up.shape[0]
    return {f"{name}.{DOWN}": torch.cat(downs, dim=0).contiguous(), f"{name}.{UP}": up,
            f"{name}.{ALPHA}": torch.tensor(alpha * count, dtype=torch.float32)}


def split_fused(tensors: Mapping[str, torch.Tensor], sizes: Sequence[int],
                targets: Sequence[str]) -> dict[str, torch.Tensor]:
    """A fused layer's LoRA (its down, up and alpha; alpha = rank when absent) -> each part's keys under
    `targets`, the parts `sizes` rows of up each. A block-diagonal up (kohya's split_qkv, or `fuse`; an all-zero
    up counts as one) splits into the parts' own matrices with alpha / k; a dense one (kohya's default) gives each
    part the shared down and its rows of up with the same alpha, which is the same delta."""
    down, up = tensors[DOWN], tensors[UP]
    count, rank = len(sizes), down.shape[0]
    alpha = float(tensors[ALPHA]) if ALPHA in tensors else float(rank)
    offsets = [sum(sizes[:i]) for i in range(count + 1)]
    r = rank // count
    diagonal = rank % count == 0 and _block_diagonal(up, offsets, r)
    out = {}
    for part, target in enumerate(targets):
        rows = up[offsets[part]:offsets[part + 1]]
        if diagonal:
            part_down, part_up = down[part * r:(part + 1) * r], rows[:, part * r:(part + 1) * r]
            part_alpha = alpha / count
        else:
            part_down, part_up, part_alpha = down, rows, alpha
        out[f"{target}.{DOWN}"] = part_down.contiguous()
        out[f"{target}.{UP}"] = part_up.contiguous()
        out[f"{target}.{ALPHA}"] = torch.tensor(part_alpha, dtype=torch.float32)
    return out


def _block_diagonal(up: torch.Tensor, offsets: list[int], rank: int) -> bool:
    mask = torch.ones_like(up, dtype=torch.bool)
    for part in range(len(offsets) - 1):
        mask[offsets[part]:offsets[part + 1], part * rank:(part + 1) * rank] = False
    return not bool(up[mask].any())


def peft_state_dict(state_dict: Mapping[str, torch.Tensor], names: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """Our `<kohya name>.lora_down.weight` / `.lora_up.weight` / `.alpha` tensors -> diffusers' peft keys
    (`<names[kohya name]>.lora_A.weight`, `.lora_B.weight`), alpha / rank folded into B. Raises ValueError on a
    name not in `names` or a LoRA without its down or up."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        name, role = split_key(key)
        grouped.setdefault(name, {})[role] = tensor
    out, unknown = {}, []
    for name, tensors in grouped.items():
        if name not in names or DOWN not in tensors or UP not in tensors:
            unknown.append(name)
            continue
        scale = float(tensors[ALPHA]) / tensors[DOWN].shape[0] if ALPHA in tensors else 1.0
        out[f"{names[name]}.lora_A.weight"] = tensors[DOWN]
        out[f"{names[name]}.lora_B.weight"] = tensors[UP] * scale
    if unknown:
        raise ValueError(f"LoRA keys that fit no module: {', '.join(sorted(unknown)[:5])}")
    return out


def from_peft_key(key: str) -> str | None:
    """A diffusers / peft key (`<module path>.lora_A.weight`, `.lora_B.weight` or `.alpha`, behind
    `diffusion_model.`, `transformer.` or nothing) -> ours, `lora_unet_<path with _>.<role>`; None for any other
    key (ours, or musubi's)."""
    body = key.removeprefix("diffusion_model.").removeprefix("transformer.")
    role = next((r for r in PEFT_ROLES if body.endswith("." + r)), None)
    if role is None or body.startswith(PREFIX):
        return None
    return f"{PREFIX}_{body[:-len(role) - 1].replace('.', '_')}.{PEFT_ROLES[role]}"


def add_missing_alphas(state_dict: dict[str, torch.Tensor]) -> None:
    """alpha = rank for each LoRA of `state_dict` without one, as diffusers and musubi's convert_lora read it."""
    for name in {key.partition(".")[0] for key in state_dict if key.endswith(DOWN)}:
        if f"{name}.{ALPHA}" not in state_dict:
            state_dict[f"{name}.{ALPHA}"] = torch.tensor(float(state_dict[f"{name}.{DOWN}"].shape[0]))
