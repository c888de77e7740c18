"""What is on disk and how it is fed: images, captions, aspect-ratio buckets, the dataset, a resumable seeded sampler.

Every image is decoded and every caption read once before training, and every problem is collected: the run stops
with all of them listed (status 2), or, with skip_bad_images, leaves the unusable files out and logs them. Random
choices per item (flip, random crop, caption shuffle / dropout) come from generators seeded by (seed, epoch, index),
so they do not depend on worker processes, the global random stream or resuming.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from library.data.captions import process_caption, read_caption
from library.config import Config, UserError
from library.data.dataset_config import DatasetSpec, SubsetSpec, resolve_datasets
from library.data.images import (FORMATS_BY_EXTENSION, IMAGE_EXTENSIONS, Bucketer, ImageProblem, center_crop, inspect_image,
                            prepare_image, prepare_mask, read_mask)
from library.core.seeds import derive_seed

logger = logging.getLogger(__name__)

_SHOWN = 5  # paths listed per warning before "... and N more"




def list_images(directory: Path) -> list[Path]:
    """Image files by extension (any case); hidden files such as macOS `._x.png` are not images."""
    return sorted(p for p in directory.iterdir()
                  if p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".") and p.is_file())


# ------------------------------------------------------------------------------------------------------ records

@dataclass
class ImageRecord:
    """One usable image of one subset."""
    path: Path
    dataset_index: int
    subset_index: int  # within its dataset
    subset: SubsetSpec
    caption: str  # before per-use processing; the class tokens when there is no caption file
    caption_from_file: bool
    size: tuple[int, int]  # original (width, height), upright
    bucket: tuple[int, int]
    resized: tuple[int, int]
    repeats: int  # per epoch; for regularisation images after balancing against the training images
    is_reg: bool
    alpha: bool = False

    @property
    def crop(self) -> tuple[int, int]:
        return center_crop(self.resized, self.bucket)

    @property
    def upscaled(self) -> bool:
        return self.resized[0] > self.size[0] or self.resized[1] > self.size[1]


@dataclass
class SubsetReport:
    dataset_index: int
    subset_index: int
    spec: SubsetSpec
    images: int = 0
    captions_from_file: int = 0
    left_out: int = 0
    used: bool = True


@dataclass
class Scan:
    records: list[ImageRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    subsets: list[SubsetReport] = field(default_factory=list)


def listing(paths: Sequence[Any]) -> str:
    shown = ", ".join(str(p) for p in paths[:_SHOWN])
    return shown + (f" ... and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else "")


def _check_image(path: Path, subset: SubsetSpec,
                 bucketer: Bucketer) -> tuple[dict[str, Any] | None, list[str], list[str]]:
    """(record fields or None, problems, notes) for one image file; runs in a worker thread."""
    problems: list[str] = []
    notes: list[str] = []
    facts = None
    try:
        facts = inspect_image(path)
    except ImageProblem as e:
        problems.append(f"{path}: {e}")
    caption = read_caption(path, subset.caption_extension)
    if caption.problem:
        problems.append(caption.problem)
    elif caption.text is None and subset.class_tokens is None:
        problems.append(f"{path}: no caption file ({subset.caption_extension}"
                        f"{', .txt' if subset.caption_extension != '.txt' else ''}) and the subset has no class "
                        "tokens; it would train with an empty caption")
    if facts is None or problems:
        return None, problems, notes
    if subset.conditioning_data_dir is not None:
        mask_path = subset.conditioning_data_dir / path.name
        try:
            mask_size = read_mask(mask_path, alpha=False).size if mask_path.is_file() else None
        except ImageProblem as e:
            return None, [f"{mask_path}: {e}"], notes
        if mask_size is None:
            return None, [f"{path}: no mask {mask_path} (masked_loss reads the mask with the image's file name "
                          "from conditioning_data_dir)"], notes
        if mask_size != facts.size:
            return None, [f"{mask_path}: the mask is {mask_size[0]}x{mask_size[1]}, its image "
                          f"{facts.size[0]}x{facts.size[1]}; they must be the same size"], notes
    expected = FORMATS_BY_EXTENSION.get(path.suffix.lower(), ())
    if facts.format not in expected:
        notes.append(f"wrong-extension:{path} is {facts.format} data with a {path.suffix} extension; decoded as "
                     f"{facts.format}")
    placement = bucketer.place(*facts.size)
    if placement.problem:
        return None, [f"{path}: {placement.problem}"], notes
    fields_ = {"path": path, "caption": caption.text if caption.text is not None else subset.class_tokens,
               "caption_from_file": caption.text is not None, "size": facts.size, "bucket": placement.bucket,
               "resized": placement.resized, "alpha": facts.alpha}
    return fields_, problems, notes


def scan_datasets(specs: Sequence[DatasetSpec], threads: int | None = None) -> Scan:
    """Read every image and caption of every subset; collect usable records, problems and warnings."""
    scan = Scan()
    jobs: list[tuple[SubsetReport, Path, Bucketer]] = []
    for d, spec in enumerate(specs):
        bucketer = Bucketer(spec)
        seen: set[Path] = set()
        for s, subset in enumerate(spec.subsets):
            report = SubsetReport(d, s, subset)
            scan.subsets.append(report)
            directory = subset.image_dir
            if directory.resolve() in seen:
                scan.warnings.append(f"{directory}: the same folder is already a subset of dataset {d}; "
                                     "this one is ignored (kohya does the same)")
                report.used = False
                continue
            seen.add(directory.resolve())
            if subset.num_repeats == 0:
                scan.warnings.append(f"{directory}: num_repeats is 0; the subset is not used")
                report.used = False
                continue
            if not directory.exists():
                scan.problems.append(f"{directory}: image folder not found")
                report.used = False
                continue
            if not directory.is_dir():
                scan.problems.append(f"{directory}: not a folder")
                report.used = False
                continue
            images = list_images(directory)
            if not images:
                scan.problems.append(f"{directory}: no images (extensions {', '.join(IMAGE_EXTENSIONS)})")
                report.used = False
                continue
            report.images = len(images)
            jobs.extend((report, path, bucketer) for path in images)

    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda job: _check_image(job[1], job[0].spec, job[2]), jobs))

    notes: dict[str, list[str]] = {}
    class_token_users: dict[int, list[Path]] = {}
    for (report, path, _), (fields_, problems, image_notes) in zip(jobs, results):
        scan.problems.extend(problems)
        for note in image_notes:
            kind, text = note.split(":", 1)
            notes.setdefault(kind, []).append(text)
        if fields_ is None:
            report.left_out += 1
            continue
        record = ImageRecord(dataset_index=report.dataset_index, subset_index=report.subset_index,
                             subset=report.spec, repeats=report.spec.num_repeats, is_reg=report.spec.is_reg,
                             **fields_)
        scan.records.append(record)
        if record.caption_from_file:
            report.captions_from_file += 1
        else:
            class_token_users.setdefault(id(report), []).append(path)
        if record.upscaled:
            notes.setdefault("upscaled", []).append(
                f"{path} ({record.size[0]}x{record.size[1]} -> bucket {record.bucket[0]}x{record.bucket[1]})")
        if record.alpha:
            notes.setdefault("alpha", []).append(str(path))

    for report in scan.subsets:
        users = class_token_users.get(id(report), [])
        if users:
            scan.warnings.append(
                f"{report.spec.image_dir}: {len(users)} of {report.images} images have no caption file "
                f"({report.spec.caption_extension}); they use the class tokens {report.spec.class_tokens!r}: "
                + listing(users))
    if "wrong-extension" in notes:
        scan.warnings.append(f"{len(notes['wrong-extension'])} images have an extension that does not match "
                             "their content (decoded by content): " + listing(notes["wrong-extension"]))
    if "upscaled" in notes:
        scan.warnings.append(f"{len(notes['upscaled'])} images are smaller than their bucket and are enlarged "
                             "(set bucket_no_upscale to keep them small): " + listing(notes["upscaled"]))
    if "alpha" in notes:
        scan.warnings.append(f"{len(notes['alpha'])} images have transparency; it is composited on white: "
                             + listing(notes["alpha"]))
    return scan


def balance_regularisation(records: list[ImageRecord]) -> None:
    """kohya: regularisation images are repeated (round-robin) until they match the training images per epoch;
    when there are more, the ones past that count are not used."""
    num_train = sum(r.repeats for r in records if not r.is_reg)
    reg = [r for r in records if r.is_reg]
    for r in reg:
        r.repeats = 0
    if not reg:
        return
    total, first_pass = 0, True
    while total < num_train:
        for r in reg:
            added = r.subset.num_repeats if first_pass else 1
            r.repeats += added
            total += added
            if total >= num_train:
                break
        first_pass = False


# ------------------------------------------------------------------------------------------------------ dataset

def item_rng(seed: int, purpose: str, epoch: int, index: int) -> random.Random:
    """A generator for one use of one item: the same (seed, epoch, index) always draws the same values."""
    return random.Random(derive_seed(seed, purpose, epoch, index))


class SampleKey(NamedTuple):
    """What the sampler yields for each item: the epoch is part of the key so the item's random draws follow it."""
    epoch: int
    index: int


