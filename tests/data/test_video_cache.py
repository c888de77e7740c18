"""Latent caching of video clips through a video VAE (a tiny diffusers AutoencoderKLWan behind a small wrapper that
takes 4-D images and 5-D clips, as a video family's VAE does): clips go through unchanged as (B, 3, F, H, W), their
latents are (C, F', H', W'), and the disk cache is keyed by the video's content and the clip's frames."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import library.families.registry  # noqa: F401 - the families' options are part of the schema
from library.data.cache import cache_latents, latent_cache_path
from library.data.dataset import build_training_data
from library.families.entry import FramesRule
from tests.helpers.datasets import noise_image
from tests.helpers.runs import make_config
from tests.helpers.videos import write_frame_folder, write_video

WAN = FramesRule(4, 16.0)
RUN = {"resolution": 32, "bucket_reso_steps": 16, "min_bucket_reso": 16, "max_bucket_reso": 64}


class VideoVae(torch.nn.Module):
    """AutoencoderKLWan taking images (B, 3, H, W) as one-frame clips and clips (B, 3, F, H, W) as they are."""

    def __init__(self, vae: torch.nn.Module):
        super().__init__()
        self.vae = vae
        self.config = vae.config
        self.seen: list[tuple[int, ...]] = []

    def encode(self, pixels: torch.Tensor) -> SimpleNamespace:
        self.seen.append(tuple(pixels.shape))
        posterior = self.vae.encode(pixels.unsqueeze(2) if pixels.ndim == 4 else pixels).latent_dist
        if pixels.ndim == 4:
            return SimpleNamespace(latent_dist=SimpleNamespace(mean=posterior.mean.squeeze(2),
                                                               logvar=posterior.logvar.squeeze(2)))
        return SimpleNamespace(latent_dist=posterior)


@pytest.fixture(scope="module")
def video_vae():
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                               temperal_downsample=[False, True, True])
    return VideoVae(vae.eval().requires_grad_(False))


def write_mixed_data(data_dir: Path) -> Path:
    """A 9-frame video a.mp4, a 5-frame folder b and an image c.png, each with a caption."""
    write_video(data_dir / "a.mp4", 9)
    write_frame_folder(data_dir / "b", 5)
    noise_image(data_dir / "c.png")
    for name in ("a", "b", "c"):
        (data_dir / f"{name}.txt").write_text(f"{name} caption", encoding="utf-8")
    return data_dir


def build(tmp_path: Path):
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[general]\nresolution = [32, 32]\ncaption_extension = ".txt"\nbatch_size = 2\n\n'
                    f'[[datasets]]\nvideo_directory = "{tmp_path / "data"}"\ntarget_frames = [1, 5, 9]\n',
                    encoding="utf-8")
    config = make_config(tmp_path, None, tmp_path / "out", "--dataset_config", str(toml), run=RUN)
    return build_training_data(config, None, 0, 1, WAN)


def test_clips_cache_to_disk_by_content(tmp_path, video_vae):
    data_dir = write_mixed_data(tmp_path / "data")

    data = build(tmp_path)
    assert sorted((r.path.name, None if r.frames is None else len(r.frames)) for r in data.records) == [
        ("a.mp4", 1), ("a.mp4", 5), ("a.mp4", 9), ("b", 1), ("b", 5), ("c.png", None)]
    video_vae.seen.clear()
    stats = cache_latents(data, video_vae, to_disk=True, vae_batch_size=2)
    assert (stats.encoded, stats.reused) == (6, 0)
    # Clips reach the VAE as 5-D batches of one length, the image as a 4-D one.
    assert sorted(video_vae.seen) == sorted([(1, 3, 32, 32), (1, 3, 9, 32, 32), (2, 3, 1, 32, 32),
                                             (2, 3, 5, 32, 32)])
    assert latent_cache_path(data_dir / "a.mp4").is_file() and latent_cache_path(data_dir / "b").is_file()
    shapes = {(r.path.name, None if r.frames is None else len(r.frames)):
              tuple(data.dataset.latents.get(i, False)[0].shape) for i, r in enumerate(data.records)}
    assert shapes == {("a.mp4", 1): (4, 1, 4, 4), ("a.mp4", 5): (4, 2, 4, 4), ("a.mp4", 9): (4, 3, 4, 4),
                      ("b", 1): (4, 1, 4, 4), ("b", 5): (4, 2, 4, 4), ("c.png", None): (4, 4, 4)}
    # The cached mean is the VAE's for the clip's pixels.
    nine = next(i for i, r in enumerate(data.records) if r.frames is not None and len(r.frames) == 9)
    data.dataset.latents = None  # the item's pixels, as the VAE saw them
    pixels = data.dataset[data.dataset.samples.index(nine)]["pixels"]
    with torch.inference_mode():
        direct = video_vae.encode(pixels.unsqueeze(0)).latent_dist.mean[0]
    again = build(tmp_path)
    stats = cache_latents(again, video_vae, to_disk=True, vae_batch_size=2)
    assert (stats.encoded, stats.reused) == (0, 6)
    cached = again.dataset.latents.get(next(i for i, r in enumerate(again.records) if r.frames is not None
                                            and len(r.frames) == 9), False)[0]
    torch.testing.assert_close(cached, direct.float(), atol=1e-5, rtol=1e-4)

    # A changed video re-encodes its clips; the unchanged frame folder and image do not.
    write_video(data_dir / "a.mp4", 10)
    stats = cache_latents(build(tmp_path), video_vae, to_disk=True, vae_batch_size=2)
    assert (stats.encoded, stats.reused) == (3, 3)
    # So does a changed frame of the frame folder.
    noise_image(data_dir / "b" / "frame_0003.png", seed=5)
    stats = cache_latents(build(tmp_path), video_vae, to_disk=True, vae_batch_size=2)
    assert (stats.encoded, stats.reused) == (2, 4)


def test_clips_cache_in_memory_with_flips(tmp_path, video_vae):
    for i in range(5):  # noise frames, which a flip changes
        noise_image(tmp_path / "data" / "a" / f"frame_{i:04d}.png", seed=i)
    (tmp_path / "data" / "a.txt").write_text("a", encoding="utf-8")
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[general]\nresolution = [32, 32]\ncaption_extension = ".txt"\n\n[[datasets]]\n'
                    f'video_directory = "{tmp_path / "data"}"\ntarget_frames = [5]\nflip_aug = true\n',
                    encoding="utf-8")
    data = build_training_data(make_config(tmp_path, None, tmp_path / "out", "--dataset_config", str(toml), run=RUN),
                               None, 0, 1, WAN)
    stats = cache_latents(data, video_vae, vae_batch_size=2)
    assert stats.encoded == 2
    plain, flipped = (data.dataset.latents.get(0, f)[0] for f in (False, True))
    assert plain.shape == flipped.shape == (4, 2, 4, 4) and not torch.equal(plain, flipped)
    item = data.dataset[0]
    assert item["latent_mean"].shape == (4, 2, 4, 4) and "pixels" not in item


def test_two_processes_share_the_disk_cache_by_file(tmp_path, video_vae, monkeypatch):
    """Each video's clips are encoded and written by one process, so no two processes write one file."""
    from library.data import cache as cache_module

    write_mixed_data(tmp_path / "data")
    rank, written, second = [0], [], []
    write_entries = cache_module.write_entries

    def recording(path, entries):
        written.append((rank[0], path.name, len(entries)))
        write_entries(path, entries)

    monkeypatch.setattr(cache_module, "write_entries", recording)

    def other_process() -> None:  # rank 1 runs while rank 0 waits for everyone
        rank[0] = 1
        second.append(cache_latents(build(tmp_path), video_vae, to_disk=True, process_index=1, num_processes=2))
        rank[0] = 0

    first = cache_latents(build(tmp_path), video_vae, to_disk=True, process_index=0, num_processes=2,
                          wait_for_everyone=other_process)
    # Records in order: a.mp4's three clips (rank 0), then b's two clips and c.png (rank 1).
    assert (first.encoded, second[0].encoded) == (3, 3)
    assert sorted(written) == [(0, "a.mp4.latents.safetensors", 3), (1, "b.latents.safetensors", 2),
                               (1, "c.png.latents.safetensors", 1)]
    assert cache_latents(build(tmp_path), video_vae, to_disk=True).reused == 6
