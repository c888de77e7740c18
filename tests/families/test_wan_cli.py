"""Wan through train_network.py with its shipped configs (paths and sizes overridden on the command line): images as
one-frame clips, a video dataset, both Wan 2.2 experts in one run; the file and its metadata, and exact resume."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from library.network.kohya_format import load_kohya_lora
from tests.helpers import REPO
from tests.helpers.cli import run_cli, write
from tests.helpers.datasets import copy_images
from tests.helpers.videos import write_video

MODULES = 2 * 10  # two blocks x musubi's 10 lora_wan modules


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from library.families.wan.tiny import save_tiny_wan21, save_tiny_wan22_a14b

    root = tmp_path_factory.mktemp("wan")
    return {"wan": save_tiny_wan21(root / "wan21"), "wan22": save_tiny_wan22_a14b(root / "wan22")}


@pytest.fixture(scope="module")
def data(sample_data_dir, tmp_path_factory) -> Path:
    return copy_images(sample_data_dir, tmp_path_factory.mktemp("wan_data"), 4)


def overrides(model: Path, out: Path) -> list[str]:
    """The shipped config at the tiny model's size: no buckets, fp32, a rank-4 LoRA, steps instead of epochs."""
    return ["--pretrained_model_name_or_path", str(model), "--output_dir", str(out), "--resolution", "64",
            "--enable_bucket", "false", "--mixed_precision", "no", "--save_precision", "float", "--fp8_base", "false",
            "--gradient_checkpointing", "false", "--network_dim", "4", "--network_alpha", "2", "--learning_rate",
            "1e-3", "--max_train_epochs", "0", "--save_every_n_epochs", "0", "--train_batch_size", "2", "--seed",
            "3", "--output_name", "last"]


def run(config: str, model: Path, out: Path, *more: str, steps: int = 4) -> Path:
    result = run_cli("--config", str(REPO / "configs" / config), *overrides(model, out), "--max_train_steps",
                     str(steps), *more)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def reference(models, data, tmp_path_factory) -> Path:
    return run("wan_lora.toml", models["wan"], tmp_path_factory.mktemp("wan_reference"), "--train_data_dir",
               str(data), "--save_every_n_steps", "2", "--save_state")


@pytest.fixture(scope="module")
def experts(models, data, tmp_path_factory) -> Path:
    return run("wan22_lora.toml", models["wan22"], tmp_path_factory.mktemp("wan22_reference"), "--train_data_dir",
               str(data), "--save_every_n_steps", "2", "--save_state", "--timestep_boundary", "500",
               "--expert_loras", "shared")


def test_images_train_as_one_frame_clips_into_musubis_file(reference):
    state_dict, metadata = load_kohya_lora(reference / "last.safetensors")
    modules = {key.split(".")[0] for key in state_dict}
    assert len(modules) == MODULES and all(m.startswith("lora_unet_blocks_") for m in modules)
    assert all(state_dict[f"{m}.lora_up.weight"].abs().sum() > 0 for m in modules)
    assert metadata["ss_base_model_version"] == "wan" and metadata["modelspec.architecture"] == "wan2.1/lora"
    assert metadata["ss_network_module"] == "networks.lora_wan" and metadata["ss_task"] == "t2v-1.3B"
    assert metadata["ss_timestep_sampling"] == "shift" and metadata["ss_discrete_flow_shift"] == "3.0"


def assert_resumes_bit_exactly(config: str, model: Path, reference: Path, data: Path, out: Path, *more: str):
    run(config, model, out, "--train_data_dir", str(data), "--resume", str(reference / "last-step00000002-state"),
        *more)
    expected, got = load_file(reference / "last.safetensors"), load_file(out / "last.safetensors")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_resumes_bit_exactly(models, reference, data, tmp_path):
    assert_resumes_bit_exactly("wan_lora.toml", models["wan"], reference, data, tmp_path / "resumed")


def test_both_experts_train_one_lora_switched_at_the_boundary(experts):
    state_dict, metadata = load_kohya_lora(experts / "last.safetensors")
    assert len({key.split(".")[0] for key in state_dict}) == MODULES
    assert metadata["ss_task"] == "t2v-A14B" and float(metadata["ss_timestep_boundary"]) == 0.5


@pytest.mark.slow
def test_both_experts_resume_bit_exactly(models, experts, data, tmp_path):
    """The resumed run starts on the low-noise expert; each step's batch picks its expert again from its
    timesteps, so the swaps, and the file, are the same."""
    assert_resumes_bit_exactly("wan22_lora.toml", models["wan22"], experts, data, tmp_path / "resumed",
                               "--timestep_boundary", "500", "--expert_loras", "shared")


