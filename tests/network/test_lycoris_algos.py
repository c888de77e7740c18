"""LyCORIS' ia3, diag-oft, dylora and train_norm (network_module = "lycoris.kohya"): the files LyCORIS itself reads
with the same outputs, DyLoRA's random truncations, max-norm as LyCORIS, and exact resume."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from library.config import parse_config
from library.config.network_args import NetworkArgs, parse_network_args
from library.network import kohya_format, lora, lycoris_layers
from library.network import targets as network_setup
from tests.helpers import runs
from tests.helpers.datasets import copy_images


def lycoris(*args: str) -> NetworkArgs:
    settings, problems = parse_network_args(list(args), network_module="lycoris.kohya")
    assert problems == []
    return settings


def randomized(tiny, network_args: list[str], seed: int = 0) -> torch.nn.Module:
    unet = copy.deepcopy(tiny["unet"])
    network_setup.attach_network(unet, "unet", 8, 4.0, 0.0, lycoris(*network_args))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora.lora_layers(unet):
            for role, param in lora.layer_parameters(layer).items():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2 + (role == "rescale"))
    return unet.eval()


def unet_inputs(seed: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([10, 700]), torch.randn(2, 7, 32, generator=gen)


def test_gui_network_args_of_the_new_algorithms():
    # LyCORIS' kohya.py never reads train_on_input: accepted, noted, without effect
    unread = lycoris("algo=ia3", "train_on_input=True")
    assert unread.unread == ("train_on_input",) and dataclasses.replace(unread, unread=()) == lycoris("algo=ia3")
    assert lycoris("algo=diag-oft", "constraint=0.5", "rescaled=True").constraint == 0.5
    assert lycoris("algo=dylora", "block_size=1", "train_norm=True") == NetworkArgs(
        algo="dylora", block_size=1, train_norm=True, lycoris=True)
    for args, message in [(["algo=ia3"], "is LyCORIS'"), (["block_size=2"], "block_size applies to algo=dylora"),
                          (["algo=ia3", "rescaled=True"], "rescaled applies to algo=diag-oft"),
                          (["algo=dylora", "rank_dropout=0.1"], "rank_dropout is not offered")]:
        module = "networks.lora" if args == ["algo=ia3"] else "lycoris.kohya"
        assert any(message in p for p in parse_network_args(args, network_module=module)[1]), args


@pytest.mark.parametrize("network_args", [
    ["algo=ia3", "preset=attn-mlp"],
    ["algo=ia3", "conv_dim=4", "preset=unet-convblock-only", "train_norm=True"],
    ["algo=diag-oft", "constraint=0.001", "rescaled=True", "preset=attn-mlp"],
    ["algo=diag-oft", "conv_dim=4", "preset=unet-convblock-only"],
    ["algo=dylora", "block_size=2", "conv_dim=4", "preset=unet-convblock-only", "train_norm=True"],
    ["algo=lokr", "factor=4", "preset=attn-mlp", "train_norm=True"],
])
def test_lycoris_reads_the_file_strictly_and_computes_the_same(tiny, network_args):
    lycoris_kohya = pytest.importorskip("lycoris.kohya")
    from lycoris.config import PRESET

    ours = randomized(tiny, network_args)
    state_dict = kohya_format.kohya_state_dict({"lora_unet": ours})
    theirs, te = copy.deepcopy(tiny["unet"]), copy.deepcopy(tiny["text_encoder"])
    if "algo=dylora" in network_args:
        # A DyLoRA file is a plain LoRA for its readers: LyCORIS' loader of saved files
        lycoris_kohya.LycorisNetworkKohya.apply_preset(PRESET["attn-only"])  # its full preset trips on diffusers
        network, _ = lycoris_kohya.create_network_from_weights(1.0, None, tiny["vae"], te, theirs,
                                                               weights_sd=dict(state_dict))
        network.apply_to(te, theirs, apply_text_encoder=False, apply_unet=True)
    else:
        # LyCORIS' training network as sd-scripts builds it from these network_args (its from-weights loader cannot
        # build IA3 modules: IA3Module.make_module_from_state_dict takes no on_input)
        network = lycoris_kohya.create_network(1.0, 8, 4.0, tiny["vae"], te, theirs,
                                               **dict(arg.split("=", 1) for arg in network_args))
        network.apply_to(te, theirs, apply_text_encoder=False, apply_unet=True)
        network.load_state_dict(dict(state_dict), strict=True)
    assert set(network.state_dict()) == set(state_dict)
    network.eval()
    x = unet_inputs()
    with torch.no_grad():
        expected = theirs(*x).sample
        torch.testing.assert_close(ours(*x).sample, expected, atol=2e-5, rtol=1e-4)
        assert not torch.allclose(tiny["unet"](*x).sample, expected, atol=1e-3)

    # network_weights / resume read the file back exactly
    again = randomized(tiny, network_args, seed=5)
    kohya_format.apply_kohya_state_dict({"lora_unet": again}, state_dict)
    back = kohya_format.kohya_state_dict({"lora_unet": again})
    assert all(torch.equal(back[key], value) for key, value in state_dict.items())


def test_dylora_trains_one_block_of_a_random_truncation(tiny):
    unet = randomized(tiny, ["algo=dylora", "block_size=2", "preset=attn-only"])
    name, layer = lora.lora_layers(unet)[0]
    assert isinstance(layer, lycoris_layers.DyLoRALayer) and len(layer.down) == 4
    x = torch.randn(3, layer.base_layer.in_features)
    layer.train()
    torch.manual_seed(3)
    used = int(torch.randint(0, 4, (1,)).item()) + 1
    torch.manual_seed(3)
    layer(x).sum().backward()
    trained = [i for i, p in enumerate(layer.down) if p.grad is not None]
    assert trained == [used - 1] and layer.up[used - 1].grad is not None
    # LyCORIS: the first `used` blocks at alpha / used
    down, up = torch.cat(list(layer.down[:used])), torch.cat(list(layer.up[:used]), dim=1)
    torch.manual_seed(3)
    torch.testing.assert_close(layer(x), layer.base_layer(x) + x @ (up @ down * 4.0 / used).T)
    # out of training (validation, samples) the whole rank at alpha / rank, as readers apply the file
    layer.eval()
    full = layer.export(None)
    delta = full["lora_up.weight"] @ full["lora_down.weight"] * 4.0 / 8
    torch.testing.assert_close(layer(x), layer.base_layer(x) + x @ delta.T)


def test_max_norm_on_diag_oft_is_lycoris(tiny):
    lycoris_kohya = pytest.importorskip("lycoris.kohya")
    from library.training.adapters import apply_max_norm

    network_args = ["algo=diag-oft", "preset=attn-mlp"]
    ours = randomized(tiny, network_args)
    theirs, te = copy.deepcopy(tiny["unet"]), copy.deepcopy(tiny["text_encoder"])
    network = lycoris_kohya.create_network(1.0, 8, 4.0, tiny["vae"], te, theirs,
                                           **dict(arg.split("=", 1) for arg in network_args))
    network.apply_to(te, theirs, apply_text_encoder=False, apply_unet=True)
    network.load_state_dict(kohya_format.kohya_state_dict({"lora_unet": ours}), strict=True)
    logs = apply_max_norm([ours], 1.0)
    keys_scaled, mean, largest = network.apply_max_norm_regularization(1.0, "cpu")
    assert 0 < logs["max_norm/keys_scaled"] == keys_scaled
    assert logs["max_norm/max_key_norm"] == pytest.approx(float(largest), rel=1e-5)
    ours_sd, theirs_sd = kohya_format.kohya_state_dict({"lora_unet": ours}), network.state_dict()
    assert all(torch.allclose(ours_sd[k], theirs_sd[k], atol=1e-6) for k in ours_sd)


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_dylora_with_train_norm_resumes_bit_exactly(tiny_sd1_dir, sample_data_dir, tmp_path):
    from library.training.state import TrainState

    data = copy_images(sample_data_dir, tmp_path / "data", 4)

    def train(output: Path, *extra: str):
        return runs.train(tiny_sd1_dir, data, output, *extra, seed=7, learning_rate="1e-2", max_train_steps=4,
                          network_dim=4, network_module="lycoris.kohya",
                          network_args=["algo=dylora", "block_size=1", "train_norm=True", "preset=attn-mlp"])

    straight = train(tmp_path / "a", "--save_every_n_steps", "2", "--save_state")
    state_dir = tmp_path / "a" / "last-step00000002-state"
    assert TrainState.read(state_dir).global_step == 2
    resumed = train(tmp_path / "b", "--resume", str(state_dir))
    assert resumed.losses == straight.losses[2:]
    a, b = (kohya_format.load_kohya_lora(r.output_file)[0] for r in (straight, resumed))
    assert a.keys() == b.keys() and any(key.endswith(".w_norm") for key in a)
    assert all(torch.equal(a[k], b[k]) for k in a)


@torch.no_grad()
def comfy_merge(tiny, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A fresh UNet with the file merged as ComfyUI's loader does (comfy/lora.py: `lora_unet_<path with _>` names
    `<path>.weight`; w_norm / b_norm added to a norm's weight / bias; weight_adapter/oft.py: R from oft_blocks with
    `.alpha` as the bound of ||Q||, the weight's row blocks turned by R - I; LoRA: up @ down * alpha / rank).
    Every key must be consumed."""
    unet = copy.deepcopy(tiny["unet"])
    by_name = {kohya_format.kohya_lora_name("lora_unet", name): module for name, module in unet.named_modules()
               if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.LayerNorm, torch.nn.GroupNorm))}
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        name, _, role = key.partition(".")
        grouped.setdefault(name, {})[role] = tensor.float()
    consumed = set()
    for name, v in grouped.items():
        module = by_name[name]
        weight = module.weight
        if "oft_blocks" in v:
            blocks, alpha = v["oft_blocks"], float(v["alpha"])
            block_num, block_size, _ = blocks.shape
            eye = torch.eye(block_size)
            q = blocks - blocks.transpose(1, 2)
            if alpha > 0 and torch.norm(q) + 1e-8 > alpha:
                q = q * alpha / (torch.norm(q) + 1e-8)
            r = (eye + q) @ (eye - q).inverse()
            _, *shape = weight.shape
            weight += torch.einsum("k n m, k n ... -> k m ...", r - eye,
                                   weight.view(block_num, block_size, *shape)).view(-1, *shape)
            consumed |= {"oft_blocks", "alpha"}
        elif "lora_up.weight" in v:
            up, down = v["lora_up.weight"], v["lora_down.weight"]
            weight += (up.flatten(1) @ down.flatten(1)).reshape(weight.shape) * float(v["alpha"]) / down.shape[0]
            consumed |= {"lora_up.weight", "lora_down.weight", "alpha"}
        if "w_norm" in v:
            weight += v["w_norm"]
            module.bias += v["b_norm"]
            consumed |= {"w_norm", "b_norm"}
        assert set(v) <= consumed, (name, set(v) - consumed)
    return unet


