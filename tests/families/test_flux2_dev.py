"""FLUX.2 [dev]: the folder and musubi's files, the Mistral prompt and the transformer call (guidance input
included) against Flux2Pipeline's own, the LoRA file in Flux2Pipeline.load_lora_weights, and training from edit
pairs with the shipped config: exact resume, a --ci sample, two gloo processes."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from library.config import UserError
from library.config.network_args import NetworkArgs
from library.families.flux2 import latents as flux2_latents
from library.families.flux2 import lora as flux2_lora
from library.families.flux2.family import Flux2
from library.families.loading import load_components
from tests.helpers import REPO, musubi_lora
from tests.helpers.datasets import write_pairs
from tests.helpers.lora_files import file_delta
from tests.helpers.runs import family_settings, train

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory) -> Path:
    from library.families.flux2.tiny import save_tiny_flux2_dev

    return save_tiny_flux2_dev(tmp_path_factory.mktemp("tiny_flux2_dev") / "model", seed=0)


@pytest.fixture(scope="module")
def components(dev_dir):
    return load_components(dev_dir)


@pytest.fixture(scope="module")
def pipe(dev_dir):
    from diffusers import Flux2Pipeline

    return Flux2Pipeline.from_pretrained(dev_dir, local_files_only=True)


# --- the folder and the files ---------------------------------------------------------------------------------------

def test_a_dev_folder_is_told_by_its_pipeline_and_model_version_is_checked(dev_dir, components):
    from transformers import Mistral3ForConditionalGeneration

    assert components.family == Flux2("dev") and components.family.name == "flux2-dev"
    assert components.base_model_version == "flux_2_dev"
    assert isinstance(components.text_encoders[0], Mistral3ForConditionalGeneration)
    assert load_components(dev_dir, model_version="dev").family == components.family
    with pytest.raises(UserError, match='holds FLUX.2 dev; set model_version = "dev"'):
        load_components(dev_dir, model_version="klein-base-4b")
    with pytest.raises(UserError) as refused:  # musubi trains [dev]'s guidance input at 1.0 only
        components.family.configured(family_settings(Flux2, guidance_scale=3.5, resolution=(72, 64)))
    text = str(refused.value)
    assert "guidance_scale: not for FLUX.2 [dev] training (its guidance input is 1" in text
    assert "multiples of 16" in text and "no guidance input" not in text


def test_musubis_files_load_to_the_folders_weights(dev_dir, components, tmp_path):
    """BFL's flux2-dev.safetensors, the Mistral split files in the older Mistral3 key layout (language_model.model.
    ...) with the tokenizer/ folder beside text_encoder/, and ae.safetensors: the transformer and autoencoder are
    the folder's, the text encoder its language model (the vision tower is not loaded). The tiny widths need
    model_config; without the tokenizer folder the files are refused, naming it."""
    from safetensors.torch import load_file

    from library.families.flux2.tiny import save_tiny_flux2_dev_files

    files = save_tiny_flux2_dev_files(dev_dir, tmp_path / "FLUX.2-dev")
    assert any(key.startswith("language_model.model.layers.") for key in load_file(files["text_encoder"]))
    separate = {"text_encoder": str(files["text_encoder"]), "ae": str(files["ae"])}
    loaded = load_components(files["transformer"], model_config=dev_dir, **separate)
    assert loaded.family == Flux2("dev")
    for ours, reference in ((loaded.denoiser, components.denoiser), (loaded.vae.vae, components.vae.vae)):
        a, b = ours.state_dict(), reference.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    language = {k.replace("model.language_model.", "model."): v
                for k, v in components.text_encoders[0].state_dict().items() if "vision" not in k
                and "projector" not in k}
    mistral = loaded.text_encoders[0].state_dict()
    assert mistral.keys() == language.keys() and all(torch.equal(mistral[k], language[k]) for k in mistral)
    with pytest.raises(UserError, match="Mistral Small 3.1's heads of 128; set model_config"):
        load_components(files["transformer"], **separate)
    with pytest.raises(UserError, match=r"holds FLUX.2 dev; set model_version = \"dev\""):
        load_components(files["transformer"], model_config=dev_dir, model_version="klein-4b", **separate)
    config = shutil.copytree(dev_dir, tmp_path / "config", ignore=shutil.ignore_patterns("tokenizer"))
    shutil.rmtree(tmp_path / "FLUX.2-dev" / "tokenizer")
    with pytest.raises(UserError, match="tokenizer/ folder beside text_encoder/, or set model_config"):
        load_components(files["transformer"], model_config=config, **separate)


# --- the prompt and the transformer call, against the pipeline --------------------------------------------------------

def test_prompts_are_the_pipelines_mistral_layers_10_20_30_after_its_system_message(components, pipe):
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    batch, ours = musubi_lora.encode_captions(components, ["a photo of sks dog", "red [IMG]"])
    assert batch["input_ids"].shape == (2, 512)
    text = components.tokenizers[0].decode(batch["input_ids"][1][batch["attention_mask"][1].bool()])
    assert text == f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]red [/INST]"
    with torch.no_grad():
        theirs, _ = pipe.encode_prompt(["a photo of sks dog", "red [IMG]"], device="cpu")
    assert ours.keys() == {"encoder_hidden_states"} and ours["encoder_hidden_states"].shape == (2, 512, 3 * 16)
    assert torch.equal(ours["encoder_hidden_states"], theirs)
    hidden = components.text_encoders[0].model(input_ids=batch["input_ids"][:1], output_hidden_states=True,
                                                attention_mask=batch["attention_mask"][:1]).hidden_states
    assert len(hidden) == 31 and torch.equal(theirs[:1, :, 16:32], hidden[20])  # the second of the three is 20


def test_denoise_gives_the_transformer_what_the_pipeline_gives_it_guidance_included(components, pipe):
    """One pipeline step with guidance 1.0 (musubi's training value): the latents, time, text, positions and the
    guidance input of the pipeline's call are ours; a reference image follows the image tokens at t = 10."""
    _, encoded = musubi_lora.encode_captions(components, ["make it blue"])
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8))
    calls: list[dict] = []
    transformer = pipe.transformer
    hook = transformer.register_forward_pre_hook(lambda _, args, kwargs: calls.append(dict(kwargs)),
                                                 with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(image=[image], prompt_embeds=encoded["encoder_hidden_states"], guidance_scale=1.0, height=64,
                 width=64, num_inference_steps=1, generator=torch.Generator().manual_seed(0), output_type="latent")
            theirs = calls[-1]
            pixels = pipe.image_processor.preprocess(image, height=64, width=96)
            conditioning = components.family.control_conditioning([components.vae.encode(pixels).latent_dist.mean])
            noisy = flux2_latents.unpack(theirs["hidden_states"][:, :16], 4, 4)
            prediction = components.family.denoise(transformer, noisy, theirs["timestep"] * 1000, encoded,
                                                   conditioning)
            ours = calls[-1]
    finally:
        hook.remove()
    assert prediction.shape == noisy.shape and ours["hidden_states"].shape == (1, 16 + 24, 128)
    for name in ("hidden_states", "timestep", "encoder_hidden_states", "guidance"):
        assert torch.equal(ours[name], theirs[name]), name
    assert ours["guidance"].tolist() == [1.0]
    for name in ("img_ids", "txt_ids"):
        assert torch.equal(ours[name], theirs[name][0]), name
    assert ours["img_ids"][16].tolist() == [10, 0, 0, 0]


def test_sampling_is_flux2_pipelines_with_g_as_its_guidance_input(components, tmp_path):
    """Our sample is Flux2Pipeline's for the same prompt embeddings: --g is the guidance input (4.0 without it, as
    musubi and the pipeline), and no CFG is run."""
    from diffusers import Flux2Pipeline

    from tests.helpers.family_checks import assert_same_image, pipeline_scheduler, sample, sampling_models

    _, (plain, guided) = sample(sampling_models(components), tmp_path,
                                "a photo of sks dog --s 2 --w 64 --h 64 --d 3\n"
                                "a photo of sks dog --g 1.5 --s 2 --w 64 --h 64 --d 3\n")
    _, positive = musubi_lora.encode_captions(components, ["a photo of sks dog"])
    pipe = Flux2Pipeline(scheduler=pipeline_scheduler(components), vae=components.vae.vae,
                         text_encoder=components.text_encoders[0], tokenizer=components.tokenizers[0],
                         transformer=components.denoiser)
    with torch.no_grad():
        for ours, scale in ((plain, 4.0), (guided, 1.5)):
            theirs = pipe(prompt_embeds=positive["encoder_hidden_states"], guidance_scale=scale,
                          num_inference_steps=2, width=64, height=64,
                          generator=torch.Generator().manual_seed(3)).images[0]
            assert_same_image(ours, theirs)
    assert not np.array_equal(plain, guided)


# --- LoRA ------------------------------------------------------------------------------------------------------------

def test_diffusers_load_lora_weights_consumes_every_key_with_the_same_change(dev_dir, components):
    """Flux2Pipeline.load_lora_weights on our file (musubi's names), into the folder's own unfused transformer:
    every module of the file becomes LoRA layers whose weight changes, q, k and v stacked, equal ours."""
    from diffusers import Flux2Pipeline

    ours = musubi_lora.random_lora(components.denoiser, flux2_lora.targets(components.denoiser, NetworkArgs()))
    written = flux2_lora.to_file(ours)
    assert {key.split(".")[0] for key in written} == MUSUBI_MODULES
    pipe = Flux2Pipeline.from_pretrained(dev_dir, local_files_only=True)
    pipe.load_lora_weights(written, adapter_name="ours")
    loaded = {name: module.get_delta_weight("ours") for name, module in pipe.transformer.named_modules()
              if hasattr(module, "lora_A")}
    assert len(loaded) == 2 * 12 + 2 * 2
    for i in range(2):
        block = f"transformer_blocks.{i}.attn."
        for fused, parts in (("to_qkv", ("to_q", "to_k", "to_v")),
                             ("to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"))):
            stacked = torch.cat([loaded.pop(block + part) for part in parts])
            torch.testing.assert_close(stacked, file_delta(ours, "lora_unet_" + (block + fused).replace(".", "_")))
    for name, delta in loaded.items():
        torch.testing.assert_close(delta, file_delta(ours, "lora_unet_" + name.replace(".", "_")), rtol=1e-5,
                                   atol=1e-6)


