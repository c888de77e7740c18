"""FLUX.1 Kontext [dev] as a variant of the FLUX family: the reference tokens' positions and the slicing as musubi-tuner
has them, control latents scaled as the targets are, how Kontext is recognised, a training run from pairs (the LoRA,
exact resume, a sample with its control image), the refusals, --ci prompts and diffusers' FluxKontextPipeline
reading the file."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from library.config import UserError
from library.families.flux.family import Flux, pack_latents, unpack_latents
from library.families.flux.kontext import FluxKontext, reference_ids
from library.families.loading import load_components
from library.monitoring.sample_prompts import load_prompts
from library.network import kohya_format
from library.training.model import batch_controls, scale_latents
from tests.helpers.datasets import write_pairs
from tests.helpers.lora_files import flux_pipelines_and_kohya_file, flux_transformer_inputs, lora_names
from tests.helpers.runs import train

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")


def musubi_prepare_img_ids(batch_size: int, packed_latent_height: int, packed_latent_width: int,
                           is_ctrl: bool = False) -> torch.Tensor:
    """musubi-tuner's flux_utils.prepare_img_ids, as its code has it (einops.repeat written out)."""
    img_ids = torch.zeros(packed_latent_height, packed_latent_width, 3)
    img_ids[..., 1] = img_ids[..., 1] + torch.arange(packed_latent_height)[:, None]
    img_ids[..., 2] = img_ids[..., 2] + torch.arange(packed_latent_width)[None, :]
    if is_ctrl:
        img_ids[..., 0] = 1
    return img_ids.reshape(1, -1, 3).repeat(batch_size, 1, 1)


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory) -> Path:
    from library.families.flux.tiny import save_tiny_flux_kontext

    return save_tiny_flux_kontext(tmp_path_factory.mktemp("tiny_kontext") / "model", seed=0)


@pytest.fixture(scope="module")
def kontext(kontext_dir):
    return load_components(kontext_dir)


# --- the reference tokens ---------------------------------------------------------------------------------------

def test_reference_ids_are_musubis_control_ids():
    # unpacked latents 6x4 -> 3x2 packed tokens: axis 0 one, rows and columns from 0
    expected = musubi_prepare_img_ids(1, 3, 2, is_ctrl=True)[0]
    assert torch.equal(reference_ids(6, 4), expected)
    assert expected[:, 0].eq(1).all() and expected[-1].tolist() == [1.0, 2.0, 1.0]