@pytest.mark.parametrize("network_args", [
    ["algo=diag-oft", "conv_dim=4", "train_norm=True"],  # the GUI's constraint 0, rescaled off
    ["algo=dylora", "block_size=2", "conv_dim=4", "train_norm=True"],
])
def test_comfyui_merge_consumes_every_key_and_computes_the_same(tiny, network_args):
    ours = randomized(tiny, network_args)
    state_dict = kohya_format.kohya_state_dict({"lora_unet": ours})
    assert any(key.endswith(".w_norm") for key in state_dict)
    x = unet_inputs()
    with torch.no_grad():
        torch.testing.assert_close(comfy_merge(tiny, state_dict)(*x).sample, ours(*x).sample, atol=2e-5, rtol=1e-4)


def test_files_without_a_rank_are_named_for_dim_from_weights(tiny):
    ia3 = kohya_format.kohya_state_dict({"lora_unet": randomized(tiny, ["algo=ia3", "preset=attn-only"])})
    assert kohya_format.has_no_rank(ia3)
    with pytest.raises(ValueError, match="no rank to read"):
        kohya_format.dims_from_state_dict(ia3)
    dylora = kohya_format.kohya_state_dict({"lora_unet": randomized(tiny, ["algo=dylora", "preset=attn-only",
                                                                           "train_norm=True"])})
    assert not kohya_format.has_no_rank(dylora) and kohya_format.dims_from_state_dict(dylora) == (8, 4.0)


