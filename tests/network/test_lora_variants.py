"""network_args and the LoRA variants (LoCon, DoRA, LoHa, LoKr), LoRA+, max-norm, rank/module dropout.

Files are checked against the readers: diffusers' load_lora_weights where it supports the variant, otherwise a
merge written from ComfyUI's weight adapters (comfy/weight_adapter/{lora,loha,lokr,base}.py), which is also how
AUTOMATIC1111's built-in Lora extension merges them.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from torch import nn

from library.config import ConfigError, parse_config
from library.config.network_args import NetworkArgs, parse_network_args
from library.network import kohya_format, lora
from library.network import targets as network_setup
from tests.helpers.lora_files import randomize_adapters
from tests.helpers.runs import make_config

RANK = 4


def fixed_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    return dict(sample=torch.randn(2, 4, 8, 8, generator=gen), timestep=torch.tensor([10, 700]),
                encoder_hidden_states=torch.randn(2, 7, 32, generator=gen),
                input_ids=torch.randint(0, 500, (2, 7), generator=gen))


@torch.no_grad()
def outputs(unet: nn.Module, te: nn.Module, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    u = unet(x["sample"], x["timestep"], encoder_hidden_states=x["encoder_hidden_states"]).sample
    t = te(x["input_ids"]).last_hidden_state
    return u, t


def attached(tiny, net: NetworkArgs, rank: int = RANK, alpha: float = 2.0, seed: int = 1):
    """Fresh copies of the tiny UNet and text encoder with the adapter attached and every tensor random, so that
    each factor matters in the comparison."""
    unet, te = copy.deepcopy(tiny["unet"]), copy.deepcopy(tiny["text_encoder"])
    network_setup.attach_network(unet, "unet", rank, alpha, 0.0, net)
    network_setup.attach_network(te, "text_encoder", rank, alpha, 0.0, net)
    randomize_adapters((unet, te), torch.Generator().manual_seed(seed), scale=0.1, magnitude_spread=0.2)
    return unet, te


def diffusers_load(tiny, state_dict: dict[str, torch.Tensor]):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(unet=copy.deepcopy(tiny["unet"]), text_encoder=copy.deepcopy(tiny["text_encoder"]),
                                   vae=tiny["vae"], tokenizer=tiny["tokenizer"], scheduler=tiny["scheduler"],
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.load_lora_weights(dict(state_dict))
    return pipe.unet, pipe.text_encoder


# --------------------------------------------------------------------------------------------- network_args


def test_kohya_network_args_parse():
    settings, problems = parse_network_args(
        ["conv_dim=8", "conv_alpha=4", "algo=LoCon", "rank_dropout=0.1", "module_dropout=0.05",
         "loraplus_unet_lr_ratio=16"])
    assert problems == []
    assert settings == NetworkArgs(algo="locon", conv_dim=8, conv_alpha=4.0, rank_dropout=0.1, module_dropout=0.05,
                                   loraplus_unet_lr_ratio=16.0)
    assert settings.variant == "lora" and settings.conv_rank_alpha == (8, 4.0)
    # kohya: conv_alpha defaults to 1 when conv_dim is given
    assert parse_network_args(["conv_dim=2"])[0].conv_rank_alpha == (2, 1.0)
    assert parse_network_args(["algo=lokr", "factor=4", "decompose_both=true"])[0] == NetworkArgs(
        algo="lokr", factor=4, decompose_both=True)
    assert parse_network_args(["dora_wd=True", "wd_on_output=True"])[0] == NetworkArgs(dora_wd=True,
                                                                                    wd_on_output=True)
    assert parse_network_args([])[0].is_default


@pytest.mark.parametrize("args, message", [
    (["conv_dims=4"], "unknown key 'conv_dims' (did you mean conv_dim?); supported: algo, conv_dim"),
    (["algo=glora"], "network_args: algo=glora: expected one of lora, locon, loha, lokr, ia3, diag-oft, dylora"),
    (["algo=ia3"], "algo=ia3 is LyCORIS'; set network_module = \"lycoris.kohya\""),
    (["conv_dim=0"], "network_args: conv_dim=0: must be at least 1"),
    (["conv_dim=four"], "network_args: conv_dim=four: expected an integer"),
    (["rank_dropout=1"], "network_args: rank_dropout=1: must be in [0, 1)"),
    (["dora_wd=maybe"], "network_args: dora_wd=maybe: expected true or false"),
    (["preset=full"], "preset is LyCORIS'; it takes effect with network_module = \"lycoris.kohya\""),
    (["conv_dim"], "'conv_dim' must look like key=value"),
    (["conv_alpha=4"], "conv_alpha needs conv_dim"),
    (["factor=4"], "factor applies to algo=lokr only"),
    (["algo=loha", "dora_wd=true"], "dora_wd works with algo=lora or locon"),
    (["dora_wd=true", "rank_dropout=0.1"], "cannot be combined with dora_wd"),
    (["algo=loha", "loraplus_lr_ratio=4"], "algo=loha has none"),
])
def test_bad_network_args_name_the_key(args, message):
    _, problems = parse_network_args(args)
    assert any(message in problem for problem in problems), problems


def config_args(tmp_path: Path, text: str) -> list[str]:
    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir(exist_ok=True)
    data.mkdir(exist_ok=True)
    path = tmp_path / "lora.toml"
    path.write_text(text, encoding="utf-8")
    return ["--config", str(path), "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data),
            "--output_dir", str(tmp_path / "out")]


def test_network_options_from_toml(tmp_path):
    config, _ = parse_config(config_args(tmp_path, 'network_args = ["conv_dim=4", "conv_alpha=1", "algo=locon"]\n'
                                                   "loraplus_lr_ratio = 8\nscale_weight_norms = 1.0\n"))
    assert config.network_args == ["conv_dim=4", "conv_alpha=1", "algo=locon"]
    assert config.loraplus_lr_ratio == 8.0 and config.scale_weight_norms == 1.0

    with pytest.raises(ConfigError) as err:
        parse_config(config_args(tmp_path, 'network_args = ["convdim=4", "loraplus_lr_ratio=2", "algo=lokr"]\n'
                                           "loraplus_lr_ratio = 8\nscale_weight_norms = -1\nnetwork_dropout = 0.1\n"))
    problems = "\n".join(err.value.problems)
    for message in ("unknown key 'convdim' (did you mean conv_dim?)",
                    "loraplus_lr_ratio is set both as an option and in network_args",
                    "scale_weight_norms must be positive",
                    "network_dropout is not available for algo=lokr"):
        assert message in problems, problems


@pytest.mark.parametrize("text, message", [
    ("ema_decay = 1.5\n", "ema_decay must be between 0 and 1"),
    ("ema_for_saved_file = true\n", "ema_for_saved_file needs ema_decay"),
    ("scale_weight_norms = 1.0\ndeepspeed = true\n", "scale_weight_norms does not work with deepspeed"),
    ('network_args = ["block_alphas=1,2"]\n', "block_alphas takes effect only with block_dims"),
    ('network_args = ["down_lr_weight=0.5"]\n', "network_args: down_lr_weight=0.5: expected a preset"),
    ('network_args = ["block_dims=4,-1"]\n', "network_args: block_dims=4,-1: values must not be negative"),
    ('network_module = "lycoris.kohya"\nnetwork_args = ["preset=everything"]\n',
     "network_args: preset=everything: preset 'everything' is not offered; offered: full, attn-mlp"),
    ('network_module = "lycoris.kohya"\nnetwork_args = ["use_scalar=true"]\n',
     "network_args: use_scalar=true: is not offered here"),
    ('network_module = "lycoris.kohya"\nnetwork_args = ["algo=locon", "use_tucker=true"]\n',
     "network_args: use_tucker works with algo=loha or lokr"),
])
def test_more_network_option_errors(tmp_path, text, message):
    with pytest.raises(ConfigError) as err:
        parse_config(config_args(tmp_path, text))
    assert any(message in problem for problem in err.value.problems), err.value.problems


# --------------------------------------------------------------------------------------------- conv LoRA

# Written out by hand from diffusers' SD1 UNet layout (tiny: 2 down / 2 up blocks, layers_per_block 2).
RESNETS_SD1 = (["down_blocks.0.resnets.0", "down_blocks.0.resnets.1", "down_blocks.1.resnets.0",
                "down_blocks.1.resnets.1", "mid_block.resnets.0", "mid_block.resnets.1"]
               + [f"up_blocks.{b}.resnets.{r}" for b in (0, 1) for r in (0, 1, 2)])
SHORTCUTS_SD1 = ["down_blocks.1.resnets.0"] + [f"up_blocks.{b}.resnets.{r}" for b in (0, 1) for r in (0, 1, 2)]
SAMPLERS_SD1 = ["down_blocks.0.downsamplers.0.conv", "up_blocks.0.upsamplers.0.conv"]


def test_conv_targets_follow_kohya(tiny):
    linear, conv = lora.unet_conv_target_modules(tiny["unet"])
    assert set(conv) == {f"{r}.{c}" for r in RESNETS_SD1 for c in ("conv1", "conv2")} | set(SAMPLERS_SD1)
    assert set(linear) == ({f"{r}.time_emb_proj" for r in RESNETS_SD1}
                           | {f"{r}.conv_shortcut" for r in SHORTCUTS_SD1})


def test_conv_lora_keys_shapes_and_alpha(tiny):
    unet, te = attached(tiny, NetworkArgs(conv_dim=2, conv_alpha=0.5), rank=RANK, alpha=2.0)
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te})
    name = "lora_unet_down_blocks_0_resnets_0_conv1"
    assert sd[f"{name}.lora_down.weight"].shape == (2, 32, 3, 3)
    assert sd[f"{name}.lora_up.weight"].shape == (32, 2, 1, 1)
    assert sd[f"{name}.alpha"].item() == 0.5
    sampler = "lora_unet_up_blocks_0_upsamplers_0_conv"
    assert sd[f"{sampler}.lora_down.weight"].shape == (2, 64, 3, 3)
    # the Linear / 1x1 layers in the ResNet blocks take network_dim / network_alpha, as in kohya
    assert sd["lora_unet_down_blocks_0_resnets_0_time_emb_proj.lora_down.weight"].shape == (RANK, 128)
    assert sd["lora_unet_down_blocks_1_resnets_0_conv_shortcut.lora_down.weight"].shape == (RANK, 32, 1, 1)
    assert sd["lora_unet_down_blocks_1_resnets_0_conv_shortcut.alpha"].item() == 2.0
    # dim_from_weights reads the linear rank; the 3x3 convs carry conv_dim's
    assert kohya_format.dims_from_state_dict(sd) == (RANK, 2.0)


def test_conv_lora_loads_in_diffusers_and_matches(tiny, tmp_path):
    x = fixed_inputs()
    unet, te = attached(tiny, NetworkArgs(conv_dim=2, conv_alpha=0.5), rank=RANK, alpha=2.0)
    plain_u, _ = attached(tiny, NetworkArgs(), rank=RANK, alpha=2.0)
    ours_u, ours_t = outputs(unet, te, x)
    # the conv layers change the output, or the comparison would not test them
    assert (ours_u - outputs(plain_u, te, x)[0]).abs().max() > 1e-3
    path = tmp_path / "locon.safetensors"
    kohya_format.save_lora_file(path, kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te}))
    d_unet, d_te = diffusers_load(tiny, kohya_format.load_kohya_lora(path)[0])
    theirs_u, theirs_t = outputs(d_unet, d_te, x)
    torch.testing.assert_close(theirs_u, ours_u, atol=1e-5, rtol=0)
    torch.testing.assert_close(theirs_t, ours_t, atol=1e-5, rtol=0)


def test_conv_lora_round_trip_and_mismatch(tiny):
    net = NetworkArgs(conv_dim=2, conv_alpha=0.5)
    unet, te = attached(tiny, net)
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te})
    fresh_u, fresh_t = attached(tiny, net, seed=7)
    report = kohya_format.apply_kohya_state_dict({"lora_unet": fresh_u, "lora_te": fresh_t}, sd)
    assert len(report.loaded) == len(lora.lora_layers(unet)) + len(lora.lora_layers(te))
    for a, b in zip(lora.lora_parameters(unet), lora.lora_parameters(fresh_u), strict=True):
        assert torch.equal(a, b)
    other_u, other_t = attached(tiny, NetworkArgs(conv_dim=4, conv_alpha=0.5))
    with pytest.raises(ValueError, match="conv_dim"):
        kohya_format.apply_kohya_state_dict({"lora_unet": other_u, "lora_te": other_t}, sd)
    plain_u, plain_t = attached(tiny, NetworkArgs())
    with pytest.raises(ValueError, match="unexpected keys"):
        kohya_format.apply_kohya_state_dict({"lora_unet": plain_u, "lora_te": plain_t}, sd)


# --------------------------------------------------------------------------------------------- ComfyUI's merge


def _decompose(dora_scale: torch.Tensor, weight: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
    """comfy/weight_adapter/base.py weight_decompose at strength 1. A dora_scale whose first dimension is the
    weight's is per output channel (LyCORIS wd_on_output); otherwise per input channel. The output-axis norm is
    taken of the adapted weight W + dW, as in DoRA and peft (ComfyUI PR #15458; its code at the time of writing
    took the norm of W)."""
    adapted = weight + diff
    if dora_scale.shape[0] == adapted.shape[0]:
        norm = adapted.reshape(adapted.shape[0], -1).norm(dim=1, keepdim=True).reshape(
            adapted.shape[0], *[1] * (adapted.dim() - 1))
    else:
        norm = adapted.transpose(0, 1).reshape(adapted.shape[1], -1).norm(dim=1, keepdim=True).reshape(
            adapted.shape[1], *[1] * (adapted.dim() - 1)).transpose(0, 1)
    return adapted * (dora_scale / (norm + torch.finfo(weight.dtype).eps))


def _comfy_diff(v: dict[str, torch.Tensor], shape: torch.Size) -> tuple[torch.Tensor, float]:
    """(unscaled delta, scale) as comfy/weight_adapter/{lora,loha,lokr}.py compute them from a file's tensors."""
    alpha = v["alpha"].item() if "alpha" in v else None
    if "lora_up.weight" in v:
        up, down = v["lora_up.weight"], v["lora_down.weight"]
        diff = (up.flatten(start_dim=1) @ down.flatten(start_dim=1)).reshape(shape)
        return diff, 1.0 if alpha is None else alpha / down.shape[0]
    if "hada_w1_a" in v:
        diff = ((v["hada_w1_a"] @ v["hada_w1_b"]) * (v["hada_w2_a"] @ v["hada_w2_b"])).reshape(shape)
        return diff, 1.0 if alpha is None else alpha / v["hada_w1_b"].shape[0]
    dim = None
    w1 = v.get("lokr_w1")
    if w1 is None:
        dim = v["lokr_w1_b"].shape[0]
        w1 = v["lokr_w1_a"] @ v["lokr_w1_b"]
    w2 = v.get("lokr_w2")
    if w2 is None:
        dim = v["lokr_w2_b"].shape[0]
        w2 = v["lokr_w2_a"] @ v["lokr_w2_b"]
    if w2.dim() == 4:
        w1 = w1.unsqueeze(2).unsqueeze(2)
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    return torch.kron(w1, w2).reshape(shape), scale


