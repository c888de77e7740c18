"""What the FLUX, Chroma, SD3 and musubi family command-line tests share: the TOML every family starts from, the
reference run with its step-2 state, exact resume from it, comparing two LoRA files, and two gloo processes."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file

from library.network.kohya_format import load_kohya_lora
from tests.helpers.cli import launch, run_cli, write


def family_toml(model: Path, data: Path, network_module: str, options: str) -> str:
    """A TOML for the tiny `model` on `data`: 64 px, batch 2, seed 3, a rank-4 LoRA with alpha 2, then the family's
    own `options` (no output_dir or step count: each test adds its own)."""
    return (f'pretrained_model_name_or_path = "{model}"\ntrain_data_dir = "{data}"\n'
            'resolution = 64\ncaption_extension = ".txt"\ntrain_batch_size = 2\nseed = 3\nlearning_rate = 1e-3\n'
            f'network_module = "{network_module}"\nnetwork_dim = 4\nnetwork_alpha = 2\n' + options)


def train_reference(toml: str, out: Path, options: str = "") -> subprocess.CompletedProcess:
    """Four steps of `toml` (and `options`) into `out`, saving the LoRA and the state at step 2 as well."""
    config = write(out / "lora.toml", toml + f'output_dir = "{out}"\nmax_train_steps = 4\n'
                   'save_every_n_steps = 2\nsave_state = true\n' + options)
    result = run_cli("--config", str(config))
    assert result.returncode == 0, result.stderr
    return result


def assert_same_lora(expected_file: Path, got_file: Path) -> dict[str, str]:
    """The two files hold the same keys with equal tensors; returns the metadata of `got_file`."""
    expected, _ = load_kohya_lora(expected_file)
    got, metadata = load_kohya_lora(got_file)
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    return metadata


def assert_resumes_bit_exactly(reference: Path, toml: str, tmp_path: Path) -> None:
    """Resumed from the reference run's step-2 state, the run ends with the reference's LoRA to the bit."""
    out = tmp_path / "resumed"
    config = write(tmp_path / "lora.toml", toml + f'output_dir = "{out}"\nmax_train_steps = 4\n')
    result = run_cli("--config", str(config), "--resume", str(reference / "last-step00000002-state"))
    assert result.returncode == 0, result.stderr
    assert_same_lora(reference / "last.safetensors", out / "last.safetensors")


def ddp_ranks_agree(model: Path, data: Path, out: Path, *options: str, batch_size: int = 2) -> list[float]:
    """Two gloo processes train `model` on different halves of `data` for two steps into `out`: the ranks end with
    the same trained LoRA (each rank's file in kohya's names) and the same losses, so the gradients were averaged.
    Returns the losses."""
    result = launch(2, ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data),
                        "--output_dir", str(out), "--resolution", "64", "--caption_extension", ".txt",
                        "--train_batch_size", str(batch_size), "--seed", "7", "--learning_rate", "3e-3",
                        "--max_train_steps", "2", *options])
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = (load_file(out / f"rank{r}.safetensors") for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    assert any(v.abs().max() > 0 for k, v in rank0.items() if "lora_up" in k)
    losses = [json.loads((out / f"rank{r}.json").read_text())["losses"] for r in (0, 1)]
    assert losses[0] == losses[1]
    return losses[0]
