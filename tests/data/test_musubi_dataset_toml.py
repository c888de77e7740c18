"""musubi-tuner's dataset TOML shape: each [[datasets]] table names its images itself and is read as a dataset of one
subset; the keys this trainer does not act on are noted or refused, and kohya's shape reads as before."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from library.config import ConfigError
from library.data.check import dataset_report
from library.data.dataset import build_training_data, collate
from library.data.dataset_config import resolve_datasets
from tests.helpers.datasets import noise_image
from tests.helpers.runs import make_config

# The model is never read; sizes are tiny so that scanning stays cheap.
RUN = {"resolution": 32, "bucket_reso_steps": 16, "min_bucket_reso": 16, "max_bucket_reso": 64}


def config_of(tmp_path: Path, text: str, name: str = "dataset.toml"):
    toml = tmp_path / name
    toml.write_text(text, encoding="utf-8")
    return make_config(tmp_path, None, tmp_path / "o", "--dataset_config", str(toml), run=RUN)


def problems_of(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        resolve_datasets(config_of(tmp_path, text))
    return info.value.problems


def captioned(folder: Path, names: tuple[str, ...], suffix: str = ".txt") -> Path:
    for i, name in enumerate(names):
        noise_image(folder / f"{name}.png", seed=i)
        (folder / f"{name}{suffix}").write_text(f"caption of {name}", encoding="utf-8")
    return folder


MUSUBI = """
[general]
resolution = [32, 32]
caption_extension = ".txt"
batch_size = 2
enable_bucket = true
bucket_no_upscale = true

[[datasets]]
image_directory = "{a}"
cache_directory = "{tmp}/cache_a"
num_repeats = 3

[[datasets]]
image_directory = "{b}"
caption_extension = ".caption"
batch_size = 1
"""

# The same datasets in kohya's shape.
KOHYA = """
[general]
resolution = [32, 32]
caption_extension = ".txt"
batch_size = 2
enable_bucket = true
bucket_no_upscale = true

[[datasets]]
  [[datasets.subsets]]
  image_dir = "{a}"
  num_repeats = 3

[[datasets]]
batch_size = 1
  [[datasets.subsets]]
  image_dir = "{b}"
  caption_extension = ".caption"
"""


def test_image_directories_read_as_kohya_datasets_of_one_subset(tmp_path):
    a = captioned(tmp_path / "a", ("x", "y"))
    b = captioned(tmp_path / "b", ("z",), ".caption")
    names = {"a": a, "b": b, "tmp": tmp_path}
    musubi = config_of(tmp_path, MUSUBI.format(**names), "musubi.toml")
    kohya = config_of(tmp_path, KOHYA.format(**names), "kohya.toml")
    first, second = resolve_datasets(musubi)
    (subset_a,), (subset_b,) = first.subsets, second.subsets
    assert (subset_a.image_dir, subset_a.num_repeats, subset_a.caption_extension) == (a, 3, ".txt")  # [general]'s
    assert (subset_b.image_dir, subset_b.num_repeats, subset_b.caption_extension) == (b, 1, ".caption")
    assert (first.batch_size, second.batch_size) == (2, 1)
    assert first.enable_bucket and first.bucket_no_upscale and first.resolution == (32, 32)
    assert resolve_datasets(musubi) == resolve_datasets(kohya)
    data, same = build_training_data(musubi, None, seed=0), build_training_data(kohya, None, seed=0)
    assert {(r.path.name, r.caption, r.repeats) for r in data.records} == {
        ("x.png", "caption of x", 3), ("y.png", "caption of y", 3), ("z.png", "caption of z", 1)}
    assert data.fingerprint() == same.fingerprint()


def test_an_image_jsonl_file_names_images_captions_and_controls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    images = tmp_path / "t"
    noise_image(images / "a.png")
    noise_image(images / "b.png", seed=1)
    first, second = noise_image(tmp_path / "c" / "a.png", seed=2), noise_image(tmp_path / "c" / "b_0.png", seed=3)
    third = noise_image(tmp_path / "c" / "b_1.png", seed=4)
    meta = tmp_path / "lists" / "meta.jsonl"
    meta.parent.mkdir()
    meta.write_text("\n".join(json.dumps(entry) for entry in (
        {"image_path": str(images / "a.png"), "control_path": str(first), "caption": "cap a"},
        # relative paths are taken from the working directory, as musubi-tuner opens them
        {"image_path": "t/b.png", "control_path_1": "c/b_1.png", "control_path_0": "c/b_0.png", "caption": "cap b"},
    )), encoding="utf-8")
    config = config_of(tmp_path, f'[general]\nresolution = 32\n[[datasets]]\nimage_jsonl_file = "{meta}"\n'
                                 f'cache_directory = "{tmp_path / "cache"}"\nnum_repeats = 2\n')
    data = build_training_data(config, None, seed=0)
    got = {r.path.name: (r.caption, r.repeats, tuple(c.path.resolve() for c in r.controls)) for r in data.records}
    assert got == {"a.png": ("cap a", 2, (first,)), "b.png": ("cap b", 2, (second, third))}
    (subset,) = data.specs[0].subsets
    assert subset.metadata_file == meta and subset.image_dir == tmp_path


def test_control_keys_at_dataset_level(tmp_path):
    images, controls = captioned(tmp_path / "t", ("a",)), tmp_path / "c"
    noise_image(images / "a.png", (40, 40))
    noise_image(controls / "a.png", (50, 40), seed=1)
    config = config_of(tmp_path, f"""