@torch.no_grad()
def comfy_merge(tiny, state_dict: dict[str, torch.Tensor]) -> tuple[nn.Module, nn.Module]:
    """Fresh base copies with the file merged into their weights the way ComfyUI's LoRA loader does."""
    unet, te = copy.deepcopy(tiny["unet"]), copy.deepcopy(tiny["text_encoder"])
    by_name = {}
    for prefix, model in (("lora_unet", unet), ("lora_te", te)):
        for module_name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                by_name[kohya_format.kohya_lora_name(prefix, module_name)] = module
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        name, _, role = key.partition(".")
        grouped.setdefault(name, {})[role] = tensor.float()
    for name, v in grouped.items():
        weight = by_name[name].weight
        diff, scale = _comfy_diff(v, weight.shape)
        merged = _decompose(v["dora_scale"], weight, diff * scale) if "dora_scale" in v else weight + diff * scale
        weight.copy_(merged)
    return unet, te


def assert_matches_comfy(tiny, unet: nn.Module, te: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    x = fixed_inputs()
    ours_u, ours_t = outputs(unet, te, x)
    base_u, base_t = outputs(tiny["unet"], tiny["text_encoder"], x)
    assert (ours_u - base_u).abs().max() > 1e-3 and (ours_t - base_t).abs().max() > 1e-3
    c_unet, c_te = comfy_merge(tiny, sd)
    theirs_u, theirs_t = outputs(c_unet, c_te, x)
    torch.testing.assert_close(theirs_u, ours_u, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(theirs_t, ours_t, atol=2e-5, rtol=1e-4)


def test_comfy_merge_reproduces_diffusers_for_plain_and_conv_lora(tiny):
    # The reference merge is checked against diffusers where both read the file.
    unet, te = attached(tiny, NetworkArgs(conv_dim=2, conv_alpha=0.5))
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te})
    assert_matches_comfy(tiny, unet, te, sd)


