"""SD3 / SD3.5: prompt encoding against diffusers' own SD3 encoder, kohya's SD3 objective, lora_sd3's key layout,
diffusers' StableDiffusion3Pipeline reading the file, and sampling."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from library.config import UserError
from library.families.sd3 import lora as sd3_lora
from library.families.sd3.family import SD3
from tests.helpers.family_checks import (
    assert_comfyui_key_rule_patches_our_change,
    assert_same_image,
    pipeline_scheduler,
    sample,
    sampling_models,
)
from tests.helpers.lora_files import attached, deltas, file_delta
from tests.helpers.runs import family_settings

RANK, ALPHA = 4, 2.0


@pytest.fixture(scope="module")
def components(tiny_sd3_dir):
    from library.families.loading import load_components

    return load_components(tiny_sd3_dir)


def settings(**given):
    """What SD3 reads from a config of the schema's defaults and `given`."""
    return family_settings(SD3, **given)


def encode(family, components, captions):
    tokenize = family.tokenizer(components, None)
    tokens = [tokenize(c) for c in captions]
    batch = {k: torch.stack([t[k] for t in tokens]) for k in tokens[0]}
    with torch.no_grad():
        return family.encode_text(components.text_encoders, batch, None)


def test_prompts_are_encoded_as_diffusers_sd3_pipeline_encodes_them(components):
    """CLIP-L and CLIP-G penultimate states side by side, zero-padded to T5's width, then T5's states; the pooled
    outputs concatenated: what kohya's Sd3TextEncodingStrategy and diffusers' encode_prompt both compute."""
    from diffusers import StableDiffusion3Pipeline

    assert isinstance(components.family, SD3) and components.family.last_block == 1
    family = dataclasses.replace(components.family, t5_max_length=16)
    encoded = encode(family, components, ["a photo of sks dog", "a red digit seven"])
    assert encoded["encoder_hidden_states"].shape == (2, 77 + 16, 32) and encoded["pooled"].shape == (2, 32)
    pipe = StableDiffusion3Pipeline(transformer=components.denoiser, vae=components.vae,
                                    text_encoder=components.text_encoders[0], tokenizer=components.tokenizers[0],
                                    text_encoder_2=components.text_encoders[1], tokenizer_2=components.tokenizers[1],
                                    text_encoder_3=components.text_encoders[2], tokenizer_3=components.tokenizers[2],
                                    scheduler=components.noise_scheduler)
    with torch.no_grad():
        states, _, pooled, _ = pipe.encode_prompt(["a photo of sks dog", "a red digit seven"], None, None,
                                                  do_classifier_free_guidance=False, max_sequence_length=16)
    torch.testing.assert_close(encoded["encoder_hidden_states"], states)
    torch.testing.assert_close(encoded["pooled"], pooled)
    masked = encode(dataclasses.replace(family, apply_t5_attn_mask=True), components, ["a photo of sks dog"])
    assert not torch.allclose(masked["encoder_hidden_states"][0, 77:], encoded["encoder_hidden_states"][0, 77:])


def test_the_objective_is_kohyas_sd3_formula(components):
    """sd3_train_utils.get_noisy_model_input_and_timesteps: u from the density (logit_normal here), shifted by
    training_shift, t = long(u * (t_max - t_min) + t_min), sigma = t / 1000, noisy = sigma noise + (1 - sigma) x0;
    get_noise_pred_and_target: output * -sigma + noisy against x0, weighted (cosmap here is a loss weighting too)."""
    given = settings(weighting_scheme="logit_normal", logit_mean=0.2, logit_std=1.1, training_shift=3.0,
                     min_timestep=100, max_timestep=900)
    objective = components.family.objective(components, given, torch.device("cpu"))
    timesteps = objective.sample_timesteps(64, torch.Generator().manual_seed(4), "cpu")
    u = torch.sigmoid(torch.randn(64, generator=torch.Generator().manual_seed(4)) * 1.1 + 0.2)
    u = u * 3 / (1 + 2 * u)
    assert torch.equal(timesteps, (u * 800 + 100).long().float())
    x0, noise, output = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    t = timesteps[:3]
    s = (t / 1000)[:, None, None, None]
    noisy = s * noise + (1 - s) * x0
    torch.testing.assert_close(objective.noisy_latents(x0, noise, t), noisy)
    torch.testing.assert_close(objective.per_sample_loss(output, x0, noise, t),
                               ((output * -s + noisy - x0) ** 2).mean(dim=(1, 2, 3)))
    cosmap = components.family.objective(components, settings(weighting_scheme="cosmap"), torch.device("cpu"))
    sig = t / 1000
    torch.testing.assert_close(cosmap.per_sample_loss(output, x0, noise, t),
                               ((output * -s + noisy - x0) ** 2).mean(dim=(1, 2, 3))
                               * 2 / (math.pi * (1 - 2 * sig + 2 * sig ** 2)))


