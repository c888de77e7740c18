"""Single-file checkpoints (original SD / LDM layout): detection, offline loading, pickles, training."""
from __future__ import annotations

import argparse
import hashlib
import logging
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors import safe_open
from safetensors.torch import save_file

from library.config import ConfigError, UserError, parse_config
from library.families.loading import load_components
from library.families.sd.single_file import (
    ARCHITECTURES,
    CLIP_PREFIX,
    CONFIG_ROOT,
    detect_architecture,
    load_single_file,
    load_tokenizer,
    read_checkpoint,
)
from library.families.sd.single_file import main as convert_main
from library.families.sd.tiny import save_tiny_sd1_single_file
from library.families.shared.ldm_export import ldm_state_dict
from library.training import loop


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    """The session's tiny SD1 model (same size and seed as tiny_sd1_dir) as one LDM-layout safetensors file."""
    return save_tiny_sd1_single_file(tmp_path_factory.mktemp("single") / "tiny.safetensors")


@pytest.fixture(scope="module")
def tiny_sd2_file(tmp_path_factory) -> Path:
    return save_tiny_sd1_single_file(tmp_path_factory.mktemp("single2") / "tiny-sd2.safetensors", open_clip=True)


def assert_same_weights(loaded, reference) -> None:
    ours, theirs = loaded.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not different, different[:5]


def shapes_of(keys: dict[str, tuple[int, ...]] | list[str]) -> dict[str, tuple[int, ...]]:
    return dict(keys) if isinstance(keys, dict) else {k: (1,) for k in keys}


SD1_KEYS = ["model.diffusion_model.input_blocks.0.0.weight", "first_stage_model.encoder.conv_in.weight",
            CLIP_PREFIX + "text_model.embeddings.position_embedding.weight"]
SD2_KEYS = SD1_KEYS[:2] + ["cond_stage_model.model.token_embedding.weight"]
SDXL_KEYS = SD1_KEYS[:2] + ["conditioner.embedders.0.transformer.text_model.final_layer_norm.weight",
                            "conditioner.embedders.1.model.positional_embedding"]


# --- loading the file gives exactly the folder's model ------------------------------------------------------------

def test_single_file_loads_the_same_weights_as_the_folder(tiny_file, tiny_sd1_dir):
    loaded = load_single_file(tiny_file, model_config=tiny_sd1_dir)
    reference = load_components(tiny_sd1_dir)
    assert loaded.architecture.name == "sd1"
    for name, ours in (("unet", reference.denoiser), ("vae", reference.vae), ("text_encoder", reference.text_encoder)):
        assert_same_weights(loaded.parts[name], ours)
    caption = "sks shape, a red circle"
    assert loaded.parts["tokenizer"](caption).input_ids == reference.tokenizer(caption).input_ids
    assert loaded.parts["scheduler"].config == reference.noise_scheduler.config


def test_components_from_a_file_keep_the_flags_and_dtypes(tiny_file, tiny_sd1_dir):
    components = load_components(tiny_file, v_parameterization=True, weight_dtype=torch.bfloat16,
                                    model_config=tiny_sd1_dir)
    assert components.v_prediction and components.base_model_version == "sd_v1"
    assert components.denoiser.dtype == torch.bfloat16 and components.text_encoder.dtype == torch.bfloat16
    assert components.vae.dtype == torch.float32


def test_open_clip_text_encoder_reads_as_sd2(tiny_sd2_file, tiny_sd1_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="library.families.sd.single_file"):
        loaded = load_single_file(tiny_sd2_file, model_config=tiny_sd1_dir, v2=True)
    assert loaded.architecture.name == "sd2"
    assert "v_parameterization" in caplog.text  # 512 base and 768-v cannot be told apart
    reference = load_components(tiny_sd1_dir)
    # q/k/v were joined into in_proj in the file
    for name, ours in (("unet", reference.denoiser), ("vae", reference.vae), ("text_encoder", reference.text_encoder)):
        assert_same_weights(loaded.parts[name], ours)