# --------------------------------------------------------------------------------------------- DoRA


def test_dora_keys_and_shapes(tiny):
    unet, te = attached(tiny, NetworkArgs(dora_wd=True, wd_on_output=True, conv_dim=2))
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te})
    assert sd["lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.dora_scale"].shape == (32, 1)
    assert sd["lora_unet_down_blocks_0_resnets_0_conv1.dora_scale"].shape == (32, 1, 1, 1)
    assert sd["lora_unet_down_blocks_0_attentions_0_proj_in.dora_scale"].shape == (32, 1, 1, 1)
    assert sd["lora_te_text_model_encoder_layers_0_mlp_fc1.dora_scale"].shape == (128, 1)
    names = {key.partition(".")[0] for key in sd}
    assert all(f"{name}.dora_scale" in sd for name in names)


@torch.no_grad()
def test_dora_magnitude_starts_at_the_weight_norm(tiny):
    unet = copy.deepcopy(tiny["unet"])
    network_setup.attach_network(unet, "unet", RANK, 2.0, 0.0, NetworkArgs(dora_wd=True, wd_on_output=True))
    layer = dict(lora.lora_layers(unet))["down_blocks.0.attentions.0.transformer_blocks.0.ff.net.2"]
    weight = layer.get_base_layer().weight
    torch.testing.assert_close(lora.dora_scale_of(layer)[:, 0], weight.norm(dim=1))
    x = fixed_inputs()
    # lora_up starts at zero, so a fresh DoRA leaves the model unchanged
    torch.testing.assert_close(outputs(unet, tiny["text_encoder"], x)[0],
                               outputs(tiny["unet"], tiny["text_encoder"], x)[0], atol=1e-5, rtol=0)


