"""FLUX.1 on two gloo processes on CPU: DDP and DeepSpeed ZeRO-2 with CPU optimizer offload."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import launch
from tests.helpers.datasets import copy_images

pytestmark = pytest.mark.slow  # two-process FLUX launches (DDP, then DeepSpeed): 20-28 s a test on 2 CPU cores


@pytest.fixture(scope="module")
def data(sample_data_dir, tmp_path_factory):
    return copy_images(sample_data_dir, tmp_path_factory.mktemp("flux_data"), 8)


def common(tiny_flux_dir, data, output_dir) -> list[str]:
    return ["--pretrained_model_name_or_path", str(tiny_flux_dir), "--train_data_dir", str(data),
            "--output_dir", str(output_dir), "--resolution", "64", "--caption_extension", ".txt",
            "--train_batch_size", "2", "--seed", "7", "--learning_rate", "3e-3", "--max_train_steps", "3",
            "--network_module", "networks.lora_flux", "--t5xxl_max_token_length", "16",
            "--timestep_sampling", "sigmoid", "--model_prediction_type", "raw"]


def test_flux_ddp_ranks_agree_and_match_one_process(tiny_flux_dir, data, tmp_path):
    ddp = launch(2, common(tiny_flux_dir, data, tmp_path / "ddp"))
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = launch(1, common(tiny_flux_dir, data, tmp_path / "single") + ["--gradient_accumulation_steps", "2"])
    assert single.returncode == 0, single.stderr[-3000:]
    rank0, rank1 = (load_file(tmp_path / "ddp" / f"rank{r}.safetensors") for r in (0, 1))
    reference = load_file(tmp_path / "single" / "rank0.safetensors")
    assert rank0.keys() == rank1.keys() == reference.keys()
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
        torch.testing.assert_close(rank0[key], reference[key], atol=2e-6, rtol=1e-4)
    assert any(v.abs().max() > 0 for k, v in rank0.items() if "lora_B" in k or "lora_up" in k)
    losses = [json.loads((tmp_path / "ddp" / f"rank{r}.json").read_text())["losses"] for r in (0, 1)]
    assert losses[0] == losses[1]
    assert losses[0] == pytest.approx(json.loads((tmp_path / "single" / "rank0.json").read_text())["losses"],
                                      rel=1e-5)
    assert "lora_unet_double_blocks_0_img_attn_qkv.alpha" in load_file(tmp_path / "ddp" / "last.safetensors")


def test_flux_deepspeed_zero2_offload_resumes_exactly(tiny_flux_dir, data, tmp_path):
    deepspeed = ["--deepspeed", "--zero_stage", "2", "--offload_optimizer_device", "cpu", "--max_grad_norm", "1.0"]
    straight = launch(2, common(tiny_flux_dir, data, tmp_path / "a") + deepspeed +
                      ["--max_train_steps", "5", "--save_every_n_steps", "3", "--save_state"])
    assert straight.returncode == 0, straight.stderr[-3000:]
    resumed = launch(2, common(tiny_flux_dir, data, tmp_path / "b") + deepspeed +
                     ["--max_train_steps", "5", "--resume", str(tmp_path / "a" / "last-step00000003-state")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    written, final = load_file(tmp_path / "a" / "last.safetensors"), load_file(tmp_path / "b" / "last.safetensors")
    assert written.keys() == final.keys() and all(torch.equal(final[k], written[k]) for k in written)
    assert "lora_unet_single_blocks_0_linear1.lora_up.weight" in written
