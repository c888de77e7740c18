"""Wan: the prompt, latents and denoiser call against diffusers' WanPipeline and musubi-tuner's rules, the 2.2 A14B
expert draw and switch written from musubi's wan_train_network.py, the LoRA file against diffusers' loader and
ComfyUI's key rule, and the separate files loading as the folder."""
from __future__ import annotations

import pytest
import torch

from library.config import UserError, parse_config
from library.families.flow_matching import FlowOptions
from library.families.settings import settings_from
from library.families.shared import musubi_flow
from library.families.wan import experts as wan_experts
from library.families.wan import lora as wan_lora
from tests.helpers import musubi_lora
from tests.helpers.lora_files import file_delta


def config(*args: str):
    return parse_config(["--pretrained_model_name_or_path", ".", "--train_data_dir", ".", "--output_dir", ".",
                         *args])[0]


def settings(*args: str) -> wan_experts.WanSettings:
    return settings_from(wan_experts.WanSettings, config(*args))


@pytest.fixture(scope="module")
def wan21(tmp_path_factory):
    from library.families.wan.tiny import save_tiny_wan21

    return save_tiny_wan21(tmp_path_factory.mktemp("wan21") / "model")


@pytest.fixture(scope="module")
def components(wan21):
    from library.families.loading import load_components

    return load_components(wan21)


encode = musubi_lora.encode_captions


# --- the expert draw and switch, against musubi's get_noisy_model_input_and_timesteps -----------------------------

def musubi_high_low(generator, batch, boundary, draw):
    """musubi's high-low rule: the first draw (batch 1) picks the expert; each item is drawn alone up to 100 times
    until it lands on that side (t / 1000 >= boundary: high); if one never does, the whole batch is drawn afresh."""
    first = draw(1, generator) * 1000.0
    high = first[0] / 1000.0 >= boundary
    chosen = []
    for _ in range(batch):
        for _ in range(100):
            t = draw(1, generator) * 1000.0
            if (high and t[0] / 1000.0 >= boundary) or (not high and t[0] / 1000.0 < boundary):
                chosen.append(t)
                break
    if len(chosen) < batch:
        return draw(batch, generator) * 1000.0
    return torch.cat(chosen)


@pytest.mark.parametrize("boundary, seed", [(0.875, 0), (0.875, 4), (0.3, 1), (0.999999, 2)])
def test_both_experts_draw_each_batch_on_one_side_of_the_boundary_as_musubi(boundary, seed):
    options = FlowOptions(timestep_sampling="shift", discrete_flow_shift=3.0, weighting_scheme="none")
    objective = wan_experts.WanObjective(options, boundary=boundary)

    def shift_draw(count, generator):  # musubi's shift sampling
        t = torch.sigmoid(torch.randn(count, generator=generator))
        return t * 3.0 / (1 + 2.0 * t)

    ours = objective.sample_timesteps(4, torch.Generator().manual_seed(seed), "cpu", (8, 8))
    theirs = musubi_high_low(torch.Generator().manual_seed(seed), 4, boundary, shift_draw)
    torch.testing.assert_close(ours, theirs)
    if boundary < 0.99:
        assert len({bool(t / 1000 >= boundary) for t in ours}) == 1


