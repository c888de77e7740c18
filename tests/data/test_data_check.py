"""Bad data is found before training, listed together, and either stops the run or (skip_bad_images) is left out."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from library.config import UserError
from library.data.check import dataset_report
from library.data.dataset import build_training_data
from library.data.images import open_image
from tests.helpers.datasets import noise_image
from tests.helpers.runs import make_config

# The dataset's options these tests read: 32 px buckets and .txt captions; the model and output are never read.
CHECK = {"resolution": 32, "caption_extension": ".txt"}


def caption(image: Path, text: str | bytes) -> None:
    target = image.with_suffix(".txt")
    target.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))


def truncate(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.fixture()
def bad_dataset(tmp_path) -> tuple[Path, dict[str, Path]]:
    root = tmp_path / "train"
    folder = root / "2_sks"
    files = {
        "good": noise_image(folder / "good.png"),
        "truncated_png": truncate(noise_image(folder / "trunc.png", (64, 64), seed=1)),
        "truncated_jpg": truncate(noise_image(folder / "trunc.jpg", (64, 64), fmt="JPEG", seed=2)),
        "not_an_image": folder / "text.png",
        "empty_caption": noise_image(folder / "empty_caption.png", seed=3),
        "blank_caption": noise_image(folder / "blank_caption.png", seed=4),
        "latin1_caption": noise_image(folder / "latin1.png", seed=5),
        "jpeg_named_png": noise_image(folder / "really_jpeg.png", fmt="JPEG", seed=6),
        "no_caption": noise_image(folder / "no_caption.png", seed=7),
    }
    files["not_an_image"].write_text("hello", encoding="utf-8")
    for name in ("good", "truncated_png", "jpeg_named_png"):
        caption(files[name], "sks, thing")
    caption(files["empty_caption"], "")
    caption(files["blank_caption"], "  \n \n")
    caption(files["latin1_caption"], "caf\xe9, ol\xe9".encode("latin-1"))
    (root / "1_empty").mkdir()
    return root, files


def test_every_problem_is_listed_in_one_error(tmp_path, bad_dataset):
    root, files = bad_dataset
    with pytest.raises(UserError) as info:
        build_training_data(make_config(tmp_path, root, tmp_path / "o", run=CHECK), None, seed=0)
    problems = info.value.problems
    expected = {
        "truncated_png": "truncated image file", "truncated_jpg": "truncated image file",
        "not_an_image": "cannot read image",
    }
    for name, fragment in expected.items():
        assert any(p.startswith(f"{files[name]}: {fragment}") for p in problems), (name, problems)
    assert f"{files['empty_caption'].with_suffix('.txt')}: caption file is empty" in "\n".join(problems)
    assert f"{files['blank_caption'].with_suffix('.txt')}: caption file is empty" in "\n".join(problems)
    assert f"{files['latin1_caption'].with_suffix('.txt')}: caption is not UTF-8 text" in "\n".join(problems)
    assert f"{root / '1_empty'}: no images" in "\n".join(problems)
    assert len(problems) == 7, problems
    # Usable: the good image, the JPEG named .png (decoded by content), and the one without a caption file
    # (class tokens). None of them is a problem.
    for name in ("good", "jpeg_named_png", "no_caption"):
        assert not any(str(files[name]) in p for p in problems)


def test_skip_bad_images_leaves_them_out_and_logs_each(tmp_path, bad_dataset, caplog):
    root, files = bad_dataset
    with caplog.at_level(logging.WARNING, logger="library.data.dataset"):
        data = build_training_data(make_config(tmp_path, root, tmp_path / "o", "--skip_bad_images", run=CHECK), None,
                                   seed=0)
    assert sorted(r.path.name for r in data.records) == ["good.png", "no_caption.png", "really_jpeg.png"]
    assert len(data.left_out) == 7
    log = caplog.text
    assert "7 unusable files or folders are left out" in log
    assert f"{files['truncated_png']}: truncated image file" in log
    assert "really_jpeg.png is JPEG data with a .png extension" in log
    assert "1 of 9 images have no caption file" in log and "no_caption.png" in log
    items = {Path(data.dataset[i]["path"]).name: data.dataset[i] for i in range(len(data.dataset))}
    assert items["no_caption.png"]["caption"] == "sks"
    assert items["really_jpeg.png"]["pixels"].shape == (3, 32, 32)


def test_dataset_report_lists_counts_buckets_captions_and_problems(tmp_path, bad_dataset):
    root, files = bad_dataset

    class Tokenizer:  # counts words; the report only needs model_max_length and input_ids
        model_max_length = 5

        def __call__(self, texts, add_special_tokens=False):
            return type("Out", (), {"input_ids": [t.replace(",", " ").split() for t in texts]})()

    caption(files["no_caption"], "a, b, c, d, e, f")
    text, ok = dataset_report(make_config(tmp_path, root, tmp_path / "o", "--train_batch_size", "2",
                                          "--gradient_accumulation_steps", "2", run=CHECK), Tokenizer())
    assert not ok
    assert f"subset 1: {root / '2_sks'}: 3 images (6 left out) x 2 repeats -> 6 samples per epoch" in text
    assert f"{root / '1_empty'}: not used" in text
    assert "32x32: 6 / 3" in text
    assert "3 batches and 2 optimizer steps per process" in text
    assert "captions: 3 of 3 usable images have a caption file (100%)" in text
    assert "1 longer than 3 tokens are truncated" in text and "no_caption.png" in text
    assert "problems (7):" in text and "result: NOT USABLE" in text
    text, ok = dataset_report(make_config(tmp_path, root, tmp_path / "o", "--skip_bad_images", run=CHECK),
                              Tokenizer())
    assert ok and "left out by skip_bad_images (7)" in text and "result: usable" in text


def test_images_in_any_mode_become_correct_rgb(tmp_path):
    folder = tmp_path / "train" / "1_x"
    folder.mkdir(parents=True)
    Image.new("CMYK", (32, 32), (0, 255, 255, 0)).save(folder / "cmyk.jpg")  # red
    Image.fromarray(np.full((32, 32), 128 * 257, dtype=np.uint16)).save(folder / "gray16.png")
    Image.new("L", (32, 32), 200).save(folder / "gray.png")
    palette = Image.new("P", (32, 32), 0)
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    palette.putpixel((0, 0), 1)
    palette.save(folder / "palette.png", transparency=0)  # index 0 (black) is transparent
    rgba = Image.new("RGBA", (32, 32), (0, 0, 0, 0))  # transparent black
    rgba.paste((255, 0, 0, 128), (0, 0, 16, 32))  # left half: half-transparent red
    rgba.save(folder / "rgba.png")
    Image.new("LA", (32, 32), (0, 0)).save(folder / "la.png")
    data = build_training_data(make_config(tmp_path, tmp_path / "train", tmp_path / "o", run=CHECK), None, seed=0)
    assert len(data.records) == 6
    pixel = {r.path.name: np.asarray(open_image(r.path)) for r in data.records}
    assert tuple(pixel["cmyk.jpg"][5, 5]) == (255, 0, 0)
    assert tuple(pixel["gray16.png"][5, 5]) == (128, 128, 128)  # scaled from 16 bits, not clipped to white
    assert tuple(pixel["gray.png"][5, 5]) == (200, 200, 200)
    assert tuple(pixel["palette.png"][0, 0]) == (255, 0, 0) and tuple(pixel["palette.png"][5, 5]) == (255, 255, 255)
    assert tuple(pixel["rgba.png"][5, 25]) == (255, 255, 255)  # transparent -> white, not black
    assert tuple(pixel["rgba.png"][5, 5]) == (255, 127, 127)  # red over white at alpha 128
    assert tuple(pixel["la.png"][5, 5]) == (255, 255, 255)
    items = [data.dataset[i] for i in range(len(data.dataset))]
    white = next(it for it in items if it["path"].endswith("la.png"))["pixels"]
    assert torch.allclose(white, torch.ones_like(white))


def test_small_images_are_enlarged_with_a_warning_or_rejected_without_upscaling(tmp_path, caplog):
    folder = tmp_path / "train" / "1_x"
    noise_image(folder / "small.png", (16, 16))
    noise_image(folder / "big.png", (64, 64), seed=1)
    with caplog.at_level(logging.WARNING, logger="library.data.dataset"):
        data = build_training_data(make_config(tmp_path, tmp_path / "train", tmp_path / "o", run=CHECK), None, seed=0)
    small = next(r for r in data.records if r.path.name == "small.png")
    assert small.upscaled and small.bucket == (32, 32)
    assert "1 images are smaller than their bucket and are enlarged" in caplog.text
    assert "small.png (16x16" in caplog.text
    args = ("--train_data_dir", str(tmp_path / "train"), "--enable_bucket", "--bucket_no_upscale",
            "--min_bucket_reso", "32", "--max_bucket_reso", "64", "--bucket_reso_steps", "8")
    with pytest.raises(UserError) as info:
        build_training_data(make_config(tmp_path, None, tmp_path / "o", *args, run=CHECK), None, seed=0)
    assert info.value.problems == [f"{folder / 'small.png'}: 16x16 is smaller than the smallest bucket side 32 and "
                                   "bucket_no_upscale forbids enlarging it (lower min_bucket_reso, or allow "
                                   "upscaling)"]


def write_toml(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "dataset.toml"
    path.write_text(body, encoding="utf-8")
    return path


def test_missing_caption_without_class_tokens_and_missing_folders(tmp_path):
    folder = tmp_path / "images"
    noise_image(folder / "a.png")
    toml = write_toml(tmp_path, f"""
