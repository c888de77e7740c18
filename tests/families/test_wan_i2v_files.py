"""Wan image-to-video from the separate files musubi-tuner trains from (dit, dit_high_noise, t5, vae and Wan 2.1's
clip): the tiny I2V models written as those files load as their folders, the files' problems are named before any
weight is read, and a run from the files trains as the run from the folder does."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.config import UserError
from tests.helpers import REPO, musubi_lora
from tests.helpers.cli import run_cli, write
from tests.helpers.videos import write_video


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from library.families.wan.tiny import save_tiny_wan21_i2v, save_tiny_wan22_i2v_a14b

    root = tmp_path_factory.mktemp("wan_i2v_files")
    return {"2.1": save_tiny_wan21_i2v(root / "wan21_i2v"), "2.2": save_tiny_wan22_i2v_a14b(root / "wan22_i2v")}


@pytest.fixture(scope="module")
def files(models, tmp_path_factory) -> dict[str, dict[str, Path]]:
    from library.families.wan.tiny import save_tiny_wan_files

    root = tmp_path_factory.mktemp("files")
    return {version: save_tiny_wan_files(folder, root / version) for version, folder in models.items()}


def load(files: dict[str, Path], model_config: Path, **more: str):
    from library.families.loading import load_components

    return load_components(files["transformer"], model_config=model_config, t5=str(files["t5"]),
                           ae=str(files["ae"]), **more)


def test_the_i2v_files_load_as_their_folders(models, files):
    """Wan 2.1 I2V with the official clip file or ComfyUI's clip_vision_h, and Wan 2.2 I2V A14B's low-noise file:
    the same weights as the folder's, the same image encoder, and the family of an I2V model."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from library.families.loading import load_components
    from library.families.wan.i2v import WanI2V

    folder = load_components(models["2.1"])
    # the original layout written for the tests is what diffusers' own converter reads back
    converted = convert_wan_transformer_to_diffusers(load_file(files["2.1"]["transformer"]))
    assert converted.keys() == folder.denoiser.state_dict().keys()
    comfy = files["2.1"]["clip"].parent / "clip_vision_h_tiny.safetensors"  # written beside the official file
    for clip in (files["2.1"]["clip"], comfy):
        loaded = load(files["2.1"], models["2.1"], clip=str(clip))
        assert isinstance(loaded.family, WanI2V) and loaded.family.parts.clip_file == str(clip)
        musubi_lora.assert_same_weights(
            type("Parts", (), {"denoiser": loaded.denoiser, "vae": loaded.vae.vae,
                               "text_encoders": loaded.text_encoders})(),
            type("Parts", (), {"denoiser": folder.denoiser, "vae": folder.vae.vae,
                               "text_encoders": folder.text_encoders})())
        ours, theirs = loaded.family.parts.encoder.state_dict(), folder.family.parts.encoder.state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        assert loaded.family.parts.processor.to_dict() == folder.family.parts.processor.to_dict()
    two = load(files["2.2"], models["2.2"])
    reference = load_components(models["2.2"])
    assert isinstance(two.family, WanI2V) and not two.family.parts.clip and two.family.experts is None
    low = reference.denoiser.state_dict()
    assert all(torch.equal(v, low[k]) for k, v in two.denoiser.state_dict().items())


def test_both_a14b_experts_from_their_files_switch_at_musubis_i2v_boundary(models, files):
    from library.config import parse_config
    from library.families.settings import settings_from
    from library.families.wan.i2v import WanI2VSettings

    loaded = load(files["2.2"], models["2.2"])
    config = parse_config(["--pretrained_model_name_or_path", str(files["2.2"]["transformer"]), "--train_data_dir",
                           ".", "--output_dir", ".", "--dit_high_noise", str(files["2.2"]["dit_high_noise"])])[0]
    family = loaded.family.configured(settings_from(WanI2VSettings, config))
    family.prepare_denoiser(loaded.denoiser, [])
    assert family.version == "2.2" and family.experts.boundary == 0.9  # musubi's default for i2v-A14B
    assert family.metadata_fields(settings_from(WanI2VSettings, config))["ss_task"] == "i2v-A14B"


