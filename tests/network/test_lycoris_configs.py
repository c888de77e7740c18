"""kohya users' LyCORIS configs as they are (network_module = "lycoris.kohya"), and kohya's network_dropout."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from library.config import parse_config
from library.config.network_args import NetworkArgs, parse_network_args
from library.network import kohya_format, lora, presets
from library.network import targets as network_setup
from tests.helpers.lora_files import randomize_adapters

REPO = Path(__file__).resolve().parents[2]


def lycoris(*args: str) -> NetworkArgs:
    settings, problems = parse_network_args(list(args), network_module="lycoris.kohya")
    assert problems == []
    return settings


def test_lycoris_defaults_and_keys():
    # LyCORIS: preset full, conv_dim / conv_alpha default to network_dim / network_alpha, its switches accepted off
    settings = lycoris("algo=lokr", "factor=8", "conv_dim=4", "use_tucker=False", "use_scalar=false")
    assert settings == NetworkArgs(algo="lokr", factor=8, conv_dim=4, lycoris=True)
    assert settings.preset == "full" and settings.trains_text_encoder
    assert not lycoris("preset=unet-transformer-only").trains_text_encoder
    _, problems = parse_network_args(["preset=attn-only", "block_dims=1,2"], network_module="lycoris.kohya")
    assert any("block_dims is kohya's networks.lora option" in p for p in problems), problems


def attached_names(tiny, net: NetworkArgs, part: str) -> set[str]:
    model = copy.deepcopy(tiny["unet" if part == "unet" else "text_encoder"])
    network_setup.attach_network(model, part, 4, 2.0, 0.0, net)
    return {name for name, _ in lora.lora_layers(model)}


def test_presets_pick_lycoris_layers_in_the_diffusers_unet(tiny):
    unet = tiny["unet"]
    modules = dict(unet.named_modules())
    linear_or_conv = {name for name, m in modules.items() if isinstance(m, (nn.Linear, nn.Conv2d))}
    in_transformers = {n for n in linear_or_conv if ".attentions." in n}
    in_conv_blocks = {n for n in linear_or_conv if ".resnets." in n or "samplers." in n}
    attention = {n for n in in_transformers if ".attn1." in n or ".attn2." in n}
    named = {"conv_in", "conv_out", "time_embedding.linear_1", "time_embedding.linear_2"}

    full = attached_names(tiny, lycoris("preset=full"), "unet")
    assert full == in_transformers | in_conv_blocks | named
    # LyCORIS 4.1.3 lists TimestepEmbedding among the transformer presets' classes (sd-scripts' SD1/SD2 UNet has one)
    time = {"time_embedding.linear_1", "time_embedding.linear_2"}
    assert attached_names(tiny, lycoris("preset=attn-mlp"), "unet") == in_transformers | time
    assert attached_names(tiny, lycoris("preset=unet-transformer-only"), "unet") == in_transformers | time
    assert attached_names(tiny, lycoris("preset=attn-only"), "unet") == attention
    assert len(attention) == 8 * len({n.rsplit(".attn", 1)[0] for n in attention})
    assert attached_names(tiny, lycoris("preset=unet-convblock-only"), "unet") == in_conv_blocks | {"conv_in",
                                                                                                     "conv_out"}
    te_all = attached_names(tiny, lycoris("preset=full"), "text_encoder")
    te_attention = attached_names(tiny, lycoris("preset=attn-only"), "text_encoder")
    assert te_attention == {n for n in te_all if ".self_attn." in n} and len(te_attention) < len(te_all)
    assert presets.text_encoder_targets(tiny["text_encoder"], "unet-only") == []


def test_lokr_factor_splits_as_lycoris_does(tiny):
    # LyCORIS puts the smaller part of a dimension first: factor=8 on 32 x 32 is kron([4, 4], [8, 8])
    unet = copy.deepcopy(tiny["unet"])
    network_setup.attach_network(unet, "unet", 2, 1.0, 0.0, lycoris("algo=lokr", "factor=8", "preset=attn-mlp"))
    sd = kohya_format.kohya_state_dict({"lora_unet": unet})
    name = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    assert sd[f"{name}.lokr_w1"].shape == (4, 4)
    assert sd[f"{name}.lokr_w2_a"].shape == (8, 2) and sd[f"{name}.lokr_w2_b"].shape == (2, 8)


def test_lycoris_conv_defaults_give_k_by_k_convs_network_dim(tiny):
    unet = copy.deepcopy(tiny["unet"])
    network_setup.attach_network(unet, "unet", 4, 2.0, 0.0, lycoris("algo=locon"))
    sd = kohya_format.kohya_state_dict({"lora_unet": unet})
    assert sd["lora_unet_conv_in.lora_down.weight"].shape == (4, 4, 3, 3)
    assert sd["lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight"].shape[0] == 4
    assert float(sd["lora_unet_down_blocks_0_resnets_0_conv1.alpha"]) == 2.0
    assert "lora_unet_time_embedding_linear_1.lora_down.weight" in sd


# --------------------------------------------------------------------------------------------- network_dropout


def test_network_dropout_drops_lora_downs_output_as_kohya():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 12))
    lora.attach_lora(model, ["0"], 4, 2.0)
    network_setup.add_kohya_dropout(model, rank_dropout=0.0, module_dropout=0.0, dropout=0.5)
    layer = model[0]
    assert isinstance(layer.lora_dropout["default"], nn.Identity)  # peft's input dropout stays off
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    down, up = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x = torch.randn(3, 16)
    model.train()
    torch.manual_seed(1)
    ours = model(x)
    torch.manual_seed(1)
    expected = layer.base_layer(x) + torch.nn.functional.dropout(x @ down.T, p=0.5) @ up.T * 0.5
    torch.testing.assert_close(ours, expected)
    model.eval()
    torch.testing.assert_close(model(x), layer.base_layer(x) + x @ down.T @ up.T * 0.5)


def test_network_dropout_option_reaches_the_layers(tiny):
    unet = copy.deepcopy(tiny["unet"])
    network_setup.attach_network(unet, "unet", 4, 2.0, 0.1, NetworkArgs())
    _, layer = lora.lora_layers(unet)[0]
    assert isinstance(layer.lora_dropout["default"], nn.Identity)
    hooks = list(layer.lora_A["default"]._forward_hooks.values())
    assert len(hooks) == 1 and hooks[0].dropout == 0.1


# --------------------------------------------------------------------------------------------- from the quickstart


@pytest.mark.usefixtures("fresh_accelerator_state")
@pytest.mark.parametrize("network_args, expect", [
    (["algo=lokr", "factor=8", "conv_dim=4"], "lokr_w1"),
    (["algo=locon", "preset=attn-mlp"], "lora_down.weight"),
    (["algo=loha", "preset=unet-transformer-only"], "hada_w1_a"),
])
def test_kohya_lycoris_configs_train_from_the_quickstart(monkeypatch, tmp_path, network_args, expect):
    from library.training import loop

    monkeypatch.chdir(REPO)
    config, _ = parse_config(["--config", "configs/quickstart.toml", "--network_module", "lycoris.kohya",
                              "--network_args", *network_args, "--max_train_steps", "2", "--train_batch_size", "4",
                              "--output_dir", str(tmp_path)])
    result = loop.run(config)
    sd, metadata = kohya_format.load_kohya_lora(result.output_file)
    assert metadata["ss_network_module"] == "lycoris.kohya"
    names = {key.partition(".")[0] for key in sd}
    assert all(f"{name}.{expect}" in sd for name in names)
    if "preset=unet-transformer-only" in network_args:
        # LyCORIS' UNet-only presets leave the text encoder untrained, as LyCORIS does
        assert names and all(name.startswith("lora_unet_") for name in names)
    elif "preset=attn-mlp" in network_args:
        assert not any("resnets" in name or name.endswith("conv_in") for name in names)
        assert any(name.startswith("lora_te_") for name in names)
    else:
        assert "lora_unet_conv_in" in names and "lora_unet_time_embedding_linear_1" in names
        assert any("resnets_0_conv1" in name for name in names)


# --------------------------------------------------------------------------------------------- LyCORIS itself


@pytest.mark.parametrize("network_args", [
    ["algo=lokr", "factor=8", "conv_dim=4", "preset=unet-convblock-only"],
    ["algo=lokr", "factor=4", "decompose_both=true", "preset=attn-mlp"],
    ["algo=loha", "preset=attn-mlp"],
    ["algo=locon", "dora_wd=true", "wd_on_output=false", "conv_dim=2", "preset=unet-convblock-only"],
    ["algo=loha", "use_tucker=True", "conv_dim=2", "preset=unet-convblock-only"],
    ["algo=lokr", "use_cp=True", "factor=4", "conv_dim=2", "preset=unet-convblock-only"],
])
def test_lycoris_loads_the_file_strictly_and_computes_the_same(tiny, network_args):
    # Runs where the lycoris-lora package is installed (it is not a dependency). Its full / unet-only presets
    # assert on a duplicate time_embedding name with diffusers' UNet, so the presets here avoid them.
    lycoris_kohya = pytest.importorskip("lycoris.kohya")
    settings = lycoris(*network_args)
    ours = copy.deepcopy(tiny["unet"])
    network_setup.attach_network(ours, "unet", 8, 4.0, 0.0, settings)
    gen = torch.Generator().manual_seed(0)
    randomize_adapters((ours,), gen, scale=0.2, magnitude_spread=0.3)
    theirs, te = copy.deepcopy(tiny["unet"]), copy.deepcopy(tiny["text_encoder"])
    kwargs = dict(arg.split("=", 1) for arg in network_args)
    network = lycoris_kohya.create_network(1.0, 8, 4.0, tiny["vae"], te, theirs, **kwargs)
    network.apply_to(te, theirs, apply_text_encoder=False, apply_unet=True)
    missing, unexpected = network.load_state_dict(kohya_format.kohya_state_dict({"lora_unet": ours}), strict=False)
    assert not missing and not unexpected
    x = (torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([10, 700]), torch.randn(2, 7, 32, generator=gen))
    with torch.no_grad():
        torch.testing.assert_close(theirs(*x).sample, ours(*x).sample, atol=2e-5, rtol=1e-4)
    if "use_tucker=True" in network_args or "use_cp=True" in network_args:
        assert any(key.endswith((".hada_t1", ".lokr_t2")) for key in kohya_format.kohya_state_dict(
            {"lora_unet": ours}))


@pytest.mark.parametrize("network_args", [
    ["algo=loha", "preset=attn-mlp"],
    ["algo=lokr", "factor=4", "decompose_both=true", "preset=attn-mlp"],
    ["algo=lokr", "use_cp=True", "factor=4", "conv_dim=2", "preset=unet-convblock-only"],
])
def test_max_norm_on_loha_and_lokr_is_lycoris(tiny, network_args):
    # scale_weight_norms with LoHa / LoKr: the same weight deltas as LyCORIS' apply_max_norm_regularization
    lycoris_kohya = pytest.importorskip("lycoris.kohya")
    from library.training.adapters import apply_max_norm

    ours = copy.deepcopy(tiny["unet"])
    network_setup.attach_network(ours, "unet", 4, 4.0, 0.0, lycoris(*network_args))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i, (_, layer) in enumerate(lora.lora_layers(ours)):
            for param in lora.layer_parameters(layer).values():  # some layers above the limit, some below
                param.copy_(torch.randn(param.shape, generator=gen) * (0.6 if i % 2 else 0.05))
    theirs, te = copy.deepcopy(tiny["unet"]), copy.deepcopy(tiny["text_encoder"])
    network = lycoris_kohya.create_network(1.0, 4, 4.0, tiny["vae"], te, theirs,
                                           **dict(arg.split("=", 1) for arg in network_args))
    network.apply_to(te, theirs, apply_text_encoder=False, apply_unet=True)
    network.load_state_dict(kohya_format.kohya_state_dict({"lora_unet": ours}), strict=False)
    logs = apply_max_norm([ours], 1.0)
    keys_scaled, mean, largest = network.apply_max_norm_regularization(1.0, "cpu")
    assert 0 < logs["max_norm/keys_scaled"] == keys_scaled < len(lora.lora_layers(ours))
    assert logs["max_norm/average_key_norm"] == pytest.approx(float(mean), rel=1e-4)
    assert logs["max_norm/max_key_norm"] == pytest.approx(float(largest), rel=1e-4)
    x = (torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([10, 700]), torch.randn(2, 7, 32, generator=gen))
    with torch.no_grad():
        torch.testing.assert_close(theirs(*x).sample, ours(*x).sample, atol=2e-5, rtol=1e-4)


def test_gui_network_args_spellings():
    # the kohya_ss GUI writes use_tucker twice (the last counts, as in sd-scripts), use_cp for LoKr (read before
    # use_tucker, as LyCORIS does), and rank_dropout_scale, which LyCORIS' kohya entry point does not read
    assert lycoris("algo=loha", "use_tucker=False", "use_tucker=True").use_tucker
    assert not lycoris("algo=lokr", "use_cp=False", "use_tucker=True").use_tucker
    assert lycoris("algo=lokr", "use_tucker=False", "use_cp=True").use_tucker
    assert lycoris("algo=lokr", "rank_dropout_scale=True") == lycoris("algo=lokr", "rank_dropout_scale=False")
    assert parse_network_args(["conv_dim=4", "conv_dim=8"])[0].conv_dim == 8