[[datasets]]
  [[datasets.subsets]]
  image_dir = "{folder}"
  [[datasets.subsets]]
  image_dir = "{tmp_path / 'missing'}"
""")
    with pytest.raises(UserError) as info:
        build_training_data(make_config(tmp_path, None, tmp_path / "o", "--dataset_config", str(toml), run=CHECK),
                            None, seed=0)
    assert info.value.problems == [
        f"{tmp_path / 'missing'}: image folder not found",
        f"{folder / 'a.png'}: no caption file (.txt) and the subset has no class tokens; it would train with an "
        "empty caption"]


@pytest.mark.parametrize("body, fragment", [
    ('image_dir = "{folder}"\nnum_repeats = 0\n', "the dataset yields no batches: no usable images"),
    ('image_dir = "{folder}"\nis_reg = true\n', "every usable image is a regularisation image"),
])
def test_a_dataset_without_batches_is_an_error(tmp_path, body, fragment):
    folder = tmp_path / "images"
    caption(noise_image(folder / "a.png"), "sks")
    toml = write_toml(tmp_path, "[[datasets]]\n[[datasets.subsets]]\n" + body.format(folder=folder))
    with pytest.raises(UserError) as info:
        build_training_data(make_config(tmp_path, None, tmp_path / "o", "--dataset_config", str(toml),
                                        "--skip_bad_images", run=CHECK), None, seed=0)
    assert any(fragment in p for p in info.value.problems), info.value.problems


def test_skipping_everything_is_still_an_error(tmp_path):
    folder = tmp_path / "train" / "1_x"
    folder.mkdir(parents=True)
    (folder / "a.png").write_bytes(b"not a png")
    with pytest.raises(UserError) as info:
        build_training_data(make_config(tmp_path, tmp_path / "train", tmp_path / "o", "--skip_bad_images", run=CHECK),
                            None, seed=0)
    assert "the dataset yields no batches: no usable images are left after leaving out the unusable ones" in \
        info.value.problems


def test_dataset_report_counts_tokens_for_a_single_file_model(tmp_path):
    """A single .safetensors checkpoint carries no tokenizer: the report uses the one its architecture ships
    with, and the truncation limit follows max_token_length."""
    from library.families.loading import caption_tokenizer
    from library.families.sd.tiny import save_tiny_sd1_single_file

    model = save_tiny_sd1_single_file(tmp_path / "tiny.safetensors")
    root = tmp_path / "train"
    caption(noise_image(root / "1_x" / "short.png"), "a photo of a dog")
    caption(noise_image(root / "1_x" / "long.png"), " ".join(["dog"] * 100))
    tokenizer = caption_tokenizer(model)
    text, ok = dataset_report(make_config(model, root, tmp_path / "o", run=CHECK), tokenizer)
    assert ok and "longest caption 100 tokens; 1 longer than 75 tokens are truncated" in text, text
    text, ok = dataset_report(make_config(model, root, tmp_path / "o", "--max_token_length", "150", run=CHECK),
                              tokenizer)
    assert ok and "longest caption 100 tokens; 0 longer than 150 tokens are truncated" in text, text
