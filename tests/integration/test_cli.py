"""train_network.py as a user runs it: a subprocess, exit codes, messages, files."""
from __future__ import annotations

import pytest

from library.config import parse_config
from library.network.kohya_format import load_kohya_lora, read_metadata
from tests.helpers import REPO
from tests.helpers.cli import assert_user_error, run_cli, write
from tests.helpers.runs import shipped_data_args


@pytest.fixture()
def base_toml(tiny_sd1_dir, sample_data_dir, tmp_path) -> str:
    return (f'pretrained_model_name_or_path = "{tiny_sd1_dir}"\ntrain_data_dir = "{sample_data_dir}"\n'
            f'output_dir = "{tmp_path / "out"}"\nresolution = 64\ncaption_extension = ".txt"\n')


def test_misspelt_key_exits_2_with_a_suggestion(base_toml, tmp_path):
    config = write(tmp_path / "lora.toml", base_toml + "[network_arguments]\nnetwork_dimm = 8\n")
    assert_user_error(run_cli("--config", str(config)), "unknown option 'network_dimm'",
                      "did you mean 'network_dim'")


def test_wrong_type_exits_2_naming_the_option(base_toml, tmp_path):
    config = write(tmp_path / "lora.toml", base_toml + 'max_train_steps = "many"\n')
    assert_user_error(run_cli("--config", str(config)), "max_train_steps = 'many': expected an integer")


def test_missing_model_path_exits_2(base_toml, tmp_path):
    config = write(tmp_path / "lora.toml", base_toml)
    missing = tmp_path / "no_such_model"
    assert_user_error(run_cli("--config", str(config), "--pretrained_model_name_or_path", str(missing)),
                      f"{missing} does not exist")


def test_model_folder_without_components_exits_2(base_toml, tmp_path):
    broken = tmp_path / "broken_model"
    (broken / "unet").mkdir(parents=True)
    config = write(tmp_path / "lora.toml", base_toml)
    assert_user_error(run_cli("--config", str(config), "--pretrained_model_name_or_path", str(broken)),
                      "missing vae, text_encoder, tokenizer, scheduler")


def test_data_dir_without_kohya_folders_exits_2(base_toml, tmp_path):
    data = tmp_path / "flat"
    data.mkdir()
    config = write(tmp_path / "lora.toml", base_toml)
    assert_user_error(run_cli("--config", str(config), "--train_data_dir", str(data)),
                      "no images found in folders named like '10_sks dog'")


def test_trains_and_writes_a_kohya_file(base_toml, tmp_path):
    config = write(tmp_path / "lora.toml", base_toml + "max_train_steps = 3\nseed = 5\nnetwork_dim = 4\n"
                   "network_alpha = 2\nsave_precision = \"fp16\"\noutput_name = \"mine\"\n"
                   "training_comment = \"cli test\"\n")
    result = run_cli("--config", str(config), "--learning_rate", "1e-3")
    assert result.returncode == 0, result.stderr
    metadata = read_metadata(tmp_path / "out" / "mine.safetensors")
    assert metadata["ss_network_dim"] == "4" and float(metadata["ss_network_alpha"]) == 2.0
    assert metadata["ss_learning_rate"] == "0.001"
    assert metadata["ss_training_comment"] == "cli test"
    assert metadata["ss_steps"] == "3"
    assert metadata["ss_num_train_images"] == "160"  # kohya counts images x repeats (16 x 10)
    assert metadata["ss_base_model_version"] == "sd_v1"
    assert metadata["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_the_command_trains_the_lora_the_loop_trains_in_this_process(base_toml, tmp_path):
    """The command hides the optional packages its run does not use before the libraries load; in this process
    they are loaded already, so nothing is hidden. Same seed, same threads: the same LoRA, bit for bit."""
    import torch

    import train_network

    config = write(tmp_path / "lora.toml", base_toml + "max_train_steps = 3\nseed = 5\n")
    result = run_cli("--config", str(config), "--output_name", "command", "--console_log_level", "DEBUG",
                     OMP_NUM_THREADS=str(torch.get_num_threads()))
    assert result.returncode == 0, result.stderr
    assert "not imported, unused by this run: bitsandbytes, scipy, boto3" in result.stderr
    assert train_network.main(["--config", str(config), "--output_name", "here"]) == 0
    command, here = (load_kohya_lora(tmp_path / "out" / f"{name}.safetensors")[0] for name in ("command", "here"))
    assert command.keys() == here.keys() and all(torch.equal(command[k], here[k]) for k in command)


def test_output_config_writes_a_reloadable_file(base_toml, tmp_path):
    config = write(tmp_path / "lora.toml", "[training_arguments]\n" + base_toml + "network_dim = 12\n")
    resolved = tmp_path / "resolved.toml"
    result = run_cli("--config", str(config), "--output_config", str(resolved), "--seed", "9")
    assert result.returncode == 0, result.stderr
    reloaded, _ = parse_config(["--config", str(resolved)])
    assert reloaded.network_dim == 12 and reloaded.seed == 9 and reloaded.resolution == (64, 64)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path, tiny_sd1_dir, sample_data_dir, tmp_path):
    # Paths in example configs point at the user's files; everything else must pass as written.
    config, notes = parse_config(["--config", str(path), "--pretrained_model_name_or_path", str(tiny_sd1_dir),
                                  *shipped_data_args(path, sample_data_dir), "--output_dir", str(tmp_path)])
    assert config.network_dim >= 1
    assert all("no effect" in note for note in notes)


def test_help_is_grouped_by_topic():
    result = run_cli("--help")
    assert result.returncode == 0
    for title in ("Base model:", "Dataset:", "LoRA network:", "Optimizer and learning rate:"):
        assert title in result.stdout


def test_resume_from_an_incompatible_state_exits_2_saying_what_differs(base_toml, tmp_path):
    config = write(tmp_path / "lora.toml", base_toml + "max_train_steps = 1\nnetwork_dim = 4\n")
    assert run_cli("--config", str(config), "--save_state_on_train_end").returncode == 0
    state_dir = tmp_path / "out" / "last-state"
    assert (state_dir / "train_state.json").is_file()
    assert_user_error(run_cli("--config", str(config), "--network_dim", "8", "--max_train_steps", "2",
                              "--resume", str(state_dir)),
                      "cannot resume from", "network_dim: the state has 4, this run has 8")
