"""kohya's networks.lora_flux on diffusers' FLUX transformer: targets, network_args, the fused qkv / linear1 keys
(delta identical to the split layers'), reading them back, and diffusers' FluxPipeline.load_lora_weights."""
from __future__ import annotations

import pytest
import torch

from library.config.network_args import parse_network_args
from library.families.flux import lora as flux_lora
from library.network import kohya_format
from tests.helpers.lora_files import (
    deltas,
    file_delta,
    flux_pipelines_and_kohya_file,
    flux_trained,
    flux_transformer_inputs,
    lora_names,
)

RANK, ALPHA = 4, 2.0


def net(*args: str):
    settings, problems = parse_network_args(list(args))
    assert problems == []
    return settings


@pytest.fixture
def transformer():
    from library.families.flux.tiny import build_tiny_flux

    return build_tiny_flux(seed=1)["transformer"]


def kohya_names(transformer, *args):
    names, overrides = flux_lora.targets(transformer, RANK, ALPHA, net(*args))
    return {flux_lora.bfl_name(n)[0] for n in names}, names, overrides


def test_default_targets_are_kohyas_double_and_single_block_layers(transformer):
    names, modules, overrides = kohya_names(transformer)
    block = [f"lora_unet_double_blocks_0_{p}_{m}" for p in ("img", "txt")
             for m in ("mod_lin", "attn_qkv", "attn_proj", "mlp_0", "mlp_2")]
    single = [f"lora_unet_single_blocks_0_{m}" for m in ("linear1", "linear2", "modulation_lin")]
    assert names == set(block + single)
    assert len(modules) == 14 + 6 and overrides == {}  # q, k, v (and mlp) are separate diffusers layers


@pytest.mark.parametrize("which,prefix", [("single", "lora_unet_single_blocks_"), ("double", "lora_unet_double_")])
def test_train_blocks(transformer, which, prefix):
    names, _, _ = kohya_names(transformer, f"train_blocks={which}")
    assert names and all(name.startswith(prefix) for name in names)


def test_per_part_dims_rerank_or_drop_parts(transformer):
    names, modules, overrides = kohya_names(transformer, "img_attn_dim=0", "single_dim=8", "txt_mod_dim=2")
    assert not any("img_attn" in name for name in names)
    assert overrides["single_transformer_blocks.0.proj_mlp"] == (8, ALPHA)
    assert overrides["single_transformer_blocks.0.proj_out"] == (8, ALPHA)
    assert overrides["transformer_blocks.0.norm1_context.linear"] == (2, ALPHA)
    assert "single_transformer_blocks.0.norm.linear" not in overrides  # single_mod_dim is its own part


@pytest.mark.parametrize("arg,message", [("conv_dim=4", "conv_dim"), ("split_qkv=False", "split_qkv"),
                                         ("algo=loha", "algo"),
                                         ("in_dims=[4,0,0,0,0]", "unknown key"),
                                         ("train_single_block_indices=3-1", "increasing range")])
def test_what_is_not_offered_is_an_error_naming_it(transformer, arg, message):
    settings, problems = parse_network_args([arg])
    if problems:
        assert message in problems[0]
        return
    with pytest.raises(ValueError, match=message):
        flux_lora.targets(transformer, RANK, ALPHA, settings)


