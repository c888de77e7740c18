"""Qwen-Image through train_network.py with the shipped configs/qwen_image_lora.toml (paths and sizes overridden on
the command line): the file and its metadata, exact resume (which reads the file back), and 2 gloo processes
(DDP)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from library.network.kohya_format import load_kohya_lora
from tests.integration.test_cli import REPO, run_cli
from tests.integration.test_multiprocess import copy_images, launch


@pytest.fixture(scope="module")
def data(sample_data_dir, tmp_path_factory) -> Path:
    return copy_images(sample_data_dir, tmp_path_factory.mktemp("qwen_image_data"), 4)


def overrides(model: Path, data: Path, out: Path) -> list[str]:
    """The shipped config at the tiny model's size: no buckets, fp32, a rank-4 LoRA, steps instead of epochs."""
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--output_dir", str(out),
            "--resolution", "64", "--enable_bucket", "false", "--mixed_precision", "no", "--save_precision", "float",
            "--network_dim", "4", "--network_alpha", "2", "--learning_rate", "1e-3", "--max_train_epochs", "0",
            "--save_every_n_epochs", "0", "--train_batch_size", "2", "--seed", "3", "--output_name", "last"]


CONFIG = ["--config", str(REPO / "configs" / "qwen_image_lora.toml")]


@pytest.fixture(scope="module")
def reference(tiny_qwen_image_dir, data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen_image_reference")
    result = run_cli(*CONFIG, *overrides(tiny_qwen_image_dir, data, out), "--max_train_steps", "4",
                     "--save_every_n_steps", "2", "--save_state")
    assert result.returncode == 0, result.stderr
    return out


def test_the_shipped_config_trains_and_writes_musubis_file(reference):
    state_dict, metadata = load_kohya_lora(reference / "last.safetensors")
    modules = {key.split(".")[0] for key in state_dict}
    assert len(modules) == 2 * 14 - 4  # musubi's 14 Linear layers per block but the last's 4 text-only; no TE
    assert all(m.startswith("lora_unet_transformer_blocks_") for m in modules)
    assert all(state_dict[f"{m}.lora_up.weight"].abs().sum() > 0 for m in modules)
    assert all(float(state_dict[f"{m}.alpha"]) == 2.0 for m in modules)
    assert metadata["ss_base_model_version"] == "qwen_image" and metadata["modelspec.architecture"] == "Qwen-Image/lora"
    assert metadata["ss_network_module"] == "networks.lora_qwen_image"
    assert metadata["ss_timestep_sampling"] == "shift" and metadata["ss_discrete_flow_shift"] == "2.2"
    assert metadata["ss_weighting_scheme"] == "none"


def test_resumes_bit_exactly(reference, tiny_qwen_image_dir, data, tmp_path):
    out = tmp_path / "resumed"
    result = run_cli(*CONFIG, *overrides(tiny_qwen_image_dir, data, out), "--max_train_steps", "4",
                     "--resume", str(reference / "last-step00000002-state"))
    assert result.returncode == 0, result.stderr
    expected, got = load_file(reference / "last.safetensors"), load_file(out / "last.safetensors")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_ddp_ranks_agree(tiny_qwen_image_dir, data, tmp_path):
    """Two gloo processes on different halves of the data end with the same LoRA: the gradients were synced."""
    common = ["--pretrained_model_name_or_path", str(tiny_qwen_image_dir), "--train_data_dir", str(data),
              "--resolution", "64", "--caption_extension", ".txt", "--train_batch_size", "1", "--seed", "7",
              "--learning_rate", "3e-3", "--max_train_steps", "2", "--network_module", "networks.lora_qwen_image",
              "--timestep_sampling", "qwen_shift"]
    ddp = launch(2, common + ["--output_dir", str(tmp_path / "ddp")])
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    rank0, rank1 = (load_file(tmp_path / "ddp" / f"rank{r}.safetensors") for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    assert any(v.abs().max() > 0 for k, v in rank0.items() if "lora_up" in k)
    losses = [json.loads((tmp_path / "ddp" / f"rank{r}.json").read_text())["losses"] for r in (0, 1)]
    assert losses[0] == losses[1]
    assert "lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight" in load_file(tmp_path / "ddp" /
                                                                                     "last.safetensors")
