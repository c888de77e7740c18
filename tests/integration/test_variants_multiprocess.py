"""Input-axis DoRA under DDP and DeepSpeed ZeRO-2: its magnitude is an ordinary parameter of the prepared module."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from integration.test_multiprocess import common, data, launch  # noqa: F401  (data is a fixture)

DORA = ["--network_args", "dora_wd=true", "conv_dim=2", "--network_dropout", "0.1"]


def test_ddp_trains_input_axis_dora_like_one_process(tiny_sd1_dir, data, tmp_path):  # noqa: F811
    # network_dropout draws from the global RNG per rank: compare ranks with each other, not with one process
    ddp = launch(2, common(tiny_sd1_dir, data, tmp_path / "ddp") + DORA)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    rank0, rank1 = (load_file(tmp_path / "ddp" / f"rank{r}.safetensors") for r in (0, 1))
    scales = [k for k in rank0 if k.endswith(".dora_scale")]
    assert scales and all(rank0[k].shape[0] == 1 for k in scales)
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    written = load_file(tmp_path / "ddp" / "last.safetensors")
    assert written.keys() == rank0.keys() and all(torch.equal(written[k], rank0[k]) for k in rank0)


def test_zero2_resumes_input_axis_dora_exactly(tiny_sd1_dir, data, tmp_path):  # noqa: F811
    deepspeed = ["--deepspeed", "--zero_stage", "2", "--offload_optimizer_device", "cpu", "--max_grad_norm", "1.0"]
    args = ["--network_args", "dora_wd=true", "conv_dim=2"]
    straight = launch(2, common(tiny_sd1_dir, data, tmp_path / "a") + deepspeed + args +
                      ["--max_train_steps", "5", "--save_every_n_steps", "3", "--save_state"])
    assert straight.returncode == 0, straight.stderr[-3000:]
    state_dir = tmp_path / "a" / "last-step00000003-state"
    resumed = launch(2, common(tiny_sd1_dir, data, tmp_path / "b") + deepspeed + args +
                     ["--max_train_steps", "5", "--resume", str(state_dir)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    written, final = load_file(tmp_path / "a" / "last.safetensors"), load_file(tmp_path / "b" / "last.safetensors")
    assert any(k.endswith(".dora_scale") for k in written)
    assert all(torch.equal(final[k], written[k]) for k in written)
    straight_losses = json.loads((tmp_path / "a" / "rank0.json").read_text())["losses"]
    assert json.loads((tmp_path / "b" / "rank0.json").read_text())["losses"] == straight_losses[3:]
