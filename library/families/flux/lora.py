"""FLUX.1 LoRA targets and kohya's FLUX key names (networks.lora_flux), as pure functions on module names and
tensors.

LoRA is attached through peft to diffusers' FluxTransformer2DModel, where the attention's q, k, v (and, in single
blocks, the MLP input) are separate Linear layers. kohya's file names the original BFL layers, where they are
one fused Linear: `double_blocks_<i>_img_attn_qkv`, `single_blocks_<i>_linear1` (q, k, v, mlp). A fused key is
written as kohya's split_qkv writes it: the parts' down matrices stacked ([k*r, in]) and their up matrices
block-diagonal ([sum of outs, k*r]), so the fused delta is exactly the parts' deltas stacked. The alpha is
k times the parts' alpha, so that alpha / rank (every reader's scale) stays the parts' scale; kohya keeps the
parts' alpha there, which makes readers apply 1/k of the trained strength (kohya issue #2204).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from library.config.network_args import target_pattern_problems
from library.families.shared.lora_keys import ALPHA, DOWN, UP, fuse, peft_state_dict, split_fused, split_key

PREFIX = "lora_unet"

# diffusers module path inside a block ("." -> "_") -> (BFL name inside the block, part index of a fused layer)
DOUBLE = {
    "norm1_linear": ("img_mod_lin", None), "norm1_context_linear": ("txt_mod_lin", None),
    "attn_to_q": ("img_attn_qkv", 0), "attn_to_k": ("img_attn_qkv", 1), "attn_to_v": ("img_attn_qkv", 2),
    "attn_to_out_0": ("img_attn_proj", None),
    "attn_add_q_proj": ("txt_attn_qkv", 0), "attn_add_k_proj": ("txt_attn_qkv", 1),
    "attn_add_v_proj": ("txt_attn_qkv", 2), "attn_to_add_out": ("txt_attn_proj", None),
    "ff_net_0_proj": ("img_mlp_0", None), "ff_net_2": ("img_mlp_2", None),
    "ff_context_net_0_proj": ("txt_mlp_0", None), "ff_context_net_2": ("txt_mlp_2", None),
}
SINGLE = {
    "norm_linear": ("modulation_lin", None), "attn_to_q": ("linear1", 0), "attn_to_k": ("linear1", 1),
    "attn_to_v": ("linear1", 2), "proj_mlp": ("linear1", 3), "proj_out": ("linear2", None),
}
BLOCKS = {"transformer_blocks": ("double_blocks", DOUBLE), "single_transformer_blocks": ("single_blocks", SINGLE)}
FUSED_PARTS = {"img_attn_qkv": 3, "txt_attn_qkv": 3, "linear1": 4}

# kohya's per-part dims (network_args), matched on the BFL name in this order; the first match wins.
PART_DIMS = (("img_attn_dim", ("img_attn",)), ("txt_attn_dim", ("txt_attn",)), ("img_mlp_dim", ("img_mlp",)),
             ("txt_mlp_dim", ("txt_mlp",)), ("img_mod_dim", ("img_mod",)), ("txt_mod_dim", ("txt_mod",)),
             ("single_dim", ("single_blocks", "linear")), ("single_mod_dim", ("modulation",)))
_DIFFUSERS_NAME = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")
_KOHYA_NAME = re.compile(rf"^{PREFIX}_(transformer_blocks|single_transformer_blocks)_(\d+)_(.+)$")
_FUSED_NAME = re.compile(rf"^{PREFIX}_(double_blocks|single_blocks)_(\d+)_(img_attn_qkv|txt_attn_qkv|linear1)$")


def bfl_name(module_name: str) -> tuple[str, int | None] | None:
    """kohya name of a diffusers module path (`transformer_blocks.0.attn.to_q`) and its part index in a fused
    layer, or None outside the blocks."""
    match = _DIFFUSERS_NAME.match(module_name)
    if match is None:
        return None
    kind, index, inner = match.groups()
    block, table = BLOCKS[kind]
    found = table.get(inner.replace(".", "_"))
    if found is None:
        return None
    return f"{PREFIX}_{block}_{index}_{found[0]}", found[1]


def targets(transformer: nn.Module, rank: int, alpha: float,
            net: Any) -> tuple[list[str], dict[str, tuple[int, float]]]:
    """kohya lora_flux's targets in a diffusers FLUX transformer (every Linear of the double and single blocks),
    narrowed by train_blocks and re-ranked by the per-part dims (0 leaves a part out). Returns the module names
    and their (rank, alpha) where it differs from (rank, alpha)."""
    problems = [f"network_args {key}: not for FLUX" for key in (
        "conv_dim", "conv_alpha", "block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas",
        "down_lr_weight", "mid_lr_weight", "up_lr_weight") if getattr(net, key) is not None]
    if net.algo not in ("lora", "locon") or net.dora_wd:
        problems.append("network_args algo / dora_wd: FLUX trains plain LoRA here (kohya's lora_flux format)")
    problems += target_pattern_problems(net, "FLUX", "networks.lora_flux")
    if net.split_qkv is False:
        problems.append("network_args split_qkv=False: q, k, v are always trained as separate LoRAs here (kohya's "
                        "split_qkv=True); the file still has kohya's fused keys")
    if problems:
        raise ValueError("; ".join(problems))
    blocks = {"all": ("double_blocks", "single_blocks"), "single": ("single_blocks",),
              "double": ("double_blocks",)}[net.train_blocks or "all"]
    names: list[str] = []
    overrides: dict[str, tuple[int, float]] = {}
    for module_name, module in transformer.named_modules():
        kohya = bfl_name(module_name)
        if kohya is None or not isinstance(module, nn.Linear) or not kohya[0].startswith(
                tuple(f"{PREFIX}_{b}_" for b in blocks)):
            continue
        dim = part_dim(kohya[0], net)
        if dim == 0 or not block_selected(kohya[0], net):
            continue
        names.append(module_name)
        if dim is not None and dim != rank:
            overrides[module_name] = (dim, alpha)
    if not names:
        raise ValueError("network_args: train_blocks, the block indices and the per-part dims leave no FLUX module "
                         "to train")
    return names, overrides


def block_selected(name: str, net: Any) -> bool:
    """kohya's train_double_block_indices / train_single_block_indices (unset or "all": every block)."""
    block, index = re.match(rf"{PREFIX}_(double_blocks|single_blocks)_(\d+)_", name).groups()
    chosen = net.train_double_block_indices if block == "double_blocks" else net.train_single_block_indices
    if chosen is None or chosen == "all":
        return True
    return chosen != "none" and int(index) in chosen