def test_dora_file_matches_our_model_in_comfy_merge(tiny):
    net = NetworkArgs(dora_wd=True, conv_dim=2, conv_alpha=1.0)
    unet, te = attached(tiny, net)
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te})
    assert_matches_comfy(tiny, unet, te, sd)
    # the magnitudes matter: without them the merge is another model
    without = {k: v for k, v in sd.items() if not k.endswith(".dora_scale")}
    c_unet, _ = comfy_merge(tiny, without)
    x = fixed_inputs()
    assert (outputs(c_unet, te, x)[0] - outputs(unet, te, x)[0]).abs().max() > 1e-3


def test_dora_round_trip(tiny):
    net = NetworkArgs(dora_wd=True)
    unet, te = attached(tiny, net)
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te})
    fresh_u, fresh_t = attached(tiny, net, seed=5)
    kohya_format.apply_kohya_state_dict({"lora_unet": fresh_u, "lora_te": fresh_t}, sd)
    for a, b in zip(lora.lora_parameters(unet) + lora.lora_parameters(te),
                    lora.lora_parameters(fresh_u) + lora.lora_parameters(fresh_t), strict=True):
        assert torch.equal(a, b)
    plain_u, plain_t = attached(tiny, NetworkArgs())
    with pytest.raises(ValueError, match="dora_scale"):
        kohya_format.apply_kohya_state_dict({"lora_unet": plain_u, "lora_te": plain_t}, sd)


# --------------------------------------------------------------------------------------------- LoHa / LoKr


def test_loha_keys_shapes_and_comfy_merge(tiny):
    unet, te = attached(tiny, NetworkArgs(algo="loha", conv_dim=2, conv_alpha=1.0), rank=RANK, alpha=2.0)
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te})
    name = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    assert {k for k in sd if k.startswith(name + ".")} == {
        f"{name}.{role}" for role in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha")}
    assert sd[f"{name}.hada_w1_a"].shape == (32, RANK) and sd[f"{name}.hada_w1_b"].shape == (RANK, 32)
    assert sd[f"{name}.alpha"].item() == 2.0
    conv = "lora_unet_down_blocks_0_resnets_0_conv1"
    assert sd[f"{conv}.hada_w2_a"].shape == (32, 2) and sd[f"{conv}.hada_w2_b"].shape == (2, 32 * 9)
    assert not any(".lora_" in key for key in sd)
    assert_matches_comfy(tiny, unet, te, sd)
    assert kohya_format.dims_from_state_dict(sd) == (RANK, 2.0)


@pytest.mark.parametrize("rank, extra", [(2, {}), (RANK, {}), (2, {"decompose_both": True, "factor": 8})])
def test_lokr_keys_and_comfy_merge(tiny, rank, extra):
    unet, te = attached(tiny, NetworkArgs(algo="lokr", conv_dim=2, **extra), rank=rank, alpha=1.0)
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te})
    name = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"  # 32 x 32: factors 4 x 8
    roles = {k.partition(".")[2] for k in sd if k.startswith(name + ".")}
    if extra:  # factor 8: w1 is 8 x 8 (factored, rank < 8 / 2), w2 4 x 4 (whole)
        assert roles == {"lokr_w1_a", "lokr_w1_b", "lokr_w2", "alpha"}
        assert sd[f"{name}.lokr_w1_a"].shape == (8, rank) and sd[f"{name}.lokr_w2"].shape == (4, 4)
    elif rank == 2:
        assert roles == {"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"}
        assert sd[f"{name}.lokr_w1"].shape == (4, 4) and sd[f"{name}.lokr_w2_a"].shape == (8, rank)
    else:
        # rank >= half the factor: both matrices whole; readers then ignore alpha, so the layer trains unscaled
        assert roles == {"lokr_w1", "lokr_w2", "alpha"}
        assert sd[f"{name}.lokr_w2"].shape == (8, 8) and sd[f"{name}.alpha"].item() == rank
    assert_matches_comfy(tiny, unet, te, sd)


