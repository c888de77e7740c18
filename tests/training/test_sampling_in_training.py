"""Sampling wired into training: files, tracker images, and a training path that sampling does not change."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from library.config import UserError, parse_config
from library.network import kohya_format
from tests.helpers.runs import TINY_RUN, train

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")

RUN = {**TINY_RUN, "seed": 9, "learning_rate": "1e-2", "network_dropout": 0.2}


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("sks shape --d 11 --s 2\n# not a prompt\nred shape --w 64 --h 128 --s 2 --ss euler_a --d 12\n")
    return path


def test_sampling_writes_and_logs_images_without_changing_training(tiny_sd1_dir, sample_data_dir, tmp_path,
                                                                   prompts):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plain = train(tiny_sd1_dir, sample_data_dir, tmp_path / "plain", "--max_train_steps", "4", run=RUN)
    sampled = train(tiny_sd1_dir, sample_data_dir, tmp_path / "sampled", "--max_train_steps", "4",
                    "--sample_prompts", str(prompts), "--sample_every_n_steps", "2", "--sample_at_first",
                    "--log_with", "tensorboard", run=RUN)

    assert sampled.losses == plain.losses
    a, b = (kohya_format.load_kohya_lora(tmp_path / d / "last.safetensors")[0] for d in ("plain", "sampled"))
    assert all(torch.equal(a[k], b[k]) for k in a)

    names = sorted(p.name for p in (tmp_path / "sampled" / "sample").iterdir())
    assert names == sorted(f"last_{step:06d}_{index:02d}_{seed}.png" for step in (0, 2, 4)
                           for index, seed in ((0, 11), (1, 12)))
    for step in (0, 2, 4):
        assert Image.open(tmp_path / "sampled" / "sample" / f"last_{step:06d}_00_11.png").size == (64, 64)
        assert Image.open(tmp_path / "sampled" / "sample" / f"last_{step:06d}_01_12.png").size == (64, 128)

    (events,) = (tmp_path / "sampled" / "logs").rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events.parent), size_guidance={"images": 0})
    accumulator.Reload()
    for tag in ("sample/00", "sample/01"):
        assert [e.step for e in accumulator.Images(tag)] == [0, 2, 4]
    first = accumulator.Images("sample/01")[0]
    assert (first.width, first.height) == (64, 128)


def test_epoch_rounds_are_named_by_epoch_and_override_step_rounds(tiny_sd1_dir, sample_data_dir, tmp_path,
                                                                  prompts):
    data = tmp_path / "data"
    (data / "1_sks shape").mkdir(parents=True)
    for image in sorted((sample_data_dir / "10_sks shape").glob("*.png"))[:4]:
        shutil.copy(image, data / "1_sks shape" / image.name)
        shutil.copy(image.with_suffix(".txt"), data / "1_sks shape" / image.with_suffix(".txt").name)
    train(tiny_sd1_dir, data, tmp_path / "out", "--max_train_epochs", "2", "--sample_prompts", str(prompts),
          "--sample_every_n_epochs", "1", "--sample_every_n_steps", "1", run=RUN)
    names = sorted(p.name for p in (tmp_path / "out" / "sample").iterdir())
    assert names == sorted(f"last_e{epoch:06d}_{index:02d}_{seed}.png" for epoch in (1, 2)
                           for index, seed in ((0, 11), (1, 12)))


def test_prompt_file_problems_stop_before_training(tiny_sd1_dir, sample_data_dir, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("a shape --w abc\nanother --s 0\n")
    with pytest.raises(UserError) as e:
        train(tiny_sd1_dir, sample_data_dir, tmp_path / "out", "--max_train_steps", "1", "--sample_prompts", str(bad),
              "--sample_every_n_steps", "1", run=RUN)
    assert "line 1" in str(e.value) and "line 2" in str(e.value)
    assert not (tmp_path / "out" / "last.safetensors").exists()
    with pytest.raises(UserError, match="sample_sampler"):
        parse_config(["--output_config", str(tmp_path / "c.toml"), "--sample_sampler", "eulr"])