def part_dim(name: str, net: Any) -> int | None:
    for key, needles in PART_DIMS:
        if all(needle in name for needle in needles):
            return getattr(net, key)
    return None


def to_kohya(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our export (`lora_unet_<diffusers path>`) -> kohya's FLUX keys, fusing q/k/v (and mlp) as documented above.
    Keys of other prefixes (lora_te1) pass through."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, tensor in state_dict.items():
        name, role = split_key(key)
        match = _KOHYA_NAME.match(name)
        found = bfl_name(f"{match.group(1)}.{match.group(2)}.{match.group(3)}") if match else None
        if found is None:
            out[key] = tensor
            continue
        kohya, part = found
        if part is None:
            out[f"{kohya}.{role}"] = tensor
        else:
            fused.setdefault(kohya, {}).setdefault(part, {})[role] = tensor
    for kohya, parts in fused.items():
        out.update(_fuse(kohya, parts))
    return out


def _fuse(kohya: str, parts: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    count = next(parts for suffix, parts in FUSED_PARTS.items() if kohya.endswith(suffix))
    if sorted(parts) != list(range(count)):
        raise ValueError(f"{kohya}: LoRA on parts {sorted(parts)} of {count}; kohya's fused key needs all of them")
    downs = [parts[i][DOWN] for i in range(count)]
    ups = [parts[i][UP] for i in range(count)]
    alphas = {float(parts[i][ALPHA]) for i in range(count)}
    ranks = {down.shape[0] for down in downs}
    if len(alphas) != 1 or len(ranks) != 1:
        raise ValueError(f"{kohya}: the fused parts differ in rank or alpha ({sorted(ranks)}, {sorted(alphas)})")
    return fuse(kohya, downs, ups, alphas.pop())


def _diffusers_names() -> dict[tuple[str, str, int | None], str]:
    """(BFL block, BFL name in the block, part) -> diffusers path in the block ("." as "_")."""
    table = {}
    for kind, (block, names) in BLOCKS.items():
        for inner, (bfl, part) in names.items():
            table[(block, bfl, part)] = f"{kind}:{inner}"
    return table


_TO_DIFFUSERS = _diffusers_names()
_BFL_NAME = re.compile(rf"^{PREFIX}_(double_blocks|single_blocks)_(\d+)_(.+)$")


def _unfused_name(block: str, index: str, bfl: str, part: int | None) -> str | None:
    found = _TO_DIFFUSERS.get((block, bfl, part))
    if found is None:
        return None
    kind, inner = found.split(":")
    return f"{PREFIX}_{kind}_{index}_{inner}"


def from_kohya(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """kohya's FLUX keys -> `lora_unet_<diffusers path>` for our peft layers (inverse of to_kohya). A fused key
    with a block-diagonal up (kohya's split_qkv, or ours) splits into its parts' own matrices with alpha / k; a
    dense fused LoRA (kohya's default) gives each part the shared down and its rows of up, same alpha, which is
    the same delta. (An all-zero up counts as block-diagonal.) Unknown keys pass through (and are reported by the
    loader)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        name, role = split_key(key)
        if _FUSED_NAME.match(name):
            fused.setdefault(name, {})[role] = tensor
            continue
        match = _BFL_NAME.match(name)
        renamed = _unfused_name(match.group(1), match.group(2), match.group(3), None) if match else None
        out[f"{renamed}.{role}" if renamed else key] = tensor
    for name, tensors in fused.items():
        out.update(_split(name, tensors))
    return out


def _split(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    block, index, bfl = _FUSED_NAME.match(name).groups()
    if DOWN not in tensors or UP not in tensors:
        return {f"{name}.{role}": t for role, t in tensors.items()}
    count, hidden = FUSED_PARTS[bfl], tensors[DOWN].shape[1]
    sizes = [hidden] * 3 if count == 3 else [hidden] * 3 + [tensors[UP].shape[0] - 3 * hidden]
    return split_fused(tensors, sizes, [_unfused_name(block, index, bfl, part) for part in range(count)])


def to_peft(state_dict: dict[str, torch.Tensor], modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """A kohya FLUX LoRA file's tensors -> diffusers' peft-format keys (`transformer.<path>.lora_A.weight`,
    `text_encoder.<path>.lora_B.weight`) for `FluxPipeline.load_lora_weights`, which reads kohya's single-block
    keys only at FLUX.1's own widths. `modules`: {"transformer": ..., "text_encoder": CLIP-L}; alpha / rank is
    folded into B. Raises ValueError on a key no module of theirs takes."""
    prefixes = {PREFIX: "transformer", "lora_te1": "text_encoder"}
    names = {}
    for prefix, component in prefixes.items():
        if component in modules:
            for path, module in modules[component].named_modules():
                if isinstance(module, nn.Linear):
                    names[f"{prefix}_{path.replace('.', '_')}"] = f"{component}.{path}"
                    if component == "text_encoder" and not path.startswith("text_model."):
                        # kohya names CLIP's layers under text_model (transformers < 5 kept that wrapper)
                        names[f"{prefix}_text_model_{path.replace('.', '_')}"] = f"{component}.{path}"
    return peft_state_dict(from_kohya(state_dict), names)
