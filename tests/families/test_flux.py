"""The FLUX.1 family: packing, image ids, loading and telling dev from schnell, prompt encoding, the denoiser call."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from library.config import UserError
from library.families.flux.family import Flux, image_ids, is_schnell, pack_latents, unpack_latents
from library.families.settings import settings_from
from tests.helpers.runs import family_settings


def test_packing_puts_each_2x2_patch_in_one_token_channel_major():
    latents = torch.randn(2, 3, 4, 6)
    packed = pack_latents(latents)
    assert packed.shape == (2, 2 * 3, 3 * 4)
    for i in range(2):
        for j in range(3):
            token = packed[:, i * 3 + j]
            for c in range(3):
                for ph in range(2):
                    for pw in range(2):
                        assert torch.equal(token[:, c * 4 + ph * 2 + pw], latents[:, c, 2 * i + ph, 2 * j + pw])


def test_unpacking_inverts_packing():
    latents = torch.randn(2, 16, 8, 12)
    assert torch.equal(unpack_latents(pack_latents(latents), 8, 12), latents)


def test_image_ids_hold_row_and_column_of_each_token():
    ids = image_ids(4, 6)
    assert ids.shape == (6, 3)
    assert ids[:, 0].eq(0).all()
    assert ids[:, 1].tolist() == [0, 0, 0, 1, 1, 1] and ids[:, 2].tolist() == [0, 1, 2, 0, 1, 2]


@pytest.fixture(scope="module")
def components(tiny_flux_dir):
    from library.families.loading import load_components

    return load_components(tiny_flux_dir)


def test_a_flux_folder_loads_as_dev_with_the_vae_shift(components):
    assert isinstance(components.family, Flux) and not components.family.schnell
    assert components.family.name == "flux1-dev" and components.family.base_model_version == "flux1"
    assert components.vae.config.shift_factor == pytest.approx(0.1159)
    assert components.vae.config.latent_channels == 16


def test_schnell_is_told_by_the_missing_guidance_embedding():
    from library.families.flux.tiny import build_tiny_flux

    assert is_schnell(build_tiny_flux(guidance=False)["transformer"])
    assert not is_schnell(build_tiny_flux(guidance=True)["transformer"])
    assert Flux(schnell=True).t5_length == 256 and Flux(schnell=False).t5_length == 512


def settings(**changes):
    """What FLUX.1 reads from a config of the schema's defaults and `changes`."""
    return family_settings(Flux, **changes)


def test_configured_takes_the_t5_settings_and_refuses_what_does_not_apply(components, caplog):
    family = components.family.configured(settings(t5xxl_max_token_length=16, apply_t5_attn_mask=True,
                                                   guidance_scale=1.0))
    assert (family.t5_length, family.apply_t5_attn_mask, family.guidance_scale) == (16, True, 1.0)
    # kohya's FLUX trainer accepts clip_skip (its GUI writes 1) and uses only CLIP-L's pooled output: a note
    with caplog.at_level("WARNING"):
        assert components.family.configured(settings(clip_skip=1)) == components.family.configured(settings())
    assert "clip_skip has no effect for FLUX" in caplog.text
    with pytest.raises(UserError, match="multiples of 16"):
        components.family.configured(settings(resolution=(520, 512)))


def encode(family, components, captions):
    tokenize = family.tokenizer(components, None)
    tokens = [tokenize(c) for c in captions]
    batch = {k: torch.stack([t[k] for t in tokens]) for k in tokens[0]}
    with torch.no_grad():
        return batch, family.encode_text(components.text_encoders, batch, None)


def test_prompts_give_clip_pooled_and_t5_states(components):
    family = dataclasses.replace(components.family, t5_max_length=16)
    batch, encoded = encode(family, components, ["a photo of sks dog", "a red digit seven"])
    assert batch["input_ids"].shape == (2, 77) and batch["t5_input_ids"].shape == (2, 16)
    assert encoded["encoder_hidden_states"].shape == (2, 16, 32) and encoded["pooled"].shape == (2, 32)
    with torch.no_grad():
        pooled = components.text_encoders[0](batch["input_ids"]).pooler_output
    torch.testing.assert_close(encoded["pooled"], pooled)


def denoise(family, components, encoded, timesteps=(300.0, 700.0)):
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return family.denoise(components.denoiser, latents, torch.tensor(timesteps), encoded, {})


def test_the_t5_mask_hides_padding_from_the_transformer(components):
    family = dataclasses.replace(components.family, t5_max_length=16, apply_t5_attn_mask=True)
    _, encoded = encode(family, components, ["a photo of sks dog", "a red digit seven"])
    changed = dict(encoded)
    padding = ~encoded["t5_attn_mask"].bool()
    assert padding.any()
    changed["encoder_hidden_states"] = encoded["encoder_hidden_states"].masked_fill(padding[..., None], 5.0)
    torch.testing.assert_close(denoise(family, components, changed), denoise(family, components, encoded))
    unmasked = dataclasses.replace(family, apply_t5_attn_mask=False)
    assert not torch.allclose(denoise(unmasked, components, changed), denoise(unmasked, components, encoded))


