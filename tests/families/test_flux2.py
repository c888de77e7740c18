"""FLUX.2 [klein]: prompts, latents, reference images and the transformer call against Flux2KleinPipeline's own, the
variant a folder or BFL's files hold, musubi-tuner's objective, LoRA layout (read by diffusers' loader and by
ComfyUI's key rule) and block swap split, sampling with the pipeline, and training: the shipped config, exact resume,
edit pairs with a --ci sample, two gloo processes and fp8_base."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from library.config import UserError
from library.config.network_args import NetworkArgs
from library.families.flow_matching import FlowOptions, unsupported
from library.families.flux2 import latents as flux2_latents
from library.families.flux2 import lora as flux2_lora
from library.families.flux2.family import Flux2
from library.families.flux2.transformer import bfl_state_dict
from library.families.loading import load_components
from library.families.shared import musubi_flow
from tests.helpers import REPO, musubi_lora
from tests.helpers.family_checks import (
    assert_comfyui_key_rule_patches_our_change,
    assert_same_image,
    pipeline_scheduler,
    sample,
    sampling_models,
)
from tests.helpers.lora_files import attached, file_delta
from tests.helpers.runs import family_settings, train

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")


@pytest.fixture(scope="module")
def klein_dir(tmp_path_factory) -> Path:
    from library.families.flux2.tiny import save_tiny_flux2_klein

    return save_tiny_flux2_klein(tmp_path_factory.mktemp("tiny_flux2_klein") / "model", seed=0)


@pytest.fixture(scope="module")
def components(klein_dir):
    return load_components(klein_dir)


def pipeline(components):
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline(scheduler=pipeline_scheduler(components), vae=components.vae.vae,
                              text_encoder=components.text_encoders[0], tokenizer=components.tokenizers[0],
                              transformer=components.denoiser)


# --- the folder -------------------------------------------------------------------------------------------------

def test_a_klein_base_folder_is_told_and_model_version_is_checked_against_it(klein_dir, components, tmp_path):
    assert components.family == Flux2("klein-base-4b") and components.family.name == "flux2-klein-base-4b"
    assert components.base_model_version == "flux_2_klein_4b" and components.family.default_sampling_scale == 4.0
    assert load_components(klein_dir, model_version="klein-base-4b").family == components.family
    with pytest.raises(UserError, match='holds FLUX.2 klein-base-4b; set model_version = "klein-base-4b"'):
        load_components(klein_dir, model_version="klein-4b")
    with pytest.raises(UserError, match="model_version 'kontext': FLUX.2 takes klein-4b, klein-base-4b"):
        load_components(klein_dir, model_version="kontext")
    distilled = shutil.copytree(klein_dir, tmp_path / "distilled")
    index = json.loads((distilled / "model_index.json").read_text())
    (distilled / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    family = load_components(distilled).family
    assert family.version == "klein-4b" and family.default_sampling_scale == 1.0
    (distilled / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    with pytest.raises(UserError, match=r"FluxPipeline folder; FLUX.2 folders are Flux2KleinPipeline's"):
        load_components(distilled)


def test_bfls_files_load_as_the_folder_with_or_without_model_config(klein_dir, components, tmp_path):
    """The files musubi's users keep (BFL's transformer, the Qwen3 split files, BFL's ae.safetensors) load to the
    folder's weights: widths read from their shapes, or from model_config; the text encoder is refused as a folder
    option and required with a file; model_version tells the distilled model and must fit the file's size."""
    from library.families.flux2.tiny import save_tiny_flux2_klein_files

    files = save_tiny_flux2_klein_files(klein_dir, tmp_path)
    separate = {"text_encoder": str(files["text_encoder"]), "ae": str(files["ae"])}
    musubi_lora.assert_same_weights(musubi_lora.load_split_files(files, klein_dir), components)
    loaded = load_components(files["transformer"], **separate)
    musubi_lora.assert_same_weights(loaded, components)
    assert loaded.family == Flux2("klein-base-4b") and isinstance(loaded.vae, flux2_latents.Flux2Vae)
    assert load_components(files["transformer"], model_version="klein-4b", **separate).family.version == "klein-4b"
    with pytest.raises(UserError, match='holds FLUX.2 klein-4b; set model_version = "klein-4b"'):
        load_components(files["transformer"], model_version="klein-9b", **separate)
    with pytest.raises(UserError, match=r"model_version dev: .* is a FLUX.2 \[klein\] 4B transformer"):
        load_components(files["transformer"], model_version="dev", **separate)