def tiny_call_inputs(g: torch.Generator, control_size: tuple[int, int] = (6, 4)):
    noisy = torch.randn(2, 16, 4, 6, generator=g)  # target 4x6 latents: 2x3 tokens
    control = torch.randn(2, 16, *control_size, generator=g)
    text = {"encoder_hidden_states": torch.randn(2, 5, 32, generator=g), "pooled": torch.randn(2, 32, generator=g),
            "t5_attn_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}
    return noisy, control, text, torch.tensor([300.0, 800.0])


def test_the_control_tokens_follow_the_target_and_the_prediction_is_the_targets(kontext):
    """musubi's call_dit: target then control tokens, target ids then control ids (is_ctrl), guidance 1.0, and the
    output cut back to the target's tokens before unpacking."""
    transformer = kontext.denoiser
    family = kontext.family.configured(settings())
    noisy, control, text, timesteps = tiny_call_inputs(torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = family.denoise(transformer, noisy, timesteps, text, {"control_latents": control})
        img = torch.cat([pack_latents(noisy), pack_latents(control)], dim=1)
        ids = torch.cat([musubi_prepare_img_ids(1, 2, 3)[0], musubi_prepare_img_ids(1, 3, 2, is_ctrl=True)[0]])
        pred = transformer(hidden_states=img, img_ids=ids, encoder_hidden_states=text["encoder_hidden_states"],
                           txt_ids=torch.zeros(5, 3), pooled_projections=text["pooled"], timestep=timesteps / 1000,
                           guidance=torch.full((2,), 1.0), return_dict=False)[0]
        expected = unpack_latents(pred[:, : 2 * 3], 4, 6)
        alone = Flux().configured(settings()).denoise(transformer, noisy, timesteps, text, {})
    assert ours.shape == noisy.shape
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert not torch.allclose(ours, alone, atol=1e-4)  # the control image reaches the target's prediction


def test_with_the_t5_mask_every_image_token_is_attended(kontext):
    family = kontext.family.configured(settings(apply_t5_attn_mask=True))
    seen = {}

    def hook(_, args, kwargs):
        seen.update(kwargs)

    noisy, control, text, timesteps = tiny_call_inputs(torch.Generator().manual_seed(1))
    handle = kontext.denoiser.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            family.denoise(kontext.denoiser, noisy, timesteps, text, {"control_latents": control})
    finally:
        handle.remove()
    mask = seen["joint_attention_kwargs"]["attention_mask"]
    assert mask.shape == (2, 1, 1, 5 + 6 + 6)
    assert mask[0, 0, 0].tolist() == [True] * 3 + [False] * 2 + [True] * 12


def settings(**given):
    from tests.helpers.runs import family_settings

    return family_settings(FluxKontext, resolution=(64, 64), **given)


def test_training_guidance_is_musubis_unless_set():
    assert FluxKontext().configured(settings()).guidance_scale == 1.0
    assert FluxKontext().configured(settings(guidance_scale=2.0)).guidance_scale == 2.0
    assert Flux().configured(settings()).guidance_scale == 3.5  # FLUX.1 dev keeps kohya's


def test_control_latents_are_scaled_as_the_targets_are_cached_or_not(kontext):
    vae = kontext.vae
    g = torch.Generator().manual_seed(2)
    pixels = torch.rand(2, 3, 32, 48, generator=g) * 2 - 1
    with torch.no_grad():
        means = torch.cat([vae.encode(p[None]).latent_dist.mean for p in pixels])
    cached = batch_controls({"control_latents": [means]}, vae, torch.float32)
    encoded = batch_controls({"control_pixels": [pixels], "path": ["a", "b"]}, vae, torch.float32)
    expected = (means - vae.config.shift_factor) * vae.config.scaling_factor
    torch.testing.assert_close(cached[0], expected, rtol=0, atol=0)
    torch.testing.assert_close(encoded[0], cached[0], rtol=0, atol=0)
    torch.testing.assert_close(scale_latents(means, vae.config), expected, rtol=0, atol=0)
    assert batch_controls({"pixels": pixels}, vae, torch.float32) == []


# --- how Kontext is recognised ----------------------------------------------------------------------------------

def test_a_kontext_folder_is_kontext_and_its_single_file_needs_model_version(kontext, kontext_dir, tiny_flux_dir,
                                                                            tmp_path):
    from library.families.flux.tiny import save_tiny_flux_files

    assert type(kontext.family) is FluxKontext and kontext.family.name == "flux1-kontext-dev"
    files = save_tiny_flux_files(kontext_dir, tmp_path / "files")
    # The tiny widths come from a FluxPipeline folder, as the released files' from the shipped FLUX.1 configs.
    separate = {"model_config": tiny_flux_dir, **{name: str(files[name]) for name in ("clip_l", "t5xxl", "ae")}}
    assert type(load_components(files["transformer"], **separate).family) is Flux  # dev's keys: dev
    told = load_components(files["transformer"], model_version="kontext", **separate)
    assert type(told.family) is FluxKontext
    assert type(load_components(files["transformer"], **{**separate, "model_config": kontext_dir}).family) \
        is FluxKontext  # a Kontext folder describing the file says so too
    with pytest.raises(UserError, match="model_version dev: .* names FluxKontextPipeline"):
        load_components(kontext_dir, model_version="dev")
    with pytest.raises(UserError, match="model_version 'edit': FLUX.1 takes dev, schnell, kontext"):
        load_components(files["transformer"], model_version="edit", **separate)


def test_model_version_for_a_family_without_variants_is_refused(tiny_sd1_dir):
    with pytest.raises(UserError, match="model_version 'kontext': not read for .* FLUX.1"):
        load_components(tiny_sd1_dir, model_version="kontext")


# --- training from pairs ----------------------------------------------------------------------------------------

RUN = {"seed": 3, "learning_rate": 1e-3, "network_module": "networks.lora_flux", "network_dim": 4,
       "network_alpha": 2}


def kontext_run(model: Path, toml: Path, out: Path, *extra: str, **options):
    return train(model, None, out, "--dataset_config", str(toml), *extra, run={**RUN, **options})


@pytest.fixture(scope="module")
def reference(kontext_dir, tmp_path_factory):
    """Four steps from pairs, the state saved at step 2, a sample at step 4 with its control image (--ci)."""
    root = tmp_path_factory.mktemp("kontext_run")
    toml = write_pairs(root / "data")
    prompts = root / "prompts.txt"
    prompts.write_text(f"make it blue --ci {root / 'data' / 'controls' / '0.png'} --w 64 --h 64 --s 2 --d 1\n")
    out = root / "out"
    result = kontext_run(kontext_dir, toml, out, "--max_train_steps", "4", "--save_every_n_steps", "2",
                         "--save_state", "--sample_every_n_steps", "4", "--sample_prompts", str(prompts))
    return root, toml, result


def test_a_kontext_run_from_pairs_writes_flux_lora_keys_and_a_sample_beside_its_control(reference):
    root, _, result = reference
    state, metadata = kohya_format.load_kohya_lora(result.output_file)
    modules = {key.split(".")[0] for key in state}
    assert "lora_unet_double_blocks_0_img_attn_qkv" in modules and "lora_unet_single_blocks_0_linear1" in modules
    assert all(m.startswith(("lora_unet_double_blocks_0_", "lora_unet_single_blocks_0_", "lora_te1_"))
               for m in modules)
    assert state["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"].abs().sum() > 0
    assert metadata["ss_base_model_version"] == "flux1"
    assert metadata["modelspec.architecture"] == "flux-1-kontext-dev/lora"
    assert metadata["ss_guidance_scale"] == "1.0"
    samples = sorted((root / "out" / "sample").glob("*.png"))
    assert len(samples) == 1
    with Image.open(samples[0]) as image:
        assert image.size == (128, 64)  # the 64x64 control, then the 64x64 result
        control = np.asarray(Image.open(root / "data" / "controls" / "0.png").convert("RGB"))
        assert np.array_equal(np.asarray(image.convert("RGB"))[:, :64], control)


def test_a_kontext_run_resumes_bit_exactly(reference, kontext_dir, tmp_path):
    root, toml, straight = reference
    resumed = kontext_run(kontext_dir, toml, tmp_path / "b", "--max_train_steps", "4", "--resume",
                          str(root / "out" / "last-step00000002-state"))
    assert resumed.losses == straight.losses[2:]
    a, b = (kohya_format.load_kohya_lora(r.output_file)[0] for r in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- refusals ---------------------------------------------------------------------------------------------------

def test_a_kontext_run_without_control_images_is_refused(kontext_dir, tmp_path):
    toml = write_pairs(tmp_path / "data", controls_per_item=0)
    with pytest.raises(UserError, match="flux1-kontext-dev takes 1 control image per item; 4 items have none"):
        kontext_run(kontext_dir, toml, tmp_path / "out", "--max_train_steps", "1")


def test_a_dev_run_on_pairs_is_refused_saying_to_set_the_variant(tiny_flux_dir, tmp_path):
    toml = write_pairs(tmp_path / "data")
    with pytest.raises(UserError) as refused:
        kontext_run(tiny_flux_dir, toml, tmp_path / "out", "--max_train_steps", "1")
    text = str(refused.value)
    assert "the dataset has control images (4 items" in text and "flux1-dev takes none" in text
    assert 'set model_version = "kontext"' in text


def test_two_control_images_per_item_are_refused_naming_the_count(kontext_dir, tmp_path):
    toml = write_pairs(tmp_path / "data")
    for i in range(4):  # a second, numbered control for each target: 0.png and 0_1.png
        Image.new("RGB", (64, 64), "red").save(tmp_path / "data" / "controls" / f"{i}_1.png")
    with pytest.raises(UserError, match="takes 1 control image per item; 4 items have 2"):
        kontext_run(kontext_dir, toml, tmp_path / "out", "--max_train_steps", "1")


def test_a_ci_prompt_for_a_family_without_control_images_is_refused(tiny_flux_dir, sample_data_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    control = sample_data_dir / "10_sks shape" / "00_red_circle.png"
    prompts.write_text(f"a shape --ci {control}\n")
    with pytest.raises(UserError, match="sample prompt 1 names 1 control images .--ci.; flux1-dev takes none"):
        train(tiny_flux_dir, sample_data_dir, tmp_path / "out", "--max_train_steps", "1", "--sample_at_first",
              "--sample_prompts", str(prompts), network_module="networks.lora_flux")


# --- sample prompts ---------------------------------------------------------------------------------------------

def test_ci_names_control_images_in_line_toml_and_json_prompts(tmp_path):
    first, second = (tmp_path / "a b.png", tmp_path / "c.png")
    for path in (first, second):
        Image.new("RGB", (16, 16)).save(path)
    (tmp_path / "p.txt").write_text(f"edit it --ci {first} --w 64 --ci {second}\nplain\n")
    (tmp_path / "p.toml").write_text(f'[prompt]\nwidth = 64\n[[prompt.subset]]\nprompt = "x"\n'
                                     f'control_image = "{first}"\n[[prompt.subset]]\nprompt = "y"\n'
                                     f'control_image = ["{first}", "{second}"]\n')
    (tmp_path / "p.json").write_text(f'[{{"prompt": "x", "control_image": "{second}"}}]')
    line, plain = load_prompts(tmp_path / "p.txt")
    assert line.control_images == (str(first), str(second)) and line.width == 64 and plain.control_images == ()
    assert [p.control_images for p in load_prompts(tmp_path / "p.toml")] == [(str(first),), (str(first), str(second))]
    assert load_prompts(tmp_path / "p.json")[0].control_images == (str(second),)
    (tmp_path / "bad.txt").write_text(f"edit it --ci {tmp_path / 'missing.png'}\n")
    with pytest.raises(UserError, match="line 1: --ci .*missing.png.*not an image file"):
        load_prompts(tmp_path / "bad.txt")


def test_a_ci_sample_is_fluxkontextpipelines_image_beside_its_control(kontext, tmp_path):
    """Our sample of a --ci prompt is what FluxKontextPipeline draws from the same embeddings, seed, guidance (2.5
    by default, musubi's) and control image (cropped from the top left to multiples of 16), drawn right of the
    control; with apply_t5_attn_mask the control's tokens are attended too."""
    import dataclasses

    from diffusers import FluxKontextPipeline

    from library.monitoring.sampling import generate_image
    from tests.helpers.family_checks import pipeline_scheduler, sampling_models

    control = tmp_path / "start.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 70, 3), dtype=np.uint8)).save(control)
    (tmp_path / "p.txt").write_text(f"make it blue --ci {control} --w 64 --h 64 --s 2 --d 5\n")
    prompt = load_prompts(tmp_path / "p.txt")[0]
    masked = dataclasses.replace(kontext.family, t5_max_length=16, apply_t5_attn_mask=True)
    with torch.no_grad():
        ours = np.asarray(generate_image(prompt, sampling_models(kontext, masked), seed=5))
        encoded = sampling_models(kontext, masked).encode_text(prompt.prompt)
        pipe = FluxKontextPipeline(scheduler=pipeline_scheduler(kontext), vae=kontext.vae,
                                   text_encoder=kontext.text_encoders[0], tokenizer=kontext.tokenizers[0],
                                   text_encoder_2=kontext.text_encoders[1], tokenizer_2=kontext.tokenizers[1],
                                   transformer=kontext.denoiser)
        start = Image.open(control).convert("RGB").crop((0, 0, 64, 32))
        mask = torch.cat([encoded["t5_attn_mask"].bool(), torch.ones(1, 16 + 8, dtype=torch.bool)], dim=1)
        theirs = pipe(image=start, prompt_embeds=encoded["encoder_hidden_states"],
                      pooled_prompt_embeds=encoded["pooled"], width=64, height=64, num_inference_steps=2,
                      guidance_scale=2.5, max_area=64 * 64, _auto_resize=False,
                      joint_attention_kwargs={"attention_mask": mask[:, None, None]},
                      generator=torch.Generator().manual_seed(5)).images[0]
    assert ours.shape == (64, 70 + 64, 3)
    assert np.array_equal(ours[:40, :70], np.asarray(Image.open(control).convert("RGB")))
    assert np.abs(ours[:, 70:].astype(int) - np.asarray(theirs).astype(int)).max() <= 1


# --- the LoRA file in diffusers ---------------------------------------------------------------------------------

def test_diffusers_kontext_pipeline_loads_every_key_with_our_weight_change(kontext_dir, tmp_path):
    """As FLUX.1's reader test, on FluxKontextPipeline: double blocks and CLIP-L through load_lora_weights (diffusers
    hard-codes FLUX.1's widths for single blocks), every key placed, the same output with reference tokens in the
    sequence; the single blocks through to_peft."""
    from diffusers import FluxKontextPipeline

    from library.families.flux import lora as flux_lora

    pipe, ours, model, state = flux_pipelines_and_kohya_file(kontext_dir, "train_blocks=double",
                                                             pipeline="FluxKontextPipeline")
    path = tmp_path / "kontext_lora.safetensors"
    kohya_format.save_lora_file(path, state, {})
    converted = FluxKontextPipeline.lora_state_dict(kohya_format.load_kohya_lora(path)[0])
    converted = converted[0] if isinstance(converted, tuple) else converted
    assert {key.rsplit(".", 2)[0] for key in converted if key.startswith("transformer.")} == {
        f"transformer.{name}" for name in lora_names(model)}
    assert len(converted) == 2 * (len(lora_names(model)) + len(lora_names(ours.text_encoder)))
    pipe.load_lora_weights(str(path))
    assert len(lora_names(pipe.transformer)) == len(lora_names(model)) == 14
    inputs = flux_transformer_inputs(torch.Generator().manual_seed(5), references=16)
    inputs["img_ids"][16:] = reference_ids(8, 8)
    with torch.no_grad():
        expected, got = model(**inputs)[0], pipe.transformer(**inputs)[0]
        base = FluxKontextPipeline.from_pretrained(kontext_dir, local_files_only=True).transformer(**inputs)[0]
    assert not torch.allclose(expected, base, atol=1e-3)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)

    _, _, everything, all_blocks = flux_pipelines_and_kohya_file(kontext_dir, pipeline="FluxKontextPipeline")
    other = FluxKontextPipeline.from_pretrained(kontext_dir, local_files_only=True)
    other.load_lora_weights(flux_lora.to_peft(all_blocks, {"transformer": other.transformer,
                                                           "text_encoder": other.text_encoder}))
    assert len(lora_names(other.transformer)) == len(lora_names(everything)) == 20
    with torch.no_grad():
        torch.testing.assert_close(other.transformer(**inputs)[0], everything(**inputs)[0], rtol=1e-4, atol=1e-5)


# --- musubi-tuner's names for the files ---------------------------------------------------------------------------

def musubi_file_toml(files: dict) -> str:
    """A config in musubi-tuner's flux_kontext_train_network.py names: dit, text_encoder1 (T5-XXL), text_encoder2
    (CLIP-L) and vae (the autoencoder file)."""
    return "\n".join([f'dit = "{files["transformer"]}"', f'text_encoder1 = "{files["t5xxl"]}"',
                      f'text_encoder2 = "{files["clip_l"]}"', f'vae = "{files["ae"]}"', 'model_version = "kontext"'])


@pytest.fixture(scope="module")
def kontext_files(kontext_dir, tmp_path_factory):
    from library.families.flux.tiny import save_tiny_flux_files

    return save_tiny_flux_files(kontext_dir, tmp_path_factory.mktemp("kontext_files"))


def test_musubis_names_for_the_files_are_read_as_the_transformer_its_encoders_and_ae(kontext_dir, kontext_files,
                                                                                     tmp_path):
    from library.families.loading import musubi_autoencoder
    from tests.helpers.runs import make_config

    toml = musubi_file_toml(kontext_files)
    config = make_config(kontext_dir, tmp_path, tmp_path / "out", toml=toml)  # the command line's model wins
    assert config.pretrained_model_name_or_path == str(kontext_dir)
    assert (config.t5xxl, config.clip_l) == (str(kontext_files["t5xxl"]), str(kontext_files["clip_l"]))
    # With a folder, which brings its own VAE, vae stays kohya's replacement VAE.
    assert musubi_autoencoder(config) is config
    config = make_config(kontext_files["transformer"], tmp_path, tmp_path / "out", toml=toml)
    musubi = musubi_autoencoder(config)
    assert (musubi.ae, musubi.vae) == (str(kontext_files["ae"]), None)
    assert musubi.is_set("ae") and not musubi.is_set("vae")
    # kohya's names: ae given, so vae is a replacement VAE as kohya has it, not touched
    both = make_config(kontext_files["transformer"], tmp_path, tmp_path / "out", toml=toml, ae=kontext_files["ae"])
    assert musubi_autoencoder(both) is both


@pytest.mark.slow  # about 30 s: two gloo processes, each importing torch and building the model
def test_musubis_kontext_command_on_two_gloo_processes_ends_with_the_same_lora(kontext_dir, kontext_files, tmp_path):
    """musubi-tuner's file names on pairs, two processes: each rank takes its half of the pairs, the gradients are
    averaged (the ranks end with the same file and losses), and the file is FLUX.1's. (The transformer file loads
    only with its autoencoder: musubi's vae is read as ae.)"""
    import json

    from safetensors.torch import load_file

    from tests.helpers.cli import launch

    toml = write_pairs(tmp_path / "data")
    config = tmp_path / "musubi.toml"
    config.write_text(musubi_file_toml(kontext_files) + f'\nmodel_config = "{kontext_dir}"\n', encoding="utf-8")
    out = tmp_path / "ddp"
    result = launch(2, ["--config", str(config), "--dataset_config", str(toml), "--output_dir", str(out),
                        "--seed", "7", "--learning_rate", "3e-3", "--max_train_steps", "2",
                        "--network_module", "networks.lora_flux", "--network_dim", "4"])
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = (load_file(out / f"rank{r}.safetensors") for r in (0, 1))
    assert rank0.keys() == rank1.keys() and all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight" in load_file(out / "last.safetensors")
    assert all(v.abs().max() > 0 for k, v in rank0.items() if "lora_up" in k and "lora_unet" in k)
    losses = [json.loads((out / f"rank{r}.json").read_text())["losses"] for r in (0, 1)]
    assert losses[0] == losses[1] and len(losses[0]) == 2
