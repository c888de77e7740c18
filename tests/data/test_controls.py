"""Edit datasets: control images paired by file stem or named in metadata, sized as musubi-tuner sizes them, batched
with their targets, reported by --dataset_check, and their latents cached by content; a dataset without control
images is fed as before."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from library.config import UserError
from library.data.cache import cache_latents
from library.data.check import dataset_report
from library.data.control_cache import CONTROL_SUFFIX
from library.data.controls import pair_by_stem
from library.data.dataset import BucketBatchSampler, build_training_data
from library.data.images import open_image, to_tensor
from tests.helpers.datasets import noise_image
from tests.helpers.runs import make_config

# Buckets of 32 px area in steps of 16 (16x64 ... 32x32 ... 64x16); .txt captions; the model is never read.
CHECK = {"resolution": 32, "caption_extension": ".txt"}
DATASET = """[[datasets]]
resolution = 32
enable_bucket = true
min_bucket_reso = 16
max_bucket_reso = 64
bucket_reso_steps = 16
batch_size = 4
"""


def write_toml(tmp_path: Path, subset: str) -> Path:
    path = tmp_path / "dataset.toml"
    path.write_text(DATASET + "  [[datasets.subsets]]\n" + subset, encoding="utf-8")
    return path


def config_of(tmp_path: Path, toml: Path, *extra: str):
    return make_config(tmp_path, None, tmp_path / "o", "--dataset_config", str(toml), *extra, run=CHECK)


def build(tmp_path: Path, toml: Path, *extra: str):
    return build_training_data(config_of(tmp_path, toml, *extra), None, seed=0)


def target(folder: Path, name: str, size: tuple[int, int] = (32, 32), seed: int = 0) -> Path:
    path = noise_image(folder / f"{name}.png", size, seed)
    path.with_suffix(".txt").write_text("sks", encoding="utf-8")
    return path


def subset_of(images: Path, controls: Path | None = None, extra: str = "") -> str:
    return (f'  image_dir = "{images}"\n' + (f'  control_directory = "{controls}"\n' if controls else "")
            + extra)


def by_name(data) -> dict[str, tuple[str, ...]]:
    return {r.path.name: tuple(c.path.name for c in r.controls) for r in data.records}


# ------------------------------------------------------------------------------------------------------ pairing

def test_controls_pair_by_stem_and_by_number(tmp_path):
    images, controls = tmp_path / "t", tmp_path / "c"
    for i, name in enumerate(("a", "b", "b_1")):
        target(images, name, seed=i)
    for i, name in enumerate(("a.jpg", "b_0.png", "b_2.png", "b_10.png", "b_1.png")):
        noise_image(controls / name, seed=10 + i)
    data = build(tmp_path, write_toml(tmp_path, subset_of(images, controls)))
    # b_10 after b_2 (by number); target b_1 takes b_1.png as its own control before b could take it as number 1.
    assert by_name(data) == {"a.png": ("a.jpg",), "b.png": ("b_0.png", "b_2.png", "b_10.png"),
                             "b_1.png": ("b_1.png",)}
    index = next(i for i, r in enumerate(data.dataset.samples) if data.records[r].path.name == "b.png")
    item = data.dataset[index]
    # A 32x32 control of a 32x32 target is fed as it is, in its place.
    for pixels, name in zip(item["control_pixels"], ("b_0.png", "b_2.png", "b_10.png"), strict=True):
        assert torch.equal(pixels, to_tensor(open_image(controls / name)))


def test_two_controls_in_one_place_are_a_clash():
    pairs, unpaired, clashes = pair_by_stem([Path("t/a.png"), Path("t/b.png")],
                                            [Path("c/a.png"), Path("c/a.jpg"), Path("c/b_1.png"),
                                             Path("c/b_01.png"), Path("c/x_y.png")])
    assert pairs == {} and unpaired == [Path("c/x_y.png")]
    assert "a.jpg, a.png claim the same place" in clashes[Path("t/a.png")]
    assert "b_01.png, b_1.png claim the same place" in clashes[Path("t/b.png")]


def test_metadata_entries_name_their_controls(tmp_path):
    images = tmp_path / "t"
    target(images, "a")
    target(images, "b", seed=1)
    first, second = noise_image(tmp_path / "elsewhere" / "first.png", seed=2), noise_image(images / "ctl" / "2.png")
    noise_image(images / "ctl" / "a.png", seed=3)
    meta = tmp_path / "meta.jsonl"
    meta.write_text("\n".join(json.dumps(entry) for entry in (
        {"image_path": "a.png", "caption": "cap a", "control_path": "ctl/a.png"},  # relative: from image_dir
        {"image_path": "b.png", "caption": "cap b", "control_path_1": "ctl/2.png", "control_path_0": str(first)},
    )), encoding="utf-8")
    data = build(tmp_path, write_toml(tmp_path, subset_of(images, extra=f'  metadata_file = "{meta}"\n')))
    assert {r.path.name: tuple(c.path for c in r.controls) for r in data.records} == {
        "a.png": (images / "ctl" / "a.png",), "b.png": (first, second)}


# ------------------------------------------------------------------------------------------------------- sizes

@pytest.mark.parametrize("extra, control, fed", [
    ("", (50, 40), (32, 32)),  # resized to cover the target's 32x32 bucket, then centre-cropped
    ("no_resize_control = true", (50, 40), (48, 32)),  # its own size, cropped down to multiples of 16
    ("control_resolution = 64", (80, 40), (80, 48)),  # musubi's bucket at 64x64's area nearest 2:1
    ("no_resize_control = true\ncontrol_resolution = 64", (80, 40), (80, 32)),  # within the area: own size
    ("no_resize_control = true\ncontrol_resolution = 64", (200, 100), (80, 48)),  # beyond it: the area's bucket
])
def test_control_sizes_follow_musubi(tmp_path, extra, control, fed):
    images, controls = tmp_path / "t", tmp_path / "c"
    target(images, "a", (40, 40))
    noise_image(controls / "a.png", control)
    data = build(tmp_path, write_toml(tmp_path, subset_of(images, controls, extra + "\n")))
    (record,) = data.records
    assert record.bucket == (32, 32) and record.controls[0].target == fed
    pixels = data.dataset[0]["control_pixels"][0]
    assert pixels.shape == (3, fed[1], fed[0])


def test_a_batch_shares_its_controls_count_and_sizes(tmp_path):
    images, controls = tmp_path / "t", tmp_path / "c"
    for i, (name, sizes) in enumerate({"a": [(32, 32)], "b": [(32, 32)], "c": [(48, 32)],
                                       "d": [(32, 32), (32, 32)], "e": [(32, 32)]}.items()):
        target(images, name, seed=i)
        for j, size in enumerate(sizes):
            noise_image(controls / (f"{name}_{j}.png" if len(sizes) > 1 else f"{name}.png"), size, seed=9 + j)
    data = build(tmp_path, write_toml(tmp_path, subset_of(images, controls, "no_resize_control = true\n")))
    batches = list(data.dataloader())
    # One target bucket (32x32) and batch size 4, yet three batches: {a, b, e}, {c}, {d}.
    assert sorted(sorted(Path(p).stem for p in batch["path"]) for batch in batches) == [
        ["a", "b", "e"], ["c"], ["d"]]
    shapes = {tuple(Path(p).stem for p in batch["path"])[0]: [tuple(t.shape) for t in batch["control_pixels"]]
              for batch in batches}
    assert shapes["c"] == [(1, 3, 32, 48)] and shapes["d"] == [(1, 3, 32, 32), (1, 3, 32, 32)]
    assert len(batches[0]["pixels"]) == len(batches[0]["control_pixels"][0])


def test_a_control_fed_smaller_than_the_bucket_steps_is_named_with_what_to_change(tmp_path):
    """32 px pairs under bucket_reso_steps 64 (no buckets): the control would be fed at its target's 32x32, which the
    steps cannot take; the message says so (no_resize_control is not set, so it is not blamed)."""
    images, controls = tmp_path / "t", tmp_path / "c"
    target(images, "a")
    noise_image(controls / "a.png")
    toml = tmp_path / "dataset.toml"
    toml.write_text("[[datasets]]\nresolution = 32\nbucket_reso_steps = 64\nbatch_size = 1\n"
                    f"  [[datasets.subsets]]\n{subset_of(images, controls)}", encoding="utf-8")
    text, usable = dataset_report(config_of(tmp_path, toml))
    assert not usable
    assert (f"{controls / 'a.png'}: the control image would be fed at 32x32 (its target's bucket), smaller than "
            "bucket_reso_steps 64: lower bucket_reso_steps or raise the resolution") in text
    assert "no_resize_control" not in text


# ---------------------------------------------------------------------------------------------- dataset check

def test_dataset_check_names_missing_broken_and_unpaired_controls(tmp_path):
    images, controls = tmp_path / "t", tmp_path / "c"
    for i, name in enumerate(("good", "no_control", "broken")):
        target(images, name, seed=i)
    noise_image(controls / "good.png")
    broken = noise_image(controls / "broken.png", (64, 64), seed=5)
    broken.write_bytes(broken.read_bytes()[: len(broken.read_bytes()) // 2])
    unpaired = noise_image(controls / "stray.png")
    text, usable = dataset_report(config_of(tmp_path, write_toml(tmp_path, subset_of(images, controls))))
    assert not usable
    assert f"{images / 'no_control.png'}: no control image in {controls}" in text
    assert f"{broken}: truncated image file" in text
    assert f"{unpaired}: a control image without a target image in {images}" in text
    assert "1 images (2 left out)" in text  # the good pair is usable
    assert "good.png" not in text.split("problems")[1]


def test_a_control_folder_without_controls_is_named(tmp_path):
    images = tmp_path / "t"
    target(images, "a")
    missing = tmp_path / "nowhere"
    text, usable = dataset_report(config_of(tmp_path, write_toml(tmp_path, subset_of(images, missing))))
    assert not usable and f"control_directory {missing} not found" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    text, usable = dataset_report(config_of(tmp_path, write_toml(tmp_path, subset_of(images, empty))))
    assert not usable and f"{empty}: control_directory holds no images" in text


def test_a_control_named_in_metadata_must_exist(tmp_path):
    images = tmp_path / "t"
    target(images, "a")
    meta = tmp_path / "meta.jsonl"
    meta.write_text(json.dumps({"image_path": "a.png", "caption": "x", "control_path": "gone.png"}), encoding="utf-8")
    with pytest.raises(UserError) as info:
        build(tmp_path, write_toml(tmp_path, subset_of(images, extra=f'  metadata_file = "{meta}"\n')))
    assert info.value.problems == [f"{images / 'gone.png'}: control image not found"]


# ------------------------------------------------------------------------------------------------------- cache

def test_control_latents_are_cached_by_content(tmp_path, tiny_vae):
    images, controls = tmp_path / "t", tmp_path / "c"
    target(images, "a")
    target(images, "b", seed=1)
    control = noise_image(controls / "a.png", seed=2)
    noise_image(controls / "b.png", seed=3)
    toml = write_toml(tmp_path, subset_of(images, controls))

    def cached():
        data = build(tmp_path, toml)
        stats = cache_latents(data, tiny_vae, to_disk=True, threads=0)
        index = next(i for i, r in enumerate(data.dataset.samples) if data.records[r].path.name == "a.png")
        return stats, data.dataset[index]["control_latents"][0]

    stats, latents = cached()
    assert stats.encoded == 4 and (controls / f"a.png{CONTROL_SUFFIX}").is_file()  # 2 targets + 2 controls
    with torch.no_grad():
        expected = tiny_vae.encode(to_tensor(open_image(control))[None]).latent_dist.mean[0]
    assert torch.allclose(latents, expected, atol=1e-5)  # the posterior's mean, at the target's 32x32
    stats, again = cached()
    assert stats.encoded == 0 and stats.reused == 4 and torch.equal(again, latents)
    noise_image(control, seed=7)  # same name and size, new content
    stats, changed = cached()
    assert stats.encoded == 1 and stats.reused == 3 and not torch.allclose(changed, latents)
    batch = next(iter(build(tmp_path, toml).dataloader()))
    assert "control_pixels" in batch and "control_latents" not in batch  # without the cache: pixels


# ---------------------------------------------------------------------------------------- without controls

def test_a_dataset_without_controls_is_fed_as_before(tmp_path, tiny_vae):
    images = tmp_path / "t"
    for i, size in enumerate(((32, 32), (48, 32), (32, 48), (32, 32))):
        target(images, f"i{i}", size, seed=i)
    data = build(tmp_path, write_toml(tmp_path, subset_of(images, extra="flip_aug = true\n")))
    # The subset's repr (part of the fingerprint) ends where it ended before the control keys.
    assert repr(data.records[0].subset).endswith(", face_crop_aug_range=None)")
    assert all(not r.controls for r in data.records)
    # The fingerprint and the batches as they were computed before control images existed.
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr([(s.batch_size, s.resolution) for s in data.specs]).encode())
    for r in data.records:
        digest.update(repr((str(r.path), r.size, r.bucket, r.resized, r.repeats, r.is_reg, r.caption,
                            r.subset)).encode())
    assert data.fingerprint() == digest.hexdigest()
    groups: dict = {}
    for sample, record_index in enumerate(data.dataset.samples):
        groups.setdefault(data.records[record_index].bucket, []).append(sample)
    before = BucketBatchSampler([(4, groups[b]) for b in sorted(groups)], seed=0)
    assert [data.sampler.batches(e) for e in range(3)] == [before.batches(e) for e in range(3)]
    cache_latents(data, tiny_vae, to_disk=True, threads=0)
    batch = next(iter(data.dataloader()))
    assert data.dataset.control_latents is None and not any(k.startswith("control") for k in batch)
    assert not list(images.glob(f"*{CONTROL_SUFFIX}"))