def test_sdxl_single_file_loads_the_same_weights_as_the_folder(tmp_path):
    from library.families.sd.single_file import save_checkpoint
    from library.families.sd.tiny import build_tiny_sdxl, save_tiny_sdxl

    folder = save_tiny_sdxl(tmp_path / "xl")
    parts = build_tiny_sdxl()
    path = save_checkpoint(ldm_state_dict(parts["unet"], parts["vae"], parts["text_encoder"],
                                          text_encoder_2=parts["text_encoder_2"]), tmp_path / "xl.safetensors")
    components = load_components(path, model_config=folder)
    reference = load_components(folder)
    assert components.family.name == "sdxl" and components.base_model_version == "sdxl_base_v1-0"
    # The tiny encoders are equally wide, so only their key prefixes keep them apart.
    for ours, theirs in zip([components.denoiser, components.vae, *components.text_encoders],
                            [reference.denoiser, reference.vae, *reference.text_encoders], strict=True):
        assert_same_weights(ours, theirs)
    assert components.tokenizers[1].pad_token == reference.tokenizers[1].pad_token == "!"


@pytest.mark.parametrize("file_fixture", ["tiny_file", "tiny_sd2_file"])
def test_reading_component_by_component_gives_the_bits_of_the_whole_file_read(file_fixture, tiny_sd1_dir, request):
    """The file is read one component at a time, each tensor cast to the training dtype as it is read; the
    weights must equal those diffusers makes when it converts and casts the whole file's state dict (the load
    before this reader), for every component and in a dtype other than the file's."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm
    from transformers import CLIPTextModel

    path = request.getfixturevalue(file_fixture)
    v2 = file_fixture == "tiny_sd2_file"
    with safe_open(path, "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    loaded = load_single_file(path, model_config=tiny_sd1_dir, v2=v2, weight_dtype=torch.bfloat16,
                              vae_dtype=torch.float16).parts
    whole = read_checkpoint(path)
    common = {"config": str(tiny_sd1_dir), "local_files_only": True}
    prefix = "cond_stage_model.model." if v2 else CLIP_PREFIX
    references = {
        "unet": UNet2DConditionModel.from_single_file(whole, subfolder="unet", torch_dtype=torch.bfloat16, **common),
        "vae": AutoencoderKL.from_single_file(whole, subfolder="vae", torch_dtype=torch.float16, **common),
        "text_encoder": create_diffusers_clip_model_from_ldm(
            CLIPTextModel, {k: v for k, v in whole.items() if k.startswith(prefix)}, subfolder="text_encoder",
            torch_dtype=torch.bfloat16, **common),
    }
    for name, reference in references.items():
        assert {p.dtype for p in loaded[name].parameters()} == {torch.float16 if name == "vae" else torch.bfloat16}
        assert_same_weights(loaded[name], reference)


def test_a_truncated_safetensors_file_is_a_user_error(tiny_file, tiny_sd1_dir, tmp_path):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(tiny_file.read_bytes()[:-1000])
    with pytest.raises(UserError, match="not a readable safetensors file"):
        load_single_file(cut, model_config=tiny_sd1_dir)


def test_v2_flag_on_an_sd1_file_is_an_error(tiny_file, tiny_sd1_dir):
    with pytest.raises(UserError, match="v2 is set, but .* Stable Diffusion 1.x"):
        load_components(tiny_file, v2=True, model_config=tiny_sd1_dir)


def test_clip_saved_without_the_text_model_level_still_loads(tiny_file, tiny_sd1_dir, tmp_path):
    # Checkpoints saved with transformers < 4.21 lack `text_model.` in the text encoder's keys.
    old = {k.replace(CLIP_PREFIX + "text_model.", CLIP_PREFIX): v for k, v in read_checkpoint(tiny_file).items()}
    assert not any(k.startswith(CLIP_PREFIX + "text_model.") for k in old)
    save_file(old, tmp_path / "old.safetensors")
    loaded = load_single_file(tmp_path / "old.safetensors", model_config=tiny_sd1_dir)
    assert_same_weights(loaded.parts["text_encoder"], load_components(tiny_sd1_dir).text_encoder)


def test_widths_that_do_not_fit_the_shipped_config_name_model_config(tiny_file):
    with pytest.raises(UserError, match=r"has shape \[128, 32\] in the file but \[1280, 320\] in the config.*"
                                        r"model_config"):
        load_components(tiny_file)


def test_a_file_missing_weights_is_a_user_error(tiny_file, tiny_sd1_dir, tmp_path):
    state = read_checkpoint(tiny_file)
    del state["model.diffusion_model.out.2.bias"]  # the UNet's conv_out.bias
    save_file(state, tmp_path / "partial.safetensors")
    with pytest.raises(UserError, match=r"the unet weights in the file are incomplete .*some tensors are missing"):
        load_components(tmp_path / "partial.safetensors", model_config=tiny_sd1_dir)


def test_incomplete_model_config_names_what_is_missing(tiny_file, tiny_sd1_dir, tmp_path):
    with pytest.raises(UserError, match="missing unet/config.json, vae/config.json, text_encoder/config.json, "
                                        "tokenizer/, scheduler/scheduler_config.json"):
        load_components(tiny_file, model_config=tmp_path)


# --- the shipped configs are the real architectures ------------------------------------------------------------

@pytest.mark.parametrize("name, open_clip", [("sd1", False), ("sd2", True)])
def test_shipped_config_matches_the_full_size_ldm_layout(name, open_clip):
    """Every key of a full-size checkpoint maps onto a parameter of the shipped config's model, as diffusers
    converts it (meta tensors: no memory), and the parameter counts are those of the released models."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
        convert_open_clip_checkpoint,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    folder = CONFIG_ROOT / name
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder / "unet"))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(folder / "vae"))
        text_encoder = CLIPTextModel(CLIPTextConfig.from_pretrained(folder / "text_encoder"))
    ldm = ldm_state_dict(unet, vae, text_encoder, open_clip=open_clip)
    width = 1024 if open_clip else 768
    assert ldm["model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"].shape == (320, width)
    assert ldm["model.diffusion_model.output_blocks.11.0.skip_connection.weight"].shape == (320, 640, 1, 1)
    assert ldm["first_stage_model.encoder.mid.attn_1.q.weight"].shape == (512, 512, 1, 1)
    assert detect_architecture({k: tuple(v.shape) for k, v in ldm.items()}).name == name

    converted_te = convert_open_clip_checkpoint(text_encoder, ldm) if open_clip else convert_ldm_clip_checkpoint(ldm)
    converted = {
        unet: convert_ldm_unet_checkpoint(ldm, dict(unet.config)),
        vae: convert_ldm_vae_checkpoint(ldm, dict(vae.config)),
        text_encoder: {k.removeprefix("text_model."): v for k, v in converted_te.items()},
    }
    for model, state in converted.items():
        expected = model.state_dict()
        assert state.keys() == expected.keys()
        assert all(state[k].shape == expected[k].shape for k in expected)
    counts = [sum(p.numel() for p in m.parameters()) for m in (unet, vae, text_encoder)]
    assert counts == ([859_520_964, 83_653_863, 123_060_480] if name == "sd1"
                      else [865_910_724, 83_653_863, 340_387_840])


