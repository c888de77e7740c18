"""Latent-caching throughput against the VAE's own batched encode of the same images, in the same run.

    python bench/cache_throughput.py [--vae tiny sd] [--images N] [--resolution R] [--vae_batch_size B]
                                     [--repeats K] [--threads T] [--device cpu|cuda] [--json PATH]

"vae" is the bare encode: the dataset's exact pixel tensors are prepared beforehand (untimed), grouped into the
same bucket batches, and only `vae.encode(batch).latent_dist` (mean and log-variance read back to the CPU) is timed.
"cache" is `library.data.cache.cache_latents` from scratch: decoding, resizing and cropping every image (in line on a
CPU device, in threads ahead of the VAE otherwise), the VAE encode, and for the disk variant the content hashes,
the VAE fingerprint, the atomic writes and the key check of every entry. "reuse" is a second disk run that finds
every entry valid (no VAE).
Throughput is (image, flip) variants per second; the runs alternate (vae, cache-memory, cache-disk, ...) so that a
noisy machine hits all of them, and the table shows medians. Target: cache / vae >= 0.9.

VAEs, randomly initialised (no download): "tiny" is the tests' 4-level 32-channel VAE (the worst case: so cheap
that image decoding dominates); "sd" has Stable Diffusion's VAE encoder shape (128/256/512/512 channels, 2 blocks
per level, ~34 M encoder parameters).

This is a benchmark, not a test: it asserts nothing about time.
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

TARGET = 0.9
VAE_SHAPES = {
    "tiny": {"block_out_channels": (32, 32, 32, 32), "layers_per_block": 1},
    "sd": {"block_out_channels": (128, 256, 512, 512), "layers_per_block": 2},
}
DEFAULT_RESOLUTION = {"tiny": 256, "sd": 256}


def make_vae(kind: str, device: str):
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    shape = VAE_SHAPES[kind]
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, norm_num_groups=32, **shape)
    return vae.to(device).eval().requires_grad_(False)


def make_images(root: Path, count: int, resolution: int) -> None:
    """PNG photos-like enough to cost a realistic decode: smooth gradients plus noise, in three aspect ratios."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = [(resolution * 3 // 2, resolution), (resolution, resolution * 3 // 2),
             (resolution * 5 // 4, resolution * 5 // 4)]
    folder = root / "1_bench"
    folder.mkdir(parents=True)
    for i in range(count):
        w, h = sizes[i % len(sizes)]
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], axis=-1)
        noise = rng.normal(0, 12, (h, w, 3))
        Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)).save(folder / f"{i:04d}.png")


