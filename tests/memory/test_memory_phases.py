"""The memory check of a run by phase: each phase against the memory on its own, the swapped blocks counted, and
every part of a split text encoder file."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import save_file

from library.config import UserError, parse_config
from library.memory import estimate as memory
from library.memory.precision import BasePrecision
from library.training.memory_check import check_memory, swapped_share


def flux_config(folder, tmp_path, *extra):
    return parse_config([f"--pretrained_model_name_or_path={folder}", f"--train_data_dir={tmp_path}",
                         f"--output_dir={tmp_path / 'out'}", "--mixed_precision=bf16", "--gradient_checkpointing",
                         "--network_train_unet_only", *extra])[0]


def folder_counts(folder):
    counts: dict[str, memory.Counts] = {}
    for path, part in memory.model_files(folder, {}):
        for name, found in memory.count_file(path, part).items():
            counts[name] = counts.get(name, memory.Counts()) + found
    return counts


def test_a_run_by_phase_needs_its_largest_phase_not_everything_at_once(tiny_flux_dir, tmp_path, caplog):
    config = flux_config(tiny_flux_dir, tmp_path)
    precision = BasePrecision.from_config(config, torch.bfloat16)
    counts = folder_counts(tiny_flux_dir)
    settings = memory.Settings(None, None, torch.bfloat16, torch.bfloat16, config.network_dim, True,
                               reads_low=False)
    at_once = memory.estimate(counts, settings).total
    phased = memory.peak(memory.phases(counts, settings, host=True)).total
    # The text encoders are the difference: they never share the memory with the denoiser.
    assert at_once - phased == pytest.approx(memory.held_bytes(counts["text"], None, settings))
    between = (at_once + phased) / 2
    with caplog.at_level(logging.INFO, logger="library.training.memory_check"):
        check_memory(config, torch.device("cpu"), 1, precision, torch.bfloat16, available=between, by_phase=True)
    assert "by phase (the largest must fit): text encoding:" in caplog.text
    with pytest.raises(UserError, match="stopped before loading"):
        check_memory(config, torch.device("cpu"), 1, precision, torch.bfloat16, available=between)
    # Sample prompts keep the encoders (on the CPU: in the host memory the run is checked against).
    with pytest.raises(UserError, match="while training"):
        check_memory(config, torch.device("cpu"), 1, precision, torch.bfloat16, available=between, by_phase=True,
                     sampling=True)


def test_swapped_blocks_are_counted_from_the_folder_without_reading_it(tiny_flux_dir, tmp_path, caplog):
    from diffusers import FluxTransformer2DModel

    # The tiny FLUX's one double and one single block cannot be swapped: its folder with 4 and 6 blocks, whose
    # transformer weights no longer match its config (they are not read).
    folder = tmp_path / "flux"
    shutil.copytree(tiny_flux_dir, folder)
    config_file = folder / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "num_layers": 4,
                                       "num_single_layers": 6}))
    transformer = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(folder / "transformer"))
    # blocks_to_swap 3: kohya's split, 1 double block and 4 single blocks, the last of each
    swapped = [*transformer.transformer_blocks[3:], *transformer.single_transformer_blocks[2:]]
    expected = sum(p.numel() for b in swapped for p in b.parameters()) / sum(p.numel()
                                                                              for p in transformer.parameters())
    config = flux_config(folder, tmp_path, "--blocks_to_swap=3")
    assert swapped_share(config) == pytest.approx(expected)
    precision = BasePrecision.from_config(config, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="library.training.memory_check"):
        check_memory(config, torch.device("cuda"), 1, precision, torch.bfloat16, available=1e12, by_phase=True)
    assert f"blocks_to_swap 3: {expected:.0%} of the denoiser in host memory" in caplog.text


def test_every_part_of_a_split_text_encoder_is_counted(tmp_path):
    folder = tmp_path / "text_encoder"
    folder.mkdir()
    save_file({"a.weight": torch.zeros(64, 64)}, folder / "model-00001-of-00002.safetensors")
    save_file({"b.weight": torch.zeros(128, 64), "b.bias": torch.zeros(128)},
              folder / "model-00002-of-00002.safetensors")
    model = tmp_path / "transformer.safetensors"
    save_file({"x.weight": torch.zeros(64, 64)}, model)
    files = memory.model_files(model, {"text": [folder / "model-00001-of-00002.safetensors"]})
    assert [path.name for path, part in files if part == "text"] == ["model-00001-of-00002.safetensors",
                                                                    "model-00002-of-00002.safetensors"]
    text = sum((memory.count_file(path, part)["text"] for path, part in files if part == "text"), memory.Counts())
    assert (text.matrices, text.other) == (64 * 64 + 128 * 64, 128)
