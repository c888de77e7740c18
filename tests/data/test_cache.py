"""Latent cache (memory and disk: keys, invalidation, reuse without the VAE, NaN), text-encoder-output cache."""
from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch
from PIL import Image

from library.config import UserError
from library.data.cache import (
    LATENT_SUFFIX,
    cache_latents,
    cache_text_encoder_outputs,
    check_finite_latents,
    latent_cache_path,
    sample_cached_latents,
)
from library.data.dataset import build_training_data
from library.data.images import prepare_image
from tests.helpers.datasets import noise_image
from tests.helpers.runs import make_config


class CountingVAE(torch.nn.Module):
    """Counts the images the VAE encodes; optionally returns NaN latents for all-white inputs."""

    def __init__(self, vae: torch.nn.Module, nan_for_white: bool = False):
        super().__init__()
        self.vae = vae
        self.config = vae.config
        self.images = 0
        self.nan_for_white = nan_for_white

    def encode(self, pixels: torch.Tensor):
        self.images += pixels.shape[0]
        output = self.vae.encode(pixels)
        if self.nan_for_white:
            white = (pixels > 0.99).flatten(1).all(dim=1)
            output.latent_dist.mean[white] = float("nan")
        return output


@pytest.fixture()
def images(tmp_path) -> Path:
    root = tmp_path / "train"
    noise_image(root / "2_sks" / "a.png", (32, 32), 1)
    noise_image(root / "2_sks" / "b.png", (48, 32), 2)
    noise_image(root / "2_sks" / "c.png", (32, 48), 3)
    return root


# 32 px buckets from 16 to 64 px in steps of 16; the model and output are never read.
BUCKETS = {"resolution": 32, "enable_bucket": True, "min_bucket_reso": 16, "max_bucket_reso": 64,
           "bucket_reso_steps": 16}


def build(tmp_path: Path, root: Path, *args: str, tokenize=None):
    return build_training_data(make_config(tmp_path, root, tmp_path / "o", *args, run=BUCKETS), tokenize, seed=0)


def test_disk_cache_is_reused_without_calling_the_vae(tmp_path, images, tiny_vae):
    vae = CountingVAE(tiny_vae)
    stats = cache_latents(build(tmp_path, images, "--flip_aug"), vae, vae_batch_size=2, to_disk=True, threads=2)
    assert vae.images == stats.encoded == 6 and stats.reused == 0  # 3 images x (plain, flipped)
    assert sorted(p.name for p in (images / "2_sks").iterdir() if p.name.endswith(LATENT_SUFFIX)) == [
        "a.png" + LATENT_SUFFIX, "b.png" + LATENT_SUFFIX, "c.png" + LATENT_SUFFIX]
    assert not [p for p in (images / "2_sks").iterdir() if ".tmp" in p.name]
    data = build(tmp_path, images, "--flip_aug")
    vae.images = 0
    stats = cache_latents(data, vae, vae_batch_size=2, to_disk=True)
    assert vae.images == 0 and stats.reused == 6
    batch = next(iter(data.dataloader()))
    assert "pixels" not in batch and batch["latent_mean"].shape[1:] == (4, 4, 4)


def test_any_change_re_encodes_exactly_what_it_affects(tmp_path, images, tiny_vae):
    vae = CountingVAE(tiny_vae)
    cache_latents(build(tmp_path, images), vae, to_disk=True)
    assert vae.images == 3
    cases = [
        ("flip_aug added: only the flipped variants", ("--flip_aug",), 3),
        ("unchanged", ("--flip_aug",), 0),
    ]
    for what, args, expected in cases:
        vae.images = 0
        cache_latents(build(tmp_path, images, *args), vae, to_disk=True)
        assert vae.images == expected, what
    noise_image(images / "2_sks" / "b.png", (48, 32), seed=99)  # same size, new content
    vae.images = 0
    cache_latents(build(tmp_path, images, "--flip_aug"), vae, to_disk=True)
    assert vae.images == 2
    vae.images = 0
    cache_latents(build(tmp_path, images, "--flip_aug", "--resolution", "48", "--max_bucket_reso", "96"), vae,
                  to_disk=True)
    assert vae.images == 6  # new buckets / sizes
    vae.images = 0
    half = CountingVAE(copy.deepcopy(tiny_vae).to(torch.bfloat16))
    cache_latents(build(tmp_path, images, "--flip_aug", "--resolution", "48", "--max_bucket_reso", "96"), half,
                  to_disk=True)
    assert half.images == 6  # another dtype
    other = CountingVAE(type(tiny_vae).from_config(tiny_vae.config).eval())
    cache_latents(build(tmp_path, images, "--flip_aug", "--resolution", "48", "--max_bucket_reso", "96"), other,
                  to_disk=True)
    assert other.images == 6  # another VAE (same config, other weights)


def test_a_broken_cache_file_is_rewritten(tmp_path, images, tiny_vae):
    vae = CountingVAE(tiny_vae)
    cache_latents(build(tmp_path, images), vae, to_disk=True)
    latent_cache_path(images / "2_sks" / "a.png").write_bytes(b"garbage")
    vae.images = 0
    data = build(tmp_path, images)
    cache_latents(data, vae, to_disk=True)
    assert vae.images == 1
    assert all(torch.isfinite(data.dataset[i]["latent_mean"]).all() for i in range(len(data.dataset)))


