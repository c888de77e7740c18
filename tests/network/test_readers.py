"""Each reader's documented rule, applied to the saved file and the base weights alone, against the trained adapter.

The rules (written from the readers' documented behaviour, see README "Which variant loads where"):
- ComfyUI (comfy/weight_adapter): W + s * dW; with `.dora_scale`, a magnitude whose first dimension is the weight's
  is per output channel and divides by the norm of the ORIGINAL W per row; any other shape is per input channel and
  divides by the norm of W + s * dW per column (plus fp32 eps).
- AUTOMATIC1111 (extensions-builtin/Lora): W + s * dW; with `.dora_scale` always per input column, norm of
  W + s * dW, no eps.
- sd-scripts (networks/lora.py merge): W + s * up @ down for lora_down / lora_up files; `.dora_scale` ignored.
- diffusers (load_lora_weights): checked by loading; drops `.dora_scale`, refuses LoHa / LoKr.
with s = alpha / rank (rank from lora_down, hada_w1_b, lokr_w1_b or lokr_w2_b; 1 without alpha or with whole LoKr
factors). The trained adapter is judged by what its layers compute: each layer's output on a probe input is compared
with F.linear / F.conv2d of the reader's weight.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from library.config.network_args import NetworkArgs
from library.network import kohya_format
from library.network import targets as network_setup
from tests.helpers.lora_files import randomize_adapters

RANK = 4


def trained(tiny, net: NetworkArgs, seed: int = 1) -> dict[str, nn.Module]:
    """Adapters with every tensor random (as after training), so that each factor shows in the comparison."""
    unet, te = copy.deepcopy(tiny["unet"]), copy.deepcopy(tiny["text_encoder"])
    network_setup.attach_network(unet, "unet", RANK, 2.0, 0.0, net)
    network_setup.attach_network(te, "text_encoder", RANK, 2.0, 0.0, net)
    randomize_adapters((unet, te), torch.Generator().manual_seed(seed), scale=0.2, magnitude_spread=0.3)
    return {"lora_unet": unet.eval(), "lora_te": te.eval()}


# --------------------------------------------------------------------------------------------- the readers' rules


def delta_and_scale(v: dict[str, torch.Tensor], shape: torch.Size) -> tuple[torch.Tensor, float]:
    alpha = float(v["alpha"]) if "alpha" in v else None
    if "lora_down.weight" in v:
        up, down = v["lora_up.weight"], v["lora_down.weight"]
        return (up.flatten(1) @ down.flatten(1)).reshape(shape), 1.0 if alpha is None else alpha / down.shape[0]
    if "hada_w1_a" in v:
        delta = (v["hada_w1_a"] @ v["hada_w1_b"]) * (v["hada_w2_a"] @ v["hada_w2_b"])
        return delta.reshape(shape), 1.0 if alpha is None else alpha / v["hada_w1_b"].shape[0]
    rank = None
    w1, w2 = v.get("lokr_w1"), v.get("lokr_w2")
    if w1 is None:
        w1, rank = v["lokr_w1_a"] @ v["lokr_w1_b"], v["lokr_w1_b"].shape[0]
    if w2 is None:
        w2, rank = v["lokr_w2_a"] @ v["lokr_w2_b"], v["lokr_w2_b"].shape[0]
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]
    return torch.kron(w1, w2).reshape(shape), 1.0 if alpha is None or rank is None else alpha / rank


def row_norm(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], -1).norm(dim=1).reshape(w.shape[0], *[1] * (w.dim() - 1))


def col_norm(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(0, 1).reshape(w.shape[1], -1).norm(dim=1).reshape(w.shape[1], *[1] * (w.dim() - 1)) \
        .transpose(0, 1)


def comfyui(v: dict[str, torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    delta, scale = delta_and_scale(v, weight.shape)
    patched = weight + delta * scale
    if "dora_scale" not in v:
        return patched
    magnitude = v["dora_scale"]
    norm = row_norm(weight) if magnitude.shape[0] == weight.shape[0] else col_norm(patched)
    return patched * (magnitude / (norm + torch.finfo(weight.dtype).eps))


def automatic1111(v: dict[str, torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    delta, scale = delta_and_scale(v, weight.shape)
    patched = weight + delta * scale
    if "dora_scale" not in v:
        return patched
    return patched * (v["dora_scale"] / col_norm(patched))


def sd_scripts(v: dict[str, torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    up, down = v["lora_up.weight"], v["lora_down.weight"]
    scale = float(v["alpha"]) / down.shape[0]
    return weight + (up.flatten(1) @ down.flatten(1)).reshape(weight.shape) * scale


READERS = {"ComfyUI": comfyui, "AUTOMATIC1111": automatic1111, "sd-scripts": sd_scripts}


# --------------------------------------------------------------------------------------------- comparing


def grouped(state_dict: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        name, _, role = key.partition(".")
        out.setdefault(name, {})[role] = tensor.float()
    return out


def probe(base: nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    if isinstance(base, nn.Conv2d):
        return torch.randn(2, base.in_channels, 6, 6, generator=gen)
    return torch.randn(3, base.in_features, generator=gen)


def apply_weight(base: nn.Module, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if isinstance(base, nn.Conv2d):
        return F.conv2d(x, weight, base.bias, base.stride, base.padding, base.dilation, base.groups)
    return F.linear(x, weight, base.bias)


@torch.no_grad()
def mismatches(tiny, modules: dict[str, nn.Module], reader) -> dict[str, float]:
    """kohya name -> largest difference between the trained layer and the reader's weight, over every layer."""
    state_dict = kohya_format.kohya_state_dict(modules)
    bases = {"lora_unet": dict(tiny["unet"].named_modules()), "lora_te": dict(tiny["text_encoder"].named_modules())}
    files = grouped(state_dict)
    worst = {}
    for name, (path, layer) in kohya_format.kohya_layer_names(modules).items():
        base = bases[name.split("_")[0] + "_" + name.split("_")[1]][path]
        x = probe(base)
        ours = layer(x)
        assert (ours - base(x)).abs().max() > 1e-3, f"{name}: the adapter changes nothing; the test shows nothing"
        theirs = apply_weight(base, reader(files[name], base.weight.float()), x)
        worst[name] = float((ours - theirs).abs().max() / ours.abs().max())
    return worst