def test_fused_keys_carry_exactly_the_split_deltas(transformer):
    model = flux_trained(transformer)
    exported = flux_lora.to_kohya(kohya_format.kohya_state_dict({"lora_unet": model}, ALPHA))
    split = deltas(model)
    d = "transformer_blocks.0.attn."
    s = "single_transformer_blocks.0."
    for name, parts in (("lora_unet_double_blocks_0_img_attn_qkv", [d + "to_q", d + "to_k", d + "to_v"]),
                        ("lora_unet_double_blocks_0_txt_attn_qkv", [d + "add_q_proj", d + "add_k_proj",
                                                                    d + "add_v_proj"]),
                        ("lora_unet_single_blocks_0_linear1", [s + "attn.to_q", s + "attn.to_k", s + "attn.to_v",
                                                               s + "proj_mlp"])):
        assert exported[f"{name}.lora_down.weight"].shape[0] == RANK * len(parts)
        assert exported[f"{name}.alpha"].item() == ALPHA * len(parts)  # keeps alpha / rank (kohya #2204)
        torch.testing.assert_close(file_delta(exported, name), torch.cat([split[p] for p in parts]),
                                   rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(file_delta(exported, "lora_unet_double_blocks_0_img_mlp_0"),
                               split["transformer_blocks.0.ff.net.0.proj"], rtol=0, atol=0)


def test_reading_the_fused_file_back_restores_every_tensor(transformer):
    model = flux_trained(transformer, "single_dim=8")
    ours = kohya_format.kohya_state_dict({"lora_unet": model})
    back = flux_lora.from_kohya(flux_lora.to_kohya(ours))
    assert set(back) == set(ours)
    for key, tensor in ours.items():
        assert torch.equal(back[key], tensor), key


def test_a_dense_fused_kohya_lora_splits_into_the_same_delta():
    g = torch.Generator().manual_seed(0)
    down, up = torch.randn(4, 32, generator=g), torch.randn(96, 4, generator=g)
    state = {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": down,
             "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": up,
             "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(1.0)}
    split = flux_lora.from_kohya(state)
    parts = [file_delta(split, f"lora_unet_transformer_blocks_0_attn_to_{p}") for p in "qkv"]
    torch.testing.assert_close(torch.cat(parts), up @ down / 4)


def test_diffusers_converts_a_real_size_linear1_to_the_same_deltas():
    # diffusers hard-codes FLUX.1's widths (3072 hidden, 12288 MLP) for single blocks: checked on one layer's LoRA.
    from diffusers import FluxPipeline

    g = torch.Generator().manual_seed(0)
    ours = {}
    for part, out in (("attn_to_q", 3072), ("attn_to_k", 3072), ("attn_to_v", 3072), ("proj_mlp", 12288)):
        key = f"lora_unet_single_transformer_blocks_0_{part}"
        ours.update({f"{key}.lora_down.weight": torch.randn(2, 3072, generator=g) / 50,
                     f"{key}.lora_up.weight": torch.randn(out, 2, generator=g) / 50, f"{key}.alpha": torch.tensor(1.0)})
    converted = FluxPipeline.lora_state_dict(flux_lora.to_kohya(ours))
    converted = converted[0] if isinstance(converted, tuple) else converted
    for part, path in (("attn_to_q", "attn.to_q"), ("attn_to_k", "attn.to_k"), ("attn_to_v", "attn.to_v"),
                       ("proj_mlp", "proj_mlp")):
        key = f"transformer.single_transformer_blocks.0.{path}"
        theirs = converted[f"{key}.lora_B.weight"] @ converted[f"{key}.lora_A.weight"]
        torch.testing.assert_close(theirs, file_delta(ours, f"lora_unet_single_transformer_blocks_0_{part}"),
                                   rtol=1e-5, atol=1e-9)


def test_diffusers_load_lora_weights_consumes_every_key_and_matches_our_output(tiny_flux_dir, tmp_path):
    """Double blocks and CLIP-L (lora_te1) on the tiny model (diffusers hard-codes FLUX.1's single-block widths,
    checked above). Outputs agree to rtol 1e-4 / atol 1e-5 (diffusers folds alpha / rank into both matrices)."""
    from diffusers import FluxPipeline


    pipe, ours, model, state = flux_pipelines_and_kohya_file(tiny_flux_dir, "train_blocks=double")
    path = tmp_path / "flux_lora.safetensors"
    kohya_format.save_lora_file(path, state, {})
    # Every key of the file becomes exactly one of our modules' A / B (diffusers raises on keys it cannot place).
    converted = FluxPipeline.lora_state_dict(kohya_format.load_kohya_lora(path)[0])
    converted = converted[0] if isinstance(converted, tuple) else converted
    # (the text encoder's keys come in diffusers' older spelling: self_attn.to_q_lora.down.weight, mlp.fc1.lora_...)
    transformer_keys = {key.rsplit(".", 2)[0] for key in converted if key.startswith("transformer.")}
    assert transformer_keys == {f"transformer.{name}" for name in lora_names(model)}
    text_keys = [key for key in converted if key.startswith("text_encoder.")]
    assert len(text_keys) == 2 * len(lora_names(ours.text_encoder))
    assert len(converted) == 2 * len(transformer_keys) + len(text_keys)
    pipe.load_lora_weights(str(path))
    assert len(lora_names(pipe.transformer)) == len(lora_names(model)) == 14
    assert len(lora_names(pipe.text_encoder)) == len(lora_names(ours.text_encoder))

    g = torch.Generator().manual_seed(5)
    inputs = flux_transformer_inputs(g)
    with torch.no_grad():
        expected, got = model(**inputs)[0], pipe.transformer(**inputs)[0]
        base = FluxPipeline.from_pretrained(tiny_flux_dir, local_files_only=True).transformer(**inputs)[0]
        ids = torch.randint(0, 50, (1, 77), generator=g)
        te_expected, te_got = ours.text_encoder(ids).pooler_output, pipe.text_encoder(ids).pooler_output
    assert not torch.allclose(expected, base, atol=1e-3)  # the LoRA changes the output
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(te_got, te_expected, rtol=1e-4, atol=1e-5)


def test_flux_network_args_are_refused_for_a_unet():
    from library.config import UserError
    from library.network.targets import attach_network

    with pytest.raises(UserError, match="train_blocks, img_attn_dim: only for FLUX"):
        attach_network(torch.nn.Module(), "unet", RANK, ALPHA, 0.0, net("train_blocks=single", "img_attn_dim=2"))


@pytest.fixture
def two_block_transformer():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(in_channels=64, num_layers=2, num_single_layers=3, attention_head_dim=16,
                                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                  guidance_embeds=True, axes_dims_rope=(4, 6, 6))


def test_block_indices_choose_blocks(two_block_transformer):
    names, _, _ = kohya_names(two_block_transformer, "train_double_block_indices=1",
                              "train_single_block_indices=0,2-2")
    assert {n.split("_")[4] for n in names if "double" in n} == {"1"}
    assert {n.split("_")[4] for n in names if "single" in n} == {"0", "2"}
    names, _, _ = kohya_names(two_block_transformer, "train_double_block_indices=none")
    assert not any("double" in name for name in names)


def test_to_peft_loads_single_blocks_too_and_matches_our_output(tiny_flux_dir, tmp_path):
    """diffusers cannot read kohya's single-block keys at the tiny model's widths; to_peft hands it peft keys that
    give every trained layer (double, single, CLIP-L) the delta the trainer's LoRA has."""


    pipe, ours, model, state = flux_pipelines_and_kohya_file(tiny_flux_dir)  # all blocks
    assert any(key.startswith("lora_unet_single_blocks_0_linear1") for key in state)
    converted = flux_lora.to_peft(state, {"transformer": pipe.transformer, "text_encoder": pipe.text_encoder})
    assert len(converted) == 2 * (len(lora_names(model)) + len(lora_names(ours.text_encoder)))
    pipe.load_lora_weights(converted)
    assert len(lora_names(pipe.transformer)) == len(lora_names(model)) == 20

    g = torch.Generator().manual_seed(5)
    inputs = flux_transformer_inputs(g)
    with torch.no_grad():
        expected, got = model(**inputs)[0], pipe.transformer(**inputs)[0]
        ids = torch.randint(0, 50, (1, 77), generator=g)
        te_expected, te_got = ours.text_encoder(ids).pooler_output, pipe.text_encoder(ids).pooler_output
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(te_got, te_expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="fit no module"):
        flux_lora.to_peft({"lora_unet_nowhere.lora_down.weight": torch.zeros(4, 8),
                           "lora_unet_nowhere.lora_up.weight": torch.zeros(8, 4)}, {"transformer": pipe.transformer})