# --- prompts, latents and the transformer call, against the pipeline ---------------------------------------------

def test_prompts_are_the_pipelines_qwen3_layers_9_18_27_through_the_chat_template(components):
    batch, ours = musubi_lora.encode_captions(components, ["a photo of sks dog", "red"])
    assert batch["input_ids"].shape == (2, 512)
    text = components.tokenizers[0].decode(batch["input_ids"][0][batch["attention_mask"][0].bool()])
    assert text == "<|im_start|>user\na photo of sks dog<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    with torch.no_grad():
        theirs, _ = pipeline(components).encode_prompt(["a photo of sks dog", "red"], device="cpu")
    assert ours.keys() == {"encoder_hidden_states"} and ours["encoder_hidden_states"].shape == (2, 512, 3 * 16)
    assert torch.equal(ours["encoder_hidden_states"], theirs)


def transformer_calls(transformer) -> tuple[list[dict], object]:
    calls: list[dict] = []
    hook = transformer.register_forward_pre_hook(lambda _, args, kwargs: calls.append(dict(kwargs)),
                                                 with_kwargs=True)
    return calls, hook


def test_denoise_gives_the_transformer_what_the_pipeline_gives_it(components):
    """One pipeline step at 64 px: the packed latents, sigma as the time, the text and the 4-axis positions of the
    pipeline's call are ours for the same latents, timestep and prompt."""
    _, encoded = musubi_lora.encode_captions(components, ["a photo of sks dog"])
    calls, hook = transformer_calls(components.denoiser)
    try:
        with torch.no_grad():
            pipeline(components)(prompt_embeds=encoded["encoder_hidden_states"], guidance_scale=1.0, height=64,
                                 width=64, num_inference_steps=1, generator=torch.Generator().manual_seed(0),
                                 output_type="latent")
            theirs = calls[-1]
            noisy = flux2_latents.unpack(theirs["hidden_states"], 4, 4)
            prediction = components.family.denoise(components.denoiser, noisy, theirs["timestep"] * 1000, encoded,
                                                   {})
            ours = calls[-1]
    finally:
        hook.remove()
    assert noisy.shape == (1, 128, 4, 4) and prediction.shape == noisy.shape
    for name in ("hidden_states", "timestep", "encoder_hidden_states"):
        assert torch.equal(ours[name], theirs[name]), name
    for name in ("img_ids", "txt_ids"):  # the transformer reads the first batch entry's positions
        assert torch.equal(ours[name], theirs[name][0]), name
    assert ours["img_ids"][:5].tolist() == [[0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 3, 0], [0, 1, 0, 0]]
    assert ours["txt_ids"][-1].tolist() == [0, 0, 0, 511] and ours["guidance"] is None


def test_the_vae_view_is_the_pipelines_reference_encoding_and_decodes_its_latents(components):
    """encode: the mode patched 2x2 and normalised by the batch-norm statistics (the pipeline's _encode_vae_image,
    musubi's AutoEncoder.encode); vae_latents + decode of the pipeline's output latents is the pipeline's decode."""
    pixels = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    view, pipe = components.vae, pipeline(components)
    with torch.no_grad():
        posterior = view.encode(pixels).latent_dist
        theirs = pipe._encode_vae_image(pixels, generator=None)
        assert posterior.mean.shape == (1, 128, 4, 4) and torch.equal(posterior.mean, theirs)
        assert torch.equal(posterior.mean + posterior.std * torch.randn(posterior.mean.shape), posterior.mean)
        raw = view.vae.encode(pixels).latent_dist.mode()
        ours = view.decode(components.family.vae_latents(raw, view.config, 64, 64))[0]
        torch.testing.assert_close(ours, view.vae.decode(raw).sample, rtol=1e-4, atol=1e-5)
    assert view.config.scaling_factor == 1.0 and view.config.shift_factor is None


# --- the objective ------------------------------------------------------------------------------------------------