[general]
resolution = 32
caption_extension = ".txt"
enable_bucket = true

[[datasets]]
image_directory = "{images}"
control_directory = "{controls}"
no_resize_control = true
""")
    data = build_training_data(config, None, seed=0)
    (record,) = data.records
    (subset,) = data.specs[0].subsets
    assert subset.control_directory == controls and subset.no_resize_control
    # no_resize_control: the control keeps its own size, cropped down to multiples of bucket_reso_steps (16)
    assert record.bucket == (32, 32) and record.controls[0].target == (48, 32)


def test_musubis_older_control_key_names_are_read(tmp_path):
    config = config_of(tmp_path, '[[datasets]]\nimage_directory = "t"\nqwen_image_edit_control_resolution = 64\n'
                                 'flux_kontext_no_resize_control = true\n')
    ((subset,),) = [spec.subsets for spec in resolve_datasets(config)]
    assert subset.control_resolution == (64, 64) and subset.no_resize_control


def test_cache_directory_is_a_note_not_an_error(tmp_path):
    config = config_of(tmp_path, '[[datasets]]\nimage_directory = "t"\ncache_directory = "cache"\n')
    warnings: list[str] = []
    (spec,) = resolve_datasets(config, warnings)
    assert spec.subsets[0].image_dir == Path("t")
    assert warnings == [f"{tmp_path / 'dataset.toml'}: datasets[0]: cache_directory is ignored: this trainer caches "
                        "latents in memory (cache_latents) or in a file beside each image (cache_latents_to_disk), "
                        "not in a folder of its own"]


def test_unread_keys_are_refused_all_at_once(tmp_path):
    problems = problems_of(tmp_path, """
[[datasets]]
image_directory = "t"
target_frames = [1, 25]
frame_extraction = "head"

[[datasets]]
image_directory = "t"
fp_1f_clean_indices = [0]
fp_1f_target_index = 9
multiple_target = true
num_repeat = 2

