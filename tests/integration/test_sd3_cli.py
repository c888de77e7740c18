"""SD3 through train_network.py as a user runs it: kohya's SD3 options in a TOML, the lora_sd3 file and its
metadata, exact resume, reading the file back with network_weights, and two gloo processes (DDP)."""
from __future__ import annotations

from pathlib import Path

import pytest

from library.network.kohya_format import load_kohya_lora
from tests.helpers.datasets import copy_images, sample_images
from tests.helpers.family_cli import assert_resumes_bit_exactly, ddp_ranks_agree, family_toml, train_reference


@pytest.fixture(scope="module")
def sd3_toml(tiny_sd3_dir, sample_data_dir, tmp_path_factory) -> str:
    data = sample_images(sample_data_dir, tmp_path_factory.mktemp("sd3_data"))
    # kohya's SD3 options on the tiny model (per-encoder dropout and SD3.5 Medium's position embeddings too), CLIP-L
    # and CLIP-G trained too.
    return family_toml(tiny_sd3_dir, data, "networks.lora_sd3",
                       't5xxl_max_token_length = 16\napply_lg_attn_mask = true\n'
                       'apply_t5_attn_mask = true\nweighting_scheme = "logit_normal"\ntraining_shift = 3.0\n'
                       'clip_l_dropout_rate = 0.3\nclip_g_dropout_rate = 0.3\nt5_dropout_rate = 0.3\n'
                       'pos_emb_random_crop_rate = 0.5\nenable_scaled_pos_embed = true\n')


@pytest.fixture(scope="module")
def reference(sd3_toml, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sd3_reference")
    train_reference(sd3_toml, out)
    return out


def test_trains_and_writes_kohyas_sd3_file(reference):
    state_dict, metadata = load_kohya_lora(reference / "last.safetensors")
    modules = {key.split(".")[0] for key in state_dict}
    assert {"lora_unet_joint_blocks_0_x_block_attn_qkv", "lora_unet_joint_blocks_1_context_block_attn_qkv",
            "lora_unet_joint_blocks_0_x_block_attn2_qkv"} <= modules
    assert {m.split("_")[1] for m in modules} == {"unet", "te1", "te2"}  # T5 only with train_t5xxl, as kohya
    assert all(state_dict[f"{m}.lora_up.weight"].abs().sum() > 0 for m in modules if m.startswith("lora_unet"))
    assert metadata["ss_base_model_version"] == "sd3"
    assert metadata["ss_network_module"] == "networks.lora_sd3"
    assert metadata["modelspec.architecture"] == "stable-diffusion-3-m/lora"
    assert metadata["ss_training_shift"] == "3.0" and metadata["ss_apply_lg_attn_mask"] == "True"


def test_resumes_bit_exactly(reference, sd3_toml, tmp_path):
    assert_resumes_bit_exactly(reference, sd3_toml, tmp_path)


def test_two_gloo_processes_train_in_step(tiny_sd3_dir, sample_data_dir, tmp_path):
    (tmp_path / "data").mkdir()
    data = copy_images(sample_data_dir, tmp_path / "data", 8)
    losses = ddp_ranks_agree(tiny_sd3_dir, data, tmp_path / "ddp", "--network_train_unet_only",
                             "--t5xxl_max_token_length", "16")
    assert len(losses) == 2