def test_configured_takes_kohyas_settings_and_refuses_what_is_not_here(components):
    family = components.family.configured(settings(t5xxl_max_token_length=32, apply_lg_attn_mask=True,
                                                   apply_t5_attn_mask=True))
    assert (family.t5_max_length, family.apply_lg_attn_mask, family.apply_t5_attn_mask) == (32, True, True)
    with pytest.raises(UserError) as refused:
        components.family.configured(settings(t5_dropout_rate=1.5, resolution=(72, 64)))
    assert "t5_dropout_rate 1.5" in str(refused.value) and "multiples of 16" in str(refused.value)


def test_per_encoder_dropout_zeroes_each_encoders_part_as_kohya_does(components):
    """kohya's drop_cached_text_encoder_outputs: a dropped CLIP-L zeroes its columns of the 77 CLIP tokens and of
    the pooled output, CLIP-G likewise, T5 its tokens; the draws come from the step's generator."""
    family = components.family.configured(settings(clip_l_dropout_rate=0.5, clip_g_dropout_rate=0.3,
                                                   t5_dropout_rate=0.2, t5xxl_max_token_length=16))
    assert components.family.configured(settings()).step_conditioning(4, torch.Generator()) == {}
    drop = family.step_conditioning(64, torch.Generator().manual_seed(2))["text_drop"]
    expected = torch.rand(64, 3, generator=torch.Generator().manual_seed(2)) < torch.tensor([0.5, 0.3, 0.2])
    assert torch.equal(drop, expected)
    encoded = encode(family, components, ["a photo of sks dog", "a red digit seven"])
    which = torch.tensor([[True, False, True], [False, True, False]])
    states, pooled = family.dropped(encoded, which, family.clip_widths)
    want_states, want_pooled = encoded["encoder_hidden_states"].clone(), encoded["pooled"].clone()
    want_states[0, :77, :16], want_pooled[0, :16], want_states[0, 77:] = 0, 0, 0  # CLIP-L and T5
    want_states[1, :77, 16:32], want_pooled[1, 16:] = 0, 0  # CLIP-G
    assert torch.equal(states, want_states) and torch.equal(pooled, want_pooled)
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = family.denoise(components.denoiser, latents, torch.tensor([300.0, 700.0]), encoded,
                             {"text_drop": which})
        direct = family.denoise(components.denoiser, latents, torch.tensor([300.0, 700.0]),
                                {"encoder_hidden_states": want_states, "pooled": want_pooled}, {})
    torch.testing.assert_close(got, direct, rtol=0, atol=0)


