"""kohya's SDXL LoRA names: diffusers UNet module paths -> the original (SGM) paths that sd-scripts trains.

sd-scripts builds its SDXL UNet in the original layout (`input_blocks.N.M`, `middle_block.N`, `output_blocks.N.M`)
and names LoRA modules from those paths; tools that only know that layout (sd-scripts' sdxl_merge_lora.py) skip
diffusers-named keys. The arithmetic is sd-scripts' `sdxl_model_util.make_unet_conversion_map`, written for any
number of ResNets per level so that the tiny SDXL of the tests maps like the real one.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

# ResNet children: diffusers -> original
_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
           "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
_TOP = {"conv_in": "input_blocks.0.0", "conv_out": "out.2", "conv_norm_out": "out.0",
        "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
        "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}
_BLOCK = re.compile(r"^(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)(?:\.(.*))?$")
_MID = re.compile(r"^mid_block\.(resnets|attentions)\.(\d+)(?:\.(.*))?$")


def _resnet_child(rest: str | None, path: str) -> str:
    head, _, tail = (rest or "").partition(".")
    if head not in _RESNET:
        raise ValueError(f"no original-SD name for the ResNet module {path}")
    return _RESNET[head] + (f".{tail}" if tail else "")


def _join(*parts: object) -> str:
    return ".".join(str(p) for p in parts if p not in (None, ""))


def sgm_path(path: str, layers_per_block: int, up_has_attention: Sequence[bool]) -> str:
    """The original-SD path of a diffusers SDXL UNet module (`down_blocks.1.attentions.0.proj_in` ->
    `input_blocks.4.1.proj_in` with 2 ResNets per level). Raises ValueError for a path outside that layout."""
    for diffusers, original in _TOP.items():
        if path == diffusers or path.startswith(diffusers + "."):
            return original + path[len(diffusers):]
    per_down = layers_per_block + 1  # the level's ResNets, then its downsampler
    per_up = layers_per_block + 1  # up levels have one ResNet more; the upsampler shares the last
    if match := _MID.match(path):
        kind, j, rest = match.group(1), int(match.group(2)), match.group(3)
        if kind == "attentions":
            return _join("middle_block.1", rest)
        return _join(f"middle_block.{2 * j}", _resnet_child(rest, path))
    match = _BLOCK.match(path)
    if not match:
        raise ValueError(f"no original-SD name for the UNet module {path}")
    side, level, kind, j, rest = match.group(1), int(match.group(2)), match.group(3), int(match.group(4)), \
        match.group(5)
    if side == "down_blocks":
        if kind == "downsamplers":
            if rest != "conv":
                raise ValueError(f"no original-SD name for the UNet module {path}")
            return f"input_blocks.{(level + 1) * per_down}.0.op"
        index = 1 + level * per_down + j
        if kind == "resnets":
            return _join(f"input_blocks.{index}.0", _resnet_child(rest, path))
        return _join(f"input_blocks.{index}.1", rest)
    if kind == "upsamplers":
        # after the level's last ResNet (and its attention, when the level has one)
        inner = 2 if up_has_attention[level] else 1
        return _join(f"output_blocks.{level * per_up + layers_per_block}.{inner}", rest)
    index = level * per_up + j
    if kind == "resnets":
        return _join(f"output_blocks.{index}.0", _resnet_child(rest, path))
    return _join(f"output_blocks.{index}.1", rest)