def train_on_clips(model: Path, folder: Path, dataset_keys: str) -> dict[str, torch.Tensor]:
    """Two steps on two 9-frame clips cut to 5 frames, the dataset's [[datasets]] table given `dataset_keys`; the
    LoRA file's tensors."""
    videos = folder / "videos"
    for i in range(2):
        write_video(videos / f"clip{i}.mp4", 9, (64, 64))
        (videos / f"clip{i}.txt").write_text("sks moving")
    dataset = write(folder / "dataset.toml", '[general]\nresolution = [64, 64]\ncaption_extension = ".txt"\n'
                    'batch_size = 2\nenable_bucket = false\n\n[[datasets]]\n'
                    f'video_directory = "{videos}"\ntarget_frames = [5]\nframe_extraction = "head"\n{dataset_keys}')
    config = write(folder / "lora.toml", f'pretrained_model_name_or_path = "{model}"\n'
                   f'dataset_config = "{dataset}"\noutput_dir = "{folder / "out"}"\noutput_name = "last"\n'
                   'network_module = "networks.lora_wan"\nnetwork_dim = 4\nnetwork_alpha = 2\nseed = 3\n'
                   'learning_rate = 1e-3\ntimestep_sampling = "shift"\ndiscrete_flow_shift = 3.0\n'
                   'max_train_steps = 2\n')
    result = run_cli("--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    return load_file(folder / "out" / "last.safetensors")


def test_a_video_dataset_trains_on_4n_plus_1_frame_clips(models, tmp_path, reference):
    video, image = train_on_clips(models["wan"], tmp_path, ""), load_file(reference / "last.safetensors")
    assert video.keys() == image.keys()
    assert any(not torch.equal(video[k], image[k]) for k in video if "lora_up" in k)
    assert all(video[k].any() for k in video if "lora_up" in k)  # each layer moved (see the prior_reg test)


def test_prior_reg_clips_keep_the_adapter_where_the_base_model_is(models, tmp_path):
    """Clips trained towards the base's own prediction: the LoRA starts as the base (its up weights are zero), so
    every step's loss and gradient are zero and it stays there, where the same clips trained towards their frames
    move it (the test above)."""
    kept = train_on_clips(models["wan"], tmp_path, "prior_reg = true\n")
    ups = [key for key in kept if "lora_up" in key]
    assert len(ups) == MODULES and all(not kept[key].any() for key in ups)


@pytest.mark.slow
def test_ddp_ranks_agree(models, data, tmp_path):
    """Two gloo processes on different halves of the data end with the same LoRA: the gradients were synced."""
    from tests.helpers.family_cli import ddp_ranks_agree

    ddp_ranks_agree(models["wan"], data, tmp_path / "ddp", "--network_module", "networks.lora_wan",
                    "--timestep_sampling", "shift", "--discrete_flow_shift", "3.0", batch_size=1)
    assert "lora_unet_blocks_0_self_attn_q.lora_down.weight" in load_file(tmp_path / "ddp" / "last.safetensors")


@pytest.mark.slow
def test_i2v_ddp_ranks_agree(data, tmp_path):
    """Wan 2.1 I2V (CLIP vision and the first frame as conditioning) on two gloo processes: the ranks end with the
    same LoRA and losses."""
    from library.families.wan.tiny import save_tiny_wan21_i2v
    from tests.helpers.family_cli import ddp_ranks_agree

    model = save_tiny_wan21_i2v(tmp_path / "i2v")
    ddp_ranks_agree(model, data, tmp_path / "ddp", "--network_module", "networks.lora_wan", "--timestep_sampling",
                    "shift", "--discrete_flow_shift", "3.0", batch_size=1)
    assert "lora_unet_blocks_0_self_attn_q.lora_down.weight" in load_file(tmp_path / "ddp" / "last.safetensors")


@pytest.mark.slow
def test_ti2v_5b_trains_from_its_folder(data, tmp_path):
    from library.families.wan.tiny import save_tiny_wan22_ti2v_5b

    model = save_tiny_wan22_ti2v_5b(tmp_path / "ti2v")
    config = write(tmp_path / "lora.toml", f'pretrained_model_name_or_path = "{model}"\ntrain_data_dir = "{data}"\n'
                   f'output_dir = "{tmp_path / "out"}"\noutput_name = "last"\nresolution = 64\ncaption_extension = '
                   '".txt"\ntrain_batch_size = 2\nnetwork_module = "networks.lora_wan"\nnetwork_dim = 4\n'
                   'network_alpha = 2\nseed = 3\nlearning_rate = 1e-3\nmax_train_steps = 2\n')
    result = run_cli("--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    state_dict, metadata = load_kohya_lora(tmp_path / "out" / "last.safetensors")
    assert len({key.split(".")[0] for key in state_dict}) == MODULES and metadata["ss_task"] == "ti2v-5B"


@pytest.mark.slow
def test_musubis_file_options_train_from_the_separate_files(models, data, tmp_path):
    """musubi-tuner's names: dit (the transformer file), t5, vae (the VAE file of a transformer file), task."""
    from library.families.wan.tiny import save_tiny_wan_files

    files = save_tiny_wan_files(models["wan"], tmp_path / "files")
    config = write(tmp_path / "lora.toml", f'dit = "{files["transformer"]}"\nt5 = "{files["t5"]}"\n'
                   f'vae = "{files["ae"]}"\nmodel_config = "{models["wan"]}"\ntask = "t2v-1.3B"\n'
                   f'train_data_dir = "{data}"\noutput_dir = "{tmp_path / "out"}"\noutput_name = "last"\n'
                   'resolution = 64\ncaption_extension = ".txt"\ntrain_batch_size = 2\nnetwork_module = '
                   '"networks.lora_wan"\nnetwork_dim = 4\nnetwork_alpha = 2\nseed = 3\nmax_train_steps = 2\n')
    result = run_cli("--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    state_dict, metadata = load_kohya_lora(tmp_path / "out" / "last.safetensors")
    assert len({key.split(".")[0] for key in state_dict}) == MODULES and metadata["ss_task"] == "t2v-1.3B"