def test_scaled_position_grids_centre_on_a_base_grid_and_are_chosen_by_area():
    """sd-scripts' enable_scaled_pos_embed: a grid 1.5x a resolution's patches whose centre has the coordinates of
    a base-16 grid over those patches (diffusers' get_2d_sincos_pos_embed is that grid); a latent takes the grid of
    the dataset resolution nearest its area, halfway in area between two, and one of its own beyond the largest."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    from library.families.sd3.pos_embed import PositionEmbedding, latent_sizes, scaled_sincos_grid

    dim = 64
    grid = scaled_sincos_grid(dim, 24, 16)[0].reshape(24, 24, dim)
    base = get_2d_sincos_pos_embed(dim, 16, base_size=16, interpolation_scale=1.0, output_type="pt").float()
    assert torch.equal(grid[4:20, 4:20].reshape(-1, dim), base)
    assert latent_sizes([(256, 256), (512, 512), (640, 384), (512, 512)]) == [32, 62, 64]  # round(sqrt(w h)) // 8

    stand_in = SimpleNamespace(pos_embed=torch.zeros(1, 4, dim), patch_size=2, pos_embed_max_size=2,
                               proj=SimpleNamespace(weight=torch.zeros(1)))
    embedding = PositionEmbedding(stand_in, latent_sizes([(256, 256), (512, 512)]))  # 16 and 32 patches

    def crop(side, size, top, left, height, width):
        return scaled_sincos_grid(dim, side, size)[0].reshape(side, side, dim)[top:top + height, left:left + width]

    def got(height, width):  # latent sides in latent pixels (2 per patch)
        return embedding(height, width).reshape(height // 2, width // 2, dim)

    assert torch.equal(got(32, 32), crop(24, 16, 4, 4, 16, 16))  # 256 patches <= (256 + 1024) / 2: the 16 grid
    assert torch.equal(got(52, 52), crop(48, 32, 11, 11, 26, 26))  # 676 > 640: the 32 grid
    embedding.crop = (0.0, 0.999)  # a random crop's draws: the top row, the rightmost place
    assert torch.equal(got(52, 52), crop(48, 32, 0, 22, 26, 26))
    embedding.crop = None
    assert torch.equal(got(80, 80), crop(48, 32, 4, 4, 40, 40))  # 1600 <= 2304, the largest bound: the 32 grid
    assert torch.equal(got(100, 100), crop(75, 50, 12, 12, 50, 50))  # wider than 48: a grid for 50 patches
    assert torch.equal(got(52, 48), crop(39, 26, 6, 7, 26, 24))  # 624 <= 640 but 26 rows > 24: one for 26


def test_position_embeddings_are_cropped_where_the_step_drew(components, caplog):
    """pos_emb_random_crop_rate: the step's generator decides whether and where (top, left) the transformer reads
    its position embeddings; the stored grid's centre otherwise, as before."""
    from library.families.sd3 import pos_embed as sd3_pos_embed

    family = components.family.configured(settings(pos_emb_random_crop_rate=0.5))
    draws = family.step_conditioning(2, torch.Generator().manual_seed(5))["pos_crop"]
    assert torch.equal(draws, torch.rand(3, generator=torch.Generator().manual_seed(5)))
    transformer = components.denoiser
    patch_embed = transformer.pos_embed
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    encoded = encode(family, components, ["a photo of sks dog", "a red digit seven"])
    timesteps = torch.tensor([300.0, 700.0])
    with torch.no_grad():
        centre = family.denoise(transformer, latents, timesteps, encoded, {})
        family.prepare_denoiser(transformer, [(64, 64)])
        try:
            assert "SD3.5 Medium's options" in caplog.text  # the tiny grid is 32 patches wide, not 384
            assert torch.equal(family.denoise(transformer, latents, timesteps, encoded,
                                              {"pos_crop": torch.tensor([0.9, 0.0, 0.0])}), centre)  # 0.9: no crop
            corner = family.denoise(transformer, latents, timesteps, encoded,
                                    {"pos_crop": torch.tensor([0.1, 0.0, 0.0])})
            assert not torch.allclose(corner, centre)
            assert sd3_pos_embed.installed(transformer).crop is None  # only for that forward
            stored = patch_embed.pos_embed.reshape(32, 32, -1)
            patches = patch_embed.proj(latents).flatten(2).transpose(1, 2)
            sd3_pos_embed.installed(transformer).crop = (0.0, 0.0)
            torch.testing.assert_close(patch_embed(latents), patches + stored[:4, :4].reshape(1, 16, -1),
                                       rtol=0, atol=0)
        finally:
            del patch_embed.cropped_pos_embed  # the class's centre crop again, for the other tests
    with pytest.raises(UserError, match="pos_emb_random_crop_rate 2"):
        components.family.configured(settings(pos_emb_random_crop_rate=2.0))