def test_musubis_defaults_and_flux2_shift_on_the_patched_latents():
    settings = family_settings(Flux2)
    objective = musubi_flow.MusubiFlowObjective.from_settings(settings)
    assert (objective.options.timestep_sampling, objective.options.discrete_flow_shift,
            objective.options.weighting_scheme) == ("sigma", 1.0, "none")
    # musubi's flux2_shift: mu on the line (256, 0.5) - (4096, 1.15) at h * w of the (already patched) latents
    options = FlowOptions(timestep_sampling="flux2_shift", sigmoid_scale=1.3)
    ours = musubi_flow.musubi_sigmas(options, 64, torch.Generator().manual_seed(5), (64, 48))
    shift = math.exp(0.5 + (1.15 - 0.5) / (4096 - 256) * (64 * 48 - 256))
    t = (torch.randn(64, generator=torch.Generator().manual_seed(5)) * 1.3).sigmoid()
    torch.testing.assert_close(ours, t * shift / (1 + (shift - 1) * t))
    assert any("flux2_shift" in p for p in unsupported({"timestep_sampling": "flux2_shift"}))  # kohya's FLUX: no


def test_configured_refuses_what_does_not_apply(components):
    family = components.family
    assert family.configured(family_settings(Flux2, resolution=(64, 64))) is family
    with pytest.raises(UserError) as error:
        family.configured(family_settings(Flux2, clip_skip=2, guidance_scale=1.0, resolution=(72, 64)))
    text = str(error.value)
    assert "clip_skip" in text and "guidance_scale" in text and "multiples of 16" in text


# --- LoRA ----------------------------------------------------------------------------------------------------------

def musubi_modules(double: int, single: int) -> set[str]:
    """musubi's networks.lora_flux_2 modules: the Linears of BFL's DoubleStreamBlock / SingleStreamBlock
    (flux2_models), none excluded by its patterns."""
    inner = ("img_attn_qkv", "img_attn_proj", "img_mlp_0", "img_mlp_2", "txt_attn_qkv", "txt_attn_proj",
             "txt_mlp_0", "txt_mlp_2")
    return ({f"lora_unet_double_blocks_{i}_{name}" for i in range(double) for name in inner}
            | {f"lora_unet_single_blocks_{i}_{name}" for i in range(single) for name in ("linear1", "linear2")})


def random_lora(transformer, seed=0):
    return musubi_lora.random_lora(transformer, flux2_lora.targets(transformer, NetworkArgs()), seed=seed)


def bfl_weights(transformer) -> dict[str, str]:
    """ComfyUI's key rule on BFL's layout: `lora_unet_<path, . -> _>` -> the BFL weight `<path>.weight`."""
    return {"lora_unet_" + key[:-len(".weight")].replace(".", "_"): key for key in bfl_state_dict(transformer)
            if key.endswith(".weight")}


def test_targets_are_musubis_fused_layers_and_the_file_has_musubis_names(components):
    transformer = components.denoiser
    ours = random_lora(transformer)
    written = flux2_lora.to_file(ours)
    names = {key.split(".")[0] for key in written}
    assert names == musubi_modules(2, 2)
    bfl, weights = bfl_state_dict(transformer), bfl_weights(transformer)
    assert all(file_delta(written, name).shape == bfl[weights[name]].shape for name in names)  # one BFL Linear each
    read = flux2_lora.from_file(written)
    assert read.keys() == ours.keys() and all(torch.equal(read[k], ours[k]) for k in ours)
    # ai-toolkit's layout: dotted BFL paths behind diffusion_model., lora_A / lora_B, no alpha (alpha = rank)
    dotted = {f"diffusion_model.{weights[name][:-len('.weight')]}.lora_{ab}.weight": written[f"{name}.{role}"]
              for name in names for ab, role in (("A", "lora_down.weight"), ("B", "lora_up.weight"))}
    read = flux2_lora.from_file(dotted)
    assert read.keys() == ours.keys()
    assert all(float(read[f"{name}.alpha"]) == 4 for name in {k.split(".")[0] for k in ours})


def test_exclude_and_include_patterns_match_bfls_names_as_musubi(components):
    from library.config.network_args import parse_network_args

    net, problems = parse_network_args([r"exclude_patterns=['.*single_blocks.*', 'double_blocks\\.1\\..*']",
                                        r"include_patterns=['single_blocks\\.1\\.linear2', '.*txt_mlp\\.0']"], None,
                                       flux2_lora.NETWORK_MODULE)
    assert not problems
    chosen = flux2_lora.targets(components.denoiser, net)
    expected = {f"transformer_blocks.0.{flux2_lora.DOTTED[inner]}" for inner in flux2_lora.DOUBLE}
    back = {"transformer_blocks.1.ff_context.linear_in", "single_transformer_blocks.1.attn.to_out"}
    assert set(chosen) == expected | back


