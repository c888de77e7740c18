"""Chroma: loading the folder and the BFL files, kohya's options, T5 masking as kohya's Chroma masks, the objective,
kohya's lora_flux keys on Chroma's blocks, diffusers' ChromaPipeline reading the file, and sampling."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from library.config import UserError
from library.families.chroma.family import Chroma, text_mask
from tests.helpers.family_checks import (
    assert_comfyui_key_rule_patches_our_change,
    assert_same_image,
    pipeline_scheduler,
    sample,
    sampling_models,
)
from tests.helpers.runs import family_settings

RANK, ALPHA = 4, 2.0


@pytest.fixture(scope="module")
def components(tiny_chroma_dir):
    from library.families.loading import load_components

    return load_components(tiny_chroma_dir)


def settings(**changes):
    return family_settings(Chroma, **{"apply_t5_attn_mask": True, "guidance_scale": 0.0, **changes})  # kohya's


def test_the_bfl_files_load_to_the_folders_weights(components, tiny_chroma_dir, tmp_path):
    from safetensors import safe_open

    from library.families.chroma.tiny import save_tiny_chroma_files
    from library.families.loading import load_components

    files = save_tiny_chroma_files(tiny_chroma_dir, tmp_path)
    with safe_open(str(files["transformer"]), "pt") as f:
        keys = {k.removeprefix("model.diffusion_model.") for k in f.keys()}
    # Chroma's original names (lodestones' flow repository, kohya's chroma_models): no modulation layers, no time /
    # vector / guidance inputs; the approximator instead.
    expected = {f"{n}.{p}" for n in ("img_in", "txt_in", "final_layer.linear", "distilled_guidance_layer.in_proj",
                                     "distilled_guidance_layer.out_proj",
                                     "distilled_guidance_layer.layers.0.in_layer",
                                     "distilled_guidance_layer.layers.0.out_layer", "single_blocks.0.linear1",
                                     "single_blocks.0.linear2")
                for p in ("weight", "bias")}
    expected |= {f"double_blocks.0.{s}_{n}.{p}" for s in ("img", "txt")
                 for n in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2") for p in ("weight", "bias")}
    expected |= {f"double_blocks.0.{s}_attn.norm.{q}_norm.scale" for s in ("img", "txt") for q in ("query", "key")}
    expected |= {f"single_blocks.0.norm.{q}_norm.scale" for q in ("query", "key")}
    expected.add("distilled_guidance_layer.norms.0.scale")
    assert keys == expected
    loaded = load_components(files["transformer"], t5xxl=str(files["t5xxl"]), ae=str(files["ae"]),
                             model_config=tiny_chroma_dir)
    assert isinstance(loaded.family, Chroma) and len(loaded.text_encoders) == 1
    for module, reference in ((loaded.denoiser, components.denoiser), (loaded.vae, components.vae),
                              (loaded.text_encoders[0], components.text_encoders[0])):
        theirs = reference.state_dict()
        assert all(torch.equal(t, theirs[k]) for k, t in module.state_dict().items())
    with pytest.raises(UserError, match="it needs ae"):
        load_components(files["transformer"], t5xxl=str(files["t5xxl"]), model_config=tiny_chroma_dir)


def test_configured_takes_kohyas_settings_and_refuses_what_does_not_apply(components, caplog):
    assert components.family.name == "chroma" and components.family.base_model_version == "chroma"
    family = components.family.configured(settings(t5xxl_max_token_length=16, network_args=["train_t5xxl=True"],
                                                   clip_l="clip_l.safetensors"))
    assert family.t5_length == 16 and family.train_t5xxl and Chroma().t5_length == 512
    assert "clip_l has no effect for Chroma" in caplog.text  # kohya accepts it for Chroma and reads nothing
    with pytest.raises(UserError) as refused:
        components.family.configured(settings(apply_t5_attn_mask=False, guidance_scale=3.5, model_type="flux",
                                              network_args=["img_mod_dim=4"], resolution=(72, 64)))
    for fragment in ("apply_t5_attn_mask", "guidance_scale 3.5", "model_type flux", "img_mod_dim",
                     "multiples of 16"):
        assert fragment in str(refused.value)


def encode(family, components, captions):
    tokenize = family.tokenizer(components, None)
    tokens = [tokenize(c) for c in captions]
    batch = {k: torch.stack([t[k] for t in tokens]) for k in tokens[0]}
    with torch.no_grad():
        return family.encode_text(components.text_encoders, batch, None)


def test_the_transformer_sees_the_prompt_and_its_first_padding_token_only(components):
    """kohya's Chroma attends to len(prompt) + 1 text tokens (attn_padding=1), as ChromaPipeline's mask does."""
    family = dataclasses.replace(components.family, t5_max_length=16)
    encoded = encode(family, components, ["a photo of sks dog", "a red digit seven"])
    lengths = encoded["t5_attn_mask"].sum(1)
    assert text_mask(encoded["t5_attn_mask"]).sum(1).tolist() == (lengths + 1).tolist()
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))

    def run(states, model=components.denoiser):
        with torch.no_grad():
            return family.denoise(model, latents, torch.tensor([300.0, 700.0]), {**encoded,
                                                                                  "encoder_hidden_states": states}, {})
    base = run(encoded["encoder_hidden_states"])
    beyond = encoded["encoder_hidden_states"].clone()
    first_pad = encoded["encoder_hidden_states"].clone()
    for i, n in enumerate(lengths.tolist()):
        beyond[i, n + 1:] = 5.0
        first_pad[i, n] = 5.0
    torch.testing.assert_close(run(beyond), base)
    assert not torch.allclose(run(first_pad), base)


def test_gradient_checkpointing_keeps_the_single_blocks_masked(components):
    """diffusers drops the single blocks' mask under checkpointing; the family binds it back."""
    from library.families.chroma.tiny import build_tiny_chroma

    family = dataclasses.replace(components.family, t5_max_length=16)
    encoded = encode(family, components, ["a photo of sks dog", "a red digit seven"])
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    model = build_tiny_chroma(seed=3)["transformer"].train()
    plain = family.denoise(model, latents, torch.tensor([200.0, 800.0]), encoded, {})
    model.enable_gradient_checkpointing()
    checkpointed = family.denoise(model, latents, torch.tensor([200.0, 800.0]), encoded, {})
    torch.testing.assert_close(checkpointed, plain, rtol=0, atol=0)
    checkpointed.sum().backward()  # and it trains
    assert model.x_embedder.weight.grad is not None