[[datasets]]
image_directory = "t"
image_jsonl_file = "m.jsonl"
image_dir = "u"
""")
    where = str(tmp_path / "dataset.toml")
    assert problems == [
        f"{where}: datasets[0]: target_frames, frame_extraction: video dataset keys, and this [[datasets]] table "
        "names no videos (video_directory or video_jsonl_file)",
        f"{where}: datasets[1]: fp_1f_clean_indices, fp_1f_target_index: FramePack's dataset keys; this trainer "
        "does not offer FramePack: remove them",
        f"{where}: datasets[1]: multiple_target = True: Qwen-Image-Layered's several target images are not "
        "offered; remove it",
        f"{where}: datasets[1]: unknown key 'num_repeat' (did you mean 'num_repeats'?)",
        f"{where}: datasets[2]: set image_directory or image_jsonl_file, not both",
        f"{where}: datasets[2]: image_dir is kohya's subset key; this [[datasets]] table is in musubi-tuner's "
        "shape, which names it image_directory",
    ]


def test_mixing_the_two_shapes_in_one_dataset_is_refused(tmp_path):
    problems = problems_of(tmp_path, '[[datasets]]\nimage_directory = "t"\n[[datasets]]\nimage_directory = "t"\n'
                                     '  [[datasets.subsets]]\n  image_dir = "u"\n')
    assert problems == [f"{tmp_path / 'dataset.toml'}: datasets[1]: mixes the two dataset shapes: image_directory "
                        "(musubi-tuner's: the dataset is its own image folder) and [[datasets.subsets]] (kohya's); "
                        "use one of them"]


@pytest.mark.parametrize("text, message", [
    ('[[datasets]]\ncontrol_directory = "c"\n  [[datasets.subsets]]\n  image_dir = "t"\n',
     "datasets[0]: control_directory belongs in a [[datasets.subsets]] table (a [[datasets]] table takes it in "
     "musubi-tuner's shape, with image_directory or image_jsonl_file)"),
    ('[[datasets]]\n  [[datasets.subsets]]\n  image_directory = "t"\n',
     "datasets[0].subsets[0]: image_directory is musubi-tuner's name, for a [[datasets]] table without subsets; "
     "a [[datasets.subsets]] table takes image_dir"),
    ('[general]\nimage_jsonl_file = "m.jsonl"\n[[datasets]]\nimage_directory = "t"\n',
     "[general]: image_jsonl_file belongs in a [[datasets]] table"),
])
def test_keys_at_the_wrong_level_say_which_shape_takes_them(tmp_path, text, message):
    problems = problems_of(tmp_path, text)
    assert f"{tmp_path / 'dataset.toml'}: {message}" in problems, problems


def test_a_kohya_dataset_keeps_its_subsets_and_needs_them(tmp_path):
    config = config_of(tmp_path, '[[datasets]]\nnum_repeats = 4\n  [[datasets.subsets]]\n  image_dir = "u"\n'
                                 '  [[datasets.subsets]]\n  image_dir = "v"\n  num_repeats = 1\n')
    warnings: list[str] = []
    (spec,) = resolve_datasets(config, warnings)
    assert [(s.image_dir, s.num_repeats) for s in spec.subsets] == [(Path("u"), 4), (Path("v"), 1)]
    assert warnings == []
    problems = problems_of(tmp_path, "[[datasets]]\nbatch_size = 1\n")
    assert problems == [f"{tmp_path / 'dataset.toml'}: datasets[0]: no [[datasets.subsets]] table; each dataset "
                        "needs at least one image_dir (or, in musubi-tuner's shape, an image_directory or "
                        "image_jsonl_file of its own)"]


def test_prior_reg_marks_its_samples_in_both_shapes_and_none_is_held_out(tmp_path):
    a = captioned(tmp_path / "a", ("x", "y"))
    b = captioned(tmp_path / "b", ("z", "w"))
    musubi = (f'[general]\nresolution = 32\ncaption_extension = ".txt"\n'
              f'[[datasets]]\nimage_directory = "{a}"\n[[datasets]]\nimage_directory = "{b}"\n')
    kohya = (f'[general]\nresolution = 32\ncaption_extension = ".txt"\n'
             f'[[datasets]]\n  [[datasets.subsets]]\n  image_dir = "{a}"\n'
             f'[[datasets]]\n  [[datasets.subsets]]\n  image_dir = "{b}"\n')
    plain = build_training_data(config_of(tmp_path, musubi, "plain.toml"), None, seed=0)
    run = {**RUN, "prior_loss_weight": 2.5}
    for text, name in ((musubi + "prior_reg = true\n", "musubi.toml"),
                       (kohya + "  prior_reg = true\n", "kohya.toml")):
        (tmp_path / name).write_text(text, encoding="utf-8")
        config = make_config(tmp_path, None, tmp_path / "o", "--dataset_config", str(tmp_path / name), run=run)
        data = build_training_data(config, None, seed=0)
        assert {r.path.name: r.subset.prior_reg for r in data.records} == {
            "x.png": False, "y.png": False, "z.png": True, "w.png": True}
        batches = [collate([data.dataset[(0, i)] for i in batch]) for batch in data.sampler.batches(0)]
        marked = {tuple(b["prior_reg"].tolist()) if "prior_reg" in b else None for b in batches}
        assert marked == {None, (True,)}  # a batch without prior_reg samples carries no mark
        weights = {tuple(b["loss_weight"].tolist()) for b in batches}
        assert weights == {(1.0,), (2.5,)}  # prior_loss_weight, as regularisation images have it
        assert data.fingerprint() != plain.fingerprint()
        text, usable = dataset_report(config)
        assert usable and f"prior_reg subset 0: {b}" in text and f"  subset 0: {a}" in text
        # The validation share is taken from the samples trained towards their images, never the base's own.
        split = make_config(tmp_path, None, tmp_path / "o", "--dataset_config", str(tmp_path / name),
                            "--validation_split", "0.5", run=RUN)
        held = build_training_data(split, None, seed=0).validation
        assert {r.path.name for r in held.records} <= {"x.png", "y.png"}
