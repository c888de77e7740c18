"""LyCORIS' presets (lycoris/config.py BUILTIN_PRESET_CONFIGS) on diffusers' modules: which layers a
`network_module = "lycoris.kohya"` config trains.

LyCORIS (4.1.3) matches block classes by name and wraps every Linear / Conv inside them, plus a few modules by
name. The classes it sees are sd-scripts' (CrossAttention for attention, TimestepEmbedding for the time embedding);
here the same layers are found in diffusers' UNet. k x k convs (k > 1) take conv_dim, everything else network_dim.
On SDXL sd-scripts hands LyCORIS its original-layout UNet, where neither the names conv_in / conv_out /
time_embedding.* nor a TimestepEmbedding class exist, so LyCORIS trains none of them there; neither does this.
"""
from __future__ import annotations

from torch import nn

from library.network import lora, lycoris_layers

_TRANSFORMER = ("Transformer2DModel",)
_CONV_BLOCKS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
_TIME = ("time_embedding.linear_1", "time_embedding.linear_2")  # by name in full, by its class in the others
_FULL_NAMES = ("conv_in", "conv_out", *_TIME)
_CONV_NAMES = ("conv_in", "conv_out")
_TE_ATTENTION = ("CLIPAttention", "CLIPSdpaAttention", "CLIPFlashAttention2")


def _named(model: nn.Module, names: tuple[str, ...], sdxl: bool) -> list[str]:
    if sdxl:
        return []
    modules = dict(model.named_modules())
    return [name for name in names if name in modules]


def unet_targets(unet: nn.Module, preset: str, sdxl: bool) -> tuple[list[str], list[str]]:
    """(layers trained with network_dim, k x k convs trained with conv_dim) of a LyCORIS preset."""
    inside = lora._targets_inside
    if preset in ("full", "unet-only"):
        names = inside(unet, _TRANSFORMER, allow_conv_1x1=True) + inside(unet, _CONV_BLOCKS, True, allow_conv=True)
        names += _named(unet, _FULL_NAMES, sdxl)
    elif preset in ("attn-mlp", "unet-transformer-only"):
        names = inside(unet, _TRANSFORMER, allow_conv_1x1=True) + _named(unet, _TIME, sdxl)
    elif preset == "attn-only":
        # LyCORIS' CrossAttention / SelfAttention: the q, k, v and output projections of attn1 and attn2
        names = [name for name in inside(unet, _TRANSFORMER, allow_conv_1x1=False)
                 if ".attn1." in name or ".attn2." in name]
    elif preset == "unet-convblock-only":
        names = inside(unet, _CONV_BLOCKS, True, allow_conv=True) + _named(unet, _CONV_NAMES, sdxl)
    else:
        raise ValueError(f"LyCORIS preset {preset!r} is not offered")
    modules = dict(unet.named_modules())
    conv = [name for name in names if lora._is_conv_3x3(lora._base_layer(modules[name]))]
    conv_set = set(conv)
    return [name for name in names if name not in conv_set], conv


def text_encoder_targets(text_encoder: nn.Module, preset: str) -> list[str]:
    """The text-encoder layers of a LyCORIS preset (none for the UNet-only presets)."""
    if preset in ("full", "attn-mlp"):
        return lora.text_encoder_target_modules(text_encoder)
    if preset == "attn-only":
        return lora._targets_inside(text_encoder, _TE_ATTENTION, allow_conv_1x1=False)
    return []


def _norms_inside(model: nn.Module, block_classes: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    for block_name, block in model.named_modules():
        if type(block).__name__ not in block_classes:
            continue
        for name, module in block.named_modules(prefix=block_name):
            if lycoris_layers.is_norm(module) and name not in found and not name.endswith(".base_layer"):
                found.append(name)
    return found


def norm_targets(model: nn.Module, preset: str, part: str) -> list[str]:
    """LyCORIS' train_norm: the LayerNorm / GroupNorm layers inside the preset's blocks (`part` "unet" or
    "text_encoder"); LyCORIS wraps every module whose class is named *Norm* there, and trains those two kinds."""
    if part != "unet":
        blocks = {"full": lora.TEXT_ENCODER_TARGET_BLOCKS, "attn-mlp": lora.TEXT_ENCODER_TARGET_BLOCKS,
                  "attn-only": _TE_ATTENTION}.get(preset, ())
        return _norms_inside(model, blocks)
    blocks = {"full": _TRANSFORMER + _CONV_BLOCKS, "unet-only": _TRANSFORMER + _CONV_BLOCKS,
              "attn-mlp": _TRANSFORMER, "unet-transformer-only": _TRANSFORMER,
              "unet-convblock-only": _CONV_BLOCKS}.get(preset, ())
    return _norms_inside(model, blocks)