class TrainingDataset(torch.utils.data.Dataset):
    """Each image once per repeat. Items are dicts; see `collate` for the batch layout.

    `latents` (set by library.data.cache.cache_latents) replaces the pixels with the VAE posterior parameters;
    `text_encoder_outputs` (set by cache_text_encoder_outputs) replaces token ids with hidden states.
    """

    def __init__(self, records: list[ImageRecord], samples: list[int], seed: int,
                 tokenize: Callable[[str], torch.Tensor] | None, prior_loss_weight: float):
        self.records = records
        self.samples = samples  # sample index -> record index
        self.seed = seed
        self.tokenize = tokenize
        self.prior_loss_weight = prior_loss_weight
        self.latents: Any = None  # object with get(record_index, flipped) -> (mean, logvar)
        self.text_encoder_outputs: dict[str, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: SampleKey | tuple[int, int] | int) -> dict[str, Any]:
        epoch, index = (0, key) if isinstance(key, int) else key
        record_index = self.samples[index]
        record = self.records[record_index]
        subset = record.subset
        rng = item_rng(self.seed, "image", epoch, index)
        flipped = subset.flip_aug and rng.random() < 0.5
        left, top = record.crop
        if subset.random_crop:
            left = rng.randint(0, record.resized[0] - record.bucket[0])
            top = rng.randint(0, record.resized[1] - record.bucket[1])
        item: dict[str, Any] = {
            "index": index, "path": str(record.path), "flipped": flipped,
            "loss_weight": self.prior_loss_weight if record.is_reg else 1.0,
            "original_size": (record.size[1], record.size[0]),
            # SDXL's crop conditioning: pixels cropped from the top and the left of the resized image, as seen
            # after the flip.
            "crop_top_left": (top, record.resized[0] - left - record.bucket[0] if flipped else left),
            "target_size": (record.bucket[1], record.bucket[0]),
        }
        if self.latents is not None:
            item["latent_mean"], item["latent_logvar"] = self.latents.get(record_index, flipped)
        else:
            item["pixels"] = prepare_image(record.path, record.size, record.resized, record.bucket, (left, top),
                                           flipped)
        # Read from the files each time, also with cached latents, so a cache never holds a stale mask.
        if subset.conditioning_data_dir is not None:  # kohya prefers these masks to the alpha channel
            item["loss_mask"] = prepare_mask(subset.conditioning_data_dir / record.path.name, record.size,
                                             record.resized, record.bucket, (left, top), flipped, alpha=False)
        elif subset.alpha_mask:
            item["loss_mask"] = prepare_mask(record.path, record.size, record.resized, record.bucket, (left, top),
                                             flipped, alpha=True)
        caption = process_caption(record.caption, subset, epoch, item_rng(self.seed, "caption", epoch, index))
        item["caption"] = caption
        # Tensors for SD1.x/SD2.x; dicts for SDXL (input_ids + input_ids_2, encoder_hidden_states + pooled).
        if self.text_encoder_outputs is not None:
            cached = self.text_encoder_outputs[caption]
            item.update(cached if isinstance(cached, dict) else {"encoder_hidden_states": cached})
        elif self.tokenize is not None:
            tokens = self.tokenize(caption)
            item.update(tokens if isinstance(tokens, dict) else {"input_ids": tokens})
        return item


