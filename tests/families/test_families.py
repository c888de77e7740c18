"""Loading a local diffusers model folder."""
from __future__ import annotations

import shutil

import pytest
import torch

from library.config import UserError
from library.families.loading import load_components
from library.families.sd.tiny import save_tiny_sd1
from library.families.shared.clip_text import tokenize


@pytest.fixture(scope="module")
def tiny_v_dir(tmp_path_factory):
    return save_tiny_sd1(tmp_path_factory.mktemp("v") / "tiny-v", prediction_type="v_prediction")


def test_v_prediction_is_read_from_the_scheduler(tiny_sd1_dir, tiny_v_dir):
    assert load_components(tiny_v_dir).v_prediction
    assert not load_components(tiny_sd1_dir).v_prediction
    assert load_components(tiny_sd1_dir, v_parameterization=True).v_prediction


def test_components_load_in_the_weight_dtype(tiny_sd1_dir):
    components = load_components(tiny_sd1_dir, weight_dtype=torch.bfloat16, vae_dtype=torch.float32)
    assert components.denoiser.dtype == torch.bfloat16 and components.text_encoder.dtype == torch.bfloat16
    assert components.vae.dtype == torch.float32
    assert components.base_model_version == "sd_v1"


def test_incomplete_folder_names_what_is_missing(tiny_sd1_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_sd1_dir, copy)
    shutil.rmtree(copy / "vae")
    shutil.rmtree(copy / "tokenizer")
    with pytest.raises(UserError, match="missing vae, tokenizer"):
        load_components(copy)


def test_corrupt_weights_are_a_user_error(tiny_sd1_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_sd1_dir, copy)
    for weights in (copy / "unet").glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="cannot load the model"):
        load_components(copy)


@pytest.mark.parametrize("fixture, model", [("tiny_flux_dir", "FLUX"), ("tiny_sd3_dir", "SD3"),
                                            ("tiny_chroma_dir", "Chroma"), ("tiny_z_image_dir", "Z-Image"),
                                            ("tiny_qwen_image_dir", "Qwen-Image")])
def test_a_transformer_familys_folder_is_read_whole_or_refused_by_name(fixture, model, request, tmp_path):
    folder = request.getfixturevalue(fixture)
    components = load_components(folder, weight_dtype=torch.bfloat16, vae_dtype=torch.float32)
    assert components.family.base_model_version  # told by its transformer's class, read from every subfolder
    assert components.denoiser.dtype == torch.bfloat16 and components.text_encoders[0].dtype == torch.bfloat16
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    shutil.rmtree(copy / "scheduler")
    shutil.rmtree(copy / "tokenizer")
    with pytest.raises(UserError, match=f"not a {model}.* diffusers folder; missing tokenizer, scheduler/"):
        load_components(copy)
    shutil.copytree(folder / "scheduler", copy / "scheduler")
    shutil.copytree(folder / "tokenizer", copy / "tokenizer")
    for weights in (copy / "vae").glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match=f"cannot load the {model}"):
        load_components(copy)


def test_unreadable_single_file_checkpoint_is_a_user_error(tmp_path):
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        load_components(checkpoint)


def test_tokenize_pads_to_the_model_length(tiny_sd1_dir):
    tokenizer = load_components(tiny_sd1_dir).tokenizer
    ids = tokenize(tokenizer, "sks shape, a red circle")
    assert ids.shape == (77,)
    assert ids[0].item() == tokenizer.bos_token_id
    long_ids = tokenize(tokenizer, "word " * 200)
    assert long_ids.shape == (77,) and long_ids[-1].item() == tokenizer.eos_token_id
