"""Input-axis DoRA under DDP: its magnitude is an ordinary parameter of the prepared module (ZeRO-2: see
test_multiprocess.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import DDP_RUN, launch
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