@pytest.mark.parametrize("to_disk", [False, True])
def test_cached_latents_are_the_vae_posterior_and_sample_like_the_trainer(tmp_path, images, tiny_vae, to_disk):
    data = build(tmp_path, images, "--flip_aug")
    cache_latents(data, tiny_vae, vae_batch_size=3, to_disk=to_disk, threads=2 if to_disk else 0)
    for index in range(len(data.dataset)):
        item = data.dataset[(1, index)]
        record = data.records[data.dataset.samples[index]]
        pixels = prepare_image(record.path, record.size, record.resized, record.bucket, record.crop,
                               item["flipped"])
        with torch.no_grad():
            distribution = tiny_vae.encode(pixels[None]).latent_dist
        torch.testing.assert_close(item["latent_mean"], distribution.mean[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(item["latent_logvar"], distribution.logvar[0], rtol=1e-5, atol=1e-5)
        # the trainer's uncached sample: mean + std * eps, eps drawn on CPU from the step generator
        eps = torch.randn(distribution.mean.shape, generator=torch.Generator().manual_seed(index))
        expected = (distribution.mean + distribution.std * eps) * 0.18215
        sample = sample_cached_latents(item["latent_mean"][None], item["latent_logvar"][None],
                                       torch.Generator().manual_seed(index), 0.18215)
        torch.testing.assert_close(sample, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("to_disk", [False, True])
def test_nan_latents_stop_the_run_or_are_left_out(tmp_path, images, tiny_vae, to_disk):
    Image.new("RGB", (32, 32), (255, 255, 255)).save(images / "2_sks" / "white.png")
    vae = CountingVAE(tiny_vae, nan_for_white=True)
    with pytest.raises(UserError) as info:
        cache_latents(build(tmp_path, images), vae, to_disk=to_disk)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith(f"{images / '2_sks' / 'white.png'}: the VAE gave NaN or inf latents")
    data = build(tmp_path, images)
    cache_latents(data, vae, to_disk=to_disk, skip_bad_images=True)
    assert sorted(r.path.name for r in data.records) == ["a.png", "b.png", "c.png"]
    assert len(data.dataset) == 6 and any("white.png" in reason for reason in data.left_out)
    assert all(torch.isfinite(data.dataset[i]["latent_mean"]).all() for i in range(len(data.dataset)))


def test_processes_split_the_disk_cache_work(tmp_path, images, tiny_vae):
    noise_image(images / "2_sks" / "d.png", (32, 32), 4)
    barrier = threading.Barrier(2)
    vaes = [CountingVAE(tiny_vae), CountingVAE(tiny_vae)]
    datas = [build(tmp_path, images), build(tmp_path, images)]
    errors: list[BaseException] = []

    def rank(index: int) -> None:
        try:
            cache_latents(datas[index], vaes[index], to_disk=True, process_index=index, num_processes=2,
                          wait_for_everyone=barrier.wait)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert [v.images for v in vaes] == [2, 2]
    for data in datas:  # every process reads every entry
        assert all(torch.isfinite(data.dataset[i]["latent_mean"]).all() for i in range(len(data.dataset)))


def test_random_crop_cannot_be_cached(tmp_path, images, tiny_vae):
    with pytest.raises(UserError, match="random_crop"):
        cache_latents(build(tmp_path, images, "--random_crop"), tiny_vae)


def test_check_finite_latents_names_the_images():
    latents = torch.zeros(3, 4, 2, 2)
    latents[1, 0, 0, 0] = float("inf")
    check_finite_latents(latents[[0, 2]], ["a", "c"])
    with pytest.raises(UserError) as info:
        check_finite_latents(latents, ["a", "b", "c"])
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith("b: the VAE gave NaN or inf")


def test_text_encoder_outputs_are_encoded_once_per_caption(tmp_path, images):
    for name in ("a", "b"):
        (images / "2_sks" / f"{name}.txt").write_text("sks, same caption", encoding="utf-8")

    def tokenize(caption: str) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([len(caption), sum(map(ord, caption)) % 1000])}

    encoded: list[list[int]] = []

    def encode(tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = tokens["input_ids"]
        encoded.extend(ids.tolist())
        return {"encoder_hidden_states": ids[:, :, None].float().repeat(1, 1, 3)}

    data = build(tmp_path, images, "--caption_extension", ".txt", "--caption_dropout_rate", "0.5",
                 "--caption_prefix", "photo,", tokenize=tokenize)
    assert cache_text_encoder_outputs(data, encode, batch_size=2) == 3  # two distinct captions and ""
    assert len(encoded) == 3
    captions = set()
    for index in range(len(data.dataset)):
        for epoch in range(3):
            item = data.dataset[(epoch, index)]
            captions.add(item["caption"])
            assert "input_ids" not in item["text"]
            expected = encode({"input_ids": tokenize(item["caption"])["input_ids"][None]})
            assert torch.equal(item["text"]["encoder_hidden_states"], expected["encoder_hidden_states"][0])
    assert captions == {"", "photo, sks, same caption", "photo, sks"}
    shuffled = build(tmp_path, images, "--caption_extension", ".txt", "--shuffle_caption", tokenize=tokenize)
    with pytest.raises(UserError, match="cannot use cache_text_encoder_outputs"):
        cache_text_encoder_outputs(shuffled, encode)