# --- the shipped config, trained from edit pairs ---------------------------------------------------------------------

CONFIG = REPO / "configs" / "flux2_dev_lora.toml"
# musubi's networks.lora_flux_2 modules of the tiny transformer (2 double, 2 single blocks): every Linear of BFL's
# DoubleStreamBlock and SingleStreamBlock, named by its BFL path
MUSUBI_MODULES = ({f"lora_unet_double_blocks_{i}_{name}" for i in range(2) for name in (
    "img_attn_qkv", "img_attn_proj", "img_mlp_0", "img_mlp_2", "txt_attn_qkv", "txt_attn_proj", "txt_mlp_0",
    "txt_mlp_2")} | {f"lora_unet_single_blocks_{i}_{name}" for i in range(2) for name in ("linear1", "linear2")})
# The shipped config at the tiny model's size: fp32 without fp8 or block swap, a rank-4 LoRA, steps for epochs.
RUN = {"mixed_precision": "no", "save_precision": "float", "fp8_base": "false", "blocks_to_swap": 0,
       "network_dim": 4, "network_alpha": 2, "learning_rate": 1e-3, "max_train_epochs": 0, "save_every_n_epochs": 0,
       "seed": 3, "output_name": "last"}


@pytest.fixture(scope="module")
def reference(dev_dir, tmp_path_factory):
    """Four steps of the shipped config on four edit pairs, the state saved at step 2, a --ci sample at step 4."""
    from accelerate.state import AcceleratorState

    root = tmp_path_factory.mktemp("flux2_dev_run")
    toml = write_pairs(root / "data")
    prompts = root / "prompts.txt"
    prompts.write_text(f"make it blue --ci {root / 'data' / 'controls' / '0.png'} --w 64 --h 64 --s 2 --d 1\n")
    result = train(dev_dir, None, root / "out", "--config", str(CONFIG), "--dataset_config", str(toml),
                   "--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state",
                   "--sample_every_n_steps", "4", "--sample_prompts", str(prompts), run=RUN)
    AcceleratorState._reset_state(reset_partial_state=True)
    return root, toml, result