def test_the_objective_is_kohyas_flow_matching_with_the_recommended_sigmoid_draw(components, caplog):
    """kohya's get_noisy_model_input_and_timesteps with timestep_sampling sigmoid: sigma = sigmoid(scale * n),
    noisy = (1 - sigma) x0 + sigma noise, target noise - x0; model_prediction_type raw leaves the output alone."""
    objective = components.family.objective(components, settings(timestep_sampling="sigmoid", sigmoid_scale=1.5,
                                                                 model_prediction_type="raw"), torch.device("cpu"))
    sigmas = objective.sample_timesteps(3, torch.Generator().manual_seed(7), "cpu") / 1000
    expected = torch.sigmoid(1.5 * torch.randn(3, generator=torch.Generator().manual_seed(7)))
    torch.testing.assert_close(sigmas, expected)
    x0, noise, prediction = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    timesteps = sigmas * 1000
    s = sigmas[:, None, None, None]
    torch.testing.assert_close(objective.noisy_latents(x0, noise, timesteps), (1 - s) * x0 + s * noise)
    torch.testing.assert_close(objective.per_sample_loss(prediction, x0, noise, timesteps),
                               ((prediction - (noise - x0)) ** 2).mean(dim=(1, 2, 3)))
    components.family.objective(components, settings(min_snr_gamma=5.0), torch.device("cpu"))
    assert "min_snr_gamma has no effect for Chroma" in caplog.text  # accepted and unused, as kohya's FLUX trainer
    with pytest.raises(UserError, match="huber_schedule snr: not for Chroma"):
        components.family.objective(components, settings(loss_type="huber", huber_schedule="snr"),
                                    torch.device("cpu"))


