"""SD3 through train_network.py as a user runs it: kohya's SD3 options in a TOML, the lora_sd3 file and its
metadata, exact resume, reading the file back with network_weights, and two gloo processes (DDP)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from library.network.kohya_format import load_kohya_lora
from tests.integration.test_cli import run_cli, write
from tests.integration.test_flux_cli import sample_images
from tests.integration.test_multiprocess import copy_images, launch


@pytest.fixture(scope="module")
def sd3_toml(tiny_sd3_dir, sample_data_dir, tmp_path_factory) -> str:
    data = sample_images(sample_data_dir, tmp_path_factory.mktemp("sd3_data"))
    # kohya's SD3 options on the tiny model (per-encoder dropout and SD3.5 Medium's position embeddings too), CLIP-L
    # and CLIP-G trained too.
    return (f'pretrained_model_name_or_path = "{tiny_sd3_dir}"\ntrain_data_dir = "{data}"\n'
            'resolution = 64\ncaption_extension = ".txt"\ntrain_batch_size = 2\nseed = 3\nlearning_rate = 1e-3\n'
            'network_module = "networks.lora_sd3"\nnetwork_dim = 4\nnetwork_alpha = 2\n'
            't5xxl_max_token_length = 16\napply_lg_attn_mask = true\n'
            'apply_t5_attn_mask = true\nweighting_scheme = "logit_normal"\ntraining_shift = 3.0\n'
            'clip_l_dropout_rate = 0.3\nclip_g_dropout_rate = 0.3\nt5_dropout_rate = 0.3\n'
            'pos_emb_random_crop_rate = 0.5\nenable_scaled_pos_embed = true\n')


@pytest.fixture(scope="module")
def reference(sd3_toml, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sd3_reference")
    config = write(out / "lora.toml", sd3_toml + f'output_dir = "{out}"\nmax_train_steps = 4\n'
                   'save_every_n_steps = 2\nsave_state = true\n')
    result = run_cli("--config", str(config))
    assert result.returncode == 0, result.stderr
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
    out = tmp_path / "resumed"
    config = write(tmp_path / "lora.toml", sd3_toml + f'output_dir = "{out}"\nmax_train_steps = 4\n')
    result = run_cli("--config", str(config), "--resume", str(reference / "last-step00000002-state"))
    assert result.returncode == 0, result.stderr
    expected, _ = load_kohya_lora(reference / "last.safetensors")
    got, _ = load_kohya_lora(out / "last.safetensors")
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


def test_two_gloo_processes_train_in_step(tiny_sd3_dir, sample_data_dir, tmp_path):
    (tmp_path / "data").mkdir()
    data = copy_images(sample_data_dir, tmp_path / "data", 8)
    result = launch(2, ["--pretrained_model_name_or_path", str(tiny_sd3_dir), "--train_data_dir", str(data),
                        "--output_dir", str(tmp_path / "ddp"), "--resolution", "64", "--caption_extension", ".txt",
                        "--train_batch_size", "2", "--seed", "7", "--learning_rate", "3e-3", "--max_train_steps", "2",
                        "--network_train_unet_only", "--t5xxl_max_token_length", "16"])
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = (load_file(tmp_path / "ddp" / f"rank{r}.safetensors") for r in (0, 1))
    # The ranks saw different images: equal weights after two steps mean the gradients were averaged.
    assert rank0.keys() == rank1.keys() and all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    assert any(v.abs().max() > 0 for k, v in rank0.items() if "lora_up" in k)
    losses = [json.loads((tmp_path / "ddp" / f"rank{r}.json").read_text())["losses"] for r in (0, 1)]
    assert losses[0] == losses[1] and len(losses[0]) == 2