def test_guidance_and_timestep_reach_the_transformer(components):
    family = dataclasses.replace(components.family, t5_max_length=16)
    _, encoded = encode(family, components, ["a photo of sks dog", "a red digit seven"])
    base = denoise(family, components, encoded)
    assert base.shape == (2, 16, 8, 8)
    assert not torch.allclose(denoise(dataclasses.replace(family, guidance_scale=1.0), components, encoded), base)
    assert not torch.allclose(denoise(family, components, encoded, (301.0, 700.0))[0], base[0])


def sampling_models(components):
    """The tiny FLUX's sampling modules with a 16-token T5, prompts encoded as training encodes them."""
    from library.monitoring.sampling import SamplingModels

    family = dataclasses.replace(components.family, t5_max_length=16)
    tokenize = family.tokenizer(components, None)

    def encode_text(text):
        tokens = {k: v[None] for k, v in tokenize(text).items()}
        return family.encode_text(components.text_encoders, tokens, None)

    return family, encode_text, SamplingModels(components.denoiser, components.text_encoders, components.vae,
                                               components.tokenizers, components.noise_scheduler.config, family,
                                               None, encode_text)


def test_sampling_uses_flow_match_euler_and_the_g_guidance(components, tmp_path):
    """Our round's image equals FluxPipeline's own decode of the same prompt embeddings, seed and --g."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from library.monitoring.sample_prompts import SamplePrompt, load_prompts
    from library.monitoring.sampling import generate_image

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of sks dog --g 2.0 --s 3 --w 64 --h 64 --d 5\n")
    prompt = load_prompts(prompts)[0]
    assert prompt.guidance == 2.0 and prompt.steps == 3
    family, encode_text, models = sampling_models(components)
    with torch.no_grad():
        ours = np.asarray(generate_image(prompt, models, seed=5))
        other_g = np.asarray(generate_image(dataclasses.replace(prompt, guidance=6.0), models, seed=5))
        pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(components.noise_scheduler.config),
                            vae=components.vae, text_encoder=components.text_encoders[0],
                            tokenizer=components.tokenizers[0], text_encoder_2=components.text_encoders[1],
                            tokenizer_2=components.tokenizers[1], transformer=components.denoiser)
        encoded = encode_text(prompt.prompt)
        theirs = np.asarray(pipe(prompt_embeds=encoded["encoder_hidden_states"], pooled_prompt_embeds=encoded["pooled"],
                                 width=64, height=64, num_inference_steps=3, guidance_scale=2.0,
                                 generator=torch.Generator().manual_seed(5)).images[0])
    assert ours.shape == (64, 64, 3)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1  # uint8 rounding of the same decode
    assert not np.array_equal(ours, other_g)
    assert isinstance(family.sampling_scheduler(components.noise_scheduler.config), FlowMatchEulerDiscreteScheduler)
    assert SamplePrompt("x").guidance is None


def test_t5_stays_in_eval_mode_while_clip_l_trains(tiny_flux_dir):
    # T5 has dropout (0.1 in FLUX.1's T5-XXL); training CLIP-L's LoRA must not switch it on.
    from library.config import parse_config
    from library.families.loading import load_components
    from library.training.model import build_model

    config, _ = parse_config(["--pretrained_model_name_or_path", str(tiny_flux_dir), "--train_data_dir", ".",
                              "--output_dir", "."])
    components = load_components(tiny_flux_dir)
    components.family = components.family.configured(settings_from(components.family.settings_type, config))
    model, _ = build_model(config, components, torch.device("cpu"))
    clip, t5 = model.text_encoders
    assert clip.training and not t5.training and model.denoiser.training
    assert t5.config.dropout_rate > 0


def test_true_cfg_runs_the_negative_prompt_beside_the_positive_as_kohya_does(components, tmp_path):
    """--l above 1 with --n: neg + (pos - neg) * scale at every step, the pipeline's true CFG; without --l FLUX
    samples with one pass (kohya's default scale 1.0), so --n alone changes nothing."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from library.monitoring.sample_prompts import load_prompts
    from library.monitoring.sampling import generate_image

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of sks dog --s 2 --w 64 --h 64 --d 3\n"
                       "a photo of sks dog --n a red digit --s 2 --w 64 --h 64 --d 3\n"
                       "a photo of sks dog --n a red digit --l 4 --s 2 --w 64 --h 64 --d 3\n")
    plain, negative_only, cfg = load_prompts(prompts)
    family, encode_text, models = sampling_models(components)
    with torch.no_grad():
        images = [np.asarray(generate_image(p, models, seed=3)) for p in (plain, negative_only, cfg)]
        pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(components.noise_scheduler.config),
                            vae=components.vae, text_encoder=components.text_encoders[0],
                            tokenizer=components.tokenizers[0], text_encoder_2=components.text_encoders[1],
                            tokenizer_2=components.tokenizers[1], transformer=components.denoiser)
        pos, neg = encode_text(cfg.prompt), encode_text(cfg.negative_prompt)
        theirs = np.asarray(pipe(prompt_embeds=pos["encoder_hidden_states"], pooled_prompt_embeds=pos["pooled"],
                                 negative_prompt_embeds=neg["encoder_hidden_states"],
                                 negative_pooled_prompt_embeds=neg["pooled"], true_cfg_scale=4.0, width=64, height=64,
                                 num_inference_steps=2, guidance_scale=3.5,
                                 generator=torch.Generator().manual_seed(3)).images[0])
    assert np.array_equal(images[0], images[1])
    assert not np.array_equal(images[0], images[2])
    assert np.abs(images[2].astype(int) - theirs.astype(int)).max() <= 1
