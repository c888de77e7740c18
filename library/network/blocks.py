"""kohya's UNet blocks for block_dims / block_alphas and down/mid/up_lr_weight (networks/lora.py).

SD1.x / SD2.x: 25 blocks. 0 has no LoRA; 1-12 are the down side (3 per level: two ResNet/attention pairs and the
downsampler), 12 is also the mid block, 13-24 the up side (3 per level, deepest first).
SDXL: 23 blocks in kohya's sgm numbering: 0 time/label embedding, 1-9 input_blocks 0-8, 10-12 middle_block 0-2,
13-21 output_blocks 0-8, 22 out. Module paths here are diffusers', mapped onto those indices.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

SD_BLOCKS = 12  # kohya's NUM_OF_BLOCKS: per side
SD_MID = 1
SDXL_BLOCKS = 9
SDXL_MID = 3

_UPDOWN = re.compile(r"^(up|down)_blocks\.(\d+)\.(resnets|attentions|upsamplers|downsamplers)\.(\d+)\.")
_MID = re.compile(r"^mid_block\.(resnets|attentions)\.(\d+)\.")


def num_blocks(sdxl: bool) -> int:
    return 1 + 2 * SDXL_BLOCKS + SDXL_MID + 1 if sdxl else 2 * SD_BLOCKS + SD_MID


def block_index(module_name: str, sdxl: bool) -> int:
    """kohya's block of a UNet module given by its diffusers path (-1 when it is in none)."""
    if match := _MID.match(module_name):
        if not sdxl:
            return SD_BLOCKS
        kind, j = match.group(1), int(match.group(2))
        return 1 + SDXL_BLOCKS + (1 if kind == "attentions" else 2 * j)  # resnet, attention, resnet
    match = _UPDOWN.match(module_name)
    if not match:
        return -1
    side, i, kind, j = match.group(1), int(match.group(2)), match.group(3), int(match.group(4))
    if not sdxl:
        # kohya's get_block_index on diffusers-style names
        idx = 3 * i + (2 if kind.endswith("samplers") else j)
        return 1 + idx if side == "down" else SD_BLOCKS + 1 + idx
    if side == "down":
        # input_blocks: 0 is conv_in; each level holds two ResNet(/attention) blocks, then its downsampler.
        input_block = 3 * (i + 1) if kind == "downsamplers" else 3 * i + j + 1
        return 1 + input_block
    output_block = 3 * i + (2 if kind == "upsamplers" else j)  # the upsampler shares the level's last block
    return 1 + SDXL_BLOCKS + SDXL_MID + output_block


@dataclass(frozen=True)
class BlockPlan:
    """Per-block rank and alpha of the Linear / 1x1 layers and of the 3x3 convs, and per-block lr weights."""
    dims: tuple[int, ...]
    alphas: tuple[float, ...]
    conv_dims: tuple[int, ...] | None
    conv_alphas: tuple[float, ...] | None
    lr_weights: tuple[float, ...] | None


@dataclass(frozen=True)
class BlockLR:
    """kohya's block learning rates: the UNet lr times the weight of each module's block."""
    weights: tuple[float, ...]
    sdxl: bool

    def index(self, module_name: str) -> int:
        return block_index(module_name, self.sdxl)

    def weight(self, module_name: str) -> float:
        index = self.index(module_name)
        return self.weights[index] if index >= 0 else 1.0


def _preset(spec: str, length: int) -> list[float]:
    name, _, base = spec.partition("+")
    base_lr = float(base) if base else 0.0
    steps = range(length)
    if name == "cosine":
        return [math.sin(math.pi * (i / (length - 1)) / 2) + base_lr for i in reversed(steps)]
    if name == "sine":
        return [math.sin(math.pi * (i / (length - 1)) / 2) + base_lr for i in steps]
    if name == "linear":
        return [i / (length - 1) + base_lr for i in steps]
    if name == "reverse_linear":
        return [i / (length - 1) + base_lr for i in reversed(steps)]
    return [base_lr] * length  # zeros


def lr_weight_values(spec: str | tuple[float, ...] | None, length: int) -> list[float] | None:
    """kohya's down/up_lr_weight: a preset (optionally "+base") or values; cut or padded with 1.0 to `length`."""
    if spec is None:
        return None
    values = _preset(spec, length) if isinstance(spec, str) else list(spec)
    return (values + [1.0] * length)[:length]


def block_plan(sdxl: bool, dim: int, alpha: float, conv: tuple[int, float] | None,
               block_dims: tuple[int, ...] | None, block_alphas: tuple[float, ...] | None,
               conv_block_dims: tuple[int, ...] | None, conv_block_alphas: tuple[float, ...] | None,
               down_lr_weight: str | tuple[float, ...] | None, mid_lr_weight: tuple[float, ...] | None,
               up_lr_weight: str | tuple[float, ...] | None, zero_threshold: float = 0.0) -> BlockPlan | None:
    """kohya's create_network block logic; None when no block option is given. Raises ValueError on lengths."""
    if block_dims is None and down_lr_weight is None and mid_lr_weight is None and up_lr_weight is None:
        return None
    total = num_blocks(sdxl)
    side, mid = (SDXL_BLOCKS, SDXL_MID) if sdxl else (SD_BLOCKS, SD_MID)
    for name, values in (("block_dims", block_dims), ("block_alphas", block_alphas),
                         ("conv_block_dims", conv_block_dims), ("conv_block_alphas", conv_block_alphas)):
        if values is not None and len(values) != total:
            raise ValueError(f"network_args: {name} needs {total} values for {'SDXL' if sdxl else 'SD1/SD2'} "
                             f"(kohya's blocks), got {len(values)}")
    dims = list(block_dims or [dim] * total)
    alphas = list(block_alphas or [alpha] * total)
    conv_dims: list[int] | None = None
    conv_alphas: list[float] | None = None
    if conv_block_dims is not None:
        conv_dims = list(conv_block_dims)
        conv_alphas = list(conv_block_alphas or [conv[1] if conv else 1.0] * total)
    elif conv is not None:
        conv_dims, conv_alphas = [conv[0]] * total, [conv[1]] * total

    lr_weights = None
    if down_lr_weight is not None or mid_lr_weight is not None or up_lr_weight is not None:
        down = lr_weight_values(down_lr_weight, side) or [1.0] * side
        middle = lr_weight_values(mid_lr_weight, mid) or [1.0] * mid
        up = lr_weight_values(up_lr_weight, side) or [1.0] * side
        weights = [w if w > zero_threshold else 0.0 for w in down + middle + up]
        lr_weights = [1.0] + weights + [1.0] if sdxl else weights
        for i, weight in enumerate(lr_weights):
            if weight == 0:  # kohya leaves the block out rather than train it at lr 0
                dims[i] = 0
                if conv_dims is not None:
                    conv_dims[i] = 0
    return BlockPlan(tuple(dims), tuple(alphas), None if conv_dims is None else tuple(conv_dims),
                     None if conv_alphas is None else tuple(conv_alphas),
                     None if lr_weights is None else tuple(lr_weights))