def test_diffusers_load_lora_weights_consumes_every_key_with_the_same_change(klein_dir, components):
    """Flux2KleinPipeline.load_lora_weights on our file, into the folder's own (unfused) transformer: every module
    of the file becomes LoRA layers whose weight changes, q, k and v stacked, equal ours."""
    from diffusers import Flux2KleinPipeline

    ours = random_lora(components.denoiser)
    pipe = Flux2KleinPipeline.from_pretrained(klein_dir, local_files_only=True)
    pipe.load_lora_weights(flux2_lora.to_file(ours), adapter_name="ours")
    loaded = {name: module.get_delta_weight("ours") for name, module in pipe.transformer.named_modules()
              if hasattr(module, "lora_A")}
    assert len(loaded) == 2 * 12 + 2 * 2  # q, k, v apart in diffusers' blocks
    for i in range(2):
        block = f"transformer_blocks.{i}.attn."
        for fused, parts in (("to_qkv", ("to_q", "to_k", "to_v")),
                             ("to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"))):
            stacked = torch.cat([loaded.pop(block + part) for part in parts])
            torch.testing.assert_close(stacked, file_delta(ours, "lora_unet_" + (block + fused).replace(".", "_")))
    for name, delta in loaded.items():
        torch.testing.assert_close(delta, file_delta(ours, "lora_unet_" + name.replace(".", "_")), rtol=1e-5,
                                   atol=1e-6)


def test_comfyui_applies_the_file_to_bfls_layout_as_we_trained_it(klein_dir, components):
    """ComfyUI's FLUX.2 model keeps BFL's names; its key rule (comfy/lora.py model_lora_keys_unet) on that layout
    takes every key of our file and patches each weight by the change we trained."""
    from library.families.flux2.family import load_flux2_folder
    from library.families.loading import LoadRequest
    from library.network import kohya_format

    model, base = (load_flux2_folder(LoadRequest(path=klein_dir)).denoiser for _ in range(2))
    attached(model, flux2_lora.targets(model, NetworkArgs()), {}, seed=2)
    state = components.family.export_lora_keys(kohya_format.kohya_state_dict({"lora_unet": model}, 2.0))
    assert_comfyui_key_rule_patches_our_change(state, model, base, bfl_state_dict)


# --- sampling -------------------------------------------------------------------------------------------------------

def test_sampling_is_flux2_klein_pipelines_with_musubis_cfg(components, tmp_path):
    _, (ours, plain) = sample(sampling_models(components), tmp_path,
                              "a photo of sks dog --n red --s 2 --w 64 --h 64 --d 3\n"
                              "a photo of sks dog --n red --l 1 --s 2 --w 64 --h 64 --d 3\n")
    _, positive = musubi_lora.encode_captions(components, ["a photo of sks dog"])
    _, negative = musubi_lora.encode_captions(components, ["red"])
    with torch.no_grad():
        theirs = pipeline(components)(prompt_embeds=positive["encoder_hidden_states"],
                                      negative_prompt_embeds=negative["encoder_hidden_states"], guidance_scale=4.0,
                                      num_inference_steps=2, width=64, height=64,
                                      generator=torch.Generator().manual_seed(3)).images[0]
    assert_same_image(ours, theirs)
    assert not np.array_equal(ours, plain)


# --- reference images (edit pairs) -----------------------------------------------------------------------------------

