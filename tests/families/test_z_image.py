"""Z-Image: musubi-tuner's objective against its formulas, the denoiser call, the LoRA key layout written from
musubi's rules, diffusers' loader reading our file, separate-file loading and sampling with ZImagePipeline."""
from __future__ import annotations

import math

import pytest
import torch

from library.config import UserError, parse_config
from library.families.flow_matching import FlowOptions
from library.families.settings import settings_from
from library.families.shared import musubi_flow
from library.families.z_image import lora as z_image_lora
from tests.helpers import musubi_lora
from tests.helpers.family_checks import assert_same_image, pipeline_scheduler, sample, sampling_models
from tests.helpers.lora_files import file_delta


def config(*args: str):
    return parse_config(["--pretrained_model_name_or_path", ".", "--train_data_dir", ".", "--output_dir", ".",
                         *args])[0]


def settings(*args: str) -> musubi_flow.MusubiSettings:
    """What Z-Image reads from the config of these arguments."""
    return settings_from(musubi_flow.MusubiSettings, config(*args))


# --- the objective, against musubi's get_noisy_model_input_and_timesteps ----------------------------------------

def musubi_reference(mode: str, generator: torch.Generator, batch: int, h: int, w: int, shift: float,
                     sigmoid_scale: float, logit_mean: float, logit_std: float) -> torch.Tensor:
    """musubi's draw, written from trainer_base.py (t in [0, 1]; sigma mode through its scheduler's table)."""
    def lin(x1, y1, x2, y2):
        m = (y2 - y1) / (x2 - x1)
        return lambda x: m * x + (y1 - m * x1)
    if mode == "sigma":
        u = torch.rand(size=(batch,), generator=generator)
        indices = (u * (1000 - 0) + 0).long()
        schedule = (torch.linspace(1, 0, 1000 + 1)[:-1] * 1000).to(torch.float32)  # FlowMatchDiscreteScheduler
        return schedule[indices] / 1000
    if mode == "uniform":
        return torch.rand((batch,), generator=generator)
    if mode == "sigmoid":
        return torch.sigmoid(sigmoid_scale * torch.randn((batch,), generator=generator))
    if mode == "logsnr":
        logsnr = torch.normal(mean=logit_mean, std=logit_std, size=(batch,), generator=generator)
        return torch.sigmoid(-logsnr / 2)
    if mode != "shift":
        x1, y1, x2, y2 = (256, 0.5, 4096, 1.15) if mode in ("flux_shift", "flux2_shift") else (256, 0.5, 8192, 0.9)
        shift = math.exp(lin(x1, y1, x2, y2)(h * w if mode == "flux2_shift" else (h // 2) * (w // 2)))
    t = (torch.randn((batch,), generator=generator) * sigmoid_scale).sigmoid()
    return (t * shift) / (1 + (shift - 1) * t)


@pytest.mark.parametrize("mode", musubi_flow.SAMPLINGS)
def test_timestep_sampling_follows_musubis_formulas(mode):
    options = FlowOptions(timestep_sampling=mode, discrete_flow_shift=2.0, sigmoid_scale=1.3, weighting_scheme="none",
                          logit_mean=0.4, logit_std=1.7)
    ours = musubi_flow.musubi_sigmas(options, 64, torch.Generator().manual_seed(5), (96, 64))
    theirs = musubi_reference(mode, torch.Generator().manual_seed(5), 64, 96, 64, 2.0, 1.3, 0.4, 1.7)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert ours.min() >= 0 and ours.max() <= 1


def test_min_max_timestep_scale_the_continuous_draw_as_musubi_does():
    options = FlowOptions(timestep_sampling="uniform")
    t = musubi_flow.musubi_sigmas(options, 32, torch.Generator().manual_seed(1), (8, 8), 200, 600)
    reference = torch.rand(32, generator=torch.Generator().manual_seed(1)) * (0.6 - 0.2) + 0.2
    torch.testing.assert_close(t, reference)


def test_musubi_defaults_and_refusals():
    objective = musubi_flow.MusubiFlowObjective.from_settings(settings())
    assert objective.options.discrete_flow_shift == 1.0 and objective.options.timestep_sampling == "sigma"
    assert objective.options.weighting_scheme == "none"
    assert musubi_flow.MusubiFlowObjective.from_settings(
        settings("--discrete_flow_shift", "2.5")).options.discrete_flow_shift == 2.5
    problems = musubi_flow.unsupported(settings("--min_snr_gamma", "5", "--model_prediction_type", "raw",
                                                "--max_timestep", "500"), "Z-Image")
    assert any("min_snr_gamma" in p for p in problems) and any("model_prediction_type" in p for p in problems)
    assert any("mirrored" in p for p in problems)  # min/max with sigma sampling
    assert not musubi_flow.unsupported(settings("--timestep_sampling", "shift", "--max_timestep", "500"), "Z-Image")


@pytest.mark.parametrize("scheme", ["none", "cosmap", "sigma_sqrt"])
def test_loss_is_musubis_weighted_mse_of_the_negated_output(scheme):
    """musubi: mse(model_pred, latents - noise) * weighting(sigma); our prediction is the negated model output."""
    g = torch.Generator().manual_seed(0)
    latents, noise, model_pred = (torch.randn(3, 16, 4, 4, generator=g) for _ in range(3))
    timesteps = torch.tensor([150.0, 500.0, 900.0])
    objective = musubi_flow.MusubiFlowObjective(FlowOptions(weighting_scheme=scheme))
    ours = objective.per_sample_loss(-model_pred, latents, noise, timesteps)
    sigmas = (timesteps / 1000).view(-1, 1, 1, 1)
    loss = torch.nn.functional.mse_loss(model_pred, latents - noise, reduction="none")
    if scheme == "sigma_sqrt":
        loss = loss * sigmas ** -2.0
    elif scheme == "cosmap":
        loss = loss * 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))
    torch.testing.assert_close(ours, loss.mean(dim=(1, 2, 3)))


# --- the model --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def components(tiny_z_image_dir):
    from library.families.loading import load_components

    return load_components(tiny_z_image_dir)


encode = musubi_lora.encode_captions


def test_prompts_are_qwen3s_penultimate_states_through_the_chat_template(components):
    from library.families.z_image.family import ZImage

    assert isinstance(components.family, ZImage) and components.family.base_model_version == "z_image"
    batch, encoded = encode(components, ["a photo of sks dog", "red"])
    assert batch["input_ids"].shape == (2, 512)
    text = components.tokenizers[0].decode(batch["input_ids"][0][batch["attention_mask"][0].bool()])
    assert text == "<|im_start|>user\na photo of sks dog<|im_end|>\n<|im_start|>assistant\n"
    with torch.no_grad():
        hidden = components.text_encoders[0](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                             output_hidden_states=True).hidden_states
    torch.testing.assert_close(encoded["encoder_hidden_states"], hidden[-2])


def test_denoise_is_musubis_call_negated(components):
    """musubi's call_dit: t = (1000 - timesteps) / 1000, captions without padding, output = x0 - noise direction;
    ours returns the velocity, its negation."""
    _, encoded = encode(components, ["a photo of sks dog", "red"])
    noisy = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([300.0, 800.0])
    with torch.no_grad():
        ours = components.family.denoise(components.denoiser, noisy, timesteps, encoded, {})
        states, masks = encoded["encoder_hidden_states"], encoded["attention_mask"]
        captions = [s[m.bool()] for s, m in zip(states, masks, strict=True)]
        theirs = components.denoiser(list(noisy.unsqueeze(2)), (1000 - timesteps) / 1000, captions,
                                     return_dict=False)[0]
    torch.testing.assert_close(ours, -torch.stack(theirs).squeeze(2))
    assert captions[1].shape[0] < captions[0].shape[0] < 512


def test_configured_refuses_what_does_not_apply(components):
    family = components.family
    assert family.configured(settings("--resolution", "64")) is family
    with pytest.raises(UserError) as error:
        family.configured(settings("--clip_skip", "2", "--guidance_scale", "1.0", "--resolution", "72"))
    text = str(error.value)
    assert "clip_skip" in text and "guidance_scale" in text and "multiples of 16" in text
    from library.families.flow_matching import unsupported

    assert any("qwen_shift" in p for p in unsupported(settings("--timestep_sampling", "qwen_shift").user_set))


# --- LoRA keys --------------------------------------------------------------------------------------------------

def musubi_lora_names(transformer) -> set[str]:
    """musubi's networks.lora create_modules with lora_zimage's targets and exclude pattern."""
    return musubi_lora.musubi_lora_names(transformer, "ZImageTransformerBlock", r".*(_modulation|_refiner).*")


def random_lora(transformer, rank=4, alpha=2.0, seed=0):
    return musubi_lora.random_lora(transformer, z_image_lora.targets(transformer, _no_args()), rank, alpha, seed)


def _no_args():
    from library.config.network_args import NetworkArgs

    return NetworkArgs()


def test_targets_are_musubis_and_the_file_has_diffusers_names(components):
    ours = random_lora(components.denoiser)
    assert {k.split(".")[0] for k in ours} == musubi_lora_names(components.denoiser)
    assert len(musubi_lora_names(components.denoiser)) == 7 * len(components.denoiser.layers)
    written = z_image_lora.to_file(ours)
    # musubi's convert_lora --target other names: diffusion_model.<module>.lora_A / lora_B (alpha kept here)
    assert "diffusion_model.layers.1.attention.to_out.0.lora_B.weight" in written
    assert "diffusion_model.layers.0.feed_forward.w3.alpha" in written
    assert z_image_lora.from_file(written).keys() == ours.keys()
    assert all(torch.equal(z_image_lora.from_file(written)[k], ours[k]) for k in ours)
    assert z_image_lora.from_file(ours).keys() == ours.keys()  # musubi's own file reads as it is


def test_include_patterns_bring_back_the_refiners_musubi_leaves_out_and_the_file_names_them(components):
    from library.config.network_args import parse_network_args

    transformer = components.denoiser
    net, problems = parse_network_args(["include_patterns=[r'noise_refiner\\..*']"], None, "networks.lora_zimage")
    assert not problems
    chosen = z_image_lora.targets(transformer, net)
    refiner = {name for name, module in transformer.named_modules()
               if name.startswith("noise_refiner.") and isinstance(module, torch.nn.Linear)}
    assert refiner and set(chosen) == set(z_image_lora.targets(transformer, _no_args())) | refiner
    assert any(".adaLN_modulation." in name for name in refiner)  # "_modulation" is musubi's exclude, overridden
    ours = musubi_lora.random_lora(transformer, chosen)
    assert z_image_lora.from_file(z_image_lora.to_file(ours)).keys() == ours.keys()


def test_musubis_comfyui_conversion_reads_back_to_the_same_change(components):
    """musubi's convert_z_image_lora_to_comfy: q, k, v fused (downs stacked, ups block-diagonal, alpha x 3) and
    to_out.0 renamed attention_out."""
    ours = random_lora(components.denoiser)
    comfy = {}
    for i in range(len(components.denoiser.layers)):
        base = f"lora_unet_layers_{i}_attention_"
        parts = [base + p for p in ("to_q", "to_k", "to_v")]
        ups = [ours[f"{p}.lora_up.weight"] for p in parts]
        comfy[base + "qkv.lora_down.weight"] = torch.cat([ours[f"{p}.lora_down.weight"] for p in parts])
        comfy[base + "qkv.lora_up.weight"] = torch.block_diag(*ups)
        comfy[base + "qkv.alpha"] = ours[f"{parts[0]}.alpha"] * 3
        for role in ("lora_down.weight", "lora_up.weight", "alpha"):
            comfy[f"{base}out.{role}"] = ours[f"{base}to_out_0.{role}"]
        for j in (1, 2, 3):
            name = f"lora_unet_layers_{i}_feed_forward_w{j}"
            comfy.update({k: v for k, v in ours.items() if k.startswith(name + ".")})
    read = z_image_lora.from_file(comfy)
    assert read.keys() == ours.keys()
    for name in {k.split(".")[0] for k in ours}:
        torch.testing.assert_close(file_delta(read, name), file_delta(ours, name))


def test_diffusers_load_lora_weights_consumes_every_key_with_the_same_change(tiny_z_image_dir, components):
    """ZImagePipeline.load_lora_weights on our file: every module of the file becomes a LoRA layer whose weight
    change equals ours (alpha / rank applied), to 1e-6."""
    from diffusers import ZImagePipeline

    from library.families.loading import load_components

    fresh = load_components(tiny_z_image_dir)
    ours = random_lora(components.denoiser)
    pipe = ZImagePipeline(scheduler=fresh.noise_scheduler, vae=fresh.vae, text_encoder=fresh.text_encoders[0],
                          tokenizer=fresh.tokenizers[0], transformer=fresh.denoiser)
    pipe.load_lora_weights(z_image_lora.to_file(ours), adapter_name="ours")
    musubi_lora.assert_diffusers_layers_change_as_ours(pipe.transformer, ours)


# --- files and sampling -----------------------------------------------------------------------------------------

def test_comfyui_split_files_load_as_the_folder(tiny_z_image_dir, components, tmp_path):
    from library.families.loading import load_components
    from library.families.shared.separate_files import load_qwen_tokenizer
    from library.families.z_image.files import SHIPPED_CONFIG
    from library.families.z_image.tiny import save_tiny_z_image_files

    files = save_tiny_z_image_files(tiny_z_image_dir, tmp_path)
    loaded = musubi_lora.load_split_files(files, tiny_z_image_dir)
    with pytest.raises(UserError, match=r"text_encoder: not read for .*folder, which brings its own parts.*"
                            r"Z-Image \(text_encoder, ae\)"):
        load_components(tiny_z_image_dir, text_encoder=str(files["text_encoder"]))
    musubi_lora.assert_same_weights(loaded, components)
    # The shipped tokenizer is Qwen's own vocabulary: the chat template's tokens get Qwen's ids.
    qwen = load_qwen_tokenizer(SHIPPED_CONFIG / "tokenizer")
    ids = qwen(qwen.apply_chat_template([{"role": "user", "content": "a cat"}], tokenize=False,
                                        add_generation_prompt=True, enable_thinking=True)).input_ids
    assert ids[:3] == [151644, 872, 198] and ids[-3:] == [151644, 77091, 198]  # <|im_start|> user \n ... assistant


def test_sampling_is_z_image_pipelines_with_musubis_cfg(components, tmp_path):
    import numpy as np
    from diffusers import ZImagePipeline

    _, (ours, plain) = sample(sampling_models(components), tmp_path,
                              "a photo of sks dog --n red --s 2 --w 64 --h 64 --d 3\n"
                              "a photo of sks dog --n red --l 1 --s 2 --w 64 --h 64 --d 3\n")
    with torch.no_grad():
        pipe = ZImagePipeline(scheduler=pipeline_scheduler(components), vae=components.vae,
                              text_encoder=components.text_encoders[0], tokenizer=components.tokenizers[0],
                              transformer=components.denoiser)
        theirs = pipe(prompt="a photo of sks dog", negative_prompt="red", guidance_scale=4.0, num_inference_steps=2,
                      width=64, height=64, generator=torch.Generator().manual_seed(3)).images[0]
    assert_same_image(ours, theirs)
    assert not np.array_equal(ours, plain)


def test_comfyui_applies_the_file_to_its_fused_layout_as_we_trained_it(components):
    """ComfyUI's rules (comfy/lora.py model_lora_keys_unet for Lumina2 / Z-Image, with comfy.utils
    z_image_to_diffusers): `diffusion_model.<diffusers module>` names its weight, q / k / v a slice of the fused
    attention.qkv at offsets 0, dim, 2 * dim; it reads `.lora_A.weight`, `.lora_B.weight`, `.alpha` and adds
    alpha / rank * B @ A. Applied to ComfyUI's layout of the base, every key of our file is used and the result is
    ComfyUI's layout of the base with our LoRA merged."""
    from library.families.z_image.files import comfy_state_dict

    transformer = components.denoiser
    dim = transformer.config.dim
    key_map = {}
    for i in range(len(transformer.layers)):
        d, c = f"layers.{i}.attention.", f"layers.{i}.attention."
        for j, part in enumerate(("to_q", "to_k", "to_v")):
            key_map[f"diffusion_model.{d}{part}"] = (f"{c}qkv.weight", (j * dim, dim))
        key_map[f"diffusion_model.{d}to_out.0"] = (f"{c}out.weight", None)
        for w in ("w1", "w2", "w3"):
            key_map[f"diffusion_model.layers.{i}.feed_forward.{w}"] = (f"layers.{i}.feed_forward.{w}.weight", None)
    ours = random_lora(transformer)
    written = z_image_lora.to_file(ours)
    patched = {k: v.clone() for k, v in comfy_state_dict(transformer).items()}
    used = set()
    for x, (target, offset) in key_map.items():
        if f"{x}.lora_B.weight" not in written:
            continue
        up, down = written[f"{x}.lora_B.weight"], written[f"{x}.lora_A.weight"]
        alpha = written[f"{x}.alpha"].item()
        used |= {f"{x}.lora_B.weight", f"{x}.lora_A.weight", f"{x}.alpha"}
        weight = patched[target] if offset is None else patched[target].narrow(0, *offset)
        weight += (up @ down) * (alpha / down.shape[0])
    assert used == set(written)
    merged = {name: module.weight.detach() + file_delta(ours, "lora_unet_" + name.replace(".", "_"))
              for name, module in transformer.named_modules() if "lora_unet_" + name.replace(".", "_") + ".alpha"
              in ours}
    base = {k: v.detach().clone() for k, v in transformer.state_dict().items()}
    base.update({f"{name}.weight": weight for name, weight in merged.items()})
    transformer_copy = type(transformer).from_config(transformer.config)
    transformer_copy.load_state_dict(base)
    expected = comfy_state_dict(transformer_copy)
    assert expected.keys() == patched.keys()
    for key in expected:
        torch.testing.assert_close(patched[key], expected[key], rtol=1e-5, atol=1e-6)


def test_fp8_base_stores_the_transformer_in_fp8_and_trains_the_lora(tiny_z_image_dir):
    """fp8_base (the precision options of library.memory.precision) on Z-Image: the frozen Linear weights are
    float8_e4m3fn, the step runs in bf16 and the LoRA gets its gradients."""
    from library.families.loading import load_components
    from library.training.model import build_model

    run = config("--fp8_base", "--mixed_precision", "bf16", "--network_module", "networks.lora_zimage",
                 "--network_train_unet_only", "--resolution", "64")
    loaded = load_components(tiny_z_image_dir, weight_dtype=torch.bfloat16, vae_dtype=torch.bfloat16)
    loaded.family = loaded.family.configured(settings_from(loaded.family.settings_type, run))
    model, groups = build_model(run, loaded, torch.device("cpu"))
    assert model.denoiser.layers[0].feed_forward.w1.base_layer.weight.dtype == torch.float8_e4m3fn
    _, encoded = encode(loaded, ["a photo of sks dog"])
    noisy = torch.randn(1, 16, 8, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(noisy, torch.tensor([500.0]), encoded, {}).float().square().mean().backward()
    params = [p for group in groups for p in group["params"]]
    assert len(params) == 2 * 7 * 2 and all(p.grad is not None for p in params)
    # B starts at zero (kohya's and peft's init), so the first gradient reaches every B.
    ups = [p for name, p in model.denoiser.named_parameters() if "lora_B" in name]
    assert len(ups) == 2 * 7 and all(p.grad.abs().sum() > 0 for p in ups)
