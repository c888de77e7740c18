"""sd-scripts' in_json / metadata_file (fine-tuning metadata) and dataset_repeats."""
from __future__ import annotations

import json
import shutil

import pytest

from library.config import UserError, parse_config
from library.data.dataset import build_training_data


@pytest.fixture
def images(sample_data_dir, tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    sources = sorted((sample_data_dir / "10_sks shape").glob("*.png"))[:2]
    shutil.copy(sources[0], folder / "a.png")
    shutil.copy(sources[1], folder / "b.png")
    (folder / "a.txt").write_text("a caption file, which metadata replaces", encoding="utf-8")
    (tmp_path / "model").mkdir()
    return folder


def common(tmp_path, *extra):
    return ["--pretrained_model_name_or_path", str(tmp_path / "model"), "--output_dir", str(tmp_path / "out"),
            "--resolution", "64", *extra]


def test_in_json_gives_images_and_captions_with_dataset_repeats(images, tmp_path):
    metadata = tmp_path / "meta.json"
    # kohya's tools write keys without the extension; caption and tags are joined by caption_separator
    metadata.write_text(json.dumps({"a": {"caption": "a red circle", "tags": "sks, shape"},
                                    "b.png": {"tags": "sks"}}), encoding="utf-8")
    config, _ = parse_config(common(tmp_path, "--train_data_dir", str(images), "--in_json", str(metadata),
                                    "--dataset_repeats", "3"))
    data = build_training_data(config, None, 0)
    assert {r.path.name: r.caption for r in data.records} == {"a.png": "a red circle,sks, shape", "b.png": "sks"}
    assert data.num_train_images == 6 and len(data.dataset) == 6

    metadata.write_text(json.dumps({"a": {"caption": "x"}, "missing": {"caption": "y"}}), encoding="utf-8")
    with pytest.raises(UserError, match="'missing': no image"):
        build_training_data(config, None, 0)


def test_metadata_file_in_a_dataset_toml_and_json_lines(images, tmp_path):
    lines = tmp_path / "meta.jsonl"
    lines.write_text(json.dumps({"image_path": "a.png", "caption": "one"}) + "\n"
                     + json.dumps({"image_path": str(images / "b.png"), "caption": "two", "tags": "t"}) + "\n",
                     encoding="utf-8")
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{images}"\nmetadata_file = "{lines}"\n',
                    encoding="utf-8")
    config, _ = parse_config(common(tmp_path, "--dataset_config", str(toml), "--dataset_repeats", "2"))
    data = build_training_data(config, None, 0)
    assert sorted(r.caption for r in data.records) == ["one", "two,t"]
    assert all(r.repeats == 2 for r in data.records)  # dataset_repeats: num_repeats where a subset sets none