def test_the_boundary_is_musubis_and_the_switch_swaps_base_weights_under_the_lora(components, wan21):
    from peft import LoraConfig, inject_adapter_in_model

    from library.families.wan.tiny import build_tiny_wan

    assert wan_experts.boundary_of(settings(), None) == 0.875
    assert wan_experts.boundary_of(settings("--timestep_boundary", "900"), None) == 0.9
    assert wan_experts.boundary_of(settings("--timestep_boundary", "0.5"), 0.875) == 0.5
    low = build_tiny_wan(0, experts=2)["transformer_2"]
    high = build_tiny_wan(0, experts=2)["transformer"]
    low_state = {k: v.clone() for k, v in low.state_dict().items()}
    switch = wan_experts.ExpertSwitch.of(high)
    switch.configure(0.875, offload=True)
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["to_q"]), low)
    lora_before = {k: v.clone() for k, v in low.state_dict().items() if "lora_" in k}
    assert switch.is_high(torch.tensor([875.0, 990.0])) and not switch.is_high(torch.tensor([874.9]))
    switch.activate(low, high=True)
    plain = {k.replace(".base_layer", ""): v for k, v in low.state_dict().items() if "lora_" not in k}
    assert plain.keys() == high.state_dict().keys()
    assert all(torch.equal(plain[k], high.state_dict()[k]) for k in plain)
    assert all(torch.equal(low.state_dict()[k], v) for k, v in lora_before.items())
    switch.activate(low, high=False)
    plain = {k.replace(".base_layer", ""): v for k, v in low.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(plain[k], low_state[k]) for k in low_state)


def test_configured_refuses_what_does_not_apply(components):
    family = components.family
    assert family.configured(settings("--resolution", "64")).version == "2.1"
    assert family.configured(settings("--task", "t2v-A14B")).version == "2.2"
    with pytest.raises(UserError) as error:
        family.configured(settings("--task", "i2v-14B", "--clip", "c.pth", "--timestep_boundary", "0.9",
                                   "--clip_skip", "2", "--resolution", "72"))
    text = str(error.value)
    for part in ("task i2v-14B: the model is a text-to-video one", "clip: not for Wan",
                 "timestep_boundary: only for Wan 2.2", "clip_skip", "multiples of 16"):
        assert part in text, part


# --- prompts, latents, the denoiser ------------------------------------------------------------------------------

def test_prompts_are_wanpipelines_512_umt5_states_with_the_padding_zeroed(components):
    from diffusers import WanPipeline

    batch, encoded = encode(components, ["a photo of  sks dog", "red"])
    assert batch["input_ids"].shape == (2, 512)
    pipe = WanPipeline(tokenizer=components.tokenizers[0], text_encoder=components.text_encoders[0],
                       vae=components.vae.vae, scheduler=components.noise_scheduler, transformer=components.denoiser)
    with torch.no_grad():
        theirs = pipe._get_t5_prompt_embeds(["a photo of  sks dog", "red"], max_sequence_length=512,
                                            device=torch.device("cpu"), dtype=torch.float32)
    torch.testing.assert_close(encoded["encoder_hidden_states"], theirs)
    assert encoded["encoder_hidden_states"][1, int(batch["attention_mask"][1].sum()):].abs().sum() == 0


def test_vae_gives_musubis_normalised_mode_for_videos_and_images_as_one_frame(components):
    vae = components.vae.vae
    video = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        ours = components.vae.encode(video).latent_dist.mean
        mode = vae.encode(video).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
        image = components.vae.encode(video[:, :, 0]).latent_dist.mean
        one_frame = components.vae.encode(video[:, :, :1]).latent_dist.mean
        decoded = components.vae.decode(ours)[0]
        expected = vae.decode(ours * std + mean, return_dict=False)[0]
    assert ours.shape == (1, 16, 2, 4, 4) and image.shape == (1, 16, 4, 4)
    torch.testing.assert_close(ours, (mode - mean) / std)
    torch.testing.assert_close(image, one_frame[:, :, 0])
    torch.testing.assert_close(decoded, expected)


