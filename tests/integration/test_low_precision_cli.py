"""A kohya FLUX.1 config as sd-scripts' docs write it (fp8_base, blocks_to_swap, bf16, gradient checkpointing,
cached text outputs and latents) trains the tiny FLUX from kohya's separate files; it resumes bit-exactly; the file
is the one a bf16 base gives (keys, shapes, metadata but the precision); SD1 and SDXL train with fp8_base_unet."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from library.network.kohya_format import load_kohya_lora
from tests.helpers.cli import assert_user_error, run_cli, write
from tests.helpers.datasets import sample_images

IMAGES = ("00_red_circle", "01_yellow_square")


@pytest.fixture(scope="module")
def kohya_flux_toml(tiny_flux_dir, sample_data_dir, tmp_path_factory) -> str:
    from library.families.flux.tiny import save_tiny_flux_files

    files = save_tiny_flux_files(tiny_flux_dir, tmp_path_factory.mktemp("flux_files"))
    data = sample_images(sample_data_dir, tmp_path_factory.mktemp("data"), IMAGES)
    # sd-scripts docs/flux_train_network.md's options (paths, sizes and counts are the tiny model's)
    return (f'pretrained_model_name_or_path = "{files["transformer"]}"\nclip_l = "{files["clip_l"]}"\n'
            f't5xxl = "{files["t5xxl"]}"\nae = "{files["ae"]}"\nmodel_config = "{tiny_flux_dir}"\n'
            f'train_data_dir = "{data}"\ncaption_extension = ".txt"\nresolution = 64\n'
            'cache_latents_to_disk = true\nsave_model_as = "safetensors"\nsdpa = true\n'
            'persistent_data_loader_workers = true\nmax_data_loader_n_workers = 0\nseed = 42\n'
            'gradient_checkpointing = true\nmixed_precision = "bf16"\nsave_precision = "bf16"\n'
            'network_module = "networks.lora_flux"\nnetwork_dim = 4\nnetwork_train_unet_only = true\n'
            'learning_rate = 1e-3\ncache_text_encoder_outputs = true\nfp8_base = true\nblocks_to_swap = 18\n'
            'highvram = true\ntimestep_sampling = "shift"\ndiscrete_flow_shift = 3.1582\n'
            'model_prediction_type = "raw"\nguidance_scale = 1.0\nt5xxl_max_token_length = 16\n')


@pytest.fixture(scope="module")
def fp8_run(kohya_flux_toml, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("fp8")
    config = write(out / "lora.toml", kohya_flux_toml + f'output_dir = "{out}"\nmax_train_steps = 4\n'
                   'save_every_n_steps = 2\nsave_state = true\n')
    result = run_cli("--config", str(config))
    assert result.returncode == 0, result.stderr
    return out, result.stderr


def test_kohyas_flux_config_trains_with_an_fp8_base(fp8_run):
    out, log = fp8_run
    assert "frozen base stored as fp8" in log
    assert "blocks_to_swap: no effect without a CUDA device" in log
    state_dict, metadata = load_kohya_lora(out / "last.safetensors")
    assert state_dict["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"].abs().sum() > 0
    assert metadata["ss_fp8_base"] == "True"


def test_resumes_bit_exactly_with_an_fp8_base(fp8_run, kohya_flux_toml, tmp_path):
    reference, _ = fp8_run
    out = tmp_path / "resumed"
    config = write(tmp_path / "lora.toml", kohya_flux_toml + f'output_dir = "{out}"\nmax_train_steps = 4\n')
    result = run_cli("--config", str(config), "--resume", str(reference / "last-step00000002-state"))
    assert result.returncode == 0, result.stderr
    expected, _ = load_kohya_lora(reference / "last.safetensors")
    got, _ = load_kohya_lora(out / "last.safetensors")
    assert set(got) == set(expected)
    assert all(torch.equal(got[key], tensor) for key, tensor in expected.items())


@pytest.mark.parametrize("precision", ["no_change", "nf4"])
def test_the_file_is_the_one_a_bf16_base_gives(fp8_run, kohya_flux_toml, tmp_path, precision):
    out = tmp_path / precision
    toml = kohya_flux_toml.replace("fp8_base = true\n", f'base_model_precision = "{precision}"\n')
    config = write(tmp_path / "lora.toml", toml + f'output_dir = "{out}"\nmax_train_steps = 2\n')
    result = run_cli("--config", str(config))
    assert result.returncode == 0, result.stderr
    fp8, fp8_metadata = load_kohya_lora(fp8_run[0] / "last-step00000002.safetensors")
    other, metadata = load_kohya_lora(out / "last.safetensors")
    assert {k: (v.shape, v.dtype) for k, v in other.items()} == {k: (v.shape, v.dtype) for k, v in fp8.items()}
    precision_keys = {"ss_fp8_base", "ss_fp8_base_unet", "ss_base_model_precision"}
    varying = {"ss_training_started_at", "ss_training_finished_at", "ss_session_id", "sshs_model_hash",
               "sshs_legacy_hash", "modelspec.date", "ss_steps", "ss_max_train_steps", "ss_epoch", "ss_num_epochs",
               "modelspec.title", "ss_output_name"}
    assert set(metadata) - varying - precision_keys == set(fp8_metadata) - varying - precision_keys
    assert ("ss_base_model_precision" in metadata) == (precision == "nf4")


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_sd1_and_sdxl_train_with_fp8_base_unet(family, tiny_sd1_dir, sample_data_dir, tmp_path):
    if family == "sdxl":
        from library.families.sd.tiny import save_tiny_sdxl

        model = save_tiny_sdxl(tmp_path / "sdxl")
    else:
        model = tiny_sd1_dir
    out = tmp_path / "out"
    config = write(tmp_path / "lora.toml", f'pretrained_model_name_or_path = "{model}"\n'
                   f'train_data_dir = "{sample_data_dir}"\noutput_dir = "{out}"\nresolution = 64\n'
                   'caption_extension = ".txt"\nmixed_precision = "bf16"\nfp8_base_unet = true\n'
                   'gradient_checkpointing = true\nmax_train_steps = 2\nlearning_rate = 1e-3\nseed = 1\n')
    result = run_cli("--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "frozen base stored as fp8 (text encoders unchanged)" in result.stderr
    state_dict, metadata = load_kohya_lora(out / "last.safetensors")
    assert metadata["ss_fp8_base_unet"] == "True"
    assert any(v.abs().sum() > 0 for k, v in state_dict.items() if k.endswith("lora_up.weight"))


def test_kohyas_exclusions(kohya_flux_toml, tmp_path, capsys):
    config = write(tmp_path / "lora.toml", kohya_flux_toml.replace('mixed_precision = "bf16"', 'mixed_precision = "no"')
                   + f'output_dir = "{tmp_path / "out"}"\ncpu_offload_checkpointing = true\n')
    assert_user_error(run_cli("--config", str(config)),
                      "blocks_to_swap and cpu_offload_checkpointing cannot be used together")