def test_the_shipped_config_trains_from_pairs_and_writes_musubis_file(reference):
    from library.network.kohya_format import load_kohya_lora

    root, _, result = reference
    state, metadata = load_kohya_lora(result.output_file)
    modules = {key.split(".")[0] for key in state}
    assert modules == MUSUBI_MODULES  # the transformer's only: no text-encoder key
    assert all(state[f"{m}.lora_up.weight"].abs().sum() > 0 for m in modules)
    assert metadata["ss_base_model_version"] == "flux_2_dev"
    assert metadata["modelspec.architecture"] == "Flux.2-dev/lora"
    assert metadata["ss_network_module"] == "networks.lora_flux_2"
    assert (metadata["ss_timestep_sampling"], metadata["ss_weighting_scheme"]) == ("flux2_shift", "none")
    samples = sorted((root / "out" / "sample").glob("*.png"))
    assert len(samples) == 1
    with Image.open(samples[0]) as image:
        assert image.size == (128, 64)  # the 64x64 reference, then the 64x64 result
        control = np.asarray(Image.open(root / "data" / "controls" / "0.png").convert("RGB"))
        assert np.array_equal(np.asarray(image.convert("RGB"))[:, :64], control)


def test_a_run_from_pairs_resumes_bit_exactly(reference, dev_dir, tmp_path):
    from library.network.kohya_format import load_kohya_lora

    root, toml, straight = reference
    resumed = train(dev_dir, None, tmp_path / "out", "--config", str(CONFIG), "--dataset_config", str(toml),
                    "--max_train_steps", "4", "--resume", str(root / "out" / "last-step00000002-state"), run=RUN)
    assert resumed.losses == straight.losses[2:]
    a, b = (load_kohya_lora(r.output_file)[0] for r in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # about 30 s: two gloo processes, each importing torch and building the model
def test_two_gloo_processes_end_with_the_same_lora(dev_dir, small_dataset, tmp_path):
    """DDP on [dev]: every LoRA layer gets a gradient on every rank (guidance input included in the call), and the
    ranks' files agree."""
    from safetensors.torch import load_file

    from tests.helpers.family_cli import ddp_ranks_agree

    ddp_ranks_agree(dev_dir, small_dataset(tmp_path / "data"), tmp_path / "ddp", "--network_module",
                    "networks.lora_flux_2", "--timestep_sampling", "flux2_shift", batch_size=1)
    assert {key.split(".")[0] for key in load_file(tmp_path / "ddp" / "last.safetensors")} == MUSUBI_MODULES


def test_fp8_base_stores_the_transformer_and_mistral_in_fp8_and_trains_the_lora(dev_dir):
    """The shipped config's fp8_base on [dev]: the frozen Linear weights of the transformer (the fused q, k, v
    included) and of Mistral are float8_e4m3fn, the prompt encodes to finite states, the step runs in bf16 and
    every LoRA layer gets its gradients."""
    from library.families.settings import settings_from
    from library.training.model import build_model
    from tests.helpers.runs import make_config

    run = make_config(dev_dir, ".", ".", fp8_base=True, mixed_precision="bf16",
                      network_module="networks.lora_flux_2", network_train_unet_only=True, network_dim=4)
    loaded = load_components(dev_dir, weight_dtype=torch.bfloat16, vae_dtype=torch.bfloat16)
    loaded.family = loaded.family.configured(settings_from(loaded.family.settings_type, run))
    model, _ = build_model(run, loaded, torch.device("cpu"))
    assert model.denoiser.transformer_blocks[0].attn.to_qkv.base_layer.weight.dtype == torch.float8_e4m3fn
    mistral = loaded.text_encoders[0].model.language_model
    assert mistral.layers[0].mlp.gate_proj.weight.dtype == torch.float8_e4m3fn
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, encoded = musubi_lora.encode_captions(loaded, ["a photo of sks dog"])
        assert encoded["encoder_hidden_states"].isfinite().all()
        noisy = torch.randn(1, 128, 4, 4, dtype=torch.bfloat16)
        model(noisy, torch.tensor([500.0]), encoded, {}).float().square().mean().backward()
    ups = [p for name, p in model.denoiser.named_parameters() if "lora_B" in name]
    assert len(ups) == len(MUSUBI_MODULES) and all(p.grad.abs().sum() > 0 for p in ups)