def build_data(root: Path, resolution: int, flip: bool):
    from library.config import parse_config
    from library.data.dataset import build_training_data

    args = ["--pretrained_model_name_or_path", str(root), "--output_dir", str(root / "out"), "--train_data_dir",
            str(root), "--resolution", str(resolution), "--enable_bucket", "--min_bucket_reso",
            str(resolution // 2), "--max_bucket_reso", str(resolution * 2), "--bucket_reso_steps", "64",
            "--caption_extension", ".txt"] + (["--flip_aug"] if flip else [])
    config, _ = parse_config(args)
    return build_training_data(config, None, seed=0)


def bare_batches(data, vae_batch_size: int):
    """The exact tensors cache_latents feeds the VAE, in the same bucket batches."""
    import torch

    from library.data.images import prepare_image

    items = [(i, f) for i, r in enumerate(data.records) for f in ((False, True) if r.subset.flip_aug else (False,))]
    by_bucket: dict = {}
    for i, f in items:
        by_bucket.setdefault(data.records[i].bucket, []).append((i, f))
    batches = []
    for _, group in sorted(by_bucket.items()):
        for start in range(0, len(group), vae_batch_size):
            chunk = group[start:start + vae_batch_size]
            batches.append(torch.stack([prepare_image(data.records[i].path, data.records[i].size,
                                                      data.records[i].resized, data.records[i].bucket,
                                                      data.records[i].crop, f) for i, f in chunk]))
    return batches, len(items)


def time_bare(vae, batches, device: str) -> float:
    import torch

    started = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            distribution = vae.encode(batch.to(device)).latent_dist
            distribution.mean.float().cpu(), distribution.logvar.float().cpu()
    return time.perf_counter() - started


def time_cache(root: Path, resolution: int, flip: bool, vae, vae_batch_size: int, to_disk: bool,
               device: str) -> tuple[float, int]:
    from library.data.cache import cache_latents

    data = build_data(root, resolution, flip)  # the dataset scan is not part of caching
    started = time.perf_counter()
    stats = cache_latents(data, vae, device, vae_batch_size=vae_batch_size, to_disk=to_disk)
    return time.perf_counter() - started, stats.encoded


def clear_disk_cache(root: Path) -> None:
    from library.data.cache import LATENT_SUFFIX

    for path in root.rglob("*" + LATENT_SUFFIX):
        path.unlink()


def bench(kind: str, args: argparse.Namespace, work: Path) -> dict:
    resolution = args.resolution or DEFAULT_RESOLUTION[kind]
    root = work / kind
    make_images(root, args.images, resolution)
    vae = make_vae(kind, args.device)
    data = build_data(root, resolution, args.flip)
    batches, variants = bare_batches(data, args.vae_batch_size)
    # Warm-up: the first convolutions of each shape pay for allocator and kernel set-up.
    time_bare(vae, batches[:2], args.device)
    times: dict[str, list[float]] = {"vae": [], "cache_memory": [], "cache_disk": [], "reuse_disk": []}
    for _ in range(args.repeats):
        times["vae"].append(time_bare(vae, batches, args.device))
        seconds, encoded = time_cache(root, resolution, args.flip, vae, args.vae_batch_size, False, args.device)
        assert encoded == variants
        times["cache_memory"].append(seconds)
        clear_disk_cache(root)
        seconds, encoded = time_cache(root, resolution, args.flip, vae, args.vae_batch_size, True, args.device)
        assert encoded == variants
        times["cache_disk"].append(seconds)
        seconds, encoded = time_cache(root, resolution, args.flip, vae, args.vae_batch_size, True, args.device)
        assert encoded == 0
        times["reuse_disk"].append(seconds)
    rates = {name: variants / statistics.median(values) for name, values in times.items()}
    return {"vae": kind, "resolution": resolution, "images": args.images, "variants": variants,
            "vae_batch_size": args.vae_batch_size, "buckets": len({r.bucket for r in data.records}),
            "images_per_s": rates, "seconds": times,
            "ratio_memory": rates["cache_memory"] / rates["vae"], "ratio_disk": rates["cache_disk"] / rates["vae"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae", nargs="+", choices=sorted(VAE_SHAPES), default=["tiny", "sd"])
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--resolution", type=int, default=None, help="default: 256")
    parser.add_argument("--vae_batch_size", type=int, default=4)
    parser.add_argument("--flip", action="store_true", help="flip_aug: encode both flips")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cache-bench-") as tmp:
        for kind in args.vae:
            rows.append(bench(kind, args, Path(tmp)))
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, device {args.device}; medians of {args.repeats} alternating runs; (image, flip) variants/s")
    print(f"{'vae':5s} {'res':>4s} {'n':>4s} {'batch':>5s} | {'vae encode':>10s} {'cache mem':>10s} "
          f"{'cache disk':>10s} {'reuse disk':>10s} | {'mem/vae':>7s} {'disk/vae':>8s}")
    for r in rows:
        rate = r["images_per_s"]
        print(f"{r['vae']:5s} {r['resolution']:4d} {r['variants']:4d} {r['vae_batch_size']:5d} | "
              f"{rate['vae']:10.1f} {rate['cache_memory']:10.1f} {rate['cache_disk']:10.1f} "
              f"{rate['reuse_disk']:10.1f} | {r['ratio_memory']:6.2f}x {r['ratio_disk']:7.2f}x")
    print(f"target: cache / vae >= {TARGET}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