def test_shipped_sdxl_config_matches_the_full_size_ldm_layout():
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_open_clip_checkpoint,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    folder = CONFIG_ROOT / "sdxl"
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder / "unet"))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(folder / "vae"))
        text_encoder = CLIPTextModel(CLIPTextConfig.from_pretrained(folder / "text_encoder"))
        text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(folder / "text_encoder_2"))
    ldm = ldm_state_dict(unet, vae, text_encoder, text_encoder_2=text_encoder_2)
    assert ldm["model.diffusion_model.label_emb.0.0.weight"].shape == (1280, 2816)
    assert "conditioner.embedders.1.model.transformer.resblocks.9.mlp.c_proj.bias" in ldm
    assert detect_architecture({k: tuple(v.shape) for k, v in ldm.items()}).name == "sdxl"
    converted = {
        unet: convert_ldm_unet_checkpoint(ldm, dict(unet.config)),
        text_encoder: {k.removeprefix("text_model."): v for k, v in convert_ldm_clip_checkpoint(ldm).items()
                       if not k.startswith("conditioner.")},
        text_encoder_2: convert_open_clip_checkpoint(text_encoder_2, ldm, prefix="conditioner.embedders.1.model."),
    }
    for model, state in converted.items():
        expected = model.state_dict()
        assert state.keys() == expected.keys()
        assert all(state[k].shape == expected[k].shape for k in expected)
    assert sum(p.numel() for p in unet.parameters()) == 2_567_463_684
    assert sum(p.numel() for p in text_encoder_2.parameters()) == 694_659_840


