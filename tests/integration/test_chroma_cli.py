"""Chroma through train_network.py as a user runs it: kohya's --model_type chroma options in a TOML, the file and its
metadata, sample images, exact resume, the BFL files training like the folder, a refusal with exit code 2, and two
gloo processes (DDP)."""
from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from library.network.kohya_format import load_kohya_lora
from tests.helpers.cli import refused_in_process, run_cli, write
from tests.helpers.datasets import copy_images, sample_images
from tests.helpers.family_cli import (
    assert_resumes_bit_exactly,
    assert_same_lora,
    ddp_ranks_agree,
    family_toml,
    train_reference,
)


@pytest.fixture(scope="module")
def chroma_toml(tiny_chroma_dir, sample_data_dir, tmp_path_factory) -> str:
    data = sample_images(sample_data_dir, tmp_path_factory.mktemp("chroma_data"))
    # kohya's Chroma recipe (model_type, the mask, guidance 0, sigmoid sampling, raw prediction) on the tiny model.
    return family_toml(tiny_chroma_dir, data, "networks.lora_flux",
                       'model_type = "chroma"\nt5xxl_max_token_length = 16\napply_t5_attn_mask = true\n'
                       'guidance_scale = 0.0\ntimestep_sampling = "sigmoid"\nmodel_prediction_type = "raw"\n')


@pytest.fixture(scope="module")
def reference(chroma_toml, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("chroma_reference")
    prompts = write(out / "prompts.txt", "a photo of sks shape --n a red circle --l 4 --s 2 --w 64 --h 64 --d 1\n")
    train_reference(chroma_toml, out, f'sample_prompts = "{prompts}"\nsample_every_n_steps = 4\n')
    return out


def test_trains_and_writes_kohyas_chroma_file(reference):
    state_dict, metadata = load_kohya_lora(reference / "last.safetensors")
    modules = {key.split(".")[0] for key in state_dict}
    assert len(modules) == 10 and {"lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear1"} \
        <= modules  # kohya's 8 double + 2 single targets of Chroma's blocks
    assert all(state_dict[f"{m}.lora_up.weight"].abs().sum() > 0 for m in modules)
    assert metadata["ss_base_model_version"] == "chroma" and metadata["ss_model_type"] == "chroma"
    assert metadata["modelspec.architecture"] == "chroma/lora"
    assert metadata["ss_guidance_scale"] == "0.0" and metadata["ss_timestep_sampling"] == "sigmoid"
    assert len(list((reference / "sample").glob("*.png"))) == 1


def test_resumes_bit_exactly(reference, chroma_toml, tmp_path):
    assert_resumes_bit_exactly(reference, chroma_toml, tmp_path)


def test_the_bfl_files_train_like_the_folder(reference, chroma_toml, tiny_chroma_dir, tmp_path):
    from library.families.chroma.tiny import save_tiny_chroma_files

    files = save_tiny_chroma_files(tiny_chroma_dir, tmp_path / "files")
    out = tmp_path / "from_files"
    body = chroma_toml.replace(f'pretrained_model_name_or_path = "{tiny_chroma_dir}"',
                               f'pretrained_model_name_or_path = "{files["transformer"]}"\n'
                               f'model_config = "{tiny_chroma_dir}"\nt5xxl = "{files["t5xxl"]}"\n'
                               f'ae = "{files["ae"]}"')
    assert body != chroma_toml
    config = write(tmp_path / "lora.toml", body + f'output_dir = "{out}"\nmax_train_steps = 2\n')
    result = run_cli("--config", str(config))
    assert result.returncode == 0, result.stderr
    assert_same_lora(reference / "last-step00000002.safetensors", out / "last.safetensors")


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_flux_guidance_is_refused_naming_why(chroma_toml, tmp_path, capsys):
    config = write(tmp_path / "lora.toml", chroma_toml.replace("guidance_scale = 0.0", "guidance_scale = 3.5")
                   + f'output_dir = "{tmp_path}"\nmax_train_steps = 1\n')
    refused_in_process(config, capsys, "guidance_scale 3.5", "not guidance-distilled")


def test_two_gloo_processes_train_in_step(tiny_chroma_dir, sample_data_dir, tmp_path):
    (tmp_path / "data").mkdir()
    data = copy_images(sample_data_dir, tmp_path / "data", 8)
    losses = ddp_ranks_agree(tiny_chroma_dir, data, tmp_path / "ddp", "--network_module", "networks.lora_flux",
                             "--t5xxl_max_token_length", "16", "--apply_t5_attn_mask", "--guidance_scale", "0",
                             "--timestep_sampling", "sigmoid")
    assert len(losses) == 2
    assert "lora_unet_double_blocks_0_img_attn_qkv.alpha" in load_file(tmp_path / "ddp" / "last.safetensors")
