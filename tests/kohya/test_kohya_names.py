"""SDXL LoRA keys in kohya's original-SD naming, exactly the set sd-scripts writes, and files in either naming load.

The expected names are written out here from sd-scripts' rules (library/sdxl_model_util.make_unet_conversion_map,
networks/lora.py): input_blocks.0 is conv_in, each down level holds `layers_per_block` ResNet(+attention) blocks and
then its downsampler (`.0.op`); the middle block is ResNet, attention, ResNet; each up level holds one ResNet more and
its upsampler shares the last block, at inner index 2 after an attention. Nothing here calls the mapping under test.
"""
from __future__ import annotations

import copy

import pytest
import torch

from library.config.network_args import NetworkArgs
from library.families.sd.sdxl import SDXL
from library.network import kohya_format, lora
from library.network import targets as network_setup

ATTN = [f"{a}_{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out_0")] + [
    "ff_net_0_proj", "ff_net_2"]


def transformer_names(block: str, depth: int) -> set[str]:
    names = {f"lora_unet_{block}_proj_in", f"lora_unet_{block}_proj_out"}
    names |= {f"lora_unet_{block}_transformer_blocks_{k}_{layer}" for k in range(depth) for layer in ATTN}
    return names


def resnet_names(block: str, skip: bool) -> set[str]:
    names = {f"lora_unet_{block}_{child}" for child in ("in_layers_2", "emb_layers_1", "out_layers_3")}
    return names | ({f"lora_unet_{block}_skip_connection"} if skip else set())


# The tiny SDXL UNet (library.families.sd.tiny.build_tiny_sdxl): levels (32, 64), 2 ResNets per level, attention only on
# level 1 (2 transformer blocks, also in the middle block), so up level 0 has attention and up level 1 has none.
EXPECTED_ATTENTION = set().union(*(transformer_names(b, 2) for b in (
    "input_blocks_4_1", "input_blocks_5_1", "middle_block_1", "output_blocks_0_1", "output_blocks_1_1",
    "output_blocks_2_1")))
EXPECTED_CONV = (resnet_names("input_blocks_1_0", False) | resnet_names("input_blocks_2_0", False)
                 | resnet_names("input_blocks_4_0", True) | resnet_names("input_blocks_5_0", False)
                 | resnet_names("middle_block_0", False) | resnet_names("middle_block_2", False)
                 | set().union(*(resnet_names(f"output_blocks_{i}_0", True) for i in range(6)))
                 | {"lora_unet_input_blocks_3_0_op", "lora_unet_output_blocks_2_2_conv"})


@pytest.fixture(scope="module")
def tiny_sdxl():
    from library.families.sd.tiny import build_tiny_sdxl

    parts = build_tiny_sdxl(seed=0)
    parts["unet"].eval().requires_grad_(False)
    return parts


def unet_file(unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    return kohya_format.kohya_state_dict({"lora_unet": unet}, rename=SDXL.kohya_module_path)


@pytest.mark.parametrize("net, expected", [
    (NetworkArgs(), EXPECTED_ATTENTION),
    (NetworkArgs(conv_dim=2), EXPECTED_ATTENTION | EXPECTED_CONV),
])
def test_sdxl_unet_keys_are_the_names_sd_scripts_writes(tiny_sdxl, net, expected):
    unet = copy.deepcopy(tiny_sdxl["unet"])
    network_setup.attach_network(unet, "unet", 4, 1.0, 0.0, net)
    names = {key.partition(".")[0] for key in unet_file(unet)}
    assert names == expected


def test_the_text_encoder_prefixes_stay_as_they_are(tiny_sdxl):
    te = copy.deepcopy(tiny_sdxl["text_encoder_2"])
    network_setup.attach_network(te, "text_encoder", 4, 1.0, 0.0, NetworkArgs())
    sd = kohya_format.kohya_state_dict({"lora_te2": te}, rename=SDXL.kohya_module_path)
    assert "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight" in sd


def test_a_file_in_either_naming_loads(tiny_sdxl):
    unet = copy.deepcopy(tiny_sdxl["unet"])
    network_setup.attach_network(unet, "unet", 4, 1.0, 0.0, NetworkArgs(conv_dim=2))
    with torch.no_grad():
        for param in lora.lora_parameters(unet):
            param.normal_()
    kohya_names = unet_file(unet)
    diffusers_names = kohya_format.kohya_state_dict({"lora_unet": unet})
    assert "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in diffusers_names
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in kohya_names
    for sd in (kohya_names, diffusers_names):
        fresh = copy.deepcopy(tiny_sdxl["unet"])
        network_setup.attach_network(fresh, "unet", 4, 1.0, 0.0, NetworkArgs(conv_dim=2))
        report = kohya_format.apply_kohya_state_dict({"lora_unet": fresh}, sd, rename=SDXL.kohya_module_path)
        assert not report.missing and not report.unexpected
        for a, b in zip(lora.lora_parameters(unet), lora.lora_parameters(fresh), strict=True):
            assert torch.equal(a, b)
    assert kohya_format.dims_from_state_dict(kohya_names) == (4, 1.0)
