"""What a training process imports: nothing the run does not use."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from library.config import parse_config
from library.training.optim import optimizer_package

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
import train_network
status = train_network.main(sys.argv[1:], own_process=True)
hidden = [name for name in sys.modules if sys.modules[name] is None and "." not in name]
unused = ("bitsandbytes", "scipy", "boto3", "deepspeed", "wandb", "tensorboard", "diffusers.pipelines")
loaded = [name for name in sys.modules if sys.modules[name] is not None and name.startswith(unused)]
print(json.dumps({"status": status, "hidden": hidden, "loaded": loaded}))
"""
OPTIONAL = ("bitsandbytes", "scipy", "boto3")


@pytest.mark.parametrize("args, used", [
    ([], False), (["--optimizer_type", "Lion"], False), (["--optimizer_type", "prodigy"], False),
    (["--optimizer_type", "AdamW8bit"], True), (["--optimizer_type", "PagedAdamW"], True),
    (["--use_8bit_adam"], True), (["--optimizer_type", "bitsandbytes.optim.Lion8bit"], True),
    (["--optimizer_type", "torch.optim.SGD"], False),
])
def test_bitsandbytes_is_used_only_by_its_optimizers(args, used, tiny_sd1_dir, sample_data_dir, tmp_path):
    config, _ = parse_config(["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir",
                              str(sample_data_dir), "--output_dir", str(tmp_path), *args])
    assert (optimizer_package(config) == "bitsandbytes") is used


def run_child(argv: list[str]) -> dict:
    """A tiny two-step training run in a fresh process, as train_network.py runs it: what it hid, and which
    modules of packages it has no use for it loaded."""
    command = [sys.executable, "-c", CHILD, *argv, "--max_train_steps", "2", "--resolution", "64"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_run_imports_nothing_it_does_not_use(tiny_sd1_dir, sample_data_dir, tmp_path):
    seen = run_child(["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir",
                      str(sample_data_dir), "--output_dir", str(tmp_path)])
    assert seen["status"] == 0
    assert sorted(seen["hidden"]) == sorted(OPTIONAL)
    # No optimizer, tracker, DeepSpeed or sampling pipeline asked for: none loaded.
    assert seen["loaded"] == []


@pytest.mark.skipif(importlib.util.find_spec("scipy") is None, reason="scipy is not installed")
def test_a_run_that_samples_keeps_scipy_for_the_lms_sampler(tiny_sd1_dir, sample_data_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of sks --ss k_lms --s 2 --w 64 --h 64\n")
    seen = run_child(["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir",
                      str(sample_data_dir), "--output_dir", str(tmp_path / "out"), "--sample_prompts", str(prompts),
                      "--sample_every_n_steps", "1", "--output_name", "run"])
    assert seen["status"] == 0
    assert sorted(seen["hidden"]) == ["bitsandbytes", "boto3"]
    assert "scipy" in seen["loaded"]
    assert len(list((tmp_path / "out" / "sample").glob("*.png"))) == 2  # steps 1 and 2, with LMS


@pytest.mark.parametrize("args, hidden", [
    ([], ["bitsandbytes", "scipy", "boto3"]),
    (["--optimizer_type", "AdamW8bit"], ["boto3"]),
    (["--optimizer_type", "Prodigy", "--lr_scheduler_type", "StepLR"], ["bitsandbytes", "scipy", "boto3"]),
    (["--lr_scheduler_type", "transformers.get_cosine_schedule_with_warmup"], ["bitsandbytes", "scipy", "boto3"]),
    # A user's own optimizer or scheduler class may import scipy.
    (["--optimizer_type", "pytorch_optimizer.CAME"], ["bitsandbytes", "boto3"]),
    (["--lr_scheduler_type", "my_schedules.Warmup"], ["bitsandbytes", "boto3"]),
])
def test_what_is_hidden_follows_the_optimizer_scheduler_and_sampling(args, hidden, tiny_sd1_dir, sample_data_dir,
                                                                   tmp_path, monkeypatch):
    import train_network

    config, _ = parse_config(["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir",
                              str(sample_data_dir), "--output_dir", str(tmp_path), *args])
    # As in a fresh process: none of the libraries that ask is loaded yet (monkeypatch restores them).
    for name in ("diffusers", "transformers", "peft", "accelerate", *OPTIONAL):
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        assert train_network.hide_unused_packages(config) == hidden
    finally:
        for name in hidden:
            sys.modules.pop(name, None)


def test_nothing_is_hidden_once_the_libraries_that_ask_are_loaded(tiny_sd1_dir, sample_data_dir, tmp_path):
    import diffusers  # noqa: F401 - loaded: it has recorded what is installed

    import train_network

    config, _ = parse_config(["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir",
                              str(sample_data_dir), "--output_dir", str(tmp_path)])
    assert train_network.hide_unused_packages(config) == []
    assert all(sys.modules.get(name, "absent") is not None for name in OPTIONAL)
