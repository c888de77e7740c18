"""sd-scripts' face_crop_aug_range: crops around the face named in the file name, without buckets."""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from library.config import ConfigError, parse_config
from library.data.face_crop import face_crop, face_from_name


def test_the_face_is_read_from_the_name_and_scaled_into_the_range():
    assert face_from_name(Path("photo_120_80_64_48.png")) == (120, 80, 64, 48)
    assert face_from_name(Path("photo.png")) is None and face_from_name(Path("a_b_c_d_e.png")) is None
    # a 64 px face in a 512 x 512 image, trained at 256: range (2, 2) makes the face 256 / 2 = 128 px, scale 2 ->
    # capped at 1 (kohya never enlarges), so the image keeps its size and the crop is centred on the face
    resized, crop = face_crop((512, 512), (256, 256), (300, 200, 64, 64), (2.0, 2.0), False, random.Random(0))
    assert resized == (512, 512) and crop == (300 - 128, 200 - 128)
    # range (4, 8): face 1/8 to 1/4 of 256 -> scale 0.5 to 1, drawn; the crop stays inside the image
    draws = {face_crop((512, 512), (256, 256), (500, 10, 64, 64), (4.0, 8.0), False, random.Random(s))
             for s in range(20)}
    assert len({r for r, _ in draws}) > 1
    for (w, _), (left, top) in draws:
        assert 256 <= w <= 512 and 0 <= left <= w - 256 and top == 0


def test_face_crop_in_the_dataset(sample_data_dir, tmp_path):
    from library.data.dataset import SampleKey, build_training_data
    from library.data.images import prepare_image

    folder = tmp_path / "1_x"
    folder.mkdir()
    source = sorted((sample_data_dir / "10_sks shape").glob("*.png"))[0]  # 64 x 64
    image = folder / "shape_40_24_16_16.png"
    shutil.copy(source, image)
    image.with_suffix(".txt").write_text("x", encoding="utf-8")
    (tmp_path / "model").mkdir()
    args = ["--pretrained_model_name_or_path", str(tmp_path / "model"), "--train_data_dir", str(tmp_path),
            "--output_dir", str(tmp_path / "out"), "--resolution", "32", "--face_crop_aug_range", "2,2"]
    config, _ = parse_config(args)
    item = build_training_data(config, None, 0).dataset[SampleKey(0, 0)]
    # face 16 px, 32 / (16 x 2) = 1: full size, a 32 x 32 crop centred on (40, 24)
    torch.testing.assert_close(item["pixels"], prepare_image(image, (64, 64), (64, 64), (32, 32), (24, 8), False))
    plain, _ = parse_config(args[:-2])
    assert not torch.equal(build_training_data(plain, None, 0).dataset[SampleKey(0, 0)]["pixels"], item["pixels"])
    with pytest.raises(ConfigError, match="face_crop_aug_range crops around the face anew"):
        parse_config(args + ["--cache_latents"])
