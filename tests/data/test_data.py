"""Buckets, caption operations, the seeded bucket sampler and dataset items (flip, crop, SDXL sizes, loss weights)."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from library.data.captions import process_caption
from library.data.dataset import BucketBatchSampler, SampleKey, build_training_data
from library.data.dataset_config import DatasetSpec, SubsetSpec
from library.data.images import Bucketer, make_bucket_resolutions, prepare_image
from library.data.kohya_fields import kohya_dataset_fields
from tests.helpers.runs import make_config


def gradient_image(path: Path, size: tuple[int, int], seed: int = 0) -> Path:
    """An image whose every pixel differs, so crops and flips show."""
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return path


# ---------------------------------------------------------------------------------------------------- buckets

def test_bucket_resolutions_match_kohya_for_512():
    assert make_bucket_resolutions((512, 512), 256, 1024, 64) == [
        (256, 832), (256, 896), (256, 960), (256, 1024), (320, 704), (320, 768), (384, 640), (448, 576),
        (512, 512), (576, 448), (640, 384), (704, 320), (768, 320), (832, 256), (896, 256), (960, 256),
        (1024, 256)]
    # A min_bucket_reso that is not a multiple of the step starts at the next multiple (every side stays usable).
    assert all(w % 64 == 0 and h % 64 == 0 for w, h in make_bucket_resolutions((512, 512), 200, 1000, 64))


BUCKETS = DatasetSpec((), resolution=(512, 512), enable_bucket=True, min_bucket_reso=256, max_bucket_reso=1024,
                      bucket_reso_steps=64)


@pytest.mark.parametrize("spec, size, bucket, resized", [
    (BUCKETS, (512, 512), (512, 512), (512, 512)),
    (BUCKETS, (1024, 1024), (512, 512), (512, 512)),
    (BUCKETS, (1000, 500), (704, 320), (704, 352)),  # nearest aspect ratio 2.2; cover, crop the height
    (BUCKETS, (500, 1000), (320, 704), (352, 704)),
    (BUCKETS, (300, 200), (640, 384), (640, 427)),  # enlarged
    (BUCKETS, (4000, 3000), (576, 448), (597, 448)),
    # bucket_no_upscale: the image's own size rounded down to the step, shrunk to the resolution's area
    (DatasetSpec((), resolution=(512, 512), enable_bucket=True, bucket_no_upscale=True, min_bucket_reso=64),
     (300, 200), (256, 192), (300, 200)),
    (DatasetSpec((), resolution=(512, 512), enable_bucket=True, bucket_no_upscale=True), (2000, 1000),
     (640, 320), (640, 320)),
    # no buckets: one bucket at the resolution, resized to cover it
    (DatasetSpec((), resolution=(64, 48)), (100, 100), (64, 48), (64, 64)),
    (DatasetSpec((), resolution=(64, 48)), (32, 32), (64, 48), (64, 64)),
])
def test_bucket_assignment(spec, size, bucket, resized):
    placement = Bucketer(spec).place(*size)
    assert (placement.bucket, placement.resized, placement.problem) == (bucket, resized, None)


def test_no_upscale_image_below_the_smallest_bucket_is_unusable():
    spec = DatasetSpec((), resolution=(512, 512), enable_bucket=True, bucket_no_upscale=True, min_bucket_reso=256)
    assert "smaller than the smallest bucket side 256" in Bucketer(spec).place(300, 200).problem


# --------------------------------------------------------------------------------------------------- captions

def spec(**kw) -> SubsetSpec:
    return SubsetSpec(Path("x"), **kw)


CAPTION = "sks, red, round, shiny, small"


def test_caption_operations_with_a_fixed_seed():
    assert process_caption("a, b", spec(caption_prefix="pre,", caption_suffix=", post"), 0,
                           random.Random(0)) == "pre, a, b , post"
    assert process_caption(CAPTION, spec(), 0, random.Random(0)) == CAPTION  # no operation: untouched
    shuffled = process_caption(CAPTION, spec(shuffle_caption=True, keep_tokens=1), 0, random.Random(42))
    assert shuffled == "sks, shiny, round, small, red"
    assert shuffled == process_caption(CAPTION, spec(shuffle_caption=True, keep_tokens=1), 0, random.Random(42))
    orders = {process_caption(CAPTION, spec(shuffle_caption=True, keep_tokens=2), 0, random.Random(s))
              for s in range(30)}
    assert len(orders) > 1 and all(o.startswith("sks, red, ") for o in orders)
    assert all(sorted(o.split(", ")) == sorted(CAPTION.split(", ")) for o in orders)
    dropped = process_caption(CAPTION, spec(caption_tag_dropout_rate=0.5), 0, random.Random(42))
    assert dropped == "sks, small"
    assert process_caption(CAPTION, spec(caption_tag_dropout_rate=1.0, keep_tokens=1), 0, random.Random(1)) == "sks"


def test_keep_tokens_separator_keeps_a_prefix_and_a_suffix():
    caption = "sks, dog ||| red, round, shiny ||| masterpiece, best"
    plain = process_caption(caption, spec(keep_tokens_separator="|||"), 0, random.Random(0))
    assert plain == "sks, dog, red, round, shiny, masterpiece, best"  # the separator never reaches the model
    for seed in range(10):
        out = process_caption(caption, spec(keep_tokens_separator="|||", shuffle_caption=True, keep_tokens=5), 0,
                              random.Random(seed)).split(", ")
        assert out[:2] == ["sks", "dog"] and out[-2:] == ["masterpiece", "best"]
        assert sorted(out[2:5]) == ["red", "round", "shiny"]


def test_caption_dropout_by_rate_and_every_n_epochs():
    assert process_caption(CAPTION, spec(caption_dropout_rate=1.0), 0, random.Random(0)) == ""
    kept = sum(process_caption(CAPTION, spec(caption_dropout_rate=0.3), 0, random.Random(s)) != ""
               for s in range(200))
    assert 110 < kept < 170
    # every 2nd epoch counted from 1 (kohya): epochs 1, 3 (0-based) are dropped
    assert [process_caption(CAPTION, spec(caption_dropout_every_n_epochs=2), e, random.Random(0)) == ""
            for e in range(4)] == [False, True, False, True]


def test_custom_separator():
    out = process_caption("a; b; c", spec(caption_separator=";", keep_tokens=1, caption_tag_dropout_rate=1.0), 0,
                          random.Random(0))
    assert out == "a"


# ---------------------------------------------------------------------------------------------------- sampler

GROUPS = [(2, list(range(7))), (3, list(range(7, 12)))]


def test_sampler_batches_come_from_one_bucket_and_depend_only_on_seed_and_epoch():
    sampler = BucketBatchSampler(GROUPS, seed=5)
    assert sampler.num_batches == len(sampler) == 6
    batches = [[key.index for key in batch] for batch in sampler]
    assert sorted(i for b in batches for i in b) == list(range(12))
    assert all(set(b) <= set(range(7)) or set(b) <= set(range(7, 12)) for b in batches)
    assert all(key.epoch == 0 for batch in sampler for key in batch)
    again = BucketBatchSampler(GROUPS, seed=5)
    assert again.batches(3) == sampler.batches(3)
    assert sampler.batches(3) != sampler.batches(4)
    assert BucketBatchSampler(GROUPS, seed=6).batches(3) != sampler.batches(3)
    sampler.set_epoch(4)
    assert [[k.index for k in b] for b in sampler] == again.batches(4)
    assert all(k.epoch == 4 for b in sampler for k in b)


def test_sampler_starts_at_batch_k_and_keeps_it_across_accelerates_set_epoch():
    sampler = BucketBatchSampler(GROUPS, seed=5)
    full = sampler.batches(2)
    sampler.set_epoch(2, start_batch=4)
    assert len(sampler) == 2 and [[k.index for k in b] for b in sampler] == full[4:]
    sampler.set_epoch(2)  # accelerate's DataLoaderShard repeats set_epoch(epoch) when iteration starts
    assert sampler.start_batch == 4
    sampler.set_epoch(3)
    assert sampler.start_batch == 0 and len(sampler) == 6
    with pytest.raises(ValueError):
        sampler.set_epoch(3, start_batch=7)


def test_sampler_resumes_through_accelerates_prepared_loader():
    from accelerate.data_loader import prepare_data_loader

    class Identity(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, key):
            return key.index

    sampler = BucketBatchSampler(GROUPS, seed=5)
    loader = prepare_data_loader(torch.utils.data.DataLoader(Identity(), batch_sampler=sampler,
                                                             collate_fn=list), num_processes=1, process_index=0)
    loader.set_epoch(3)
    sampler.set_epoch(3, start_batch=2)
    assert [list(b) for b in loader] == sampler.batches(3)[2:]


def test_sampler_pads_to_whole_rounds_and_shards_across_processes():
    from accelerate.data_loader import BatchSamplerShard

    sampler = BucketBatchSampler(GROUPS, seed=1, num_processes=4)
    full = sampler.batches(0)
    assert sampler.num_batches == 8 and full[6:] == full[:2]  # padded with the epoch's first batches
    shards = [[[k.index for k in b] for b in BatchSamplerShard(sampler, num_processes=4, process_index=p)]
              for p in range(4)]
    assert all(len(s) == 2 for s in shards)
    assert [shards[p][r] for r in range(2) for p in range(4)] == full
    # resuming after one batch per process: start at global batch 1 x 4
    sampler.set_epoch(0, start_batch=4)
    resumed = [[[k.index for k in b] for b in BatchSamplerShard(sampler, num_processes=4, process_index=p)]
               for p in range(4)]
    assert resumed == [s[1:] for s in shards]


# ---------------------------------------------------------------------------------------------------- dataset

@pytest.fixture()
def mixed_dataset(tmp_path):
    root = tmp_path / "train"
    gradient_image(root / "3_sks" / "wide.png", (200, 100), 1)
    gradient_image(root / "3_sks" / "tall.png", (100, 200), 2)
    gradient_image(root / "3_sks" / "square.png", (128, 128), 3)
    (root / "3_sks" / "wide.txt").write_text("sks, wide thing\n", encoding="utf-8")
    reg = tmp_path / "reg"
    for i in range(4):
        gradient_image(reg / "1_thing" / f"r{i}.png", (128, 128), 10 + i)
    return root, reg


def test_dataset_items_buckets_sizes_and_loss_weights(tmp_path, mixed_dataset):
    root, reg = mixed_dataset
    config = make_config(tmp_path, root, tmp_path / "o", "--reg_data_dir", str(reg), "--resolution", "64",
                         "--enable_bucket", "--min_bucket_reso", "32", "--max_bucket_reso", "128",
                         "--bucket_reso_steps", "16", "--train_batch_size", "2", "--prior_loss_weight", "0.5",
                         "--caption_extension", ".txt", run={})
    data = build_training_data(config, lambda c: {"input_ids": torch.tensor([len(c)])}, seed=3)
    assert (data.num_train_images, data.num_reg_images, data.num_unique_images) == (9, 4, 3)
    # kohya's balancing: 4 reg images, 9 training samples -> reg repeats 3, 2, 2, 2
    assert sorted(r.repeats for r in data.records if r.is_reg) == [2, 2, 2, 3]
    assert len(data.dataset) == 18
    histogram = {b: (n, m) for _, b, n, m in data.bucket_histogram()}
    assert histogram == {(64, 64): (12, 5), (80, 48): (3, 1), (48, 80): (3, 1)}
    batches_seen = 0
    for batch in data.dataloader():
        batches_seen += 1
        assert len({tuple(p.shape) for p in batch["pixels"]}) == 1
        for i, path in enumerate(batch["path"]):
            is_reg = "reg" in Path(path).parts
            assert batch["loss_weight"][i].item() == (0.5 if is_reg else 1.0)
            if path.endswith("wide.png"):
                assert batch["original_size"][i].tolist() == [100, 200]
                assert batch["target_size"][i].tolist() == [48, 80]
                assert batch["caption"][i] == "sks, wide thing"
            if path.endswith("tall.png"):
                assert batch["caption"][i] == "sks"  # class tokens: no caption file
                assert batch["text"]["input_ids"][i].tolist() == [3]
    assert batches_seen == len(data.sampler) == data.batches_per_epoch == 6 + 2 + 2


def test_flip_and_random_crop_are_seeded_by_epoch_and_index(tmp_path):
    root = tmp_path / "train"
    gradient_image(root / "4_x" / "a.png", (96, 64))
    config = make_config(tmp_path, root, tmp_path / "o", "--resolution", "32", "--flip_aug",
                         "--random_crop", run={})
    data = build_training_data(config, None, seed=1)
    record = data.records[0]
    assert record.resized == (48, 32)
    items = {(e, i): data.dataset[SampleKey(e, i)] for e in range(4) for i in range(4)}
    assert any(it["flipped"] for it in items.values()) and not all(it["flipped"] for it in items.values())
    assert len({tuple(it["crop_top_left"]) for it in items.values()}) > 1
    for key, item in items.items():
        again = data.dataset[SampleKey(*key)]
        assert torch.equal(item["pixels"], again["pixels"]) and item["flipped"] == again["flipped"]
        top, left = item["crop_top_left"]
        crop_left = record.resized[0] - left - 32 if item["flipped"] else left
        unflipped = prepare_image(record.path, record.size, record.resized, record.bucket, (crop_left, top), False)
        expected = unflipped.flip(-1) if item["flipped"] else unflipped
        assert torch.equal(item["pixels"], expected)


def test_items_do_not_depend_on_worker_processes(tmp_path):
    root = tmp_path / "train"
    for i in range(4):
        gradient_image(root / "2_sks" / f"{i}.png", (40 + 8 * i, 40), i)
        (root / "2_sks" / f"{i}.txt").write_text("sks, a, b, c, d, e", encoding="utf-8")
    config = make_config(tmp_path, root, tmp_path / "o", "--resolution", "32", "--flip_aug",
                         "--shuffle_caption", "--keep_tokens", "1", "--caption_tag_dropout_rate", "0.3",
                         "--train_batch_size", "2", "--caption_extension", ".txt", run={})
    data = build_training_data(config, None, seed=7)
    data.sampler.set_epoch(1)
    single = list(data.dataloader(num_workers=0))
    data.sampler.set_epoch(1)
    torch.manual_seed(123)  # the global stream must not matter either
    workers = list(data.dataloader(num_workers=2))
    assert [b["caption"] for b in single] == [b["caption"] for b in workers]
    assert all(torch.equal(a["pixels"], b["pixels"]) for a, b in zip(single, workers, strict=True))
    assert len({c for b in single for c in b["caption"]}) > 1


def test_fingerprint_and_kohya_metadata(tmp_path, mixed_dataset):
    import json

    root, reg = mixed_dataset
    def config():
        return make_config(tmp_path, root, tmp_path / "o", "--reg_data_dir", str(reg), "--resolution", "64",
                           "--caption_extension", ".txt", run={})

    first = build_training_data(config(), None, seed=3)
    assert build_training_data(config(), None, seed=3).fingerprint() == first.fingerprint()
    (root / "3_sks" / "wide.txt").write_text("sks, other", encoding="utf-8")
    assert build_training_data(config(), None, seed=3).fingerprint() != first.fingerprint()
    metadata = kohya_dataset_fields(first)
    assert metadata["ss_num_train_images"] == "9" and metadata["ss_num_reg_images"] == "4"
    assert json.loads(metadata["ss_dataset_dirs"]) == {"3_sks": {"n_repeats": 3, "img_count": 3},
                                                        "1_thing": {"n_repeats": 1, "img_count": 4}}
    assert json.loads(metadata["ss_tag_frequency"])["3_sks"] == {"sks": 3, "wide thing": 1}
    assert json.loads(metadata["ss_bucket_info"])["buckets"]["0"] == {"resolution": [64, 64], "count": 18}