def test_denoise_is_musubis_call_dit(components):
    """The transformer sees the timestep as given (1000 * sigma) and the noisy latents with their frame axis (an
    image gets one); its output is the prediction, trained against noise - x0."""
    _, encoded = encode(components, ["a photo of sks dog", "red"])
    video = torch.randn(2, 16, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([300.0, 812.5])
    with torch.no_grad():
        ours = components.family.denoise(components.denoiser, video, timesteps, encoded, {})
        theirs = components.denoiser(hidden_states=video, timestep=timesteps,
                                     encoder_hidden_states=encoded["encoder_hidden_states"], return_dict=False)[0]
        image = components.family.denoise(components.denoiser, video[:, :, 0], timesteps, encoded, {})
        one_frame = components.denoiser(hidden_states=video[:, :, :1], timestep=timesteps,
                                        encoder_hidden_states=encoded["encoder_hidden_states"], return_dict=False)[0]
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(image, one_frame[:, :, 0])
    objective = components.family.objective(components, settings(), torch.device("cpu"))
    assert isinstance(objective, musubi_flow.MusubiFlowObjective) and objective.boundary is None
    noise, latents = torch.randn_like(video), torch.randn_like(video)
    loss = objective.per_sample_loss(ours, latents, noise, timesteps)
    torch.testing.assert_close(loss, ((ours - (noise - latents)) ** 2).mean(dim=(1, 2, 3, 4)))


# --- LoRA files ---------------------------------------------------------------------------------------------------

MUSUBI_BLOCK = ("self_attn_q", "self_attn_k", "self_attn_v", "self_attn_o", "cross_attn_q", "cross_attn_k",
                "cross_attn_v", "cross_attn_o", "ffn_0", "ffn_2")


CROSS_KV = ("exclude_patterns=[r'.*']", r"include_patterns=[r'.*cross_attn\.(k|v)', 'blocks\.1\.ffn\.2']")


def our_lora(transformer, rank=4, alpha=2.0, seed=0, network_args=()):
    """A random LoRA over our targets (narrowed by `network_args`), in musubi's names."""
    from library.config.network_args import parse_network_args

    g = torch.Generator().manual_seed(seed)
    state = {}
    for path in wan_lora.targets(transformer, parse_network_args(list(network_args), None, "networks.lora_wan")[0]):
        layer = transformer.get_submodule(path)
        key = "lora_unet_" + wan_lora.original_path(path).replace(".", "_")
        state[f"{key}.lora_down.weight"] = torch.randn(rank, layer.in_features, generator=g)
        state[f"{key}.lora_up.weight"] = torch.randn(layer.out_features, rank, generator=g)
        state[f"{key}.alpha"] = torch.tensor(alpha)
    return state


def test_targets_and_keys_are_musubis_lora_wan(components):
    ours = our_lora(components.denoiser)
    blocks = len(components.denoiser.blocks)
    assert {k.split(".")[0] for k in ours} == {f"lora_unet_blocks_{i}_{m}" for i in range(blocks) for m in MUSUBI_BLOCK}
    assert wan_lora.to_file(ours) == ours
    assert wan_lora.module_path("lora_unet_blocks_1_self_attn_o") == "blocks.1.attn1.to_out.0"
    assert wan_lora.module_path("lora_unet_blocks_0_ffn_0") == "blocks.0.ffn.net.0.proj"
    # diffusers / peft keys, in diffusers' names or the original ones, read back to the same tensors
    peft = {}
    for name in {k.split(".")[0] for k in ours}:
        path = wan_lora.module_path(name)
        peft[f"transformer.{path}.lora_A.weight"] = ours[f"{name}.lora_down.weight"]
        peft[f"transformer.{path}.lora_B.weight"] = ours[f"{name}.lora_up.weight"]
        peft[f"transformer.{path}.alpha"] = ours[f"{name}.alpha"]
    read = wan_lora.from_file(peft)
    assert read.keys() == ours.keys() and all(torch.equal(read[k], ours[k]) for k in ours)
    comfy = {f"diffusion_model.{wan_lora.original_path(wan_lora.module_path(k.split('.')[0]))}.lora_A.weight": v
             for k, v in ours.items() if k.endswith("lora_down.weight")}
    assert set(wan_lora.from_file(comfy)) == {k.split(".")[0] + ".lora_down.weight" for k in ours
                                              if k.endswith("lora_down.weight")} | {
        k for k in ours if k.endswith(".alpha")}


@pytest.mark.parametrize("network_args", [(), CROSS_KV], ids=["every-layer", "layers-left-out"])
def test_diffusers_load_lora_weights_consumes_every_key_with_the_same_change(wan21, components, network_args):
    """WanPipeline.load_lora_weights on our file (its converters raise on any key left over): every module
    becomes a LoRA layer whose weight change equals ours (alpha / rank applied). With layers left out the file is
    in the original names behind diffusion_model. (diffusers' musubi converter needs every layer)."""
    from diffusers import WanPipeline

    from library.families.loading import load_components

    fresh = load_components(wan21)
    ours = our_lora(components.denoiser, network_args=network_args)
    written = wan_lora.to_file(ours)
    assert all(key.startswith("lora_unet_" if not network_args else "diffusion_model.") for key in written)
    read = wan_lora.from_file(written)
    assert read.keys() == ours.keys() and all(torch.equal(read[k], ours[k]) for k in ours)
    pipe = WanPipeline(tokenizer=fresh.tokenizers[0], text_encoder=fresh.text_encoders[0], vae=fresh.vae.vae,
                       scheduler=fresh.noise_scheduler, transformer=fresh.denoiser)
    # (diffusers' converter of diffusion_model. keys scales the given tensors in place, as a file's are)
    pipe.load_lora_weights({key: tensor.clone() for key, tensor in written.items()}, adapter_name="ours")
    loaded = {name: module for name, module in pipe.transformer.named_modules() if hasattr(module, "lora_A")}
    assert {"lora_unet_" + wan_lora.original_path(name).replace(".", "_") for name in loaded} == \
        {k.split(".")[0] for k in ours}
    for name, module in loaded.items():
        expected = file_delta(ours, "lora_unet_" + wan_lora.original_path(name).replace(".", "_"))
        torch.testing.assert_close(module.get_delta_weight("ours"), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("network_args", [(), CROSS_KV], ids=["every-layer", "layers-left-out"])
def test_comfyui_key_rule_applies_every_key_to_its_weight(components, network_args):
    """ComfyUI's Wan model keeps the original names; comfy/lora.py names each `diffusion_model.<path>.weight`
    `lora_unet_<path with _>` and `diffusion_model.<path>`, reads lora_down / lora_up or lora_A / lora_B, and adds
    up @ down * alpha / rank. Every module of our file names such a weight, and the patched original-layout weights
    equal the diffusers model's with our change merged, converted."""
    from library.families.wan.tiny import original_state_dict

    transformer = components.denoiser
    ours = our_lora(transformer, network_args=network_args)
    native = original_state_dict(transformer)
    key_map = {"lora_unet_" + k[:-len(".weight")].replace(".", "_"): k for k in native if k.endswith(".weight")}
    key_map |= {"diffusion_model." + k[:-len(".weight")]: k for k in native if k.endswith(".weight")}
    written = wan_lora.to_file(ours)
    roles = {"lora_down.weight": "lora_down.weight", "lora_up.weight": "lora_up.weight", "alpha": "alpha",
             "lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight"}
    file = {}  # the file as ComfyUI reads it: each key's module -> its weight's kohya name
    for key, tensor in written.items():
        module, role = next((key[:-len(r) - 1], r) for r in roles if key.endswith("." + r))
        assert module in key_map, key
        file[f"lora_unet_{key_map[module][:-len('.weight')].replace('.', '_')}.{roles[role]}"] = tensor
    assert file.keys() == ours.keys()
    names = {k.split(".")[0] for k in ours}
    assert names <= set(key_map)
    patched = dict(native)
    for name in names:
        patched[key_map[name]] = native[key_map[name]] + file_delta(file, name)
    merged = {k: v.clone() for k, v in transformer.state_dict().items()}
    for name in names:
        merged[wan_lora.module_path(name) + ".weight"] += file_delta(ours, name)
    copy = type(transformer).from_config(transformer.config)
    copy.load_state_dict(merged)
    for key, tensor in original_state_dict(copy).items():
        torch.testing.assert_close(patched[key], tensor)


# --- files ------------------------------------------------------------------------------------------------------

def test_comfyui_and_official_files_load_as_the_folder(wan21, components, tmp_path):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from library.families.loading import load_components
    from library.families.wan.tiny import official_t5_state_dict, save_tiny_wan_files

    files = save_tiny_wan_files(wan21, tmp_path)
    # the original layout written for the test is what diffusers' own converter reads back
    from safetensors.torch import load_file

    converted = convert_wan_transformer_to_diffusers(load_file(files["transformer"]))
    assert converted.keys() == components.denoiser.state_dict().keys()
    with pytest.raises(UserError, match="needs t5"):
        load_components(files["transformer"], model_config=wan21, ae=str(files["ae"]))
    with pytest.raises(UserError, match="model_config"):
        load_components(files["transformer"], t5=str(files["t5"]), ae=str(files["ae"]))
    pth = tmp_path / "models_t5_umt5-tiny-enc.pth"
    torch.save(official_t5_state_dict(components.text_encoders[0]), pth)
    for t5 in (files["t5"], pth):
        loaded = load_components(files["transformer"], model_config=wan21, t5=str(t5), ae=str(files["ae"]))
        musubi_lora.assert_same_weights(
            type("Parts", (), {"denoiser": loaded.denoiser, "vae": loaded.vae.vae,
                               "text_encoders": loaded.text_encoders})(),
            type("Parts", (), {"denoiser": components.denoiser, "vae": components.vae.vae,
                               "text_encoders": components.text_encoders})())
    bad = tmp_path / "pickled.pth"
    torch.save({"weights": object()}, bad)
    with pytest.raises(UserError, match="weights-only"):
        load_components(files["transformer"], model_config=wan21, t5=str(bad), ae=str(files["ae"]))


# --- sampling -----------------------------------------------------------------------------------------------------

def test_sample_prompts_draw_wanpipelines_first_frame(components, tmp_path):
    """A sample prompt renders one frame through WanPipeline with the model's own scheduler and musubi's CFG 5.0:
    the same image WanPipeline draws itself (video samples are not written yet)."""
    import numpy as np
    from diffusers import WanPipeline

    from tests.helpers.family_checks import assert_same_image, sample, sampling_models

    _, (ours,) = sample(sampling_models(components), tmp_path, "a photo of sks dog --n red --s 2 --w 64 --h 64 --d 3\n")
    pipe = WanPipeline(tokenizer=components.tokenizers[0], text_encoder=components.text_encoders[0],
                       vae=components.vae.vae, transformer=components.denoiser,
                       scheduler=components.family.sampling_scheduler(components.noise_scheduler.config))
    with torch.no_grad():
        frames = pipe(prompt="a photo of sks dog", negative_prompt="red", guidance_scale=5.0, num_inference_steps=2,
                      width=64, height=64, num_frames=1, generator=torch.Generator().manual_seed(3),
                      output_type="np").frames[0]
    assert_same_image(ours, (frames[0] * 255).round().astype(np.uint8))


def test_the_high_noise_file_becomes_the_expert_swapped_in_above_the_boundary(tmp_path):
    """musubi's --dit (low noise) and --dit_high_noise from ComfyUI's files: the expert switch holds the high-noise
    file's weights, which the transformer takes for a batch at or above the boundary."""
    from library.families.loading import load_components
    from library.families.wan.tiny import save_tiny_wan22_a14b, save_tiny_wan_files

    folder = save_tiny_wan22_a14b(tmp_path / "wan22")
    files = save_tiny_wan_files(folder, tmp_path / "files")
    reference = load_components(folder)
    loaded = load_components(files["transformer"], model_config=folder, t5=str(files["t5"]), ae=str(files["ae"]))
    family = loaded.family.configured(settings("--dit_high_noise", str(files["dit_high_noise"]),
                                               "--timestep_boundary", "900", "--offload_inactive_dit"))
    family.prepare_denoiser(loaded.denoiser, [])
    assert family.version == "2.2" and family.experts.boundary == 0.9
    low = {k: v.clone() for k, v in loaded.denoiser.state_dict().items()}
    family.denoise(loaded.denoiser, torch.zeros(1, 16, 4, 4), torch.tensor([899.0]), {
        "encoder_hidden_states": torch.zeros(1, 512, 32)}, {})
    assert all(torch.equal(v, low[k]) for k, v in loaded.denoiser.state_dict().items())
    family.denoise(loaded.denoiser, torch.zeros(1, 16, 4, 4), torch.tensor([900.0]), {
        "encoder_hidden_states": torch.zeros(1, 512, 32)}, {})
    high = reference.family.experts.high  # the folder's transformer/ (high noise), held by its own switch
    assert all(torch.equal(v, high[k]) for k, v in loaded.denoiser.state_dict().items())
    with pytest.raises(UserError, match="brings both experts"):
        reference.family.configured(settings("--dit_high_noise", str(files["dit_high_noise"])))


def test_ti2v_5b_trains_text_to_video_with_every_tokens_timestep_alike(tmp_path):
    """Wan 2.2 TI2V 5B from its folder: 48 latent channels 16x down, and the denoiser's one timestep per item is what
    WanPipeline gives the transformer per token with expand_timesteps and no image (every token at t)."""
    from library.families.loading import load_components
    from library.families.wan.tiny import save_tiny_wan22_ti2v_5b

    loaded = load_components(save_tiny_wan22_ti2v_5b(tmp_path / "ti2v"))
    family = loaded.family.configured(settings("--resolution", "64"))
    assert family.version == "2.2-ti2v-5B"
    with pytest.raises(UserError, match="multiples of 32"):
        loaded.family.configured(settings("--resolution", "48"))
    with torch.no_grad():
        latents = loaded.vae.encode(torch.zeros(1, 3, 5, 64, 64)).latent_dist.mean
        assert latents.shape == (1, 48, 2, 4, 4)
        _, encoded = encode(loaded, ["a photo of sks dog"])
        ours = family.denoise(loaded.denoiser, latents, torch.tensor([600.0]), encoded, {})
        tokens = torch.full((1, 2 * 2 * 2), 600.0)  # frames x (h / 2) x (w / 2)
        theirs = loaded.denoiser(hidden_states=latents, timestep=tokens,
                                 encoder_hidden_states=encoded["encoder_hidden_states"], return_dict=False)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_batch_on_both_sides_of_the_boundary_gets_each_items_expert(tmp_path):
    """Validation's fixed timesteps span both experts in one batch: each item is predicted by its own expert, as it
    would be alone."""
    from library.families.loading import load_components
    from library.families.wan.tiny import save_tiny_wan22_a14b

    loaded = load_components(save_tiny_wan22_a14b(tmp_path / "wan22"))
    family = loaded.family.configured(settings("--timestep_boundary", "500"))
    noisy = torch.randn(3, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    timesteps = torch.tensor([900.0, 100.0, 500.0])
    text = {"encoder_hidden_states": torch.randn(3, 512, 32, generator=torch.Generator().manual_seed(2))}
    with torch.no_grad():
        together = family.denoise(loaded.denoiser, noisy, timesteps, text, {})
        alone = [family.denoise(loaded.denoiser, noisy[i:i + 1], timesteps[i:i + 1],
                                {"encoder_hidden_states": text["encoder_hidden_states"][i:i + 1]}, {})
                 for i in (1, 0, 2)]
    torch.testing.assert_close(together, torch.cat([alone[1], alone[0], alone[2]]), rtol=1e-5, atol=1e-5)
    family.experts.activate(loaded.denoiser, high=False)
    with torch.no_grad():  # the low-noise expert's prediction of item 0 differs: item 0 went to the high-noise one
        low = loaded.denoiser(hidden_states=noisy[:1, :, None], timestep=timesteps[:1],
                              encoder_hidden_states=text["encoder_hidden_states"][:1], return_dict=False)[0]
    assert not torch.allclose(together[:1], low[:, :, 0], atol=1e-4)