def trained_transformer(tiny_chroma_dir, *args):
    from diffusers import ChromaTransformer2DModel

    from library.config.network_args import parse_network_args
    from library.network import lora

    transformer = ChromaTransformer2DModel.from_pretrained(tiny_chroma_dir, subfolder="transformer",
                                                           local_files_only=True)
    net, problems = parse_network_args(list(args))
    assert problems == []
    modules, overrides = Chroma().denoiser_lora_targets(transformer, RANK, ALPHA, net)
    lora.attach_lora(transformer, modules, RANK, ALPHA, overrides=overrides)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, layer in lora.lora_layers(transformer):
            layer.lora_B["default"].weight.copy_(torch.randn(layer.lora_B["default"].weight.shape, generator=g))
    return transformer


def test_lora_keys_are_kohyas_flux_names_of_chromas_layers(tiny_chroma_dir):
    """kohya's lora_flux on Chroma: every Linear of DoubleStreamBlock / SingleStreamBlock, named
    lora_unet_<BFL path>; Chroma's blocks have no img_mod / txt_mod / modulation layers."""
    from library.network import kohya_format

    transformer = trained_transformer(tiny_chroma_dir)
    state = Chroma().export_lora_keys(kohya_format.kohya_state_dict({"lora_unet": transformer}, ALPHA))
    names = {key.split(".")[0] for key in state}
    assert names == ({f"lora_unet_double_blocks_0_{s}_{n}" for s in ("img", "txt")
                      for n in ("attn_qkv", "attn_proj", "mlp_0", "mlp_2")}
                     | {"lora_unet_single_blocks_0_linear1", "lora_unet_single_blocks_0_linear2"})
    assert state["lora_unet_single_blocks_0_linear1.lora_down.weight"].shape[0] == 4 * RANK
    assert state["lora_unet_single_blocks_0_linear1.alpha"].item() == 4 * ALPHA  # alpha / rank kept (kohya #2204)
    back = Chroma().import_lora_keys(state)
    ours = kohya_format.kohya_state_dict({"lora_unet": transformer}, ALPHA)
    assert set(back) == set(ours) and all(torch.equal(back[k], ours[k]) for k in ours)


def lora_names(model) -> list[str]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]