def trained(transformer, seed=0):
    from library.config.network_args import parse_network_args

    net, _ = parse_network_args([])
    modules, overrides = SD3(last_block=len(transformer.transformer_blocks) - 1).denoiser_lora_targets(
        transformer, RANK, ALPHA, net)
    return attached(transformer, modules, overrides, seed, RANK, ALPHA)


def test_keys_follow_kohyas_lora_sd3_layout(tiny_sd3_dir):
    """lora_sd3 names every Linear of each SingleDiTBlock (x_block, context_block) after Stability's MMDiT:
    attn.qkv (fused), attn.proj, mlp.fc1/fc2, adaLN_modulation.1, and SD3.5-M's attn2; the last block's context
    block is pre-only (qkv and modulation)."""
    from diffusers import SD3Transformer2DModel

    from library.network import kohya_format

    model = trained(SD3Transformer2DModel.from_pretrained(tiny_sd3_dir, subfolder="transformer",
                                                          local_files_only=True))
    state = SD3(last_block=1).export_lora_keys(kohya_format.kohya_state_dict({"lora_unet": model}, ALPHA))
    block = [f"{side}_block_{n}" for side in ("x", "context")
             for n in ("attn_qkv", "attn_proj", "mlp_fc1", "mlp_fc2", "adaLN_modulation_1")]
    expected = {f"lora_unet_joint_blocks_0_{n}" for n in block + ["x_block_attn2_qkv", "x_block_attn2_proj"]}
    expected |= {f"lora_unet_joint_blocks_1_{n}" for n in block if not n.startswith("context_block_attn_proj")
                 and not n.startswith("context_block_mlp")}
    assert {key.split(".")[0] for key in state} == expected
    split = deltas(model)
    name = "lora_unet_joint_blocks_0_x_block_attn_qkv"
    assert state[f"{name}.alpha"].item() == 3 * ALPHA
    torch.testing.assert_close(file_delta(state, name), torch.cat(
        [split[f"transformer_blocks.0.attn.to_{p}"] for p in "qkv"]), rtol=1e-6, atol=1e-7)
    # The pre-only context modulation: Stability's (shift, scale), diffusers' (scale, shift).
    ours = split["transformer_blocks.1.norm1_context.linear"]
    torch.testing.assert_close(file_delta(state, "lora_unet_joint_blocks_1_context_block_adaLN_modulation_1"),
                               torch.cat(ours.chunk(2)[::-1]))
    back = SD3(last_block=1).import_lora_keys(state)
    ours_state = kohya_format.kohya_state_dict({"lora_unet": model}, ALPHA)
    assert set(back) == set(ours_state) and all(torch.equal(back[k], ours_state[k]) for k in ours_state)


