"""Two processes over gloo on CPU: DDP keeps ranks identical and matches one process with the same global batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import REPO
from tests.helpers.cli import DDP_RUN, launch
from tests.helpers.datasets import copy_images
from tests.helpers.runs import run_args


@pytest.fixture(scope="module")
def data(sample_data_dir, tmp_path_factory) -> Path:
    return copy_images(sample_data_dir, tmp_path_factory.mktemp("data"), 8)


@pytest.fixture(scope="module")
def data_with_validation(sample_data_dir, tmp_path_factory) -> Path:
    """Eight training images and three held out by VALIDATION: an odd count, which padding would show."""
    return copy_images(sample_data_dir, tmp_path_factory.mktemp("data_val"), 11)


VALIDATION = ["--validation_split", "0.27", "--log_with", "tensorboard"]


@pytest.mark.slow  # two launches of two and one process: about 23 s on 2 CPU cores
def test_ddp_ranks_agree_and_match_one_process_with_the_same_global_batch(tiny_sd1_dir, data_with_validation,
                                                                         tmp_path):
    data = data_with_validation
    ddp = launch(2, run_args(tiny_sd1_dir, data, tmp_path / "ddp", run=DDP_RUN) + VALIDATION)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    # One process accumulating two batches of 2 sees the same global batches as two processes with 2 each.
    single = launch(1, run_args(tiny_sd1_dir, data, tmp_path / "single", run=DDP_RUN) + VALIDATION +
                    ["--gradient_accumulation_steps", "2"])
    assert single.returncode == 0, single.stderr[-3000:]

    rank0, rank1 = (load_file(tmp_path / "ddp" / f"rank{r}.safetensors") for r in (0, 1))
    reference = load_file(tmp_path / "single" / "rank0.safetensors")
    assert rank0.keys() == rank1.keys() == reference.keys()
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
        torch.testing.assert_close(rank0[key], reference[key], atol=2e-6, rtol=1e-4)
    # the LoRA moved, so agreement is not just two untouched initialisations
    assert any(v.abs().max() > 0 for k, v in rank0.items() if "lora_up" in k)

    logged = [json.loads((tmp_path / "ddp" / f"rank{r}.json").read_text())["losses"] for r in (0, 1)]
    single_losses = json.loads((tmp_path / "single" / "rank0.json").read_text())["losses"]
    assert logged[0] == logged[1]  # the mean over ranks, the same on every rank
    assert logged[0] == pytest.approx(single_losses, rel=1e-5)
    assert (tmp_path / "ddp" / "last.safetensors").is_file()

    # Each of the three validation images counted once: two processes give one process's validation loss.
    validation = [json.loads((tmp_path / "ddp" / f"rank{r}.json").read_text())["validation"] for r in (0, 1)]
    single_validation = json.loads((tmp_path / "single" / "rank0.json").read_text())["validation"]
    assert validation[0] == validation[1] and set(validation[0]) == {"100", "300", "500", "700", "900"}
    assert validation[0] == pytest.approx(single_validation, rel=1e-5)
    # Only the main process writes tracker logs.
    assert len(list((tmp_path / "ddp" / "logs").rglob("events.out.tfevents.*"))) == 1


def test_launcher_and_accelerate_disagreeing_on_process_count_exits_2(tiny_sd1_dir, data, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "WORLD_SIZE": "2"}
    env.pop("LOCAL_RANK", None)
    result = subprocess.run([sys.executable, str(REPO / "train_network.py"),
                             *run_args(tiny_sd1_dir, data, tmp_path, run=DDP_RUN)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "cannot start 2 process(es) as launched" in result.stderr and "torchrun --nproc_per_node" in result.stderr


@pytest.mark.slow  # DeepSpeed, two two-process launches: about 43 s on 2 CPU cores
def test_deepspeed_zero2_cpu_offload_saves_adapter_only_and_resumes_exactly(tiny_sd1_dir, data, tmp_path):
    # Input-axis DoRA and conv LoRA on top of plain LoRA: the DoRA magnitude is one more ordinary parameter that
    # ZeRO-2 must shard, offload, save and restore. (FLUX's ZeRO-2 test covers plain LoRA alone.)
    deepspeed = ["--deepspeed", "--zero_stage", "2", "--offload_optimizer_device", "cpu", "--max_grad_norm", "1.0",
                 "--network_args", "dora_wd=true", "conv_dim=2"]
    args = run_args(tiny_sd1_dir, data, tmp_path / "a", run=DDP_RUN) + deepspeed + ["--max_train_steps", "5",
                                                                       "--save_every_n_steps", "3", "--save_state"]
    straight = launch(2, args)
    assert straight.returncode == 0, straight.stderr[-3000:]
    state_dir = tmp_path / "a" / "last-step00000003-state"
    module_files = list((state_dir / "pytorch_model").glob("*model_states.pt"))
    assert module_files
    for module_file in module_files:
        saved = torch.load(module_file, map_location="cpu", weights_only=False)["module"]
        assert saved and all("lora_" in key for key in saved), [k for k in saved if "lora_" not in k][:5]

    # The kohya file the trainer wrote is the engine's weights.
    engine = load_file(tmp_path / "a" / "rank0.safetensors")
    written = load_file(tmp_path / "a" / "last.safetensors")
    assert engine.keys() == written.keys() and all(torch.equal(engine[k], written[k]) for k in engine)
    assert any(k.endswith(".dora_scale") for k in written)

    resumed = launch(2, run_args(tiny_sd1_dir, data, tmp_path / "b", run=DDP_RUN) + deepspeed +
                     ["--max_train_steps", "5", "--resume", str(state_dir)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # With the optimizer's moments and step restored, the continued path is the straight one.
    final = load_file(tmp_path / "b" / "last.safetensors")
    assert all(torch.equal(final[k], written[k]) for k in written)
    straight_losses = json.loads((tmp_path / "a" / "rank0.json").read_text())["losses"]
    assert json.loads((tmp_path / "b" / "rank0.json").read_text())["losses"] == straight_losses[3:]
