"""kohya dataset TOML: the lookup chain, strict checking, folder names; dataset option checks in the config."""
from __future__ import annotations

from pathlib import Path

import pytest

from library.config import ConfigError, parse_config
from library.data.dataset_config import parse_kohya_folder_name, resolve_datasets


def config_of(tmp_path: Path, *args: str):
    config, _ = parse_config(["--pretrained_model_name_or_path", str(tmp_path), "--output_dir",
                              str(tmp_path / "out"), *args])
    return config


def problems_of(tmp_path: Path, *args: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config_of(tmp_path, *args)
    return info.value.problems


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "dataset.toml"
    path.write_text(text, encoding="utf-8")
    return path


PRECEDENCE_TOML = """
[general]
shuffle_caption = true
keep_tokens = 1
caption_extension = "txt"
flip_aug = true

[[datasets]]
resolution = [512, 768]
batch_size = 2
keep_tokens = 2
enable_bucket = true

  [[datasets.subsets]]
  image_dir = "A"
  keep_tokens = 3
  num_repeats = 5
  class_tokens = "sks dog"

  [[datasets.subsets]]
  image_dir = "B"
  is_reg = true

[[datasets]]
  [[datasets.subsets]]
  image_dir = "C"
"""


def test_lookup_chain_subset_dataset_general_command_line_default(tmp_path):
    toml = write_toml(tmp_path, PRECEDENCE_TOML)
    config = config_of(tmp_path, "--dataset_config", str(toml), "--keep_tokens", "9", "--caption_prefix", "cli",
                       "--train_batch_size", "7", "--resolution", "256", "--shuffle_caption", "false",
                       "--caption_dropout_rate", "0.25", "--min_bucket_reso", "128")
    first, second = resolve_datasets(config)
    a, b = first.subsets
    (c,) = second.subsets
    assert (a.keep_tokens, b.keep_tokens, c.keep_tokens) == (3, 2, 1)  # subset, dataset, general
    assert (first.batch_size, second.batch_size) == (2, 7)  # dataset, command line (train_batch_size)
    assert (first.resolution, second.resolution) == ((512, 768), (256, 256))
    assert (first.enable_bucket, second.enable_bucket) == (True, False)  # dataset, default
    assert first.min_bucket_reso == second.min_bucket_reso == 128  # command line
    # [general] beats the command line, as in kohya, even when the command line sets the value explicitly.
    assert a.shuffle_caption and b.shuffle_caption and c.shuffle_caption
    assert all(s.caption_prefix == "cli" and s.caption_dropout_rate == 0.25 for s in (a, b, c))
    assert all(s.caption_suffix is None for s in (a, b, c))  # default
    assert all(s.caption_extension == ".txt" for s in (a, b, c))  # kohya adds the dot
    assert (a.num_repeats, b.num_repeats, c.num_repeats) == (5, 1, 1)
    assert (a.is_reg, b.is_reg, c.is_reg) == (False, True, False)
    assert (a.class_tokens, b.class_tokens) == ("sks dog", None)
    assert a.image_dir == Path("A") and a.flip_aug


def test_every_toml_mistake_is_reported_at_once(tmp_path):
    toml = write_toml(tmp_path, """
[general]
shufle_caption = true
image_dir = "x"
network_multiplier = 0.5

[[datasets]]
batch_size = "two"
resolution = [512]
  [[datasets.subsets]]
  image_dir = "A"
  num_repeat = 3
  batch_size = 2
  flip_aug = "yes"
  caption_dropout_rate = true

  [[datasets.subsets]]
  is_reg = true
""")
    with pytest.raises(ConfigError) as info:
        resolve_datasets(config_of(tmp_path, "--dataset_config", str(toml)))
    text = "\n".join(info.value.problems)
    expected = [
        "[general]: unknown key 'shufle_caption' (did you mean 'shuffle_caption'?)",
        "[general]: image_dir belongs in a [[datasets.subsets]] table",
        "[general]: network_multiplier is a kohya dataset option this trainer does not support yet",
        "datasets[0]: batch_size = 'two': expected an integer",
        "datasets[0].subsets[0]: unknown key 'num_repeat' (did you mean 'num_repeats'?)",
        "datasets[0].subsets[0]: batch_size is a dataset setting; put it in [[datasets]] or [general]",
        "datasets[0].subsets[0]: flip_aug = 'yes': expected true or false",
        "datasets[0].subsets[0]: caption_dropout_rate = True: expected a number",
        "datasets[0].subsets[1]: image_dir is required",
    ]
    for fragment in expected:
        assert fragment in text, (fragment, text)
    assert len(info.value.problems) == len(expected)
    assert all(p.startswith(str(toml)) for p in info.value.problems)


@pytest.mark.parametrize("text, fragment", [
    ("[general]\n", "no [[datasets]] table"),
    ("[[datasets]]\nbatch_size = 1\n", "no [[datasets.subsets]] table"),
    ("datasets = 3\n", "datasets must be an array of tables"),
    ("[[dataset]]\n", "unknown top-level key 'dataset' (did you mean 'datasets'?)"),
    ("[[datasets]\n", "not valid TOML"),
])
def test_malformed_tomls(tmp_path, text, fragment):
    toml = write_toml(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        resolve_datasets(config_of(tmp_path, "--dataset_config", str(toml)))
    assert fragment in "\n".join(info.value.problems)


def test_resolved_values_are_range_checked_per_dataset(tmp_path):
    toml = write_toml(tmp_path, """
[[datasets]]
enable_bucket = true
min_bucket_reso = 1024
bucket_reso_steps = 60
  [[datasets.subsets]]
  image_dir = "A"
  caption_tag_dropout_rate = 1.5
  num_repeats = -1
  random_crop = true
""")
    with pytest.raises(ConfigError) as info:
        resolve_datasets(config_of(tmp_path, "--dataset_config", str(toml), "--cache_latents"))
    text = "\n".join(info.value.problems)
    for fragment in ("bucket_reso_steps must be a positive multiple of 8", "min_bucket_reso 1024 is larger than",
                     "caption_tag_dropout_rate must be in [0, 1]", "num_repeats must not be negative",
                     "random_crop draws a new crop each time and cannot use cached latents"):
        assert fragment in text, text


def test_text_encoder_cache_rejects_changing_captions_in_the_toml(tmp_path):
    toml = write_toml(tmp_path, '[[datasets]]\n[[datasets.subsets]]\nimage_dir = "A"\nshuffle_caption = true\n')
    config = config_of(tmp_path, "--dataset_config", str(toml), "--cache_text_encoder_outputs",
                       "--network_train_unet_only")
    with pytest.raises(ConfigError, match="cannot use cache_text_encoder_outputs"):
        resolve_datasets(config)


@pytest.mark.parametrize("name, expected", [
    ("10_sks dog", (10, "sks dog")), ("3", (3, "")), ("1_a_b", (1, "a_b")), ("0_x", (0, "x")),
    ("sks dog", None), ("x_10", None),
])
def test_kohya_folder_names(name, expected):
    assert parse_kohya_folder_name(name) == expected


def test_folders_become_subsets_with_regularisation(tmp_path):
    train, reg = tmp_path / "train", tmp_path / "reg"
    for folder in (train / "10_sks dog", train / "3", train / "notes", reg / "1_dog"):
        folder.mkdir(parents=True)
    config = config_of(tmp_path, "--train_data_dir", str(train), "--reg_data_dir", str(reg), "--flip_aug",
                       "--caption_extension", ".txt")
    warnings: list[str] = []
    problems: list[str] = []
    (spec,) = resolve_datasets(config, warnings, problems)
    got = [(s.image_dir.name, s.num_repeats, s.class_tokens, s.is_reg, s.flip_aug, s.caption_extension)
           for s in spec.subsets]
    assert got == [("10_sks dog", 10, "sks dog", False, True, ".txt"), ("3", 3, None, False, True, ".txt"),
                   ("1_dog", 1, "dog", True, True, ".txt")]
    assert problems == [] and len(warnings) == 1 and "notes" in warnings[0]


def test_data_dir_without_kohya_folders_is_a_data_problem(tmp_path):
    (tmp_path / "flat").mkdir()
    problems: list[str] = []
    resolve_datasets(config_of(tmp_path, "--train_data_dir", str(tmp_path / "flat")), [], problems)
    assert problems == [f"train_data_dir {tmp_path / 'flat'}: no images found in folders named like '10_sks dog' "
                        "(no folder name starts with a repeat count)"]


@pytest.mark.parametrize("args, fragment", [
    (["--random_crop", "--cache_latents"], "random_crop draws a new crop each time"),
    (["--random_crop", "--cache_latents_to_disk"], "random_crop draws a new crop each time"),
    (["--cache_text_encoder_outputs"], "cache_text_encoder_outputs needs a frozen text encoder"),
    (["--cache_text_encoder_outputs", "--network_train_unet_only", "--shuffle_caption"],
     "cannot use cache_text_encoder_outputs"),
    (["--caption_dropout_rate", "1.5"], "caption_dropout_rate must be in [0, 1]"),
    (["--caption_tag_dropout_rate", "-0.1"], "caption_tag_dropout_rate must be in [0, 1]"),
    (["--vae_batch_size", "-1"], "vae_batch_size must be at least 1"),
    (["--bucket_reso_steps", "12"], "bucket_reso_steps must be a positive multiple of 8"),
    (["--min_bucket_reso", "600", "--max_bucket_reso", "500"], "need 1 <= min_bucket_reso <= max_bucket_reso"),
    (["--enable_bucket", "--resolution", "512", "--min_bucket_reso", "640", "--max_bucket_reso", "1024"],
     "min_bucket_reso 640 is larger than the resolution's shorter side 512"),
    (["--enable_bucket", "--resolution", "1024", "--max_bucket_reso", "768"],
     "max_bucket_reso 768 is smaller than the resolution's longer side 1024"),
    (["--resolution", "500"], "sides must be multiples of 8"),
    (["--keep_tokens", "-1"], "keep_tokens must not be negative"),
    (["--prior_loss_weight", "-1"], "prior_loss_weight must not be negative"),
])
def test_dataset_option_checks(tmp_path, args, fragment):
    (tmp_path / "data").mkdir()
    problems = problems_of(tmp_path, "--train_data_dir", str(tmp_path / "data"), *args)
    assert any(fragment in p for p in problems), problems


def test_train_data_dir_or_dataset_config(tmp_path):
    (tmp_path / "data").mkdir()
    toml = write_toml(tmp_path, '[[datasets]]\n[[datasets.subsets]]\nimage_dir = "A"\n')
    assert config_of(tmp_path, "--dataset_config", str(toml)).train_data_dir is None  # not required with a TOML
    problems = problems_of(tmp_path)
    assert any("train_data_dir is required" in p and "dataset_config" in p for p in problems)
    problems = problems_of(tmp_path, "--dataset_config", str(toml), "--train_data_dir", str(tmp_path / "data"),
                           "--reg_data_dir", str(tmp_path / "data"))
    assert sum("cannot be combined with dataset_config" in p for p in problems) == 2
    assert problems_of(tmp_path, "--dataset_config", str(tmp_path / "missing.toml")) == [
        f"dataset_config: {tmp_path / 'missing.toml'} is not a file"]
    problems = problems_of(tmp_path, "--train_data_dir", str(tmp_path / "data"), "--reg_data_dir",
                           str(tmp_path / "nope"))
    assert problems == [f"reg_data_dir: {tmp_path / 'nope'} is not a folder"]