def test_each_problem_of_the_files_is_named_before_a_weight_is_read(models, files, monkeypatch):
    from library.families.wan import files as wan_files

    def no_reading(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(wan_files, "transformer_state_dict", no_reading)
    monkeypatch.setattr(wan_files, "read_any", no_reading)
    wan21, wan22 = files["2.1"], files["2.2"]
    with pytest.raises(UserError) as missing:  # Wan 2.1 I2V without clip, and without t5
        load({**wan21, "t5": ""}, models["2.1"])
    assert "it needs clip" in str(missing.value) and "needs t5" in str(missing.value)
    with pytest.raises(UserError, match="reads no CLIP vision features"):  # 2.2 I2V A14B takes none
        load(wan22, models["2.2"], clip=str(wan21["clip"]))
    with pytest.raises(UserError, match="not a CLIP vision file"):  # the UMT5 file given as clip
        load(wan21, models["2.1"], clip=str(wan21["t5"]))
    t2v = wan21["clip"].parent.parent / "t2v.safetensors"  # a text-to-video transformer: 16 channels, no image part
    state = load_file(wan21["transformer"])
    state = {k: v for k, v in state.items() if "img_emb" not in k and "_img" not in k}
    state["model.diffusion_model.patch_embedding.weight"] = state["model.diffusion_model.patch_embedding.weight"][
        :, :16].contiguous()
    save_file(state, str(t2v))
    with pytest.raises(UserError, match="text-to-video Wan transformer, which reads no CLIP"):
        load({**wan21, "transformer": t2v}, models["2.1"], clip=str(wan21["clip"]))


def test_a_folder_refuses_the_clip_file(models, files):
    from library.families.loading import load_components

    with pytest.raises(UserError, match="clip: not read for"):
        load_components(models["2.1"], clip=str(files["2.1"]["clip"]))


def train(model: Path, data: Path, out: Path, *more: str) -> Path:
    """The shipped I2V config (musubi's names) at the tiny model's size, its image folder swapped for the video
    dataset config `data`, two steps."""
    shipped = (REPO / "configs" / "wan_i2v_lora.toml").read_text()
    image_folder = 'train_data_dir = "/path/to/train_images"\n'
    assert image_folder in shipped
    config = write(out.parent / f"{out.name}.toml", shipped.replace(image_folder, f'dataset_config = "{data}"\n'))
    result = run_cli("--config", str(config), "--dit", str(model), "--task", "i2v-14B", "--output_dir", str(out),
                     "--output_name", "last", "--mixed_precision", "no", "--save_precision", "float",
                     "--gradient_checkpointing", "false", "--fp8_base", "false", "--network_dim", "4",
                     "--network_alpha", "2", "--learning_rate", "1e-3", "--seed", "3", "--max_train_epochs", "0",
                     "--save_every_n_epochs", "0", "--max_train_steps", "2", *more)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_tiny_i2v_from_its_files_trains_as_from_its_folder(models, files, tmp_path):
    """dit, t5, vae, clip and model_config through train_network.py: the same first-step loss and the same LoRA as
    the folder's run, from clips whose first frame is the condition."""
    clips = tmp_path / "clips"
    for i in range(2):
        write_video(clips / f"clip{i}.mp4", 5, (32, 32))
        (clips / f"clip{i}.txt").write_text("sks moving")
    data = write(tmp_path / "dataset.toml", '[general]\nresolution = [32, 32]\ncaption_extension = ".txt"\n'
                 'batch_size = 2\nenable_bucket = false\n\n[[datasets]]\n'
                 f'video_directory = "{clips}"\ntarget_frames = [5]\nframe_extraction = "head"\n')
    folder = train(models["2.1"], data, tmp_path / "folder")
    parts = files["2.1"]
    from_files = train(parts["transformer"], data, tmp_path / "files", "--t5", str(parts["t5"]), "--vae",
                       str(parts["ae"]), "--clip", str(parts["clip"]), "--model_config", str(models["2.1"]))
    losses = [[event["loss"] for event in map(json.loads, (out / "events.jsonl").read_text().splitlines())
               if event["event"] == "step"] for out in (folder, from_files)]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    ours, theirs = load_file(from_files / "last.safetensors"), load_file(folder / "last.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
