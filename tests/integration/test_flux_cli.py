"""FLUX.1 through train_network.py as a user runs it: a TOML config, the kohya FLUX file, exact resume, reading
the file back with network_weights, and options that do not apply refused with exit code 2."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from library.network.kohya_format import load_kohya_lora
from tests.helpers.cli import refused_in_process, run_cli, write
from tests.helpers.datasets import sample_images
from tests.helpers.family_cli import assert_resumes_bit_exactly, assert_same_lora, family_toml, train_reference


@pytest.fixture(scope="module")
def flux_toml(tiny_flux_dir, sample_data_dir, tmp_path_factory) -> str:
    data = sample_images(sample_data_dir, tmp_path_factory.mktemp("flux_data"))
    # kohya's FLUX option names; huber with an exponential schedule, the T5 mask, a logit-normal draw and input
    # perturbation on top of the defaults, so that those paths run end to end.
    return family_toml(tiny_flux_dir, data, "networks.lora_flux",
                       't5xxl_max_token_length = 16\napply_t5_attn_mask = true\nguidance_scale = 1.0\n'
                       'timestep_sampling = "sigma"\nweighting_scheme = "logit_normal"\nmodel_prediction_type = "raw"\n'
                       'loss_type = "huber"\nhuber_schedule = "exponential"\nip_noise_gamma = 0.05\n')


@pytest.fixture(scope="module")
def reference(flux_toml, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("flux_reference")
    train_reference(flux_toml, out)
    return out


def test_trains_and_writes_kohyas_flux_file(reference):
    state_dict, metadata = load_kohya_lora(reference / "last.safetensors")
    modules = {key.split(".")[0] for key in state_dict}
    assert "lora_unet_double_blocks_0_img_attn_qkv" in modules and "lora_unet_single_blocks_0_linear1" in modules
    assert all(m.startswith(("lora_unet_double_blocks_0_", "lora_unet_single_blocks_0_", "lora_te1_"))
               for m in modules)
    assert len([m for m in modules if m.startswith("lora_unet_")]) == 13  # kohya's 10 double + 3 single
    assert len([m for m in modules if m.startswith("lora_te1_")]) == 12  # CLIP-L's q, k, v, out, fc1, fc2 x 2
    # the fused qkv: 3 stacked rank-4 downs, alpha 3 x 2 so that alpha / rank is the trained 2 / 4
    assert state_dict["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape[0] == 12
    assert state_dict["lora_unet_double_blocks_0_img_attn_qkv.alpha"].item() == 6.0
    assert state_dict["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"].abs().sum() > 0
    assert metadata["ss_base_model_version"] == "flux1"
    assert metadata["modelspec.architecture"] == "flux-1-dev/lora"
    assert "modelspec.prediction_type" not in metadata
    assert metadata["ss_network_module"] == "networks.lora_flux"
    assert metadata["ss_timestep_sampling"] == "sigma" and metadata["ss_guidance_scale"] == "1.0"
    assert metadata["ss_apply_t5_attn_mask"] == "True" and metadata["ss_weighting_scheme"] == "logit_normal"


def test_resumes_bit_exactly(reference, flux_toml, tmp_path):
    assert_resumes_bit_exactly(reference, flux_toml, tmp_path)


def test_network_weights_reads_the_fused_file_back(reference, flux_toml, tmp_path):
    out = tmp_path / "continued"
    config = write(tmp_path / "lora.toml", flux_toml.replace("learning_rate = 1e-3", "learning_rate = 1e-12")
                   + f'output_dir = "{out}"\nmax_train_steps = 1\n'
                   f'network_weights = "{reference / "last.safetensors"}"\n')
    result = run_cli("--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "start from scratch" not in result.stderr
    start, _ = load_kohya_lora(reference / "last.safetensors")
    after, _ = load_kohya_lora(out / "last.safetensors")
    assert set(after) == set(start)
    for key, tensor in start.items():
        torch.testing.assert_close(after[key], tensor, rtol=0, atol=1e-7)


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_ddpm_options_are_refused_naming_why(flux_toml, tmp_path, capsys):
    snr_huber = flux_toml.replace('huber_schedule = "exponential"', 'huber_schedule = "snr"')
    config = write(tmp_path / "lora.toml", snr_huber + f'output_dir = "{tmp_path}"\nmax_train_steps = 1\n')
    refused_in_process(config, capsys, "huber_schedule snr: not for FLUX")


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_unet_network_args_are_refused_for_flux(flux_toml, tmp_path, capsys):
    config = write(tmp_path / "lora.toml", flux_toml + f'output_dir = "{tmp_path}"\nmax_train_steps = 1\n'
                   'network_args = ["conv_dim=4"]\n')
    refused_in_process(config, capsys, "conv_dim: not for FLUX")


def test_train_t5xxl_trains_t5_under_kohyas_lora_te3_names(flux_toml, tiny_flux_dir, tmp_path):
    from transformers import T5EncoderModel

    config = write(tmp_path / "lora.toml", flux_toml + f'output_dir = "{tmp_path}"\nmax_train_steps = 2\n'
                   'network_args = ["train_t5xxl=True"]\n')
    result = run_cli("--config", str(config))
    assert result.returncode == 0, result.stderr
    state_dict, metadata = load_kohya_lora(tmp_path / "last.safetensors")
    t5 = T5EncoderModel.from_pretrained(tiny_flux_dir, subfolder="text_encoder_2")
    expected = {f"lora_te3_encoder_block_{i}_layer_0_SelfAttention_{x}" for i in range(len(t5.encoder.block))
                for x in "qkvo"}
    expected |= {f"lora_te3_encoder_block_{i}_layer_1_DenseReluDense_{x}" for i in range(len(t5.encoder.block))
                 for x in ("wi_0", "wi_1", "wo")}
    modules = {key.split(".")[0] for key in state_dict}
    assert {m for m in modules if m.startswith("lora_te3_")} == expected
    assert any(m.startswith("lora_te1_") for m in modules)
    assert all(state_dict[f"{m}.lora_up.weight"].abs().sum() > 0 for m in expected)  # T5's LoRA trained
    assert "train_t5xxl" in metadata["ss_network_args"]


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_train_t5xxl_needs_the_text_encoders_trained(flux_toml, tmp_path, capsys):
    config = write(tmp_path / "lora.toml", flux_toml + f'output_dir = "{tmp_path}"\nmax_train_steps = 1\n'
                   'network_args = ["train_t5xxl=True"]\nnetwork_train_unet_only = true\n')
    refused_in_process(config, capsys, "train_t5xxl", "network_train_unet_only")


def test_kohyas_separate_files_train_like_the_folder(reference, flux_toml, tiny_flux_dir, tmp_path):
    from library.families.flux.tiny import save_tiny_flux_files

    files = save_tiny_flux_files(tiny_flux_dir, tmp_path / "files")
    out = tmp_path / "from_files"
    body = flux_toml.replace(f'pretrained_model_name_or_path = "{tiny_flux_dir}"',
                             f'pretrained_model_name_or_path = "{files["transformer"]}"\n'
                             f'model_config = "{tiny_flux_dir}"\nclip_l = "{files["clip_l"]}"\n'
                             f't5xxl = "{files["t5xxl"]}"\nae = "{files["ae"]}"')
    assert body != flux_toml
    config = write(tmp_path / "lora.toml", body + f'output_dir = "{out}"\nmax_train_steps = 2\n')
    result = run_cli("--config", str(config))
    assert result.returncode == 0, result.stderr
    metadata = assert_same_lora(reference / "last-step00000002.safetensors", out / "last.safetensors")
    assert metadata["modelspec.architecture"] == "flux-1-dev/lora"