@pytest.mark.parametrize("algo", ["loha", "lokr"])
def test_lycoris_round_trip_and_training_parameters(tiny, algo):
    net = NetworkArgs(algo=algo, conv_dim=2)
    unet, te = attached(tiny, net, rank=2)
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te})
    fresh_u, fresh_t = attached(tiny, net, rank=2, seed=9)
    kohya_format.apply_kohya_state_dict({"lora_unet": fresh_u, "lora_te": fresh_t}, sd)
    ours = lora.lora_parameters(unet) + lora.lora_parameters(te)
    for a, b in zip(ours, lora.lora_parameters(fresh_u) + lora.lora_parameters(fresh_t), strict=True):
        assert torch.equal(a, b)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in ours)
    trainable = {id(p) for p in ours}
    assert not any(p.requires_grad for p in unet.parameters() if id(p) not in trainable)
    lora_u, lora_t = attached(tiny, NetworkArgs(conv_dim=2), rank=2)
    with pytest.raises(ValueError, match="missing keys"):
        kohya_format.apply_kohya_state_dict({"lora_unet": lora_u, "lora_te": lora_t}, sd)


def test_lycoris_fresh_adapter_changes_nothing(tiny):
    x = fixed_inputs()
    base = outputs(tiny["unet"], tiny["text_encoder"], x)
    for algo in ("loha", "lokr"):
        unet, te = copy.deepcopy(tiny["unet"]), copy.deepcopy(tiny["text_encoder"])
        network_setup.attach_network(unet, "unet", 2, 1.0, 0.0, NetworkArgs(algo=algo, conv_dim=2))
        network_setup.attach_network(te, "text_encoder", 2, 1.0, 0.0, NetworkArgs(algo=algo))
        for ours, theirs in zip(outputs(unet, te, x), base, strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------- LoRA+


def built(tiny_sd1_dir, sample_data_dir, tmp_path, *extra):
    from library.families.loading import load_components
    from library.training.model import build_model

    config = make_config(tiny_sd1_dir, sample_data_dir, tmp_path, *extra)
    return build_model(config, load_components(tiny_sd1_dir), torch.device("cpu"))


def test_loraplus_splits_up_weights_into_their_own_groups(tiny_sd1_dir, sample_data_dir, tmp_path):
    model, groups = built(tiny_sd1_dir, sample_data_dir, tmp_path, "--learning_rate", "1e-3", "--unet_lr", "2e-3",
                          "--network_args", "loraplus_lr_ratio=4", "loraplus_text_encoder_lr_ratio=8",
                          "dora_wd=true", "wd_on_output=true")
    assert [(g["name"], g["lr"]) for g in groups] == [("unet", 2e-3), ("unet plus", 8e-3),
                                                      ("text_encoder", 1e-3), ("textencoder plus", 8e-3)]
    for part, (rest, plus) in ((model.denoiser, groups[:2]), (model.text_encoders[0], groups[2:])):
        layers = [layer for _, layer in lora.lora_layers(part)]
        assert {id(p) for p in plus["params"]} == {id(layer.lora_B["default"].weight) for layer in layers}
        assert {id(p) for p in rest["params"]} == {id(p) for layer in layers for p in (
            layer.lora_A["default"].weight, layer.lora_magnitude_vector["default"].weight)}
    from library.monitoring.tracking import lr_names
    assert lr_names(groups) == ["unet", "unet plus", "textencoder", "textencoder plus"]


def test_without_loraplus_the_groups_are_as_before(tiny_sd1_dir, sample_data_dir, tmp_path):
    model, groups = built(tiny_sd1_dir, sample_data_dir, tmp_path, "--learning_rate", "1e-3")
    assert [g["name"] for g in groups] == ["unet", "text_encoder"]
    expected = [p for _, layer in lora.lora_layers(model.denoiser)
                for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight)]
    assert [id(p) for p in groups[0]["params"]] == [id(p) for p in expected]


# --------------------------------------------------------------------------------------------- max norm


def kohya_max_norm(pairs: list[tuple[torch.Tensor, torch.Tensor, float]], max_norm: float):
    """kohya's networks/lora.py apply_max_norm_regularization on (down, up, alpha) tensors, as written there."""
    norms, keys_scaled, scaled = [], 0, []
    for down, up, alpha in pairs:
        scale = alpha / down.shape[0]
        if up.shape[2:] == (1, 1) and down.shape[2:] == (1, 1):
            updown = (up.squeeze(2).squeeze(2) @ down.squeeze(2).squeeze(2)).unsqueeze(2).unsqueeze(3)
        elif up.shape[2:] == (3, 3) or down.shape[2:] == (3, 3):
            updown = torch.nn.functional.conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3)
        else:
            updown = up @ down
        updown *= scale
        norm = updown.norm().clamp(min=max_norm / 2)
        desired = torch.clamp(norm, max=max_norm)
        ratio = desired.cpu() / norm.cpu()
        if ratio != 1:
            keys_scaled += 1
        scaled.append((down * ratio ** 0.5, up * ratio ** 0.5))
        norms.append((updown.norm() * ratio).item())
    return keys_scaled, sum(norms) / len(norms), max(norms), scaled


def test_max_norm_matches_kohya(tiny):
    from library.training.adapters import apply_max_norm

    unet, te = attached(tiny, NetworkArgs(conv_dim=2, conv_alpha=1.0), alpha=2.0)
    layers = lora.lora_layers(unet) + lora.lora_layers(te)
    with torch.no_grad():
        for i, (_, layer) in enumerate(layers):
            layer.lora_B["default"].weight.mul_(0.2 if i % 2 else 20.0)  # some above the limit, some below
    before = [(layer.lora_A["default"].weight.clone(), layer.lora_B["default"].weight.clone(),
               float(layer.lora_alpha["default"])) for _, layer in layers]
    keys_scaled, mean, largest, scaled = kohya_max_norm(before, 1.0)
    logs = apply_max_norm([unet, te], 1.0)
    assert 0 < keys_scaled < len(layers)
    assert logs["max_norm/keys_scaled"] == keys_scaled
    assert logs["max_norm/average_key_norm"] == pytest.approx(mean, rel=1e-5)
    assert logs["max_norm/max_key_norm"] == pytest.approx(largest, rel=1e-5) and largest <= 1.0 + 1e-5
    for (_, layer), (down, up) in zip(layers, scaled, strict=True):
        torch.testing.assert_close(layer.lora_A["default"].weight, down)
        torch.testing.assert_close(layer.lora_B["default"].weight, up)