def test_chroma_pipeline_load_lora_weights_consumes_every_key_with_our_output(tiny_chroma_dir, tmp_path):
    """ChromaPipeline.load_lora_weights reads kohya's file (double blocks: diffusers' converter hard-codes FLUX.1's
    widths for single blocks, so those go through flux_lora.to_peft at the tiny widths). Outputs agree to rtol 1e-4
    / atol 1e-5 (diffusers folds alpha / rank into the matrices)."""
    from diffusers import ChromaPipeline

    from library.families.flux import lora as flux_lora
    from library.network import kohya_format

    model = trained_transformer(tiny_chroma_dir, "train_blocks=double")
    path = tmp_path / "chroma_lora.safetensors"
    kohya_format.save_lora_file(path, Chroma().export_lora_keys(
        kohya_format.kohya_state_dict({"lora_unet": model}, ALPHA)), {})
    pipe = ChromaPipeline.from_pretrained(tiny_chroma_dir, local_files_only=True)
    converted = ChromaPipeline.lora_state_dict(kohya_format.load_kohya_lora(path)[0])
    converted = converted[0] if isinstance(converted, tuple) else converted
    assert {key.rsplit(".", 2)[0] for key in converted} == {f"transformer.{n}" for n in lora_names(model)}
    pipe.load_lora_weights(str(path))
    assert len(lora_names(pipe.transformer)) == len(lora_names(model)) == 12  # no modulation layers

    everything = trained_transformer(tiny_chroma_dir)
    other = ChromaPipeline.from_pretrained(tiny_chroma_dir, local_files_only=True)
    other.load_lora_weights(flux_lora.to_peft(Chroma().export_lora_keys(
        kohya_format.kohya_state_dict({"lora_unet": everything}, ALPHA)), {"transformer": other.transformer}))
    assert len(lora_names(other.transformer)) == len(lora_names(everything)) == 17

    g = torch.Generator().manual_seed(5)
    mask = torch.ones(1, 8 + 16, dtype=torch.bool)
    mask[0, 5:8] = False
    inputs = dict(hidden_states=torch.randn(1, 16, 64, generator=g), encoder_hidden_states=torch.randn(1, 8, 32,
                  generator=g), timestep=torch.tensor([0.4]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3),
                  attention_mask=mask, return_dict=False)
    with torch.no_grad():
        base = ChromaPipeline.from_pretrained(tiny_chroma_dir, local_files_only=True).transformer(**inputs)[0]
        expected, got = model(**inputs)[0], pipe.transformer(**inputs)[0]
        expected_all, got_all = everything(**inputs)[0], other.transformer(**inputs)[0]
    assert not torch.allclose(expected, base, atol=1e-3)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_all, expected_all, rtol=1e-4, atol=1e-5)


def test_sampling_is_chroma_pipelines_cfg_with_the_masked_prompts(components, tmp_path):
    import numpy as np
    from diffusers import ChromaPipeline

    models = sampling_models(components, dataclasses.replace(components.family, t5_max_length=16))
    (cfg, _), (ours, no_cfg) = sample(models, tmp_path,
                                      "a photo of sks dog --n a red digit --l 4 --s 2 --w 64 --h 64 --d 3\n"
                                      "a photo of sks dog --n a red digit --s 2 --w 64 --h 64 --d 3\n")
    with torch.no_grad():
        pipe = ChromaPipeline(scheduler=pipeline_scheduler(components), vae=components.vae,
                              text_encoder=components.text_encoders[0], tokenizer=components.tokenizers[0],
                              transformer=components.denoiser)
        pos, neg = models.encode_text(cfg.prompt), models.encode_text(cfg.negative_prompt)
        theirs = pipe(prompt_embeds=pos["encoder_hidden_states"], prompt_attention_mask=text_mask(pos["t5_attn_mask"]),
                      negative_prompt_embeds=neg["encoder_hidden_states"],
                      negative_prompt_attention_mask=text_mask(neg["t5_attn_mask"]), guidance_scale=4.0, width=64,
                      height=64, num_inference_steps=2, generator=torch.Generator().manual_seed(3)).images[0]
    assert_same_image(ours, theirs)
    assert not np.array_equal(ours, no_cfg)


def test_comfyuis_key_rule_takes_every_key_with_our_weight_change(tiny_chroma_dir):
    """ComfyUI (comfy/lora.py model_lora_keys_unet) names every weight `diffusion_model.<path>.weight` of its native
    (BFL-layout) Chroma `lora_unet_<path, . -> _>` and adds up @ down * alpha / rank to it: every key of our file
    must name such a weight, and the patched weights must equal our trained model's, in BFL's layout."""
    from diffusers import ChromaTransformer2DModel

    from library.families.flux.files import bfl_state_dict
    from library.network import kohya_format

    model = trained_transformer(tiny_chroma_dir)
    state = Chroma().export_lora_keys(kohya_format.kohya_state_dict({"lora_unet": model}, ALPHA))
    base = ChromaTransformer2DModel.from_pretrained(tiny_chroma_dir, subfolder="transformer", local_files_only=True)
    assert_comfyui_key_rule_patches_our_change(state, model, base, bfl_state_dict)
