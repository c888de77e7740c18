"""What a training process imports: nothing the run does not use."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from library.config import parse_config
from library.training.optim import uses_bitsandbytes

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import importlib.util, sys
import train_network
from library.config import parse_config
config, _ = parse_config(sys.argv[1:])
hidden = train_network.hide_unused_packages(config)
from diffusers import UNet2DConditionModel
from library.training import loop
print(hidden, "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is not None,
      importlib.util.find_spec("bitsandbytes") is not None)
"""


@pytest.mark.parametrize("args, used", [
    ([], False), (["--optimizer_type", "Lion"], False), (["--optimizer_type", "prodigy"], False),
    (["--optimizer_type", "AdamW8bit"], True), (["--optimizer_type", "PagedAdamW"], True),
    (["--use_8bit_adam"], True), (["--optimizer_type", "bitsandbytes.optim.Lion8bit"], True),
    (["--optimizer_type", "torch.optim.SGD"], False),
])
def test_bitsandbytes_is_used_only_by_its_optimizers(args, used, tiny_sd1_dir, sample_data_dir, tmp_path):
    config, _ = parse_config(["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir",
                              str(sample_data_dir), "--output_dir", str(tmp_path), *args])
    assert uses_bitsandbytes(config) is used


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
def test_a_run_without_its_optimizers_never_imports_bitsandbytes(tiny_sd1_dir, sample_data_dir, tmp_path):
    argv = ["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir", str(sample_data_dir),
            "--output_dir", str(tmp_path)]
    result = subprocess.run([sys.executable, "-c", CHILD, *argv], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert result.returncode == 0, result.stderr
    # diffusers, peft and transformers ask importlib.util.find_spec before importing it.
    assert result.stdout.strip().splitlines()[-1] == "['bitsandbytes'] False False"


def test_nothing_is_hidden_once_the_libraries_that_ask_are_loaded(tiny_sd1_dir, sample_data_dir, tmp_path):
    import diffusers  # noqa: F401 - loaded: it has recorded what is installed

    import train_network

    config, _ = parse_config(["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir",
                              str(sample_data_dir), "--output_dir", str(tmp_path)])
    assert train_network.hide_unused_packages(config) == []
    assert sys.modules.get("bitsandbytes", "absent") is not None
