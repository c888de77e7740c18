"""Qwen-Image: the prompt embedding, VAE normalisation, denoiser call and objective against musubi-tuner's formulas
(qwen_image_train_network.py, qwen_image/qwen_image_utils.py), the LoRA key layout from musubi's rules, diffusers'
and ComfyUI's key rules reading our file, and sampling with QwenImagePipeline."""
from __future__ import annotations

import math

import pytest
import torch

from library.config import UserError, parse_config
from library.families.qwen_image import lora as qwen_image_lora
from library.families.settings import settings_from
from library.families.shared import musubi_flow
from tests.helpers import musubi_lora
from tests.helpers.family_checks import assert_same_image, pipeline_scheduler, sample, sampling_models
from tests.helpers.lora_files import file_delta

TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")  # musubi's get_qwen_prompt_embeds, prompt_template_encode_start_idx 34


def config(*args: str):
    return parse_config(["--pretrained_model_name_or_path", ".", "--train_data_dir", ".", "--output_dir", ".",
                         *args])[0]


def settings(*args: str) -> musubi_flow.MusubiSettings:
    """What Qwen-Image reads from the config of these arguments."""
    return settings_from(musubi_flow.MusubiSettings, config(*args))


@pytest.fixture(scope="module")
def components(tiny_qwen_image_dir):
    from library.families.loading import load_components

    return load_components(tiny_qwen_image_dir)


def encode(components, captions):
    return musubi_lora.encode_captions(components, captions)[1]


# --- musubi's formulas, written from its code --------------------------------------------------------------------

def musubi_prompt_embeds(tokenizer, vlm, prompts):
    """get_qwen_prompt_embeds: the template, max_length 1024 + 34, padded to the longest; last hidden states, the
    masked rows split per prompt, the first 34 dropped."""
    tokens = tokenizer([TEMPLATE.format(p) for p in prompts], max_length=1024 + 34, padding=True, truncation=True,
                       return_tensors="pt")
    hidden = vlm(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                 output_hidden_states=True).hidden_states[-1]
    mask = tokens.attention_mask.bool()
    split = torch.split(hidden[mask], mask.sum(dim=1).tolist())
    return [e[34:] for e in split]