def test_diffusers_load_lora_weights_takes_every_key_with_our_output(tiny_sd3_dir, tmp_path):
    """diffusers' SD3 loader reads no kohya SD3 keys; sd3_lora.to_peft hands it every key of the file, and the
    transformer's output equals ours to rtol 1e-4 / atol 1e-5 (alpha / rank folded into B)."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    from library.network import kohya_format

    model = trained(SD3Transformer2DModel.from_pretrained(tiny_sd3_dir, subfolder="transformer",
                                                          local_files_only=True))
    path = tmp_path / "sd3_lora.safetensors"
    kohya_format.save_lora_file(path, SD3(last_block=1).export_lora_keys(
        kohya_format.kohya_state_dict({"lora_unet": model}, ALPHA)), {})
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir, local_files_only=True)
    converted = sd3_lora.to_peft(kohya_format.load_kohya_lora(path)[0], pipe.transformer)
    assert len(converted) == 2 * len(deltas(model))
    pipe.load_lora_weights(converted)
    g = torch.Generator().manual_seed(5)
    inputs = dict(hidden_states=torch.randn(1, 16, 8, 8, generator=g),
                  encoder_hidden_states=torch.randn(1, 12, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([400.0]),
                  return_dict=False)
    with torch.no_grad():
        expected, got = model(**inputs)[0], pipe.transformer(**inputs)[0]
        base = SD3Transformer2DModel.from_pretrained(tiny_sd3_dir, subfolder="transformer",
                                                     local_files_only=True)(**inputs)[0]
    assert not torch.allclose(expected, base, atol=1e-3)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_sampling_is_sd3_pipelines_cfg(components, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    models = sampling_models(components, dataclasses.replace(components.family, t5_max_length=16))
    [prompt], [ours] = sample(models, tmp_path, "a photo of sks dog --n a red digit --s 2 --w 64 --h 64 --d 3\n")
    with torch.no_grad():
        pipe = StableDiffusion3Pipeline(
            scheduler=pipeline_scheduler(components), vae=components.vae, text_encoder=components.text_encoders[0],
            tokenizer=components.tokenizers[0], text_encoder_2=components.text_encoders[1],
            tokenizer_2=components.tokenizers[1], text_encoder_3=components.text_encoders[2],
            tokenizer_3=components.tokenizers[2], transformer=components.denoiser)
        pos, neg = models.encode_text(prompt.prompt), models.encode_text(prompt.negative_prompt)
        theirs = pipe(prompt_embeds=pos["encoder_hidden_states"], pooled_prompt_embeds=pos["pooled"],
                      negative_prompt_embeds=neg["encoder_hidden_states"], negative_pooled_prompt_embeds=neg["pooled"],
                      guidance_scale=7.5, width=64, height=64, num_inference_steps=2,
                      generator=torch.Generator().manual_seed(3)).images[0]
    assert_same_image(ours, theirs)


def test_single_files_with_and_without_text_encoders_load_the_folders_weights(components, tiny_sd3_dir, tmp_path):
    """Stability's layout, read by diffusers' own SD3 converter: the written file converts back exactly."""
    from library.families.loading import load_components
    from library.families.sd3.tiny import save_tiny_sd3_files

    files = save_tiny_sd3_files(tiny_sd3_dir, tmp_path)
    whole = load_components(files["checkpoint"], model_config=tiny_sd3_dir)
    split = load_components(files["checkpoint_no_te"], clip_l=str(files["clip_l"]), clip_g=str(files["clip_g"]),
                            t5xxl=str(files["t5xxl"]), model_config=tiny_sd3_dir)
    reference = [components.denoiser, components.vae, *components.text_encoders]
    for loaded in (whole, split):
        assert isinstance(loaded.family, SD3) and loaded.family.last_block == 1
        for module, theirs in zip([loaded.denoiser, loaded.vae, *loaded.text_encoders], reference, strict=True):
            expected = theirs.state_dict()
            assert all(torch.equal(t, expected[k]) for k, t in module.state_dict().items())
    with pytest.raises(UserError, match="give clip_g"):
        load_components(files["checkpoint_no_te"], clip_l=str(files["clip_l"]), t5xxl=str(files["t5xxl"]),
                        model_config=tiny_sd3_dir)


def test_comfyuis_key_rule_takes_every_key_with_our_weight_change(tiny_sd3_dir):
    """ComfyUI (comfy/lora.py model_lora_keys_unet) names every weight `diffusion_model.<path>.weight` of its native
    (Stability-layout) MMDiT `lora_unet_<path, . -> _>` and adds up @ down * alpha / rank to it: every key of our
    file must name such a weight, and the patched weights must equal our trained model's in Stability's layout
    (the pre-only context modulation's halves included)."""
    from diffusers import SD3Transformer2DModel

    from library.families.sd3.files import sai_state_dict
    from library.network import kohya_format

    load = dict(subfolder="transformer", local_files_only=True)
    model = trained(SD3Transformer2DModel.from_pretrained(tiny_sd3_dir, **load))
    state = SD3(last_block=1).export_lora_keys(kohya_format.kohya_state_dict({"lora_unet": model}, ALPHA))
    base = SD3Transformer2DModel.from_pretrained(tiny_sd3_dir, **load)
    assert_comfyui_key_rule_patches_our_change(state, model, base, sai_state_dict)
