"""train_network.py on real datasets: the dataset check, bad data, and training with buckets, regularisation images
and a disk latent cache."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from library.network.kohya_format import read_metadata
from tests.helpers.cli import run_cli
from tests.helpers.datasets import noise_image


@pytest.fixture()
def mixed_dataset(tmp_path) -> tuple[Path, Path]:
    """Training images in three aspect ratios with captions, and a regularisation folder without captions."""
    train, reg = tmp_path / "images", tmp_path / "reg"
    for i, size in enumerate([(96, 64), (64, 96), (64, 64), (128, 64)]):
        image = noise_image(train / f"{i}.png", size, i)
        image.with_suffix(".txt").write_text(f"sks shape, picture {i}", encoding="utf-8")
    for i in range(3):
        noise_image(reg / f"r{i}.png", (64, 64), 10 + i)
    return train, reg


def dataset_toml(tmp_path: Path, train: Path, reg: Path) -> Path:
    path = tmp_path / "dataset.toml"
    path.write_text(f"""
[general]
enable_bucket = true
min_bucket_reso = 32
max_bucket_reso = 128
bucket_reso_steps = 16
caption_extension = ".txt"
flip_aug = true

[[datasets]]
resolution = 64
batch_size = 2

  [[datasets.subsets]]
  image_dir = "{train}"
  num_repeats = 2

  [[datasets.subsets]]
  image_dir = "{reg}"
  is_reg = true
  class_tokens = "shape"
""", encoding="utf-8")
    return path


def base_args(model: Path, toml: Path, out: Path) -> list[str]:
    return ["--pretrained_model_name_or_path", str(model), "--dataset_config", str(toml), "--output_dir", str(out),
            "--seed", "1", "--learning_rate", "1e-3"]


def test_dataset_check_needs_only_the_tokenizer(tiny_sd1_dir, mixed_dataset, tmp_path):
    train, reg = mixed_dataset
    model = tmp_path / "tokenizer_only"
    shutil.copytree(tiny_sd1_dir / "tokenizer", model / "tokenizer")  # no UNet, VAE or text encoder
    result = run_cli(*base_args(model, dataset_toml(tmp_path, train, reg), tmp_path / "out"), "--dataset_check")
    assert result.returncode == 0, result.stderr
    report = result.stdout
    assert f"subset 0: {train}: 4 images x 2 repeats -> 8 samples per epoch" in report
    assert f"reg subset 1: {reg}: 3 images x 1 repeats -> 8 samples per epoch" in report
    # bucket histogram (samples per epoch / images): 96x64 and 128x64 -> 80x48, 64x96 -> 48x80
    assert "48x80: 2 / 1" in report and "64x64: 10 / 4" in report and "80x48: 4 / 2" in report
    assert "longest caption" in report and "result: usable" in report
    assert not (tmp_path / "out").exists()


def test_bad_data_stops_before_training_listing_every_problem(tiny_sd1_dir, mixed_dataset, tmp_path):
    train, reg = mixed_dataset
    broken = noise_image(train / "broken.png", (64, 64), 99)
    broken.write_bytes(broken.read_bytes()[:200])
    (train / "0.txt").write_bytes("caf\xe9".encode("latin-1"))
    args = base_args(tiny_sd1_dir, dataset_toml(tmp_path, train, reg), tmp_path / "out")
    check = run_cli(*args, "--dataset_check")
    assert check.returncode != 0
    assert f"{broken}: truncated image file" in check.stdout + check.stderr
    result = run_cli(*args, "--max_train_steps", "2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{broken}: truncated image file" in result.stderr
    assert f"{train / '0.txt'}: caption is not UTF-8 text" in result.stderr
    assert not list((tmp_path / "out").glob("*.safetensors"))


def test_trains_on_mixed_aspect_images_with_regularisation_and_a_disk_latent_cache(tiny_sd1_dir, mixed_dataset,
                                                                                    tmp_path):
    train, reg = mixed_dataset
    args = base_args(tiny_sd1_dir, dataset_toml(tmp_path, train, reg), tmp_path / "out") + [
        "--cache_latents_to_disk", "--vae_batch_size", "4", "--max_train_steps", "3", "--prior_loss_weight", "0.5"]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    caches = sorted(p.name for p in list(train.iterdir()) + list(reg.iterdir()) if p.name.endswith(".safetensors"))
    assert len(caches) == 7  # every training and regularisation image
    assert "latents: 0 reused from disk, 14 encoded" in result.stderr  # 7 images x (plain, flipped)
    metadata = read_metadata(tmp_path / "out" / "last.safetensors")
    assert metadata["ss_num_reg_images"] == "3" and metadata["ss_num_train_images"] == "8"
    assert json.loads(metadata["ss_bucket_info"])["buckets"]
    # Reuse without the VAE on an unchanged second run is covered in tests/data/test_cache.py.
