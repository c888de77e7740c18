"""Z-Image and Qwen-Image (musubi-tuner's families) through train_network.py with their shipped configs (paths and
sizes overridden on the command line): the file and its metadata, exact resume (which reads the file's layout
back), and 2 gloo processes (DDP)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from library.network.kohya_format import load_kohya_lora
from tests.helpers import REPO
from tests.helpers.cli import run_cli
from tests.helpers.datasets import copy_images
from tests.helpers.family_cli import ddp_ranks_agree


@dataclass(frozen=True)
class Family:
    name: str  # its tiny model fixture is tiny_<name>_dir, its config configs/<name>_lora.toml
    network_module: str
    timestep_sampling: str  # for the DDP run, which has no config file
    discrete_flow_shift: str  # the shipped config's
    architecture: str
    up: str  # the file's name of the LoRA's up (B) matrix
    first_key: str  # a key the file must hold


Z_IMAGE = Family("z_image", "networks.lora_zimage", "sigmoid", "2.0", "Z-Image/lora", "lora_B",
                 "diffusion_model.layers.0.attention.to_q.lora_A.weight")
QWEN_IMAGE = Family("qwen_image", "networks.lora_qwen_image", "qwen_shift", "2.2", "Qwen-Image/lora", "lora_up",
                    "lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight")


def file_modules(family: Family, state_dict: dict[str, torch.Tensor]) -> set[str]:
    """The LoRA modules of a file, each checked against the family's layout."""
    if family is Z_IMAGE:  # musubi's: the transformer's own module names, lora_A / lora_B, no alpha
        modules = {key.rsplit(".", 2)[0] if key.endswith(".weight") else key.rsplit(".", 1)[0] for key in state_dict}
        assert len(modules) == 2 * 7  # two layers x (to_q, to_k, to_v, to_out.0, w1, w2, w3); no text encoder
        assert all(m.startswith("diffusion_model.layers.") for m in modules)
    else:  # kohya's names with an alpha each
        modules = {key.split(".")[0] for key in state_dict}
        assert len(modules) == 2 * 14 - 4  # musubi's 14 Linear layers per block but the last's 4 text-only; no TE
        assert all(m.startswith("lora_unet_transformer_blocks_") for m in modules)
        assert all(float(state_dict[f"{m}.alpha"]) == 2.0 for m in modules)
    return modules


@pytest.fixture(scope="module", params=[Z_IMAGE, QWEN_IMAGE], ids=lambda family: family.name)
def family(request) -> Family:
    return request.param


@pytest.fixture(scope="module")
def model(family, request) -> Path:
    return request.getfixturevalue(f"tiny_{family.name}_dir")


@pytest.fixture(scope="module")
def data(sample_data_dir, tmp_path_factory) -> Path:
    return copy_images(sample_data_dir, tmp_path_factory.mktemp("musubi_data"), 4)


def overrides(model: Path, data: Path, out: Path) -> list[str]:
    """The shipped config at the tiny model's size: no buckets, fp32, a rank-4 LoRA, steps instead of epochs."""
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--output_dir", str(out),
            "--resolution", "64", "--enable_bucket", "false", "--mixed_precision", "no", "--save_precision", "float",
            "--network_dim", "4", "--network_alpha", "2", "--learning_rate", "1e-3", "--max_train_epochs", "0",
            "--save_every_n_epochs", "0", "--train_batch_size", "2", "--seed", "3", "--output_name", "last"]


def config(family: Family) -> list[str]:
    return ["--config", str(REPO / "configs" / f"{family.name}_lora.toml")]


@pytest.fixture(scope="module")
def reference(family, model, data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"{family.name}_reference")
    result = run_cli(*config(family), *overrides(model, data, out), "--max_train_steps", "4",
                     "--save_every_n_steps", "2", "--save_state")
    assert result.returncode == 0, result.stderr
    return out


def test_the_shipped_config_trains_and_writes_musubis_file(family, reference):
    state_dict, metadata = load_kohya_lora(reference / "last.safetensors")
    modules = file_modules(family, state_dict)
    assert all(state_dict[f"{m}.{family.up}.weight"].abs().sum() > 0 for m in modules)
    assert metadata["ss_base_model_version"] == family.name
    assert metadata["modelspec.architecture"] == family.architecture
    assert metadata["ss_network_module"] == family.network_module
    assert metadata["ss_timestep_sampling"] == "shift"
    assert metadata["ss_discrete_flow_shift"] == family.discrete_flow_shift
    assert metadata["ss_weighting_scheme"] == "none"


def test_resumes_bit_exactly(family, reference, model, data, tmp_path):
    out = tmp_path / "resumed"
    result = run_cli(*config(family), *overrides(model, data, out), "--max_train_steps", "4",
                     "--resume", str(reference / "last-step00000002-state"))
    assert result.returncode == 0, result.stderr
    expected, got = load_file(reference / "last.safetensors"), load_file(out / "last.safetensors")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_ddp_ranks_agree(family, model, data, tmp_path):
    """Two gloo processes on different halves of the data end with the same LoRA: the gradients were synced."""
    ddp_ranks_agree(model, data, tmp_path / "ddp", "--network_module", family.network_module,
                    "--timestep_sampling", family.timestep_sampling, batch_size=1)
    assert family.first_key in load_file(tmp_path / "ddp" / "last.safetensors")