@pytest.mark.parametrize("name, pad_id", [("sd1", 49407), ("sd2", 0)])
def test_shipped_tokenizer_is_clips(name, pad_id):
    tokenizer = load_tokenizer(CONFIG_ROOT / name)
    assert len(tokenizer) == 49408 and tokenizer.model_max_length == 77
    assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert tokenizer.pad_token_id == pad_id  # SD2 (OpenCLIP) pads with "!", SD1 with the end token


# --- telling the architecture -----------------------------------------------------------------------------------

@pytest.mark.parametrize("keys, name", [(SD1_KEYS, "sd1"), (SD2_KEYS, "sd2"), (SDXL_KEYS, "sdxl")])
def test_architecture_is_told_from_the_keys(keys, name):
    assert detect_architecture(shapes_of(keys)) is ARCHITECTURES[name]


@pytest.mark.parametrize("keys, message", [
    (["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"], "LoRA / network file, not a base model"),
    (["down_blocks.0.resnets.0.conv1.weight", "conv_in.weight"], "single diffusers component"),
    (["model.diffusion_model.double_blocks.0.img_attn.qkv.weight"], "SD3 / Flux"),
    (["encoder.layers.0.weight", "decoder.up.0.block.0.weight"], r"no UNet keys .*Found: encoder.layers \(1 key\)"),
    (SD1_KEYS[:2], r"no known text encoder. Found: model.diffusion_model \(1 key\), first_stage_model"),
    ([SD1_KEYS[0], SD1_KEYS[2]], "Stable Diffusion 1.x checkpoint without its VAE"),
    (SD1_KEYS[:2] + ["conditioner.embedders.0.model.text_projection"], "SDXL refiner"),
])
def test_unknown_layouts_name_what_was_found(keys, message):
    with pytest.raises(UserError, match=message):
        detect_architecture(shapes_of(keys), "model.safetensors")


def test_inpainting_unet_is_refused():
    shapes = {**shapes_of(SD1_KEYS), "model.diffusion_model.input_blocks.0.0.weight": (320, 9, 3, 3)}
    with pytest.raises(UserError, match="9 input channels"):
        detect_architecture(shapes)


def test_unrecognised_file_is_a_user_error_naming_its_keys(tmp_path):
    path = tmp_path / "mystery.safetensors"
    save_file({"net.layer1.weight": torch.zeros(2), "net.layer2.weight": torch.zeros(2)}, path)
    with pytest.raises(UserError, match=r"cannot tell the model family.*Found: net.layer1 \(1 key\), net.layer2"):
        load_components(path)


def test_a_family_the_caller_cannot_train_is_refused_before_loading_weights(tmp_path):
    path = tmp_path / "xl.safetensors"
    save_file({k: torch.zeros(1) for k in SDXL_KEYS}, path)  # only the keys: loading weights would fail
    with pytest.raises(UserError, match="is a Stable Diffusion XL checkpoint; single files of Stable Diffusion 1.x, "
                                        "Stable Diffusion 2.x can be trained"):
        load_single_file(path, architectures=("sd1", "sd2"))


def test_corrupt_safetensors_is_a_user_error(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"not a safetensors file at all")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        load_components(path)


# --- pickles -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_ckpt(tiny_file, tmp_path_factory) -> Path:
    """The tiny model as a Lightning-style pickle whose extra object needs full unpickling."""
    path = tmp_path_factory.mktemp("pickle") / "tiny.ckpt"
    torch.save({"state_dict": read_checkpoint(tiny_file), "global_step": 7,
                "hyper_parameters": argparse.Namespace(lr=1e-4)}, path)
    return path


def test_pickle_checkpoint_is_refused_with_the_way_out(tiny_ckpt, tiny_sd1_dir):
    with pytest.raises(UserError) as refused:
        load_components(tiny_ckpt, model_config=tiny_sd1_dir)
    message = str(refused.value)
    assert "arbitrary code" in message and "allow_pickle_checkpoints = true" in message
    assert "python -m library.families.sd.single_file" in message and "tiny.safetensors" in message