def assert_exact(worst: dict[str, float]) -> None:
    bad = {name: err for name, err in worst.items() if err > 1e-5}
    assert not bad, f"{len(bad)} of {len(worst)} layers differ, e.g. {sorted(bad.items())[:3]}"


VARIANTS = {
    "dora": NetworkArgs(dora_wd=True),  # Linear layers and SD1's 1x1 proj_in / proj_out
    "dora-conv": NetworkArgs(dora_wd=True, conv_dim=2, conv_alpha=1.0),  # and the 3x3 convs
    "locon": NetworkArgs(algo="locon", conv_dim=2, conv_alpha=1.0),
    "loha": NetworkArgs(algo="loha", conv_dim=2, conv_alpha=1.0),
    "lokr": NetworkArgs(algo="lokr", conv_dim=2, conv_alpha=1.0, factor=4),
}
# which reader offers which variant (sd-scripts' networks/lora.py reads lora_down / lora_up only, without DoRA)
OFFERED = {"ComfyUI": set(VARIANTS), "AUTOMATIC1111": set(VARIANTS), "sd-scripts": {"locon"}}


@pytest.mark.parametrize("variant, reader", [(v, r) for r in READERS for v in VARIANTS if v in OFFERED[r]])
def test_every_reader_applies_the_file_as_trained(tiny, variant, reader):
    modules = trained(tiny, VARIANTS[variant])
    worst = mismatches(tiny, modules, READERS[reader])
    assert any("conv1" in name for name in worst) == ("conv" in variant or variant in ("locon", "loha", "lokr"))
    assert_exact(worst)


def test_dora_scale_has_the_shape_both_uis_read_on_the_input_axis(tiny):
    sd = kohya_format.kohya_state_dict(trained(tiny, VARIANTS["dora-conv"]))
    assert sd["lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.dora_scale"].shape == (1, 32)
    assert sd["lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_ff_net_2.dora_scale"].shape == (1, 128)
    assert sd["lora_unet_down_blocks_0_resnets_0_conv1.dora_scale"].shape == (1, 32, 1, 1)
    assert sd["lora_unet_down_blocks_0_attentions_0_proj_in.dora_scale"].shape == (1, 32, 1, 1)
    assert sd["lora_te_text_model_encoder_layers_0_mlp_fc2.dora_scale"].shape == (1, 128)


def test_output_axis_dora_is_not_applied_exactly_by_the_uis(tiny):
    # wd_on_output=true (peft's DoRA): right in LyCORIS-style loaders, wrong in both UIs, as the README says.
    modules = trained(tiny, NetworkArgs(dora_wd=True, wd_on_output=True))
    for reader in (comfyui, automatic1111):
        worst = mismatches(tiny, modules, reader)
        assert max(worst.values()) > 1e-2


@torch.no_grad()
def test_diffusers_loads_locon_exactly_and_dora_without_its_magnitude(tiny):
    from diffusers import StableDiffusionPipeline

    def load(state_dict):
        pipe = StableDiffusionPipeline(
            unet=copy.deepcopy(tiny["unet"]), text_encoder=copy.deepcopy(tiny["text_encoder"]), vae=tiny["vae"],
            tokenizer=tiny["tokenizer"], scheduler=tiny["scheduler"], safety_checker=None, feature_extractor=None,
            requires_safety_checker=False)
        pipe.load_lora_weights(dict(state_dict))
        return pipe.unet

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([10, 700]), torch.randn(2, 7, 32, generator=gen))
    for variant, exact in (("locon", True), ("dora", False)):
        modules = trained(tiny, VARIANTS[variant])
        ours = modules["lora_unet"](*x).sample
        theirs = load(kohya_format.kohya_state_dict(modules))(*x).sample
        close = torch.allclose(theirs, ours, atol=2e-5, rtol=1e-4)
        assert close == exact, variant