# --------------------------------------------------------------------------------------------- kohya dropout


def test_rank_and_module_dropout_follow_kohya():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 12))
    lora.attach_lora(base, ["0"], 4, 2.0)
    network_setup.add_kohya_dropout(base, rank_dropout=0.5, module_dropout=0.0)
    layer = base[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    x = torch.randn(3, 5, 16)  # (batch, tokens, features) as in the text encoder
    down, up = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    base_out = layer.base_layer(x)
    base.train()
    torch.manual_seed(1)
    ours = base(x)
    torch.manual_seed(1)
    mask = (torch.rand(3, 4) > 0.5).unsqueeze(1)
    expected = base_out + ((x @ down.T) * mask) @ up.T * 0.5 / 0.5  # scale alpha / r, kept ranks / (1 - p)
    torch.testing.assert_close(ours, expected)
    base.eval()
    torch.testing.assert_close(base(x), base_out + x @ down.T @ up.T * 0.5)

    conv = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1))
    lora.attach_lora(conv, ["0"], 2, 2.0)
    network_setup.add_kohya_dropout(conv, rank_dropout=0.0, module_dropout=0.5)
    with torch.no_grad():
        conv[0].lora_B["default"].weight.normal_()
    image = torch.randn(2, 4, 5, 5)
    conv.train()
    skipped = kept = 0
    for seed in range(20):
        torch.manual_seed(seed)
        dropped = torch.rand(1) < 0.5
        torch.manual_seed(seed)
        out = conv(image)
        if dropped:
            skipped += 1
            torch.testing.assert_close(out, conv[0].base_layer(image))
        else:
            kept += 1
            assert (out - conv[0].base_layer(image)).abs().max() > 1e-3
    assert skipped and kept


# --------------------------------------------------------------------------------------------- training runs


@pytest.fixture()
def logged(monkeypatch) -> list[dict[str, float]]:
    from library.monitoring import tracking

    records: list[dict[str, float]] = []
    original = tracking.Trackers.log

    def log(self, values, step):
        records.append(dict(values))
        return original(self, values, step)

    monkeypatch.setattr(tracking.Trackers, "log", log)
    return records


def base_models(tiny_sd1_dir) -> dict[str, nn.Module]:
    from library.families.loading import load_components

    components = load_components(tiny_sd1_dir)
    return {"unet": components.denoiser.eval(), "text_encoder": components.text_encoder.eval()}


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_dora_locon_loraplus_max_norm_run(tiny_sd1_dir, sample_data_dir, tmp_path, logged):
    from library.training import loop

    config = make_config(tiny_sd1_dir, sample_data_dir, tmp_path, "--max_train_steps", "3", "--learning_rate",
                         "2e-2", "--network_args", "conv_dim=2", "conv_alpha=1", "dora_wd=true",
                         "loraplus_lr_ratio=4", "--scale_weight_norms", "0.05", "--max_grad_norm", "0")
    result = loop.run(config)
    steps = [record for record in logged if "max_norm/keys_scaled" in record]
    assert len(steps) == 3 and steps[-1]["max_norm/keys_scaled"] > 0
    assert all(record["max_norm/max_key_norm"] <= 0.05 + 1e-6 for record in steps)
    assert "lr/unet plus" in steps[0] and steps[0]["lr/unet plus"] == pytest.approx(4 * steps[0]["lr/unet"])
    sd = kohya_format.load_kohya_lora(result.output_file)[0]
    assert sd["lora_unet_mid_block_resnets_0_conv2.lora_down.weight"].shape == (2, 64, 3, 3)
    assert "lora_unet_mid_block_resnets_0_conv2.dora_scale" in sd
    model = result.model.eval()
    assert_matches_comfy(base_models(tiny_sd1_dir), model.denoiser, model.text_encoders[0], sd)


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_lokr_run_saves_a_file_that_matches(tiny_sd1_dir, sample_data_dir, tmp_path):
    from library.training import loop

    config = make_config(tiny_sd1_dir, sample_data_dir, tmp_path, "--max_train_steps", "2", "--learning_rate",
                         "2e-2", "--network_dim", "2", "--network_args", "algo=lokr", "conv_dim=2")
    result = loop.run(config)
    sd = kohya_format.load_kohya_lora(result.output_file)[0]
    assert all(key.endswith(".alpha") or key.partition(".")[2].startswith("lokr_") for key in sd)
    model = result.model.eval()
    assert_matches_comfy(base_models(tiny_sd1_dir), model.denoiser, model.text_encoders[0], sd)


@pytest.mark.usefixtures("fresh_accelerator_state")
@pytest.mark.parametrize("network_args", [
    ["dora_wd=true", "conv_dim=2"],
    ["algo=loha", "conv_dim=2", "rank_dropout=0.2", "module_dropout=0.1"],
    ["rank_dropout=0.3", "module_dropout=0.2", "loraplus_lr_ratio=4"],
])
def test_variant_resume_is_bit_exact(tiny_sd1_dir, sample_data_dir, tmp_path, network_args):
    from library.training import loop

    def run(out: Path, *extra: str):
        AcceleratorState._reset_state(reset_partial_state=True)
        return loop.run(make_config(tiny_sd1_dir, sample_data_dir, out, "--max_train_steps", "3",
                                       "--learning_rate", "1e-2", "--network_args", *network_args, *extra))

    straight = run(tmp_path / "a", "--save_every_n_steps", "1", "--save_state")
    resumed = run(tmp_path / "b", "--resume", str(tmp_path / "a" / "last-step00000001-state"))
    assert resumed.losses == straight.losses[1:]
    a, b = kohya_format.load_kohya_lora(straight.output_file)[0], kohya_format.load_kohya_lora(resumed.output_file)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = resumed.model.eval()
    assert_matches_comfy(base_models(tiny_sd1_dir), model.denoiser, model.text_encoders[0], b)