def test_kohyas_dylora_trains_one_unit_of_every_rank(tiny):
    settings, problems = parse_network_args(["unit=2", "conv_dim=8", "conv_alpha=1"], network_module="networks.dylora")
    assert problems == [] and settings.kohya_dylora and (settings.algo, settings.block_size) == ("dylora", 2)
    assert any("unknown key 'algo'" in p for p in parse_network_args(["algo=lora"],
                                                                     network_module="networks.dylora")[1])
    unet = copy.deepcopy(tiny["unet"])
    network_setup.attach_network(unet, "unet", 8, 4.0, 0.0, settings)
    layers = dict(lora.lora_layers(unet))
    # kohya's targets (networks.lora's, with conv_dim the ResNet blocks too), every conv at network_dim / alpha
    assert set(layers) == set(lora.unet_target_modules(tiny["unet"])) | set(
        sum(lora.unet_conv_target_modules(tiny["unet"]), []))
    conv = layers["down_blocks.0.resnets.0.conv1"]
    assert isinstance(conv, lycoris_layers.DyLoRALayer) and conv.kohya and (conv.r, conv.alpha) == (8, 4.0)
    layer = layers["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"]
    with torch.no_grad():
        for p in layer.up:
            p.normal_()
    x = torch.randn(3, layer.base_layer.in_features)
    layer.train()
    torch.manual_seed(4)
    first = int(torch.randint(0, 8, (1,)).item()) // 2 * 2
    torch.manual_seed(4)
    out = layer(x)
    down, up = torch.cat(list(layer.down)), torch.cat(list(layer.up), dim=1)
    torch.testing.assert_close(out, layer.base_layer(x) + x @ (up @ down).T * 4.0 / 8 * (8 / (first + 2)) ** 0.5)
    out.sum().backward()
    assert [i for i, p in enumerate(layer.down) if p.grad is not None] == [first // 2]


def test_ia3s_network_dim_is_not_a_rank_in_the_memory_estimate(tiny_sd1_dir, tmp_path):
    # the GUI's iA3-Prodigy preset writes network_dim 1024: IA3 trains one scale per channel

    from library.config import UserError
    from library.memory import estimate as memory
    from library.memory.precision import BasePrecision
    from library.training.memory_check import check_memory

    def config(*network: str):
        return parse_config([f"--pretrained_model_name_or_path={tiny_sd1_dir}", f"--train_data_dir={tmp_path}",
                             f"--output_dir={tmp_path / 'out'}", "--network_dim=1024", *network])[0]

    ia3 = config("--network_module=lycoris.kohya", "--network_args", "algo=ia3")
    counts: dict[str, memory.Counts] = {}
    for path, part in memory.model_files(str(tiny_sd1_dir), {"text": [None], "vae": [None]}):
        for name, found in memory.count_file(path, part).items():
            counts[name] = counts.get(name, memory.Counts()) + found
    rank_one = memory.estimate(counts, memory.Settings(None, None, torch.float32, torch.float32, 1, False)).total
    where = (torch.device("cpu"), 1)  # the device and the processes sharing it
    precision = BasePrecision.from_config(ia3, torch.float32)
    check_memory(ia3, *where, precision, torch.float32, available=rank_one + 1)
    with pytest.raises(UserError):
        check_memory(config(), *where, precision, torch.float32, available=rank_one + 1)