def noise_image(rng, height: int, width: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_reference_images_follow_the_image_tokens_as_the_pipeline_puts_them(components):
    """Two reference images of other sizes: the pipeline's transformer call with `image=` is ours with the same
    images encoded by the VAE view (t = 10 and 20, rows and columns from 0) as control conditioning."""
    rng = np.random.default_rng(0)
    images = [noise_image(rng, 64, 96), noise_image(rng, 128, 64)]
    _, encoded = musubi_lora.encode_captions(components, ["make it blue"])
    pipe = pipeline(components)
    calls, hook = transformer_calls(components.denoiser)
    try:
        with torch.no_grad():
            pipe(image=images, prompt_embeds=encoded["encoder_hidden_states"], guidance_scale=1.0, height=64,
                 width=64, num_inference_steps=1, generator=torch.Generator().manual_seed(0), output_type="latent")
            theirs = calls[-1]
            pixels = [pipe.image_processor.preprocess(image, height=image.height, width=image.width)
                      for image in images]
            references = [components.vae.encode(p).latent_dist.mean for p in pixels]
            conditioning = components.family.control_conditioning(references)
            noisy = flux2_latents.unpack(theirs["hidden_states"][:, :16], 4, 4)
            prediction = components.family.denoise(components.denoiser, noisy, theirs["timestep"] * 1000, encoded,
                                                   conditioning)
            ours = calls[-1]
    finally:
        hook.remove()
    assert prediction.shape == noisy.shape and ours["hidden_states"].shape == (1, 16 + 24 + 32, 128)
    for name in ("hidden_states", "timestep", "encoder_hidden_states"):
        assert torch.equal(ours[name], theirs[name]), name
    assert torch.equal(ours["img_ids"], theirs["img_ids"][0])
    assert ours["img_ids"][16].tolist() == [10, 0, 0, 0] and ours["img_ids"][-1].tolist() == [20, 7, 3, 0]


def test_reference_counts_are_any_up_to_the_limit(components):
    family = components.family
    assert family.control_problems({0: 3, 1: 2, 10: 1}) == []
    assert family.control_problems({11: 2}) == ["flux2-klein-base-4b takes at most 10 reference (control) images "
                                                "per item; 2 items have 11"]




def write_pairs(root: Path, count: int = 4) -> Path:
    """`count` 64x64 targets with captions and a reference image each (noise, seeded), in musubi's dataset TOML
    shape (image_directory and control_directory); returns the TOML."""
    rng = np.random.default_rng(0)
    images, controls = root / "targets", root / "controls"
    images.mkdir(parents=True)
    controls.mkdir()
    for i in range(count):
        noise_image(rng, 64, 64).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text("make it blue", encoding="utf-8")
        noise_image(rng, 64, 64).save(controls / f"{i}.png")
    toml = root / "dataset.toml"
    toml.write_text(f'[general]\ncaption_extension = ".txt"\nresolution = [64, 64]\nbatch_size = 2\n\n[[datasets]]\n'
                    f'image_directory = "{images}"\ncontrol_directory = "{controls}"\n', encoding="utf-8")
    return toml


def test_a_run_from_pairs_trains_with_its_references_and_samples_beside_them(klein_dir, tmp_path):
    """Two steps from pairs, a sample with its reference image (--ci) written left of the result."""
    from library.network.kohya_format import load_kohya_lora

    toml = write_pairs(tmp_path / "data")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"make it blue --ci {tmp_path / 'data' / 'controls' / '0.png'} --w 64 --h 64 --s 2 --d 1\n")
    result = train(klein_dir, None, tmp_path / "out", "--dataset_config", str(toml), "--max_train_steps", "2",
                   "--sample_every_n_steps", "2", "--sample_prompts", str(prompts),
                   run={"seed": 3, "learning_rate": 1e-3, "network_module": "networks.lora_flux_2",
                        "network_dim": 4, "network_alpha": 2})
    state, _ = load_kohya_lora(result.output_file)
    assert {key.split(".")[0] for key in state} == musubi_modules(2, 2)
    samples = sorted((tmp_path / "out" / "sample").glob("*.png"))
    assert len(samples) == 1
    with Image.open(samples[0]) as image:
        assert image.size == (128, 64)  # the 64x64 reference, then the 64x64 result
        reference = np.asarray(Image.open(tmp_path / "data" / "controls" / "0.png").convert("RGB"))
        assert np.array_equal(np.asarray(image.convert("RGB"))[:, :64], reference)


def test_blocks_to_swap_split_as_musubi_with_its_documented_maxima():
    """musubi's docs: at most 13 for klein 4B (5 double, 20 single blocks), 16 for klein 9B (8, 24), 29 for dev
    (8, 48)."""
    from types import SimpleNamespace

    family = Flux2()
    for (double, single), most, split in (((5, 20), 13, [3, 18]), ((8, 24), 16, [6, 18]), ((8, 48), 29, [6, 44])):
        model = SimpleNamespace(transformer_blocks=[None] * double, single_transformer_blocks=[None] * single)
        assert [count for _, count in family.block_swap_plan(model, most)] == split  # musubi's rounding
        with pytest.raises(UserError, match=f"FLUX.2 swaps at most {double - 2} double and {single - 2} single"):
            family.block_swap_plan(model, most + 1)


# --- the shipped config, trained -------------------------------------------------------------------------------------

CONFIG = REPO / "configs" / "flux2_lora.toml"
# The shipped config at the tiny model's size: no buckets, fp32, a rank-4 LoRA, steps instead of epochs.
RUN = {"resolution": 64, "enable_bucket": "false", "mixed_precision": "no", "save_precision": "float",
       "network_dim": 4, "network_alpha": 2, "learning_rate": 1e-3, "max_train_epochs": 0, "save_every_n_epochs": 0,
       "train_batch_size": 2, "seed": 3, "output_name": "last", "caption_extension": ".txt"}