# --------------------------------------------------------------------------------------------- blocks


def kohya_block_index_sd1(lora_name: str) -> int:
    """kohya's get_block_index for SD1/SD2 (networks/lora.py), on a kohya module name."""
    import re

    match = re.search(r"(up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|attentions)_(\d+)_", lora_name)
    if match:
        side, i, kind, j = match.group(1), int(match.group(2)), match.group(3), int(match.group(4))
        idx = 3 * i + 2 if kind in ("upsamplers", "downsamplers") else 3 * i + j
        return 1 + idx if side == "down" else 12 + 1 + idx
    return 12 if "mid_block_" in lora_name else -1


def test_sd1_block_index_matches_kohya(tiny):
    from library.network.blocks import block_index

    linear, conv = lora.unet_conv_target_modules(tiny["unet"])
    for name in lora.unet_target_modules(tiny["unet"]) + linear + conv:
        assert block_index(name, sdxl=False) == kohya_block_index_sd1(kohya_format.kohya_lora_name("lora_unet", name))


@pytest.mark.parametrize("name, index", [
    ("down_blocks.0.resnets.0.conv1", 2),  # input_blocks_1
    ("down_blocks.0.downsamplers.0.conv", 4),  # input_blocks_3
    ("down_blocks.1.attentions.1.proj_in", 6),  # input_blocks_5
    ("down_blocks.2.resnets.1.conv2", 9),  # input_blocks_8
    ("mid_block.resnets.0.conv1", 10), ("mid_block.attentions.0.proj_out", 11), ("mid_block.resnets.1.conv1", 12),
    ("up_blocks.0.attentions.0.proj_in", 13),  # output_blocks_0
    ("up_blocks.0.upsamplers.0.conv", 15),  # output_blocks_2, with the level's last ResNet
    ("up_blocks.2.resnets.2.conv1", 21),  # output_blocks_8
])
def test_sdxl_block_index_follows_kohyas_sgm_numbering(name, index):
    from library.network.blocks import block_index

    assert block_index(name, sdxl=True) == index


def test_lr_weight_presets_follow_kohya():
    import math

    from library.network.blocks import lr_weight_values

    assert lr_weight_values("cosine", 12) == [math.sin(math.pi * (i / 11) / 2) for i in reversed(range(12))]
    assert lr_weight_values("linear+0.5", 4) == [0.5, 0.5 + 1 / 3, 0.5 + 2 / 3, 1.5]
    assert lr_weight_values((0.0, 0.5), 4) == [0.0, 0.5, 1.0, 1.0]  # kohya pads with 1
    assert lr_weight_values((1.0,) * 14, 12) == [1.0] * 12  # and cuts what is too long


SD1_BLOCK_DIMS = ",".join(str(d) for d in [0, 2, 3, 4, 0, 5, 6, 7, 8, 9, 10, 11, 2, 3, 2, 3, 4, 5, 6, 2, 2, 2, 2, 2, 2])


def test_block_dims_set_each_blocks_rank_and_load_in_diffusers(tiny):
    net, problems = parse_network_args([f"block_dims={SD1_BLOCK_DIMS}", "block_alphas=" + ",".join(["1.5"] * 25),
                                        "conv_dim=2"])
    assert problems == []
    unet, te = attached(tiny, net, rank=RANK, alpha=2.0)
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te})
    dims = [int(d) for d in SD1_BLOCK_DIMS.split(",")]
    for key, tensor in sd.items():
        name, _, role = key.partition(".")
        if name.startswith("lora_unet") and role == "lora_down.weight":
            index = kohya_block_index_sd1(name)
            assert tensor.shape[0] == (2 if tensor.dim() == 4 and tensor.shape[2] == 3 else dims[index]), key
            assert sd[f"{name}.alpha"].item() == (1.0 if tensor.dim() == 4 and tensor.shape[2] == 3 else 1.5)
        elif name.startswith("lora_te") and role == "lora_down.weight":
            assert tensor.shape[0] == RANK  # block_dims are the UNet's
    # block 4 (down_blocks.1.resnets.0) has rank 0 for its Linear / 1x1 layers: left out; its 3x3 convs keep conv_dim
    block4 = "lora_unet_down_blocks_1_resnets_0"
    assert f"{block4}_time_emb_proj.lora_down.weight" not in sd and f"{block4}_conv_shortcut.alpha" not in sd
    assert f"{block4}_conv1.lora_down.weight" in sd
    x = fixed_inputs()
    d_unet, d_te = diffusers_load(tiny, sd)
    torch.testing.assert_close(outputs(d_unet, d_te, x)[0], outputs(unet, te, x)[0], atol=1e-5, rtol=0)


def test_block_lr_weights_make_kohyas_groups(tiny_sd1_dir, sample_data_dir, tmp_path):
    model, groups = built(tiny_sd1_dir, sample_data_dir, tmp_path, "--learning_rate", "1e-3",
                          "--network_args", "down_lr_weight=0,1,0.5,1,0,1", "mid_lr_weight=2",
                          "up_lr_weight=zeros+0.25", "loraplus_unet_lr_ratio=4", "conv_dim=2")
    names = [(g["name"], g["lr"]) for g in groups]
    assert names[:4] == [("unet_block1", 1e-3), ("unet_block1 plus", 4e-3), ("unet_block2", 5e-4),
                         ("unet_block2 plus", 2e-3)]
    assert {("unet_block3", 1e-3), ("unet_block5", 1e-3), ("unet_block12", 2e-3), ("unet_block16", 2.5e-4)} <= set(
        names)
    # down_blocks.1.resnets.0 (block 4) has weight 0: kohya leaves it out rather than train it at lr 0
    assert not any(name.startswith("unet_block4") for name, _ in names)
    assert not any(name.startswith("down_blocks.1.resnets.0.") for name, _ in lora.lora_layers(model.denoiser))
    assert any(name.startswith("down_blocks.1.resnets.1.") for name, _ in lora.lora_layers(model.denoiser))
    assert names[-1] == ("text_encoder", 1e-3)  # the UNet's ratio only; block weights are the UNet's too


