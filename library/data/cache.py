"""Latent and text-encoder-output caches.

Latents are cached as the VAE posterior's mean and log-variance (not a sample), so the trainer still draws a fresh
posterior sample with its own generator at every step. A disk entry `<image file>.latents.safetensors` lies beside
the image and records, for each variant (plain, flipped), a key made of the image file's content hash and every
setting that changes the latent: resized size, bucket, crop, flip, the VAE (config + weights hash) and its dtype.
A video's file (beside the video file or frame folder) holds an entry per clip and variant, whose key adds the
clip's source frames; a video's latents are (C, F', H', W').
An entry whose key differs is re-encoded; files are written atomically (temporary file, then os.replace).
Control images of edit datasets are cached alongside, the same way (library.data.control_cache).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from library.config import UserError
from library.data.captions import process_caption
from library.data.control_cache import ControlLatents, cache_control_latents
from library.data.dataset import TrainingData
from library.data.encoding import (
    CacheStats,
    DiskShare,
    InlineExecutor,
    VaeEncoder,
    file_digest,
    finite,
    read_entries,
    vae_fingerprint,
    write_entries,
)
from library.data.images import prepare_image
from library.data.scan import ImageRecord
from library.data.video import prepare_clip

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the pixels fed to the VAE change for the same settings
LATENT_SUFFIX = ".latents.safetensors"
_NAMES = {False: "plain", True: "flipped"}


def latent_cache_path(image_path: Path) -> Path:
    return image_path.with_name(image_path.name + LATENT_SUFFIX)


def variant_key(record: ImageRecord, flipped: bool, image_digest: str, vae_id: str, dtype: torch.dtype) -> str:
    # resize_interpolation only when set, so the entries written before it existed stay valid.
    interpolation = record.subset.resize_interpolation
    key = {"format": CACHE_FORMAT, "image": image_digest, "size": record.size, "resized": record.resized,
           "bucket": record.bucket, "crop": record.crop, "flipped": flipped, "vae": vae_id, "dtype": str(dtype)}
    if interpolation:
        key["interpolation"] = interpolation
    if record.frames is not None:
        key["frames"] = list(record.frames)
    return json.dumps(key, sort_keys=True)


def entry_name(record: ImageRecord, flipped: bool) -> str:
    """The entry's name in its file: the variant, and for a video clip its first frame, length and frames' hash
    (clips of one video share the file)."""
    if record.frames is None:
        return _NAMES[flipped]
    frames = hashlib.blake2b(repr(record.frames).encode(), digest_size=4).hexdigest()
    return f"{_NAMES[flipped]}-{record.frames[0]:05d}-{len(record.frames):03d}-{frames}"


class MemoryLatents:
    """(record index, flipped) -> (mean, logvar) held in memory (float32 copies of the VAE's values)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}

    def has(self, record_index: int, flipped: bool) -> bool:
        return (record_index, flipped) in self.entries

    def put(self, record_index: int, flipped: bool, mean: torch.Tensor, logvar: torch.Tensor) -> None:
        self.entries[(record_index, flipped)] = (mean, logvar)

    def get(self, record_index: int, flipped: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return self.entries[(record_index, flipped)]


class DiskLatents:
    """(record index, flipped) -> tensors read from the record's cache file at each use."""

    def __init__(self, records: Sequence[ImageRecord]):
        self.records = list(records)

    def get(self, record_index: int, flipped: bool) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors import safe_open

        record = self.records[record_index]
        name = entry_name(record, flipped)
        with safe_open(latent_cache_path(record.path), framework="pt") as f:
            return f.get_tensor(f"{name}.mean"), f.get_tensor(f"{name}.logvar")


def _nan_message(record: ImageRecord, flipped: bool) -> str:
    return (f"{record.path}: the VAE gave NaN or inf latents (bucket {record.bucket[0]}x{record.bucket[1]}"
            f"{', flipped' if flipped else ''}); the image may be broken, or the VAE overflows in half precision "
            "(try no_half_vae)")


def cache_latents(data: TrainingData, vae: torch.nn.Module, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None, vae_batch_size: int = 1, to_disk: bool = False, *,
                  process_index: int = 0, num_processes: int = 1, wait_for_everyone: Callable[[], Any] | None = None,
                  skip_bad_images: bool = False, threads: int | None = None) -> CacheStats:
    """Encode every (image, flip) the dataset uses; afterwards its items carry latent_mean / latent_logvar.

    threads: worker threads that decode and resize images ahead of the VAE (0: in line; default: 0 on CPU,
    else up to 8).

    to_disk: entries are reused when their key matches and rewritten otherwise. With several processes each one
    encodes its share (records i with i % num_processes == process_index), then all wait (wait_for_everyone) and
    read everyone's files. In memory, every process encodes everything (no communication). NaN/inf latents are
    an error naming the files, or, with skip_bad_images, those images are left out.
    """
    started = time.perf_counter()
    first_parameter = next(vae.parameters())
    device = torch.device(device) if device is not None else first_parameter.device
    dtype = dtype or first_parameter.dtype
    if dtype != first_parameter.dtype:
        raise ValueError(f"dtype {dtype} differs from the VAE's {first_parameter.dtype}; cast the VAE instead")
    if any(r.subset.random_crop for r in data.records):
        raise UserError("random_crop draws a new crop each time and cannot use cached latents; turn off "
                        "random_crop or cache_latents")
    stats = CacheStats()
    if threads is None:
        # Preparing pixels in threads overlaps it with a GPU encode; when the VAE itself runs on the CPU, threads
        # only compete with its intra-op threads (measured slower than preparing in line; bench/cache_throughput.py).
        threads = 0 if device.type == "cpu" else min(8, os.cpu_count() or 1)
    share = DiskShare(vae_fingerprint(vae) if to_disk else "", {}, process_index, num_processes, wait_for_everyone)
    memory = MemoryLatents()
    controls = ControlLatents(to_disk) if any(r.controls for r in data.records) else None
    with (ThreadPoolExecutor(max_workers=threads) if threads else nullcontext(InlineExecutor())) as pool:
        encoder = VaeEncoder(vae, device, dtype, vae_batch_size, pool, stats)
        while True:
            records = data.records
            needed = [(i, flipped) for i, r in enumerate(records) if r.repeats
                      for flipped in ((False, True) if r.subset.flip_aug else (False,))]
            problems = (_cache_to_disk(records, needed, encoder, share) if to_disk
                        else _cache_in_memory(records, needed, memory, encoder))
            if controls is not None:
                problems += cache_control_latents(records, controls, encoder, share)
            if not problems:
                break
            messages = sorted({message for _, message in problems})
            if not skip_bad_images:
                raise UserError(messages)
            # Leaving images out re-balances regularisation repeats; any image that now needs a latent gets it
            # on the next pass.
            old = {id(r): i for i, r in enumerate(records)}
            data.drop_records({r.path for r, _ in problems}, messages)
            logger.warning("skip_bad_images: left out %d images with NaN/inf latents:\n  %s", len(messages),
                           "\n  ".join(messages))
            remap = {old[id(r)]: i for i, r in enumerate(data.records)}
            memory.entries = {(remap[i], f): v for (i, f), v in memory.entries.items() if i in remap}
    data.dataset.latents = DiskLatents(data.records) if to_disk else memory
    data.dataset.control_latents = controls
    stats.seconds = time.perf_counter() - started
    logger.info("latents: %d reused from disk, %d encoded in %d VAE batches (%.1f s)", stats.reused, stats.encoded,
                stats.vae_batches, stats.seconds)
    return stats


def _target_pixels(record: ImageRecord, flipped: bool) -> torch.Tensor:
    if record.frames is not None:
        return prepare_clip(record.path, record.frames, record.size, record.resized, record.bucket, record.crop,
                            flipped, record.subset.resize_interpolation)
    return prepare_image(record.path, record.size, record.resized, record.bucket, record.crop, flipped,
                         record.subset.resize_interpolation)


def _cache_in_memory(records: Sequence[ImageRecord], needed: list[tuple[int, bool]], memory: MemoryLatents,
                     encoder: VaeEncoder) -> list[tuple[ImageRecord, str]]:
    """Encode the needed entries not yet in memory; returns (record, message) for those that are not finite."""
    problems: list[tuple[ImageRecord, str]] = []

    def keep(record_index: int, flipped: bool, mean: torch.Tensor, logvar: torch.Tensor) -> None:
        memory.put(record_index, flipped, mean, logvar)
        if not finite(mean, logvar):
            problems.append((records[record_index], _nan_message(records[record_index], flipped)))

    encoder.encode([item for item in needed if not memory.has(*item)], lambda i: records[i].bucket_key,
                   lambda i, flipped: _target_pixels(records[i], flipped), keep)
    return problems


def _cache_to_disk(records: Sequence[ImageRecord], needed: list[tuple[int, bool]], encoder: VaeEncoder,
                   share: DiskShare) -> list[tuple[ImageRecord, str]]:
    """Bring every needed disk entry up to date; returns (record, message) for the entries that are not finite.
    Entries are shared out by file (a video's clips are one file), each file written once by one process."""
    digests, pool = share.digests, encoder.pool
    paths = sorted({records[i].path for i, _ in needed} - digests.keys())
    digests.update(zip(paths, pool.map(file_digest, paths), strict=True))
    keys = {(i, f): variant_key(records[i], f, digests[records[i].path], share.vae_id, encoder.dtype)
            for i, f in needed}
    owner: dict[Path, int] = {}
    for i, _ in needed:  # an image's owner is its record's index, as before clips shared files
        owner.setdefault(records[i].path, i)
    mine = [(i, f) for i, f in needed if owner[records[i].path] % share.num_processes == share.process_index]
    to_encode = [(i, f) for path, items in _by_file(records, mine).items()
                 for entries in (read_entries(latent_cache_path(path)),)
                 for i, f in items if entries.get(entry_name(records[i], f), {}).get("key") != keys[(i, f)]]
    encoder.stats.reused += len(mine) - len(to_encode)
    pending: dict[Path, dict[str, tuple[str, dict[str, torch.Tensor], bool]]] = {}
    expected = {path: len(items) for path, items in _by_file(records, to_encode).items()}
    writes: list[Future] = []

    def write(record_index: int, flipped: bool, mean: torch.Tensor, logvar: torch.Tensor) -> None:
        path = records[record_index].path
        entries = pending.setdefault(path, {})
        entries[entry_name(records[record_index], flipped)] = (keys[(record_index, flipped)],
                                                               {"mean": mean, "logvar": logvar}, finite(mean, logvar))
        if len(entries) == expected[path]:
            writes.append(pool.submit(write_entries, latent_cache_path(path), pending.pop(path)))

    encoder.encode(to_encode, lambda i: records[i].bucket_key,
                   lambda i, flipped: _target_pixels(records[i], flipped), write)
    for future in writes:
        future.result()
    if share.num_processes > 1 and share.wait_for_everyone is not None:
        share.wait_for_everyone()
    return _check_disk_entries(records, needed, keys)


def _by_file(records: Sequence[ImageRecord], items: Iterable[tuple[int, bool]]) -> dict[Path, list[tuple[int, bool]]]:
    grouped: dict[Path, list[tuple[int, bool]]] = {}
    for i, f in items:
        grouped.setdefault(records[i].path, []).append((i, f))
    return grouped


def _check_disk_entries(records: Sequence[ImageRecord], needed: list[tuple[int, bool]],
                        keys: dict[tuple[int, bool], str]) -> list[tuple[ImageRecord, str]]:
    """(record, message) for the needed entries that are not finite; an error for any missing or stale."""
    problems, missing = [], []
    for path, items in _by_file(records, needed).items():
        entries = read_entries(latent_cache_path(path))
        for i, f in items:
            entry = entries.get(entry_name(records[i], f), {})
            if entry.get("key") != keys[(i, f)]:
                missing.append(f"{latent_cache_path(path)}: latent cache entry missing or stale after "
                               "caching (was the file changed by another run?)")
            elif not entry.get("finite", False):
                problems.append((records[i], _nan_message(records[i], f)))
    if missing:
        raise UserError(sorted(set(missing)))
    return problems


def sample_cached_latents(mean: torch.Tensor, logvar: torch.Tensor, generator: torch.Generator,
                          scaling_factor: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A posterior sample from cached parameters, computed like diffusers' DiagonalGaussianDistribution in the VAE's
    dtype, with the noise drawn on CPU from `generator` (as the uncached path does), times the scaling factor."""
    if dtype is not None:
        mean, logvar = mean.to(dtype), logvar.to(dtype)
    std = torch.exp(0.5 * logvar)
    eps = torch.randn(mean.shape, generator=generator, dtype=torch.float32)
    return (mean + std * eps.to(device=mean.device, dtype=mean.dtype)) * scaling_factor


def check_finite_latents(latents: torch.Tensor, paths: Sequence[str]) -> None:
    """For the uncached path: NaN/inf latents stop the run naming the images (never trained on, never zeroed)."""
    bad = ~torch.isfinite(latents.detach().flatten(1)).all(dim=1)
    if bool(bad.any()):
        raise UserError([f"{paths[i]}: the VAE gave NaN or inf latents; the image may be broken, or the VAE "
                         "overflows in half precision (try no_half_vae)" for i in bad.nonzero().flatten().tolist()])


def fixed_caption(record: ImageRecord) -> str:
    """The caption when no random caption operation applies (prefix, suffix, kept-token separator handled)."""
    subset = dataclasses.replace(record.subset, caption_dropout_rate=0.0, caption_dropout_every_n_epochs=0)
    return process_caption(record.caption, subset, 0, random.Random(0))


def cache_text_encoder_outputs(data: TrainingData, encode: Callable[[Any], Any], batch_size: int = 16) -> int:
    """Encode every caption the dataset and its validation images can produce once (in memory); items then carry
    the encoded text.

    `encode` maps a dict of batched token ids to the family's dict of outputs with the frozen text encoders
    (encoder_hidden_states, and for SDXL pooled), cached per caption. Whole-caption dropout
    works (the empty caption is cached too); shuffled or tag-dropped captions cannot be cached. Returns the number
    of distinct captions encoded.
    """
    tokenize = data.dataset.tokenize
    if tokenize is None:
        raise ValueError("cache_text_encoder_outputs needs the dataset built with a tokenize function")
    bad = sorted({str(r.subset.image_dir) for r in data.records if r.subset.caption_ops})
    if bad:
        raise UserError([f"{d}: shuffle_caption / caption_tag_dropout_rate change the caption each time and "
                         "cannot use cache_text_encoder_outputs" for d in bad])
    captions: set[str] = set()
    held_out = data.validation.records if data.validation is not None else []
    for record in [*data.records, *held_out]:
        captions.add(fixed_caption(record))
        if record.subset.caption_dropout_rate > 0 or record.subset.caption_dropout_every_n_epochs > 0:
            captions.add("")
    ordered = sorted(captions)
    outputs: dict[str, Any] = {}
    with torch.inference_mode():
        for start in range(0, len(ordered), batch_size):
            chunk = ordered[start:start + batch_size]
            tokens = [tokenize(c) for c in chunk]
            encoded = encode({key: torch.stack([t[key] for t in tokens]) for key in tokens[0]})
            for i, caption in enumerate(chunk):
                outputs[caption] = {key: value[i].detach().cpu().clone() for key, value in encoded.items()}
    data.dataset.text_encoder_outputs = outputs
    if data.validation is not None:
        data.validation.text_encoder_outputs = outputs
    logger.info("text encoder outputs cached for %d distinct captions", len(outputs))
    return len(outputs)
