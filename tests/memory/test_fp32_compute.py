"""A low-precision base (fp8_base, base_model_precision int8 or nf4) with mixed_precision = "no" computes in float32:
the tiny FLUX trains from kohya's separate files (transformer and T5 stored fp8, as users have them), resumes
bit-exactly, and writes the same LoRA file (keys, shapes, dtypes) as a float32 base."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.network.kohya_format import load_kohya_lora
from tests.helpers.cli import run_cli, write
from tests.helpers.datasets import sample_images

IMAGES = ("00_red_circle", "01_yellow_square")
PRECISIONS = {"fp8": "fp8_base = true\n", "int8": 'base_model_precision = "int8"\n',
              "nf4": 'base_model_precision = "nf4"\n'}


@pytest.fixture(scope="module")
def fp32_toml(tiny_flux_dir, sample_data_dir, tmp_path_factory) -> str:
    from library.families.flux.tiny import save_tiny_flux_files

    files = save_tiny_flux_files(tiny_flux_dir, tmp_path_factory.mktemp("flux_files"))
    for name in ("transformer", "t5xxl"):
        state = load_file(files[name])
        save_file({k: v.to(torch.float8_e4m3fn) if v.ndim >= 2 else v for k, v in state.items()}, str(files[name]))
    data = sample_images(sample_data_dir, tmp_path_factory.mktemp("data"), IMAGES)
    return (f'pretrained_model_name_or_path = "{files["transformer"]}"\nclip_l = "{files["clip_l"]}"\n'
            f't5xxl = "{files["t5xxl"]}"\nae = "{files["ae"]}"\nmodel_config = "{tiny_flux_dir}"\n'
            f'train_data_dir = "{data}"\ncaption_extension = ".txt"\nresolution = 64\n'
            'max_data_loader_n_workers = 0\nseed = 42\ngradient_checkpointing = true\nmixed_precision = "no"\n'
            'network_module = "networks.lora_flux"\nnetwork_dim = 4\nnetwork_train_unet_only = true\n'
            'learning_rate = 1e-3\ncache_text_encoder_outputs = true\ncache_latents = true\n'
            'guidance_scale = 1.0\nt5xxl_max_token_length = 16\n')


def _train(toml: str, out: Path, steps: int, *args: str) -> str:
    config = write(out.parent / f"{out.name}.toml", toml + f'output_dir = "{out}"\nmax_train_steps = {steps}\n')
    result = run_cli("--config", str(config), *args)
    assert result.returncode == 0, result.stderr
    return result.stderr


@pytest.fixture(scope="module")
def fp32_base_file(fp32_toml, tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("fp32") / "out"
    _train(fp32_toml, out, 2)
    return load_kohya_lora(out / "last.safetensors")[0]


@pytest.fixture(scope="module", params=sorted(PRECISIONS))
def low_run(request, fp32_toml, tmp_path_factory) -> tuple[str, Path, str, str]:
    kind = request.param
    toml = fp32_toml + PRECISIONS[kind]
    out = tmp_path_factory.mktemp(kind) / "out"
    log = _train(toml, out, 4, "--save_every_n_steps", "2", "--save_state")
    return kind, out, log, toml


def test_the_low_base_computes_in_float32_and_the_lora_trains(low_run, fp32_base_file):
    kind, out, log, _ = low_run
    assert f"frozen base stored as {kind}" in log and "computed in float32" in log
    state_dict, metadata = load_kohya_lora(out / "last.safetensors")
    assert any(v.abs().sum() > 0 for k, v in state_dict.items() if k.endswith("lora_up.weight"))
    # the same file as a float32 base writes: keys, shapes and dtypes
    assert {k: (v.shape, v.dtype) for k, v in state_dict.items()} == \
        {k: (v.shape, v.dtype) for k, v in fp32_base_file.items()}
    if kind == "fp8":
        assert metadata["ss_fp8_base"] == "True"
    else:
        assert metadata["ss_base_model_precision"] == kind


@pytest.mark.slow
def test_resumes_bit_exactly_in_float32(low_run, tmp_path):
    kind, reference, _, toml = low_run
    out = tmp_path / "resumed"
    _train(toml, out, 4, "--resume", str(reference / "last-step00000002-state"))
    expected, _ = load_kohya_lora(reference / "last.safetensors")
    got, _ = load_kohya_lora(out / "last.safetensors")
    assert set(got) == set(expected)
    assert all(torch.equal(got[key], tensor) for key, tensor in expected.items()), kind
