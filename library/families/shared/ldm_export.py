"""Diffusers UNet, VAE and CLIP weights -> one state dict in the original (LDM) checkpoint layout, for writing files."""
from __future__ import annotations

from typing import Any, Mapping

import torch

# Where the original (LDM) checkpoint layout keeps each part (the SD single-file reader reads them too).
UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_PREFIX = "cond_stage_model.transformer."  # SD1.x: OpenAI CLIP ViT-L/14 (transformers layout)
OPEN_CLIP_PREFIX = "cond_stage_model.model."  # SD2.x: OpenCLIP ViT-H/14
SDXL_CLIP_PREFIX = "conditioner.embedders.0.transformer."
SDXL_OPEN_CLIP_PREFIX = "conditioner.embedders.1.model."
SDXL_REFINER_PREFIX = "conditioner.embedders.0.model."

_RESNET_TO_LDM = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
                  "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
_UNET_TOP_TO_LDM = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
                    "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
                    "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}


def _unet_key_to_ldm(key: str, config: Mapping[str, Any]) -> str:
    """The inverse of diffusers' convert_ldm_unet_checkpoint for one key."""
    per_block = config["layers_per_block"] + 1  # LDM counts the down/upsampler as one more layer
    parts = key.split(".")
    for top, ldm in _UNET_TOP_TO_LDM.items():
        if key.startswith(top + "."):
            return ldm + key[len(top):]

    def resnet(rest: list[str]) -> str:
        return ".".join([_RESNET_TO_LDM.get(rest[0], rest[0]), *rest[1:]])

    if parts[0] in ("down_blocks", "up_blocks"):
        block, kind, index, rest = int(parts[1]), parts[2], int(parts[3]), parts[4:]
        if parts[0] == "down_blocks":
            layer = 1 + block * per_block + index
            if kind == "resnets":
                return f"input_blocks.{layer}.0.{resnet(rest)}"
            if kind == "attentions":
                return f"input_blocks.{layer}.1.{'.'.join(rest)}"
            if kind == "downsamplers":
                return f"input_blocks.{1 + block * per_block + per_block - 1}.0.op.{'.'.join(rest[1:])}"
        else:
            layer = block * per_block + index
            if kind == "resnets":
                return f"output_blocks.{layer}.0.{resnet(rest)}"
            if kind == "attentions":
                return f"output_blocks.{layer}.1.{'.'.join(rest)}"
            if kind == "upsamplers":
                slot = 2 if config["up_block_types"][block].startswith("CrossAttn") else 1
                return f"output_blocks.{block * per_block + per_block - 1}.{slot}.{'.'.join(rest)}"
    if parts[0] == "mid_block":
        slot = {"resnets": {0: 0, 1: 2}, "attentions": {0: 1}}[parts[1]][int(parts[2])]
        rest = parts[3:]
        return f"middle_block.{slot}." + (resnet(rest) if parts[1] == "resnets" else ".".join(rest))
    raise ValueError(f"no LDM name for UNet key {key}")


def vae_key_to_ldm(key: str, num_blocks: int) -> str:
    """The inverse of diffusers' convert_ldm_vae_checkpoint for one key."""
    parts = key.split(".")
    if parts[0] in ("quant_conv", "post_quant_conv"):
        return key
    coder, rest = parts[0], parts[1:]
    if rest[0] in ("conv_in", "conv_out"):
        return key
    if rest[0] == "conv_norm_out":
        return ".".join([coder, "norm_out", *rest[1:]])
    shortcut = {"conv_shortcut": "nin_shortcut"}
    if rest[0] in ("down_blocks", "up_blocks"):
        block = int(rest[1]) if rest[0] == "down_blocks" else num_blocks - 1 - int(rest[1])
        level = "down" if rest[0] == "down_blocks" else "up"
        if rest[2] == "resnets":
            return ".".join([coder, level, str(block), "block", rest[3], shortcut.get(rest[4], rest[4]), *rest[5:]])
        sampler = "downsample" if level == "down" else "upsample"
        return ".".join([coder, level, str(block), sampler, *rest[4:]])
    if rest[0] == "mid_block" and rest[1] == "resnets":
        return ".".join([coder, "mid", f"block_{int(rest[2]) + 1}", shortcut.get(rest[3], rest[3]), *rest[4:]])
    if rest[0] == "mid_block" and rest[1] == "attentions":
        names = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out": "proj_out"}
        tail = rest[5:] if rest[3] == "to_out" else rest[4:]  # to_out.0.weight
        return ".".join([coder, "mid", "attn_1", names[rest[3]], *tail])
    raise ValueError(f"no LDM name for VAE key {key}")


def _open_clip_state(text_encoder: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The inverse of diffusers' convert_open_clip_checkpoint (q/k/v joined into in_proj)."""
    state = {k.removeprefix("text_model."): v for k, v in text_encoder.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    renames = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
               "self_attn.out_proj": "attn.out_proj"}
    for key, value in state.items():
        if key == "embeddings.token_embedding.weight":
            out["token_embedding.weight"] = value
        elif key == "embeddings.position_embedding.weight":
            out["positional_embedding"] = value
        elif key.startswith("final_layer_norm."):
            out["ln_final." + key.split(".")[-1]] = value
        elif key == "text_projection.weight":
            out["text_projection"] = value.T.contiguous()
        elif key.startswith("encoder.layers."):
            layer, rest = key.split(".")[2], ".".join(key.split(".")[3:])
            if rest.startswith("self_attn.q_proj."):
                kind = rest.split(".")[-1]
                qkv = [state[f"encoder.layers.{layer}.self_attn.{p}_proj.{kind}"] for p in "qkv"]
                out[f"transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat(qkv)
            elif not rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
                for old, new in renames.items():
                    rest = rest.replace(old, new)
                out[f"transformer.resblocks.{layer}.{rest}"] = value
    return out


def ldm_state_dict(unet: Any, vae: Any, text_encoder: Any, open_clip: bool = False,
                   text_encoder_2: Any = None) -> dict[str, torch.Tensor]:
    """An SD1.x (CLIP), SD2.x (`open_clip`) or SDXL (`text_encoder_2` given) checkpoint state dict in the original
    LDM layout.

    The inverse of what `load_single_file` reads; used to write single-file versions of diffusers models.
    """
    out = {UNET_PREFIX + _unet_key_to_ldm(k, unet.config): v for k, v in unet.state_dict().items()}
    num_vae_blocks = len(vae.config["block_out_channels"])
    for key, value in vae.state_dict().items():
        ldm = vae_key_to_ldm(key, num_vae_blocks)
        if ".mid.attn_1." in ldm and ldm.endswith("weight") and value.dim() == 2:
            value = value[:, :, None, None]  # LDM's VAE attention uses 1x1 convolutions
        out[VAE_PREFIX + ldm] = value
    if text_encoder_2 is not None:
        clip_prefix = SDXL_CLIP_PREFIX
        out.update({SDXL_OPEN_CLIP_PREFIX + k: v for k, v in _open_clip_state(text_encoder_2).items()})
    else:
        clip_prefix = CLIP_PREFIX
    if open_clip and text_encoder_2 is None:
        out.update({OPEN_CLIP_PREFIX + k: v for k, v in _open_clip_state(text_encoder).items()})
    else:
        out.update({clip_prefix + "text_model." + k.removeprefix("text_model."): v
                    for k, v in text_encoder.state_dict().items()})
    return {k: v.detach().contiguous() for k, v in out.items()}