def musubi_pack(latents):  # pack_latents for (B, C, 1, H, W)
    b, c, _, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def musubi_unpack(latents, height, width):  # unpack_latents: pixel height / width -> (B, C, 1, H, W)
    b, n, c = latents.shape
    height, width = 2 * (height // 16), 2 * (width // 16)
    x = latents.view(b, 1, height // 2, width // 2, c // 4, 2, 2).permute(0, 1, 4, 2, 5, 3, 6)
    return x.reshape(b, 1, c // 4, height, width).permute(0, 2, 1, 3, 4)


def test_prompts_are_musubis_template_with_the_34_template_tokens_dropped(components):
    from library.families.qwen_image.family import QwenImage

    family = components.family
    assert isinstance(family, QwenImage) and family.base_model_version == "qwen_image"
    tokenizer = components.tokenizers[0]
    # The tiny tokenizer keeps the template's words whole, so its system turn is 34 tokens as in Qwen's vocabulary.
    assert len(tokenizer(TEMPLATE.split("{}")[0]).input_ids) == 34
    captions = ["a photo of sks dog", "red"]
    encoded = encode(components, captions)
    with torch.no_grad():
        theirs = musubi_prompt_embeds(tokenizer, components.text_encoders[0], captions)
    mask = encoded["attention_mask"]
    assert mask.sum(dim=1).tolist() == [len(e) for e in theirs]
    for states, keep, reference in zip(encoded["encoder_hidden_states"], mask, theirs, strict=True):
        torch.testing.assert_close(states[keep], reference, rtol=1e-5, atol=1e-5)


def test_vae_is_musubis_normalised_mode_of_one_frame(components):
    vae = components.vae
    inner = vae.vae
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        posterior = vae.encode(pixels).latent_dist
        # encode_pixels_to_latents: mode of the posterior, (z - latents_mean) / latents_std per channel
        mode = inner.encode(pixels.unsqueeze(2)).latent_dist.mode()
        mean = torch.tensor(inner.config.latents_mean).view(1, 16, 1, 1, 1)
        std = torch.tensor(inner.config.latents_std).view(1, 16, 1, 1, 1)
        expected = ((mode - mean) / std).squeeze(2)
        decoded = vae.decode(expected)[0]
        reference = inner.decode(expected.unsqueeze(2) * std + mean).sample[:, :, 0]
    torch.testing.assert_close(posterior.mean, expected)
    # a "sample" of the cached posterior is the mode, in every dtype the caches use
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.exp(0.5 * posterior.logvar.to(dtype)).abs().max() == 0
    assert vae.config.scaling_factor == 1.0 and vae.config.get("shift_factor") is None
    torch.testing.assert_close(decoded, reference)


def test_denoise_is_musubis_call_dit(components):
    """call_dit: packed latents, img_shapes [(1, H/2, W/2)], timestep t / 1000, captions padded to the batch's
    longest with the mask; the unpacked output is the prediction of noise - x0."""
    encoded = encode(components, ["a photo of sks dog", "red"])
    noisy = torch.randn(2, 16, 8, 6, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([300.0, 800.0])
    with torch.no_grad():
        ours = components.family.denoise(components.denoiser, noisy, timesteps, encoded, {})
        lengths = encoded["attention_mask"].sum(dim=1)
        longest = int(lengths.max())
        mask = torch.arange(longest)[None] < lengths[:, None]
        theirs = components.denoiser(hidden_states=musubi_pack(noisy.unsqueeze(2)), timestep=timesteps / 1000.0,
                                     encoder_hidden_states=encoded["encoder_hidden_states"][:, :longest],
                                     encoder_hidden_states_mask=mask, img_shapes=[[(1, 4, 3)]] * 2,
                                     return_dict=False)[0]
    torch.testing.assert_close(ours, musubi_unpack(theirs, 64, 48).squeeze(2))


def test_loss_and_qwen_shift_are_musubis():
    """The raw prediction against noise - latents; qwen_shift from the latent's size in 2x2 patches."""
    g = torch.Generator().manual_seed(0)
    latents, noise, prediction = (torch.randn(3, 16, 4, 4, generator=g) for _ in range(3))
    objective = musubi_flow.MusubiFlowObjective.from_settings(settings("--timestep_sampling", "qwen_shift"))
    loss = objective.per_sample_loss(prediction, latents, noise, torch.tensor([100.0, 500.0, 900.0]))
    torch.testing.assert_close(loss, ((prediction - (noise - latents)) ** 2).mean(dim=(1, 2, 3)))
    t = objective.sample_timesteps(64, torch.Generator().manual_seed(3), "cpu", (128, 96)) / 1000
    m = (0.9 - 0.5) / (8192 - 256)
    shift = math.exp(m * (64 * 48) + 0.5 - m * 256)
    u = torch.randn(64, generator=torch.Generator().manual_seed(3)).sigmoid()
    torch.testing.assert_close(t, u * shift / (1 + (shift - 1) * u))


def test_configured_refuses_what_does_not_apply(components, tiny_qwen_image_dir):
    family = components.family
    assert family.configured(settings("--resolution", "64")) is family
    with pytest.raises(UserError) as error:
        family.configured(settings("--clip_skip", "2", "--guidance_scale", "1.0", "--resolution", "72",
                                   "--vae", str(tiny_qwen_image_dir / "vae")))
    text = str(error.value)
    assert "clip_skip" in text and "guidance_scale" in text and "multiples of 16" in text and "vae:" in text
    with pytest.raises(UserError, match="noise_offset"):
        family.objective(None, settings("--noise_offset", "0.1"), torch.device("cpu"))


# --- LoRA keys --------------------------------------------------------------------------------------------------

def musubi_lora_names(transformer) -> set[str]:
    """musubi's networks.lora create_modules with lora_qwen_image's target class and default exclude pattern."""
    return musubi_lora.musubi_lora_names(transformer, "QwenImageTransformerBlock", r".*(_mod_).*")


def random_lora(transformer, rank=4, alpha=2.0, seed=0):
    from library.config.network_args import NetworkArgs

    return musubi_lora.random_lora(transformer, qwen_image_lora.targets(transformer, NetworkArgs()), rank, alpha, seed)


# The last block's layers that only feed the text stream the transformer discards.
LAST_BLOCK_TEXT_ONLY = {f"lora_unet_transformer_blocks_1_{name}" for name in (
    "attn_add_q_proj", "attn_to_add_out", "txt_mlp_net_0_proj", "txt_mlp_net_2")}


def test_targets_are_musubis_but_the_layers_without_gradient(components):
    """musubi's targets (the modulation layers included, 14 per block), less the last block's four text-only layers,
    which are exactly those that get no gradient."""
    transformer = components.denoiser
    musubi = musubi_lora_names(transformer)
    assert len(musubi) == 14 * len(transformer.transformer_blocks) and LAST_BLOCK_TEXT_ONLY <= musubi
    assert {k.split(".")[0] for k in random_lora(transformer)} == musubi - LAST_BLOCK_TEXT_ONLY
    encoded = encode(components, ["a photo of sks dog"])
    transformer.zero_grad()
    prediction = components.family.denoise(transformer, torch.randn(1, 16, 4, 4), torch.tensor([500.0]), encoded, {})
    prediction.sum().backward()
    for name in musubi:
        grad = transformer.get_submodule(qwen_image_lora.module_path(name)).weight.grad
        assert (grad is not None and bool(grad.abs().sum() > 0)) == (name not in LAST_BLOCK_TEXT_ONLY), name
    transformer.zero_grad(set_to_none=True)


def test_file_keys_are_musubis(components):
    ours = random_lora(components.denoiser)
    names = {k.split(".")[0] for k in ours}
    written = qwen_image_lora.to_file(ours)
    assert written.keys() == ours.keys()  # musubi's own layout
    assert all(torch.equal(qwen_image_lora.from_file(written)[k], ours[k]) for k in ours)
    # musubi's file holds the last block's text-only modules too; they are dropped on reading
    musubi_file = {**ours, **{f"{n}.{role}": torch.zeros(1) for n in LAST_BLOCK_TEXT_ONLY
                              for role in ("lora_down.weight", "lora_up.weight", "alpha")}}
    assert components.family.import_lora_keys(musubi_file).keys() == ours.keys()
    peft = {f"transformer.{qwen_image_lora.module_path(k.split('.')[0])}.lora_"
            f"{'A' if 'down' in k else 'B'}.weight": v for k, v in ours.items() if not k.endswith("alpha")}
    read = qwen_image_lora.from_file(peft)
    assert read.keys() == ours.keys() and all(float(read[f"{n}.alpha"]) == 4.0 for n in names)


def test_diffusers_load_lora_weights_consumes_every_key_with_the_same_change(tiny_qwen_image_dir, components):
    """QwenImagePipeline.load_lora_weights on our file: every module of the file becomes a LoRA layer whose weight
    change equals ours (alpha / rank applied), to 1e-6."""
    from diffusers import QwenImagePipeline

    from library.families.loading import load_components

    fresh = load_components(tiny_qwen_image_dir)
    ours = random_lora(components.denoiser)
    pipe = QwenImagePipeline(scheduler=fresh.noise_scheduler, vae=fresh.vae.vae, text_encoder=fresh.text_encoders[0],
                             tokenizer=fresh.tokenizers[0], transformer=fresh.denoiser)
    pipe.load_lora_weights(qwen_image_lora.to_file(ours), adapter_name="ours")
    musubi_lora.assert_diffusers_layers_change_as_ours(pipe.transformer, ours)


def test_comfyui_key_rule_applies_every_key_to_its_weight(components):
    """ComfyUI's comfy/lora.py model_lora_keys_unet: `lora_unet_<path with _>` names `diffusion_model.<path>.weight`
    of every model; its Qwen-Image model (comfy/ldm/qwen_image/model.py) has diffusers' module names. Every key
    of our file finds its weight, and alpha / rank * up @ down has the weight's shape."""
    comfy_state = {f"diffusion_model.{k}": v for k, v in components.denoiser.state_dict().items()}
    key_map = {"lora_unet_" + k[len("diffusion_model."):-len(".weight")].replace(".", "_"): k
               for k in comfy_state if k.endswith(".weight")}
    written = qwen_image_lora.to_file(random_lora(components.denoiser))
    used = set()
    for name, target in key_map.items():
        if f"{name}.lora_up.weight" in written:
            used |= {f"{name}.{role}" for role in ("lora_up.weight", "lora_down.weight", "alpha")}
            assert file_delta(written, name).shape == comfy_state[target].shape
    assert used == set(written)


# --- sampling ---------------------------------------------------------------------------------------------------

def test_sampling_is_qwen_image_pipelines_with_true_cfg(components, tmp_path):
    import numpy as np
    from diffusers import QwenImagePipeline

    _, (ours, plain) = sample(sampling_models(components), tmp_path,
                              "a photo of sks dog --n red --s 2 --w 64 --h 64 --d 3\n"
                              "a photo of sks dog --n red --l 1 --s 2 --w 64 --h 64 --d 3\n")
    with torch.no_grad():
        pipe = QwenImagePipeline(scheduler=pipeline_scheduler(components), vae=components.vae.vae,
                                 text_encoder=components.text_encoders[0], tokenizer=components.tokenizers[0],
                                 transformer=components.denoiser)
        theirs = pipe(prompt="a photo of sks dog", negative_prompt="red", true_cfg_scale=4.0, num_inference_steps=2,
                      width=64, height=64, generator=torch.Generator().manual_seed(3)).images[0]
    assert_same_image(ours, theirs)
    assert not np.array_equal(ours, plain)


# --- separate files ---------------------------------------------------------------------------------------------

def test_comfyui_split_files_load_as_the_folder(tiny_qwen_image_dir, components, tmp_path):
    """ComfyUI's layouts (transformer behind model.diffusion_model., Qwen2.5-VL with model.layers / visual names,
    the VAE in Wan 2.1's layout read by diffusers' converter) load bit-identically to the folder."""
    from library.families.qwen_image.files import SHIPPED_TOKENIZER
    from library.families.qwen_image.tiny import save_tiny_qwen_image_files
    from library.families.shared.separate_files import load_qwen_tokenizer

    loaded = musubi_lora.load_split_files(save_tiny_qwen_image_files(tiny_qwen_image_dir, tmp_path),
                                          tiny_qwen_image_dir)
    assert loaded.family == components.family
    musubi_lora.assert_same_weights(loaded, components)
    # The shipped tokenizer is Qwen's own vocabulary: the template's system turn is the 34 tokens musubi drops.
    qwen = load_qwen_tokenizer(SHIPPED_TOKENIZER)
    ids = qwen(TEMPLATE.format("a cat")).input_ids
    assert ids[:3] == [151644, 8948, 198] and ids[31:34] == [151644, 872, 198]  # <|im_start|>system\n ... user\n
    assert ids[34:] == [64, 8251, 151645, 198, 151644, 77091, 198]  # a cat<|im_end|>\n<|im_start|>assistant\n


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_a_transformer_file_stored_in_low_precision_is_read_cast(tiny_qwen_image_dir, components, tmp_path, stored):
    """bf16 / fp16 / fp8_e4m3fn stored transformer files (ComfyUI's downloads) load as the stored values, in the
    training dtype."""
    from safetensors.torch import save_file

    from library.families.loading import load_components
    from library.families.qwen_image.tiny import save_tiny_qwen_image_files

    files = save_tiny_qwen_image_files(tiny_qwen_image_dir, tmp_path)
    state = {f"model.diffusion_model.{k}": v.to(stored) for k, v in components.denoiser.state_dict().items()}
    save_file(state, str(files["transformer"]))
    loaded = load_components(files["transformer"], model_config=tiny_qwen_image_dir,
                             text_encoder=str(files["text_encoder"]), ae=str(files["ae"]))
    for key, value in loaded.denoiser.state_dict().items():
        assert value.dtype == torch.float32
        assert torch.equal(value, components.denoiser.state_dict()[key].to(stored).float()), key
    if stored == torch.float8_e4m3fn:  # ComfyUI's fp8_scaled files: weights that need their scales
        save_file({**state, "scaled_fp8": torch.zeros(0, dtype=stored)}, str(files["transformer"]))
        with pytest.raises(UserError, match="scales"):
            load_components(files["transformer"], model_config=tiny_qwen_image_dir,
                            text_encoder=str(files["text_encoder"]), ae=str(files["ae"]))


def test_fp8_base_stores_the_transformer_in_fp8_and_trains_the_lora(tiny_qwen_image_dir):
    """fp8_base on Qwen-Image: the frozen Linear weights are float8_e4m3fn, the step runs in bf16 and every LoRA
    module gets its gradient."""
    from library.families.loading import load_components
    from library.training.model import build_model

    run = config("--fp8_base", "--mixed_precision", "bf16", "--network_module", "networks.lora_qwen_image",
                 "--network_train_unet_only", "--resolution", "64")
    loaded = load_components(tiny_qwen_image_dir, weight_dtype=torch.bfloat16, vae_dtype=torch.bfloat16)
    loaded.family = loaded.family.configured(settings_from(loaded.family.settings_type, run))
    model, groups = build_model(run, loaded, torch.device("cpu"))
    assert model.denoiser.transformer_blocks[0].attn.to_q.base_layer.weight.dtype == torch.float8_e4m3fn
    encoded = encode(loaded, ["a photo of sks dog"])
    noisy = torch.randn(1, 16, 8, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(noisy, torch.tensor([500.0]), encoded, {}).float().square().mean().backward()
    ups = [p for name, p in model.denoiser.named_parameters() if "lora_B" in name]
    assert len(ups) == 2 * 14 - 4 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in ups)


def _train_lora(components, swap: int):
    """Two LoRA steps on a 4-block transformer of the tiny model's widths, `swap` blocks swapped to a stand-in
    host (tests.memory.test_offload's Recorder) or none."""
    from diffusers import QwenImageTransformer2DModel

    from library.config.network_args import NetworkArgs
    from library.memory.offload import install_offloading
    from library.network import lora
    from tests.helpers.offload import DEVICE, HOST, Recorder

    torch.manual_seed(0)
    denoiser = QwenImageTransformer2DModel.from_config({**components.denoiser.config, "num_layers": 4})
    denoiser.requires_grad_(False)
    params = lora.attach_lora(denoiser, qwen_image_lora.targets(denoiser, NetworkArgs()), 4, 4.0)
    denoiser.enable_gradient_checkpointing()
    denoiser.train()
    recorder = None
    if swap:
        plan = components.family.block_swap_plan(denoiser, swap)
        recorder = Recorder(plan[0][0])
        recorder.watch(plan[0][0])
        install_offloading(denoiser, plan, False, DEVICE, move=recorder.move, host=HOST)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    encoded = encode(components, ["a photo of sks dog"])
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        noisy = torch.randn(1, 16, 4, 4, generator=generator)
        components.family.denoise(denoiser, noisy, torch.tensor([500.0]), encoded, {}).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in params], recorder


def test_blocks_to_swap_trains_the_same_lora(components):
    """At most all blocks but two (kohya's schedule), and a LoRA trained with 2 of 4 blocks swapped equals one
    trained without: every block was on the device whenever it ran, and blocks moved in forward and backward."""
    with pytest.raises(UserError, match="at most 0 of its 2 blocks"):
        components.family.block_swap_plan(components.denoiser, 1)
    without, _ = _train_lora(components, 0)
    with_swap, recorder = _train_lora(components, 2)
    assert all(torch.equal(a, b) for a, b in zip(without, with_swap, strict=True))
    assert recorder.seen and all(resident for _, resident, _ in recorder.seen)
    assert {"host", "device"} <= {d for _, d in recorder.moves} and len(recorder.moves) > 8


def test_with_an_fp8_base_the_text_encoder_file_is_read_in_fp8(tiny_qwen_image_dir, tmp_path):
    """musubi's Qwen2.5-VL file is lowered as it is read, as kohya's T5 file is: its matrices arrive in fp8 (a 7 B
    encoder read in float32 first would take 30 GiB), the transformer's too, and the VAE's stay float32."""
    from library.families.qwen_image.tiny import save_tiny_qwen_image_files
    from library.memory.precision import BasePrecision
    from library.training.base_loading import read_base
    from tests.helpers.runs import make_config

    files = save_tiny_qwen_image_files(tiny_qwen_image_dir, tmp_path)
    config = make_config(files["transformer"], tmp_path, tmp_path / "out", model_config=tiny_qwen_image_dir,
                         text_encoder=files["text_encoder"], ae=files["ae"], fp8_base=True, mixed_precision="no",
                         network_module="networks.lora_qwen_image")
    loaded = read_base(config, BasePrecision.from_config(config, torch.float32), torch.float32, torch.float32,
                       frozenset())
    encoder_matrices = [p for name, p in loaded.text_encoders[0].named_parameters() if p.ndim == 2
                        and "layers" in name]
    assert encoder_matrices and all(p.dtype == torch.float8_e4m3fn for p in encoder_matrices)
    assert any(p.dtype == torch.float8_e4m3fn for p in loaded.denoiser.parameters())
    assert all(p.dtype == torch.float32 for p in loaded.vae.parameters())
