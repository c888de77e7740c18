"""Input-axis DoRA under DDP: its magnitude is an ordinary parameter of the prepared module (ZeRO-2: see
test_multiprocess.py). prior_reg under DDP: the base model's forward is run by every process or none."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import DDP_RUN, launch, write
from tests.helpers.datasets import copy_images
from tests.helpers.runs import run_args


@pytest.fixture(scope="module")
def data(sample_data_dir, tmp_path_factory) -> Path:
    return copy_images(sample_data_dir, tmp_path_factory.mktemp("data"), 8)


DORA = ["--network_args", "dora_wd=true", "conv_dim=2", "--network_dropout", "0.1"]


def test_ddp_trains_input_axis_dora_like_one_process(tiny_sd1_dir, data, tmp_path):
    # network_dropout draws from the global RNG per rank: compare ranks with each other, not with one process
    ddp = launch(2, run_args(tiny_sd1_dir, data, tmp_path / "ddp", run=DDP_RUN) + DORA)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    rank0, rank1 = (load_file(tmp_path / "ddp" / f"rank{r}.safetensors") for r in (0, 1))
    scales = [k for k in rank0 if k.endswith(".dora_scale")]
    assert scales and all(rank0[k].shape[0] == 1 for k in scales)
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    written = load_file(tmp_path / "ddp" / "last.safetensors")
    assert written.keys() == rank0.keys() and all(torch.equal(written[k], rank0[k]) for k in rank0)



def test_ddp_ranks_with_and_without_prior_reg_samples_run_the_base_forward_together(tiny_sd1_dir, data, tmp_path):
    """Batches are dealt to the processes in turn, so at a step one process may hold prior_reg samples and the other
    none; a forward of the base model on one process alone would leave DDP's collectives unmatched (here, gloo
    aborted the run)."""
    images = next(p for p in data.iterdir() if p.is_dir())
    dataset = write(tmp_path / "dataset.toml", '[general]\nresolution = 64\ncaption_extension = ".txt"\n'
                    f'batch_size = 2\n[[datasets]]\n  [[datasets.subsets]]\n  image_dir = "{images}"\n'
                    f'[[datasets]]\n  [[datasets.subsets]]\n  image_dir = "{images}"\n  prior_reg = true\n')
    out = tmp_path / "ddp"
    ddp = launch(2, ["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--dataset_config", str(dataset),
                     "--output_dir", str(out), "--seed", "7", "--learning_rate", "3e-3", "--max_train_steps", "3",
                     "--prior_loss_weight", "5"])
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    rank0, rank1 = (load_file(out / f"rank{r}.safetensors") for r in (0, 1))
    assert all(torch.equal(rank0[key], rank1[key]) for key in rank0)