@pytest.fixture(scope="module")
def reference(klein_dir, small_dataset, tmp_path_factory):
    """Four steps of the shipped config (flux2_shift) on four images, the state saved at step 2."""
    from accelerate.state import AcceleratorState

    root = tmp_path_factory.mktemp("flux2_run")
    data = small_dataset(root / "data")
    result = train(klein_dir, data, root / "out", "--config", str(CONFIG), "--max_train_steps", "4",
                   "--save_every_n_steps", "2", "--save_state", run=RUN)
    AcceleratorState._reset_state(reset_partial_state=True)
    return root, data, result


def test_the_shipped_config_trains_and_writes_musubis_file(reference):
    from library.network.kohya_format import load_kohya_lora

    state, metadata = load_kohya_lora(reference[2].output_file)
    modules = {key.split(".")[0] for key in state}
    assert modules == musubi_modules(2, 2)  # the transformer's only: no text-encoder key
    assert all(state[f"{m}.lora_up.weight"].abs().sum() > 0 for m in modules)
    assert all(float(state[f"{m}.alpha"]) == 2.0 for m in modules)
    assert metadata["ss_base_model_version"] == "flux_2_klein_4b"
    assert metadata["modelspec.architecture"] == "Flux.2-klein-4b/lora"
    assert metadata["modelspec.implementation"] == "https://github.com/black-forest-labs/flux2"
    assert metadata["ss_network_module"] == "networks.lora_flux_2"
    assert (metadata["ss_timestep_sampling"], metadata["ss_weighting_scheme"]) == ("flux2_shift", "none")


def test_a_run_resumes_bit_exactly(reference, klein_dir, tmp_path):
    from library.network.kohya_format import load_kohya_lora

    root, data, straight = reference
    resumed = train(klein_dir, data, tmp_path / "out", "--config", str(CONFIG), "--max_train_steps", "4",
                    "--resume", str(root / "out" / "last-step00000002-state"), run=RUN)
    assert resumed.losses == straight.losses[2:]
    a, b = (load_kohya_lora(r.output_file)[0] for r in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)




@pytest.mark.slow  # about 30 s: two gloo processes, each importing torch and building the model
def test_two_gloo_processes_end_with_the_same_lora(klein_dir, small_dataset, tmp_path):
    """DDP: every LoRA layer gets a gradient on every rank (FLUX.2's text stream runs through the single blocks, so
    no layer is left without one), and the ranks' files agree."""
    from safetensors.torch import load_file

    from tests.helpers.family_cli import ddp_ranks_agree

    ddp_ranks_agree(klein_dir, small_dataset(tmp_path / "data"), tmp_path / "ddp", "--network_module",
                    "networks.lora_flux_2", "--timestep_sampling", "flux2_shift", batch_size=1)
    assert {key.split(".")[0] for key in load_file(tmp_path / "ddp" / "last.safetensors")} == musubi_modules(2, 2)


def test_fp8_base_stores_the_fused_transformer_in_fp8_and_trains_the_lora(klein_dir):
    """fp8_base on FLUX.2: the frozen Linear weights (the fused q, k, v included) are float8_e4m3fn, the step runs
    in bf16 and every LoRA layer gets its gradients."""
    from library.families.settings import settings_from
    from library.training.model import build_model
    from tests.helpers.runs import make_config

    run = make_config(klein_dir, ".", ".", fp8_base=True, mixed_precision="bf16",
                      network_module="networks.lora_flux_2", network_train_unet_only=True, network_dim=4)
    loaded = load_components(klein_dir, weight_dtype=torch.bfloat16, vae_dtype=torch.bfloat16)
    loaded.family = loaded.family.configured(settings_from(loaded.family.settings_type, run))
    model, groups = build_model(run, loaded, torch.device("cpu"))
    assert model.denoiser.transformer_blocks[0].attn.to_qkv.base_layer.weight.dtype == torch.float8_e4m3fn
    _, encoded = musubi_lora.encode_captions(loaded, ["a photo of sks dog"])
    noisy = torch.randn(1, 128, 4, 4, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(noisy, torch.tensor([500.0]), encoded, {}).float().square().mean().backward()
    ups = [p for name, p in model.denoiser.named_parameters() if "lora_B" in name]
    assert len(ups) == len(musubi_modules(2, 2)) and all(p.grad.abs().sum() > 0 for p in ups)