def test_block_lengths_are_checked(tiny):
    from library.config import UserError

    net, _ = parse_network_args(["block_dims=4,4,4"])
    with pytest.raises(UserError, match="block_dims needs 25 values for SD1/SD2"):
        attached(tiny, net)


def test_sdxl_block_dims_attach_on_the_tiny_sdxl_unet():
    from library.families.sd.tiny import build_tiny_sdxl
    from library.network.blocks import block_index

    unet = build_tiny_sdxl(seed=0)["unet"].requires_grad_(False)
    assert network_setup.is_sdxl_unet(unet)
    dims = [0] + [2] * 9 + [3, 0, 3] + [4] * 9 + [0]  # mid_block attention (block 11) left out
    net, problems = parse_network_args(["block_dims=" + ",".join(map(str, dims)), "conv_dim=2"])
    assert problems == []
    network_setup.attach_network(unet, "unet", RANK, 1.0, 0.0, net)
    layers = lora.lora_layers(unet)
    indices = {name: block_index(name, sdxl=True) for name, _ in layers}
    assert all(1 <= index <= 21 for index in indices.values())
    assert not any(index == 11 for index in indices.values())
    for name, layer in layers:
        if not isinstance(layer.get_base_layer(), nn.Conv2d) or layer.get_base_layer().kernel_size == (1, 1):
            assert layer.r["default"] == dims[indices[name]], name


# --------------------------------------------------------------------------------------------- EMA


def test_ema_follows_the_weights_and_swaps_back_exactly(tiny):
    from library.training.adapters import AdapterEMA

    unet, te = attached(tiny, NetworkArgs(dora_wd=True))
    modules = {"lora_unet": unet, "lora_te": te}
    ema = AdapterEMA(modules, 0.9)
    params = lora.lora_parameters(unet) + lora.lora_parameters(te)
    start = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    ema.update()
    trained = kohya_format.kohya_state_dict(modules)
    with ema.swapped():
        for p, s in zip(params, start, strict=True):
            torch.testing.assert_close(p, s + 0.1)  # 0.9 * start + 0.1 * (start + 1)
        averaged = kohya_format.kohya_state_dict(modules)
    assert all(torch.equal(p, s + 1.0) for p, s in zip(params, start, strict=True))
    assert averaged.keys() == trained.keys()
    restored = AdapterEMA(modules, 0.9)
    restored.load_state_dict(ema.state_dict())
    assert all(torch.equal(restored.shadow[k], ema.shadow[k]) for k in ema.shadow)


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_ema_is_saved_in_the_state_used_for_the_file_and_resumes_exactly(tiny_sd1_dir, sample_data_dir, tmp_path):
    from library.training import loop
    from library.training.state import ADAPTER_FILE, EMA_FILE

    def run(out: Path, *extra: str):
        AcceleratorState._reset_state(reset_partial_state=True)
        return loop.run(make_config(tiny_sd1_dir, sample_data_dir, out, "--max_train_steps", "3",
                                       "--learning_rate", "1e-2", "--ema_decay", "0.5", "--ema_for_saved_file",
                                       *extra))

    straight = run(tmp_path / "a", "--save_every_n_steps", "1", "--save_state")
    state_dir = tmp_path / "a" / "last-step00000001-state"
    assert sorted(p.name for p in state_dir.iterdir() if p.suffix == ".safetensors") == sorted(
        [ADAPTER_FILE, EMA_FILE])
    resumed = run(tmp_path / "b", "--resume", str(state_dir))
    assert resumed.losses == straight.losses[1:]
    a, b = kohya_format.load_kohya_lora(straight.output_file)[0], kohya_format.load_kohya_lora(resumed.output_file)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the file holds the EMA, not the last weights the model trained to
    last = kohya_format.kohya_state_dict(model_lora_modules(straight.model))
    assert any(not torch.equal(a[k], last[k]) for k in a if k.endswith(".lora_up.weight"))
    ema = kohya_format.load_kohya_lora(tmp_path / "a" / "last-state" / EMA_FILE)[0]
    assert all(torch.equal(ema[k], a[k]) for k in a if not k.endswith(".alpha"))


def model_lora_modules(model) -> dict[str, nn.Module]:
    return {"lora_unet": model.denoiser, "lora_te": model.text_encoders[0]}


def test_a_partial_dora_file_names_the_number_of_modules_left_to_train(tiny_sd1_dir, sample_data_dir, tmp_path,
                                                                       caplog):
    from library.families.loading import load_components
    from library.training.model import build_model, lora_modules, network_spec

    dora = ("--network_args", "dora_wd=True")
    model, _ = built(tiny_sd1_dir, sample_data_dir, tmp_path, *dora)
    state_dict = kohya_format.kohya_state_dict(lora_modules(model, make_config(tiny_sd1_dir, sample_data_dir, tmp_path,
                                                                          *dora)))
    modules = sorted({key.split(".", 1)[0] for key in state_dict})
    dropped = modules[:3]
    partial = {k: v for k, v in state_dict.items() if k.split(".", 1)[0] not in dropped}
    assert len(state_dict) - len(partial) == 3 * 4  # down, up, alpha and dora_scale per module
    kohya_format.save_lora_file(tmp_path / "partial.safetensors", partial)
    config = make_config(tiny_sd1_dir, sample_data_dir, tmp_path, *dora,
                         "--network_weights", str(tmp_path / "partial.safetensors"))
    with caplog.at_level("WARNING", logger="library.training.model"):
        components = load_components(tiny_sd1_dir)
        build_model(config, components, torch.device("cpu"), network_spec(config, components.family))
    assert "3 LoRA modules are not in the file and start from scratch" in caplog.text, caplog.text
