"""Faults in what a user gives the trainer (issue 17, cases 7, 10, 11): each ends with one clear message."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import train_network
from library.config import UserError, parse_config
from library.data.check import dataset_report
from library.network.kohya_format import save_lora_file
from library.training import loop

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")


@pytest.fixture
def data(small_dataset, tmp_path) -> Path:
    return small_dataset(tmp_path / "data")


def options(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--output_dir", str(out),
            "--resolution", "64", "--caption_extension", ".txt", "--train_batch_size", "2", "--seed", "1",
            "--max_train_steps", "1", *extra]


# --- case 7: a dangling symlink among the images -----------------------------------------------------------------

def test_a_dangling_symlink_is_reported_by_the_scan_and_the_dataset_check(data, tmp_path):
    link = data / "1_sks shape" / "gone.png"
    os.symlink(tmp_path / "moved-away.png", link)
    config, _ = parse_config(options(tmp_path, data, tmp_path / "out"))
    text, usable = dataset_report(config)
    assert not usable
    assert f"{link}: a symlink to {tmp_path / 'moved-away.png'}, which does not exist" in text


# --- case 10: network_weights that fit nothing, or are not a safetensors file ---------------------------------

def test_network_weights_matching_no_module_are_refused_naming_the_file(tiny_sd1_dir, data, tmp_path):
    sdxl_like = tmp_path / "sdxl.safetensors"
    name = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    save_lora_file(sdxl_like, {f"{name}.lora_down.weight": torch.zeros(4, 32),
                               f"{name}.lora_up.weight": torch.zeros(32, 4), f"{name}.alpha": torch.tensor(1.0)},
                   {"ss_base_model_version": "sdxl_base_v1-0"})
    config, _ = parse_config(options(tiny_sd1_dir, data, tmp_path / "out", "--network_weights", str(sdxl_like)))
    with pytest.raises(UserError) as info:
        loop.run(config)
    message = str(info.value)
    assert str(sdxl_like) in message and "none of its keys matches" in message
    assert "SDXL" in message and "sdxl_base_v1-0" in message and "lora_unet_input*" in message
    assert not (tmp_path / "out" / "last.safetensors").exists()


def test_corrupt_network_weights_are_a_clear_error(tiny_sd1_dir, data, tmp_path, capsys):
    corrupt = tmp_path / "random.safetensors"
    corrupt.write_bytes(os.urandom(4096))
    status = train_network.main(options(tiny_sd1_dir, data, tmp_path / "out", "--network_weights", str(corrupt)))
    err = capsys.readouterr().err
    assert status == 2 and str(corrupt) in err and "not a readable safetensors file" in err
    assert "Traceback" not in err


# --- case 11: every config problem at once ---------------------------------------------------------------------

def test_a_dataset_toml_typo_is_reported_with_the_option_conflict(data, tmp_path, capsys):
    toml = tmp_path / "dataset.toml"
    toml.write_text('[[datasets]]\n[[datasets.subsets]]\nimage_dirr = "x"\n')
    status = train_network.main(options(tmp_path, data, tmp_path / "out", "--dataset_config", str(toml)))
    err = capsys.readouterr().err
    assert status == 2
    assert "train_data_dir cannot be combined with dataset_config" in err
    assert "unknown key 'image_dirr' (did you mean 'image_dir'?)" in err
    assert "image_dir is required" in err


def test_a_table_named_like_an_option_says_it_is_an_option(data, tmp_path):
    config_file = tmp_path / "lora.toml"
    config_file.write_text("[network_dim]\nvalue = 4\n")
    with pytest.raises(UserError) as info:
        parse_config(["--config", str(config_file), *options(tmp_path, data, tmp_path / "out")])
    problems = info.value.problems
    assert any("[network_dim] is a table, but network_dim is an option" in p for p in problems), problems
    assert not any("unknown option 'value'" in p for p in problems), problems
