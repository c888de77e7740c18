"""diffusers' Flux2Transformer2DModel with the layers musubi-tuner trains.

BFL's model (musubi's flux2_models, ComfyUI's) computes a double block's image q, k, v with one Linear
(`img_attn.qkv`) and the text's with another (`txt_attn.qkv`); diffusers splits each into three (to_q / to_k /
to_v, add_q_proj / add_k_proj / add_v_proj) unless its attention's projections are fused (to_qkv, to_added_qkv),
a state diffusers' own processor runs. musubi's networks.lora_flux_2 puts one LoRA on each fused layer (one down
matrix shared by q, k and v); the loaders fuse them so that the trained layers are those, and the three separate
Linears are dropped (they would hold a second copy of the weights). The single blocks are fused in both models.
"""
from __future__ import annotations

import torch
from torch import nn

SEPARATE = {"to_qkv": ("to_q", "to_k", "to_v"), "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}


def fuse_attention_projections(transformer: nn.Module) -> None:
    """Each double block's q, k, v as one Linear (to_qkv) and its text's (to_added_qkv), weights stacked in that
    order, as BFL's img_attn.qkv / txt_attn.qkv; the separate Linears go. Does nothing to fused blocks."""
    for block in transformer.transformer_blocks:
        attention = block.attn
        if attention.fused_projections:
            continue
        for fused, parts in SEPARATE.items():
            setattr(attention, fused, stacked([getattr(attention, name) for name in parts]))
            for name in parts:
                delattr(attention, name)
        attention.fused_projections = True


def stacked(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear computing `parts`' outputs one after the other (their weights stacked on the output axis), built
    without initialising a weight it would overwrite."""
    weight = torch.cat([part.weight.detach() for part in parts])
    bias = parts[0].bias is not None
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=parts[0].weight.requires_grad)
    if bias:
        layer.bias = nn.Parameter(torch.cat([part.bias.detach() for part in parts]),
                                  requires_grad=parts[0].bias.requires_grad)
    return layer


# diffusers' names -> BFL's (the inverse of diffusers' convert_flux2_transformer_checkpoint_to_diffusers, for a
# transformer whose double blocks are fused), outside the blocks and inside each
OUTER = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
         "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
         "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
         "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
         "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
         "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
         "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
         "single_stream_modulation.linear": "single_stream_modulation.lin"}
DOUBLE_BLOCK = {"attn.to_qkv": "img_attn.qkv", "attn.to_out.0": "img_attn.proj", "ff.linear_in": "img_mlp.0",
                "ff.linear_out": "img_mlp.2", "attn.norm_q": "img_attn.norm.query_norm",
                "attn.norm_k": "img_attn.norm.key_norm", "attn.to_added_qkv": "txt_attn.qkv",
                "attn.to_add_out": "txt_attn.proj", "ff_context.linear_in": "txt_mlp.0",
                "ff_context.linear_out": "txt_mlp.2", "attn.norm_added_q": "txt_attn.norm.query_norm",
                "attn.norm_added_k": "txt_attn.norm.key_norm"}
SINGLE_BLOCK = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2", "attn.norm_q": "norm.query_norm",
                "attn.norm_k": "norm.key_norm"}
BLOCK_LAYOUTS = {"transformer_blocks": ("double_blocks", DOUBLE_BLOCK),
                 "single_transformer_blocks": ("single_blocks", SINGLE_BLOCK)}


def bfl_state_dict(transformer: nn.Module) -> dict[str, torch.Tensor]:
    """A fused Flux2Transformer2DModel's weights in BFL's layout (flux2-klein-*.safetensors, ComfyUI's model and
    musubi's): BFL's module names, RMSNorm weights as `.scale`, and the output modulation's halves in BFL's
    (shift, scale) order."""
    out = {}
    for key, tensor in transformer.state_dict().items():
        module, _, role = key.rpartition(".")
        kind, _, rest = module.partition(".")
        if kind in BLOCK_LAYOUTS:
            index, _, inner = rest.partition(".")
            bfl, layout = BLOCK_LAYOUTS[kind]
            name = f"{bfl}.{index}.{layout[inner]}"
            role = "scale" if "norm" in inner else role
        elif module == "norm_out.linear":
            name, tensor = "final_layer.adaLN_modulation.1", torch.cat(tensor.chunk(2)[::-1])
        else:
            name = OUTER[module]
        out[f"{name}.{role}"] = tensor.detach()
    return out


def from_bfl(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BFL's layout (flux2-klein-*.safetensors, without ComfyUI's prefix) -> a fused Flux2Transformer2DModel's names;
    the inverse of bfl_state_dict. Unknown keys pass through (the loader names them)."""
    outer = {bfl: ours for ours, bfl in OUTER.items()}
    layouts = {bfl: (ours, {v: k for k, v in layout.items()}) for ours, (bfl, layout) in BLOCK_LAYOUTS.items()}
    out = {}
    for key, tensor in state.items():
        module, _, role = key.rpartition(".")
        kind, _, rest = module.partition(".")
        if kind in layouts:
            index, _, inner = rest.partition(".")
            ours, layout = layouts[kind]
            name = f"{ours}.{index}.{layout.get(inner, inner)}"
            role = "weight" if role == "scale" else role
        elif module == "final_layer.adaLN_modulation.1":
            name, tensor = "norm_out.linear", torch.cat(tensor.chunk(2)[::-1])
        else:
            name = outer.get(module, module)
        out[f"{name}.{role}"] = tensor
    return out


def transformer_config(state: dict[str, torch.Tensor]) -> dict[str, object]:
    """Flux2Transformer2DModel's config read from BFL-layout weights: the widths and block counts their shapes
    give, FLUX.2's rope theta (2000) and norm epsilon (1e-6), and each of the 4 position axes a quarter of a head."""
    def count(prefix: str) -> int:
        return len({key.split(".")[1] for key in state if key.startswith(prefix)})

    inner, in_channels = state["img_in.weight"].shape
    head = state["single_blocks.0.norm.query_norm.scale"].shape[0]
    return {"patch_size": 1, "in_channels": in_channels, "num_layers": count("double_blocks."),
            "num_single_layers": count("single_blocks."), "attention_head_dim": head,
            "num_attention_heads": inner // head, "joint_attention_dim": state["txt_in.weight"].shape[1],
            "timestep_guidance_channels": state["time_in.in_layer.weight"].shape[1],
            "mlp_ratio": state["double_blocks.0.img_mlp.2.weight"].shape[1] / inner,
            "axes_dims_rope": (head // 4,) * 4, "rope_theta": 2000, "eps": 1e-6,
            "guidance_embeds": "guidance_in.in_layer.weight" in state}