_STACKED = ("pixels", "latent_mean", "latent_logvar", "input_ids", "input_ids_2", "encoder_hidden_states", "pooled")


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack tensors; per-item sizes as (B, 2) long tensors in (height, width) / (top, left) order."""
    batch: dict[str, Any] = {key: torch.stack([item[key] for item in items]) for key in _STACKED if key in items[0]}
    batch["loss_weight"] = torch.tensor([item["loss_weight"] for item in items], dtype=torch.float32)
    if any("loss_mask" in item for item in items):
        # (B, 1, H, W); as in kohya, an image of a subset without masks counts everywhere.
        batch["loss_mask"] = torch.stack([item.get("loss_mask", torch.ones(item["target_size"]))
                                          for item in items]).unsqueeze(1)
    for key in ("original_size", "crop_top_left", "target_size"):
        batch[key] = torch.tensor([item[key] for item in items], dtype=torch.long)
    batch["flipped"] = torch.tensor([item["flipped"] for item in items], dtype=torch.bool)
    batch["index"] = torch.tensor([item["index"] for item in items], dtype=torch.long)
    batch["caption"] = [item["caption"] for item in items]
    batch["path"] = [item["path"] for item in items]
    return batch


# ------------------------------------------------------------------------------------------------------ sampler

class BucketBatchSampler(torch.utils.data.Sampler):
    """Batches drawn from one bucket each; the order of epoch e depends only on (seed, e).

    Within each bucket the samples are shuffled and cut into batches (the last one may be short), then all batches
    are shuffled together, as kohya does. The epoch is padded with its own first batches to a multiple of
    `num_processes`, so that accelerate's BatchSamplerShard never has to pad (which would make a resumed epoch
    differ). There is deliberately no `batch_size` attribute: batches differ in size, and BatchSamplerShard then
    passes whole batches through.
    """

    def __init__(self, groups: Sequence[tuple[int, Sequence[int]]], seed: int, num_processes: int = 1):
        self.groups = [(batch_size, tuple(members)) for batch_size, members in groups if members]
        self.seed = seed
        self.num_processes = num_processes
        unpadded = sum(math.ceil(len(m) / b) for b, m in self.groups)
        self.num_batches = math.ceil(unpadded / num_processes) * num_processes
        self.epoch = 0
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int | None = None) -> None:
        """Iterate epoch `epoch` from batch `start_batch` (counted over all processes: per-process batches done x
        num_processes). Without start_batch the start is kept when the epoch is unchanged (accelerate's
        DataLoaderShard calls set_epoch(epoch) again when iteration begins), else reset to 0."""
        if start_batch is None:
            start_batch = self.start_batch if epoch == self.epoch else 0
        if not 0 <= start_batch <= self.num_batches:
            raise ValueError(f"start_batch {start_batch} outside the epoch's {self.num_batches} batches")
        self.epoch, self.start_batch = epoch, start_batch

    def batches(self, epoch: int) -> list[list[int]]:
        """Every batch of the epoch as sample indices."""
        rng = random.Random(derive_seed(self.seed, "batches", epoch))
        batches: list[list[int]] = []
        for batch_size, members in self.groups:
            order = list(members)
            rng.shuffle(order)
            batches.extend(order[i:i + batch_size] for i in range(0, len(order), batch_size))
        rng.shuffle(batches)
        unpadded = len(batches)
        for i in range(self.num_batches - unpadded):
            batches.append(list(batches[i % unpadded]))
        return batches

    def __iter__(self) -> Iterator[list[SampleKey]]:
        epoch = self.epoch
        for batch in self.batches(epoch)[self.start_batch:]:
            yield [SampleKey(epoch, i) for i in batch]

    def __len__(self) -> int:
        return self.num_batches - self.start_batch


# -------------------------------------------------------------------------------------------------- assembling

@dataclass
class TrainingData:
    """Everything the trainer needs from the data side; built by build_training_data."""
    specs: list[DatasetSpec]
    records: list[ImageRecord]
    dataset: TrainingDataset
    sampler: BucketBatchSampler
    seed: int
    num_processes: int
    warnings: list[str]
    left_out: list[str]  # "path: reason" of files left out under skip_bad_images
    subsets: list[SubsetReport]
    validation: TrainingDataset | None = None  # held-out images (validation_split), each once

    def set_tokenizer(self, tokenize: Callable[[str], torch.Tensor]) -> None:
        for dataset in (self.dataset, self.validation):
            if dataset is not None:
                dataset.tokenize = tokenize

    collate_fn = staticmethod(collate)

    @property
    def num_train_images(self) -> int:
        """Training images x repeats (kohya's ss_num_train_images)."""
        return sum(r.subset.num_repeats for r in self.records if not r.is_reg)

    @property
    def num_reg_images(self) -> int:
        """Regularisation images x their folder repeats, before balancing (kohya's ss_num_reg_images)."""
        return sum(r.subset.num_repeats for r in self.records if r.is_reg)

    @property
    def num_unique_images(self) -> int:
        return sum(1 for r in self.records if not r.is_reg)

    @property
    def batches_per_epoch(self) -> int:
        """Over all processes (each process gets batches_per_epoch / num_processes)."""
        return self.sampler.num_batches

    def dataloader(self, num_workers: int = 0, persistent_workers: bool = False) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.dataset, batch_sampler=self.sampler, collate_fn=collate,
                                           num_workers=num_workers,
                                           persistent_workers=persistent_workers and num_workers > 0)

    def bucket_histogram(self) -> list[tuple[int, tuple[int, int], int, int]]:
        """(dataset index, bucket (w, h), samples per epoch, images), sorted."""
        samples: Counter = Counter()
        images: Counter = Counter()
        for r in self.records:
            if r.repeats:
                samples[(r.dataset_index, r.bucket)] += r.repeats
                images[(r.dataset_index, r.bucket)] += 1
        return [(d, b, samples[(d, b)], images[(d, b)]) for d, b in sorted(samples)]

    def drop_records(self, paths: set[Path], reasons: Sequence[str]) -> None:
        """Leave images out after the build (e.g. NaN latents under skip_bad_images); rebuilds the sampler."""
        self.records[:] = [r for r in self.records if r.path not in paths]
        self.left_out.extend(reasons)
        dataset, sampler = _assemble(self.specs, self.records, self.seed, self.num_processes,
                                     self.dataset.tokenize, self.dataset.prior_loss_weight)
        dataset.latents, dataset.text_encoder_outputs = self.dataset.latents, self.dataset.text_encoder_outputs
        self.dataset, self.sampler = dataset, sampler
        if not self.sampler.num_batches:
            raise UserError(["the dataset has no usable images left"] + list(reasons))

    def fingerprint(self) -> str:
        """Hash of what the sampler and items depend on (images, sizes, buckets, repeats, captions, batch sizes):
        a resumed run can compare it to tell whether the data path will be the same."""
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr([(s.batch_size, s.resolution) for s in self.specs]).encode())
        for r in self.records:
            digest.update(repr((str(r.path), r.size, r.bucket, r.resized, r.repeats, r.is_reg, r.caption,
                                r.subset)).encode())
        return digest.hexdigest()

    def kohya_metadata(self) -> dict[str, str]:
        """kohya's dataset fields for the LoRA file's ss_* metadata."""
        import json

        first = self.specs[0]
        dirs = {}
        for report in self.subsets:
            if report.used:
                dirs[report.spec.image_dir.name] = {"n_repeats": report.spec.num_repeats,
                                                    "img_count": report.images - report.left_out}
        buckets = {str(i): {"resolution": list(b), "count": n}
                   for i, (_, b, n, _) in enumerate(self.bucket_histogram())}
        tags: dict[str, Counter] = {}
        for r in self.records:
            counter = tags.setdefault(r.subset.image_dir.name, Counter())
            counter.update(t.strip().lower() for t in r.caption.split(",") if t.strip())
        return {
            "ss_tag_frequency": json.dumps({d: dict(c) for d, c in tags.items()}),
            "ss_num_train_images": str(self.num_train_images),
            "ss_num_reg_images": str(self.num_reg_images),
            "ss_num_batches_per_epoch": str(self.batches_per_epoch // self.num_processes),
            "ss_enable_bucket": str(first.enable_bucket),
            "ss_min_bucket_reso": str(first.min_bucket_reso),
            "ss_max_bucket_reso": str(first.max_bucket_reso),
            "ss_bucket_no_upscale": str(first.bucket_no_upscale),
            "ss_dataset_dirs": json.dumps(dirs),
            "ss_bucket_info": json.dumps({"buckets": buckets}),
        }


def _assemble(specs: Sequence[DatasetSpec], records: list[ImageRecord], seed: int, num_processes: int,
              tokenize: Callable[[str], torch.Tensor] | None,
              prior_loss_weight: float) -> tuple[TrainingDataset, BucketBatchSampler]:
    for d in range(len(specs)):
        in_dataset = [r for r in records if r.dataset_index == d]
        for r in in_dataset:
            if not r.is_reg:
                r.repeats = r.subset.num_repeats
        balance_regularisation(in_dataset)
    samples: list[int] = []
    groups: dict[tuple[int, tuple[int, int]], list[int]] = {}
    for record_index, r in enumerate(records):
        members = groups.setdefault((r.dataset_index, r.bucket), [])
        for _ in range(r.repeats):
            members.append(len(samples))
            samples.append(record_index)
    dataset = TrainingDataset(records, samples, seed, tokenize, prior_loss_weight)
    sampler = BucketBatchSampler([(specs[d].batch_size, groups[(d, b)]) for d, b in sorted(groups)], seed,
                                 num_processes)
    return dataset, sampler


def split_validation(candidates: Sequence[Any], fraction: float, seed: int) -> set[int]:
    """Indices of the candidates held out: round(fraction * n), at least one, never all of them."""
    n = len(candidates)
    if fraction <= 0 or n < 2:
        return set()
    count = min(max(1, round(fraction * n)), n - 1)
    return set(random.Random(derive_seed(seed, "validation-split")).sample(range(n), count))


def _hold_out(records: list[ImageRecord], fraction: float,
              seed: int) -> tuple[list[ImageRecord], list[ImageRecord]]:
    """(training records, validation records): a seeded share of the training images (never regularisation)."""
    candidates = [i for i, r in enumerate(records) if not r.is_reg]
    held = {candidates[i] for i in split_validation(candidates, fraction, seed)}
    return ([r for i, r in enumerate(records) if i not in held],
            [r for i, r in enumerate(records) if i in held])


def collect_training_data(config: Config, tokenize: Callable[[str], torch.Tensor] | None, seed: int,
             num_processes: int) -> tuple[TrainingData | None, list[str], list[str]]:
    """Build what can be built; returns (data or None, problems, warnings) without raising for data problems."""
    warnings: list[str] = []
    problems: list[str] = []
    specs = resolve_datasets(config, warnings, problems)
    scan = scan_datasets(specs)
    problems += scan.problems
    warnings += scan.warnings
    records = scan.records
    skip = config.skip_bad_images
    left_out = list(problems) if skip else []
    records, held_out = _hold_out(records, config.validation_split,
                                  seed if config.validation_seed is None else config.validation_seed)
    dataset, sampler = _assemble(specs, records, seed, num_processes, tokenize, config.prior_loss_weight)
    data = TrainingData(specs, records, dataset, sampler, seed, num_processes, warnings, left_out, scan.subsets)
    if held_out:
        data.validation = TrainingDataset(held_out, list(range(len(held_out))), seed, tokenize, 1.0)
    if sampler.num_batches == 0 and (skip or not problems):
        has_train = any(not r.is_reg for r in records)
        problems.append("the dataset yields no batches: " + (
            "every usable image is a regularisation image" if records and not has_train
            else "no usable images" + (" are left after leaving out the unusable ones" if left_out else "")))
        return data, problems, warnings
    return data, ([] if skip else problems), warnings


def build_training_data(config: Config, tokenize: Callable[[str], torch.Tensor] | None, seed: int,
                        num_processes: int = 1) -> TrainingData:
    """Resolve the datasets, read and check every image and caption, assign buckets, build dataset and sampler.

    Raises UserError listing every problem (ConfigError for dataset TOML mistakes) unless skip_bad_images, which
    leaves unusable files out and logs each with its reason. An empty result is always an error.
    """
    data, problems, warnings = collect_training_data(config, tokenize, seed, num_processes)
    for warning in warnings:
        logger.warning(warning)
    if problems:
        raise UserError(problems)
    assert data is not None
    if data.left_out:
        logger.warning("skip_bad_images: %d unusable files or folders are left out:\n  %s", len(data.left_out),
                       "\n  ".join(data.left_out))
    logger.info("%d training images (%d with repeats), %d regularisation images with repeats; %d batches per "
                "epoch over %d process(es)", data.num_unique_images, data.num_train_images, data.num_reg_images,
                data.batches_per_epoch, num_processes)
    if data.validation is not None:
        logger.info("%d images held out for validation", len(data.validation))
    elif config.validation_split > 0:
        logger.warning("validation_split: too few training images to hold any out; no validation")
    return data