def test_pickle_loads_when_allowed(tiny_ckpt, tiny_sd1_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="library.families.sd.single_file"):
        components = load_components(tiny_ckpt, model_config=tiny_sd1_dir, allow_pickle_checkpoints=True)
    assert "needs full unpickling" in caplog.text  # the Namespace is not a tensor: the safe loader refused it
    reference = load_components(tiny_sd1_dir)
    for name in ("denoiser", "vae", "text_encoder"):
        assert_same_weights(getattr(components, name), getattr(reference, name))


def test_converter_writes_safetensors_only_without_running_code(tiny_file, tiny_ckpt, tmp_path, capsys):
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": read_checkpoint(tiny_file), "global_step": 7}, plain)
    assert convert_main([str(plain), str(tmp_path / "plain.safetensors")]) == 0
    converted, original = read_checkpoint(tmp_path / "plain.safetensors"), read_checkpoint(tiny_file)
    assert converted.keys() == original.keys() and all(torch.equal(converted[k], original[k]) for k in original)

    with pytest.raises(SystemExit) as refused:
        convert_main([str(tiny_ckpt), str(tmp_path / "objects.safetensors")])
    assert refused.value.code == 2 and not (tmp_path / "objects.safetensors").exists()
    assert "running code from the file" in capsys.readouterr().err


def config_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--output_dir", str(out),
            *extra]


def test_config_checks_the_model_file(tiny_ckpt, tiny_file, tiny_sd1_dir, sample_data_dir, tmp_path):
    with pytest.raises(ConfigError) as refused:
        parse_config(config_args(tiny_ckpt, sample_data_dir, tmp_path))
    assert "pickle checkpoint" in str(refused.value)
    parse_config(config_args(tiny_ckpt, sample_data_dir, tmp_path, "--allow_pickle_checkpoints"))

    text = tmp_path / "model.txt"
    text.write_text("x")
    with pytest.raises(ConfigError, match="not a model folder or a known checkpoint file"):
        parse_config(config_args(text, sample_data_dir, tmp_path))
    with pytest.raises(ConfigError, match="model_config: .*missing-folder is not a folder"):
        parse_config(config_args(tiny_file, sample_data_dir, tmp_path, "--model_config",
                                 str(tmp_path / "missing-folder")))
    with pytest.raises(ConfigError, match="pretrained_model_name_or_path is a folder.*remove model_config"):
        parse_config(config_args(tiny_sd1_dir, sample_data_dir, tmp_path, "--model_config", str(tiny_sd1_dir)))


# --- training ---------------------------------------------------------------------------------------------------

def test_single_file_trains_identically_to_the_folder(tiny_file, tiny_sd1_dir, sample_data_dir, tmp_path,
                                                      fresh_accelerator_state):
    common = ("--resolution", "64", "--caption_extension", ".txt", "--train_batch_size", "2", "--seed", "3",
              "--max_train_steps", "3", "--learning_rate", "1e-3", "--network_dim", "4")
    folder_config, _ = parse_config(config_args(tiny_sd1_dir, sample_data_dir, tmp_path / "folder", *common))
    folder = loop.run(folder_config)
    AcceleratorState._reset_state(reset_partial_state=True)
    file_config, _ = parse_config(config_args(tiny_file, sample_data_dir, tmp_path / "file", *common,
                                              "--model_config", str(tiny_sd1_dir)))
    single = loop.run(file_config)

    assert len(single.losses) == 3 and single.losses == folder.losses
    with safe_open(folder.output_file, "pt") as a, safe_open(single.output_file, "pt") as b:
        assert set(a.keys()) == set(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
        assert b.metadata()["ss_sd_model_name"] == "tiny.safetensors"
        assert b.metadata()["ss_base_model_version"] == a.metadata()["ss_base_model_version"] == "sd_v1"
        # kohya's base-model hashes: AUTOMATIC1111's old short hash and the file's sha256; a folder has none.
        raw = Path(tiny_file).read_bytes()
        assert b.metadata()["ss_sd_model_hash"] == hashlib.sha256(raw[0x100000:0x110000]).hexdigest()[:8]
        assert b.metadata()["ss_new_sd_model_hash"] == hashlib.sha256(raw).hexdigest()
        assert "ss_sd_model_hash" not in a.metadata() and "ss_new_sd_model_hash" not in a.metadata()
