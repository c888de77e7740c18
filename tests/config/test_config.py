"""The option schema: TOML loading, command-line overrides, validation that names every problem."""
from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from library.config import ConfigError, parse_config, write_config
from library.config.network_args import network_args_of
from library.config.options import OPTIONS


@pytest.fixture()
def paths(tmp_path: Path) -> dict[str, str]:
    model = tmp_path / "model"
    data = tmp_path / "data"
    model.mkdir()
    data.mkdir()
    return {"pretrained_model_name_or_path": str(model), "train_data_dir": str(data),
            "output_dir": str(tmp_path / "out")}


def write_toml(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def required_args(paths: dict[str, str]) -> list[str]:
    return [arg for name, value in paths.items() for arg in (f"--{name}", value)]


def problems_of(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(argv)
    return info.value.problems


def test_kohya_sectioned_toml_is_flattened_and_typed(tmp_path, paths):
    config_file = write_toml(tmp_path / "lora.toml", f"""
[model_arguments]
pretrained_model_name_or_path = "{paths['pretrained_model_name_or_path']}"
v2 = false

[dataset_arguments]
train_data_dir = "{paths['train_data_dir']}"
resolution = "512,768"
caption_extention = ".txt"

[training_arguments]
output_dir = "{paths['output_dir']}"
max_train_steps = 100
learning_rate = 1e-4
mixed_precision = "bf16"
gradient_checkpointing = true
network_args = []
optimizer_args = ["weight_decay=0.1"]

[network_arguments]
network_dim = 16
network_alpha = 8
""")
    config, notes = parse_config(["--config", config_file])
    assert config.resolution == (512, 768)
    assert config.caption_extension == ".txt"  # kohya's misspelt alias
    assert config.network_dim == 16 and config.network_alpha == 8.0 and isinstance(config.network_alpha, float)
    assert config.learning_rate == pytest.approx(1e-4)
    assert config.gradient_checkpointing is True
    assert config.optimizer_args == ["weight_decay=0.1"]
    assert config.is_set("network_dim") and not config.is_set("seed")
    assert notes == []


def test_command_line_overrides_file_including_switching_a_flag_off(tmp_path, paths):
    config_file = write_toml(tmp_path / "lora.toml", """
gradient_checkpointing = true
network_train_unet_only = true
network_dim = 8
""")
    base = ["--config_file", config_file] + required_args(paths)
    config, _ = parse_config(base + ["--network_dim", "32", "--gradient_checkpointing", "false",
                                     "--no_network_train_unet_only"])
    assert config.network_dim == 32
    assert config.gradient_checkpointing is False
    assert config.network_train_unet_only is False
    config, _ = parse_config(base)
    assert config.network_dim == 8 and config.gradient_checkpointing and config.network_train_unet_only


def test_all_problems_reported_at_once_with_suggestions(tmp_path, paths):
    config_file = write_toml(tmp_path / "lora.toml", """
netwrok_dim = 8
learning_rate = "fast"
lr_scheduler = "cosin"
max_train_steps = 1.5
""")
    problems = problems_of(["--config", config_file, "--mixed_precision", "fp32"] + required_args(paths))
    text = "\n".join(problems)
    assert len(problems) == 5, text
    assert "unknown option 'netwrok_dim'" in text and "did you mean 'network_dim'" in text
    assert "learning_rate = 'fast'" in text
    assert "did you mean 'cosine'" in text
    assert "max_train_steps = 1.5: expected an integer" in text
    assert "mixed_precision = 'fp32': must be one of no, fp16, bf16" in text


def test_missing_required_paths_are_named(tmp_path):
    problems = problems_of(["--pretrained_model_name_or_path", str(tmp_path / "missing")])
    text = "\n".join(problems)
    assert f"{tmp_path / 'missing'} does not exist" in text
    assert "train_data_dir is required" in text
    assert "output_dir is required" in text


def test_empty_strings_leave_optional_paths_unset_as_in_kohya(tmp_path, paths):
    """kohya's GUI saves unset options as "", and sd-scripts tests them with `if args.x:`."""
    config_file = write_toml(tmp_path / "c.toml", "".join(f'{k} = "{v}"\n' for k, v in paths.items())
                             + 'reg_data_dir = ""\nnetwork_weights = ""\nlog_with = ""\nsample_prompts = ""\n')
    config, _ = parse_config(["--config", config_file])
    assert (config.reg_data_dir, config.network_weights, config.log_with, config.sample_prompts) == (None,) * 4
    config, _ = parse_config(["--config", config_file, "--reg_data_dir", str(tmp_path)])
    assert config.reg_data_dir == str(tmp_path)
    # A required path given as "" is missing, not the current folder.
    problems = problems_of(["--config", config_file, "--train_data_dir="])
    assert any(p.startswith("train_data_dir is required") for p in problems), problems
    assert not any("is not a folder" in p or "does not exist" in p for p in problems), problems


def test_unknown_command_line_option_and_its_value_count_once(paths):
    problems = problems_of(required_args(paths) + ["--learing_rate", "1e-4"])
    assert problems == ["command line: unknown option 'learing_rate' (did you mean 'learning_rate'?)"]


def test_kohya_options_without_effect_are_noted_and_unsupported_ones_named(tmp_path, paths):
    config_file = write_toml(tmp_path / "lora.toml", "xformers = true\ndataset_class = \"mine.Images\"\n")
    problems = problems_of(["--config", config_file] + required_args(paths))
    assert len(problems) == 1 and problems[0].startswith(
        f"{config_file}: dataset_class is a kohya option this trainer refuses: it imports and runs"), problems
    config_file = write_toml(tmp_path / "lora2.toml", "xformers = true\nsdpa = true\n")
    _, notes = parse_config(["--config", config_file] + required_args(paths))
    assert len(notes) == 2 and all("no effect" in note for note in notes)
    # sd-scripts' SD3 options that its own help marks [DOES NOT WORK]
    _, notes = parse_config(required_args(paths) + ["--t5xxl_device", "cpu", "--t5xxl_dtype", "fp16", "--save_clip",
                                                    "--save_t5xxl"])
    assert len(notes) == 4 and all("DOES NOT WORK" in note for note in notes), notes
    _, notes = parse_config(required_args(paths) + ["--controlnet_model_name_or_path", "cn.safetensors"])
    assert len(notes) == 1 and "does not read it" in notes[0], notes


def test_split_mode_becomes_block_swapping_as_in_sd_scripts(paths):
    # flux_train_network.py: the deprecated split_mode sets blocks_to_swap 18, or is ignored when that is set
    config, notes = parse_config(required_args(paths) + ["--split_mode"])
    assert config.blocks_to_swap == 18 and any("blocks_to_swap 18" in note for note in notes), notes
    config, notes = parse_config(required_args(paths) + ["--split_mode", "--blocks_to_swap", "4"])
    assert config.blocks_to_swap == 4 and any("ignored because blocks_to_swap" in note for note in notes), notes


def test_an_option_not_offered_asks_for_nothing_when_off_on_the_command_line_too(paths):
    # `--x=false` / `--x 0` on the command line is what `x = false` is in a file: noted, not refused
    for off in (["--dataset_class=false"], ["--dataset_class", "0"], ["--dataset_class="]):
        _, notes = parse_config(required_args(paths) + off)
        assert any("dataset_class" in note and "asks for nothing" in note for note in notes), (off, notes)
    problems = problems_of(required_args(paths) + ["--dataset_class=my.Dataset"])
    assert problems == ["command line: dataset_class is a kohya option this trainer refuses: it imports and runs a "
                        "Python class named in the config; give the images as kohya folders (train_data_dir) or a "
                        "dataset_config TOML; remove it"]


@pytest.mark.parametrize("text, message", [
    ("network_dim = 0", "network_dim must be at least 1"),
    ("network_dropout = 1.0", "network_dropout must be in [0, 1)"),
    ("min_timestep = 500\nmax_timestep = 100", "need 0 <= min_timestep < max_timestep <= 1000"),
    ("network_train_unet_only = true\nnetwork_train_text_encoder_only = true", "cannot both be set"),
    ("lr_warmup_steps = 2.5", "lr_warmup_steps must be a whole number of steps or a fraction"),
    ("resolution = \"512,x\"", "expected a size"),
    ("gradient_checkpointing = \"maybe\"", "expected true or false"),
    ("[a]\n[a.b]\nc = 1", "nested tables are not options"),
    ("optimizer_args = [\"weight_decay\"]", "must look like key=value"),
])
def test_value_checks(tmp_path, paths, text, message):
    config_file = write_toml(tmp_path / "bad.toml", text + "\n")
    problems = problems_of(["--config", config_file] + required_args(paths))
    assert any(message in p for p in problems), problems


def test_invalid_toml_is_reported_with_its_path(tmp_path):
    config_file = write_toml(tmp_path / "broken.toml", "network_dim = = 3\n")
    problems = problems_of(["--config", config_file])
    assert len(problems) == 1 and problems[0].startswith(f"{config_file}: not valid TOML")


def test_resolved_config_round_trips(tmp_path, paths):
    config, _ = parse_config(required_args(paths) + ["--network_dim", "12", "--resolution", "320,256",
                                                     "--optimizer_args", "weight_decay=0.05", "betas=(0.9,0.99)",
                                                     "--training_comment", 'say "hi"\nthere'])
    dumped = write_toml(tmp_path / "resolved.toml", config.to_toml())
    written = {key for table in tomllib.loads(Path(dumped).read_text()).values() for key in table}
    assert not written & {"output_config", "config_file"}
    reloaded, _ = parse_config(["--config", dumped])
    assert {**reloaded.as_dict(), "config_file": None} == config.as_dict()


def test_output_config_round_trips_quotes_backslashes_and_unicode(tmp_path, paths):
    # toml 0.10.2 alone would write "C:\\x..." as a \x escape and DEL unescaped; neither would read back.
    comment = 'say "hi" \\ C:\\xyz\\new\ttab ünï 日本 \x7f end\\'
    optimizer_args = ['betas="(0.9, 0.99)"', "path=C:\\x1\\'q'", "name=日本"]
    config, _ = parse_config(required_args(paths) + ["--training_comment", comment,
                                                     "--optimizer_args", *optimizer_args])
    write_config(config, tmp_path / "resolved.toml")
    reloaded, _ = parse_config(["--config", str(tmp_path / "resolved.toml")])
    assert reloaded.training_comment == comment and reloaded.optimizer_args == optimizer_args
    assert {**reloaded.as_dict(), "config_file": None} == config.as_dict()


def test_trackers_get_no_secrets_and_no_absolute_paths(paths):
    config, _ = parse_config(required_args(paths))
    clean = config.for_trackers()
    assert clean["pretrained_model_name_or_path"] == "model"
    assert not any(str(v).startswith("/") for v in clean.values())
    assert set(clean) <= set(OPTIONS)


def test_config_is_read_only(paths):
    config, _ = parse_config(required_args(paths))
    with pytest.raises(AttributeError):
        config.network_dim = 3


def test_network_args_are_parsed_once_per_setting(paths):
    # The training loop asks for them on every step; a Config is read-only, so one parse serves the run.
    argv = required_args(paths) + ["--network_args", "conv_dim=4", "conv_alpha=2"]
    config, again = parse_config(argv)[0], parse_config(argv)[0]
    assert network_args_of(config) is network_args_of(config) is network_args_of(again)
    assert network_args_of(config).conv_rank_alpha == (4, 2.0)


def test_a_config_as_kohya_ss_gui_writes_it_loads(tmp_path, paths):
    """kohya_ss's GUI writes flags as 0/1, text_encoder_lr as a list, dynamo_backend "no", its own keys (epoch,
    noise_offset_type), and hand-edited configs keep 0 for "off" and false for options not offered here."""
    text = "".join(f'{k} = "{v}"\n' for k, v in paths.items()) + """
dynamo_backend = "no"
epoch = 10
noise_offset_type = "Original"
persistent_data_loader_workers = 1
text_encoder_lr = [ 5e-5,]
min_snr_gamma = 0
scale_weight_norms = 0
save_last_n_steps = 0
max_train_epochs = 0
clip_skip = 0
cache_info = false
fused_backward_pass = false
"""
    config, notes = parse_config(["--config", write_toml(tmp_path / "gui.toml", text)])
    assert config.dynamo_backend == "no" and config.persistent_data_loader_workers is True
    assert config.text_encoder_lr == 5e-5
    assert (config.min_snr_gamma, config.scale_weight_norms, config.save_last_n_steps, config.max_train_epochs,
            config.clip_skip) == (None,) * 5
    noted = "\n".join(notes)
    for name in ("epoch", "noise_offset_type", "cache_info", "fused_backward_pass"):
        assert f"{name} " in noted, notes

    problems = problems_of(["--config", write_toml(tmp_path / "bad.toml", "".join(
        f'{k} = "{v}"\n' for k, v in paths.items()) + "text_encoder_lr = [1e-4, 5e-5]\ndataset_class = 'mine.Images'\n"
        "persistent_data_loader_workers = 2\n")])
    text = "\n".join(problems)
    assert "text_encoder_lr = [0.0001, 5e-05]: one learning rate for every text encoder" in text
    assert "dataset_class is a kohya option this trainer refuses" in text
    assert "persistent_data_loader_workers = 2: expected true or false" in text


def test_a_resolution_smaller_than_the_bucket_steps_is_a_config_error(tmp_path, paths):
    # FLUX's shipped bucket_reso_steps 64 with resolution 32: the bucket set held a 0 x 0 bucket and the ratio
    # computation raised ZeroDivisionError
    from library.data.dataset_config import datasets_from_toml
    from library.data.images import make_bucket_resolutions

    with pytest.raises(ZeroDivisionError):
        [w / h for w, h in make_bucket_resolutions((32, 32), 32, 1024, 64)]
    args = required_args(paths) + ["--resolution", "32", "--enable_bucket", "--bucket_reso_steps", "64",
                                   "--min_bucket_reso", "32"]
    problems = problems_of(args)
    assert len(problems) == 1 and "resolution 32x32 is smaller than bucket_reso_steps 64" in problems[0]
    assert "lower bucket_reso_steps to 32 or less" in problems[0]
    parse_config(args + ["--bucket_reso_steps", "32"])  # a step that fits is fine (the command line's last wins)
    dataset = write_toml(tmp_path / "dataset.toml", f'[general]\nresolution = 32\nenable_bucket = true\n'
                         f'bucket_reso_steps = 64\nmin_bucket_reso = 32\n[[datasets]]\n[[datasets.subsets]]\n'
                         f'image_dir = "{paths["train_data_dir"]}"\n')
    with pytest.raises(ConfigError, match="smaller than bucket_reso_steps 64"):
        datasets_from_toml(dataset, None)
