"""How the scanned images are fed: the dataset, collate, a resumable seeded bucket sampler, and building them.

Every image is decoded and every caption read once before training (library.data.scan), and every problem is
collected: the run stops with all of them listed (status 2), or, with skip_bad_images, leaves the unusable files out
and logs them. Random choices per item (flip, random crop, caption shuffle / dropout) come from generators seeded by
(seed, epoch, index), so they do not depend on worker processes, the global random stream or resuming.
"""
from __future__ import annotations

import hashlib
import logging
import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from library.config import Config, UserError
from library.core.seeds import derive_seed
from library.data.captions import process_caption
from library.data.controls import control_inputs
from library.data.dataset_config import DatasetSpec, resolve_datasets
from library.data.face_crop import face_crop, face_from_name
from library.data.images import color_augment, prepare_image, prepare_mask
from library.data.scan import ImageRecord, SubsetReport, balance_regularisation, scan_datasets
from library.data.video import FramesRule, prepare_clip

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------------ dataset

def item_rng(seed: int, purpose: str, epoch: int, index: int) -> random.Random:
    """A generator for one use of one item: the same (seed, epoch, index) always draws the same values."""
    return random.Random(derive_seed(seed, purpose, epoch, index))


class SampleKey(NamedTuple):
    """What the sampler yields for each item: the epoch is part of the key so the item's random draws follow it;
    the step the item is trained at (None outside training) drives kohya's caption token warm-up."""
    epoch: int
    index: int
    step: int | None = None


class TrainingDataset(torch.utils.data.Dataset):
    """Each image once per repeat. Items are dicts; see `collate` for the batch layout.

    `latents` (set by library.data.cache.cache_latents) replaces the pixels with the VAE posterior parameters;
    `control_latents` (set there too, for edit datasets) replaces the control images' pixels with their posterior
    means; `text_encoder_outputs` (set by cache_text_encoder_outputs) replaces token ids with hidden states.
    """

    def __init__(self, records: list[ImageRecord], samples: list[int], seed: int,
                 tokenize: Callable[[str], torch.Tensor] | None, prior_loss_weight: float):
        self.records = records
        self.samples = samples  # sample index -> record index
        self.seed = seed
        self.tokenize = tokenize
        self.tokenize_controls = False  # tokenize(caption, control pixels): the prompt reads the controls
        self.prior_loss_weight = prior_loss_weight
        self.latents: Any = None  # object with get(record_index, flipped) -> (mean, logvar)
        self.control_latents: Any = None  # object with get(control, flipped, interpolation) -> mean
        self.text_encoder_outputs: dict[str, torch.Tensor] | None = None
        self.total_steps = 0  # the run's optimizer steps, for a token warm-up given as a fraction of them

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: SampleKey | tuple[int, int] | int) -> dict[str, Any]:
        epoch, index, step = (0, key, None) if isinstance(key, int) else (*key, None)[:3]
        record_index = self.samples[index]
        record = self.records[record_index]
        subset = record.subset
        rng = item_rng(self.seed, "image", epoch, index)
        flipped = subset.flip_aug and rng.random() < 0.5
        left, top = record.crop
        resized = record.resized
        face = face_from_name(record.path) if subset.face_crop_aug_range else None
        if face is not None:
            resized, (left, top) = face_crop(record.size, record.bucket, face, subset.face_crop_aug_range,
                                             subset.random_crop, item_rng(self.seed, "face", epoch, index))
        elif subset.random_crop:
            left = rng.randint(0, record.resized[0] - record.bucket[0])
            top = rng.randint(0, record.resized[1] - record.bucket[1])
        item: dict[str, Any] = {
            "index": index, "path": str(record.path), "flipped": flipped,
            "loss_weight": self.prior_loss_weight if record.is_reg or subset.prior_reg else 1.0,
            "prior_reg": subset.prior_reg,
            "original_size": (record.size[1], record.size[0]),
            # SDXL's crop conditioning: pixels cropped from the top and the left of the resized image, as seen
            # after the flip.
            "crop_top_left": (top, resized[0] - left - record.bucket[0] if flipped else left),
            "target_size": (record.bucket[1], record.bucket[0]),
        }
        if self.latents is not None:
            item["latent_mean"], item["latent_logvar"] = self.latents.get(record_index, flipped)
        else:
            augment = None
            if subset.color_aug:
                rng = item_rng(self.seed, "color", epoch, index)
                augment = lambda image: color_augment(image, rng)  # noqa: E731 (one use, right here)
            if record.frames is not None:  # a video clip: (3, frames, height, width)
                item["pixels"] = prepare_clip(record.path, record.frames, record.size, resized, record.bucket,
                                              (left, top), flipped, subset.resize_interpolation)
            else:
                item["pixels"] = prepare_image(record.path, record.size, resized, record.bucket, (left, top),
                                               flipped, subset.resize_interpolation, augment)
        if record.controls:
            item.update(control_inputs(record.controls, subset, flipped, self.control_latents))
        # Read from the files each time, also with cached latents, so a cache never holds a stale mask.
        if subset.conditioning_data_dir is not None:  # kohya prefers these masks to the alpha channel
            item["loss_mask"] = prepare_mask(subset.conditioning_data_dir / record.path.name, record.size,
                                             resized, record.bucket, (left, top), flipped, alpha=False,
                                             interpolation=subset.resize_interpolation)
        elif subset.alpha_mask:
            item["loss_mask"] = prepare_mask(record.path, record.size, resized, record.bucket, (left, top),
                                             flipped, alpha=True, interpolation=subset.resize_interpolation)
        caption = process_caption(record.caption, subset, epoch, item_rng(self.seed, "caption", epoch, index), step,
                                  self.total_steps)
        item["caption"] = caption
        # The family's token ids, or its cached text-encoder outputs: a dict of tensors either way.
        if self.text_encoder_outputs is not None:
            item["text"] = self.text_encoder_outputs[caption]
        elif self.tokenize is not None and self.tokenize_controls and record.controls:
            pixels = item.get("control_pixels") or control_inputs(record.controls, subset, flipped,
                                                                  None)["control_pixels"]
            item["text"] = self.tokenize(caption, pixels)
        elif self.tokenize is not None:
            item["text"] = self.tokenize(caption)
        return item


_STACKED = ("pixels", "latent_mean", "latent_logvar")


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack tensors (and each tensor of the `text` dicts); per-item sizes as (B, 2) long tensors in
    (height, width) / (top, left) order. `pixels` are (B, 3, H, W) for images and (B, 3, F, H, W) for video clips
    (a batch is one or the other), in [-1, 1].

    Edit datasets add, per control index i (a batch's items share their controls' count and sizes), either
    `control_pixels[i]`: (B, 3, H_i, W_i) in [-1, 1], or, with cached latents, `control_latents[i]`: (B, C, h_i, w_i)
    VAE posterior means (the mode, as diffusers' edit pipelines encode references), before the family's scaling.
    """
    batch: dict[str, Any] = {key: torch.stack([item[key] for item in items]) for key in _STACKED if key in items[0]}
    for key in ("control_pixels", "control_latents"):
        if key in items[0]:
            batch[key] = [torch.stack([item[key][i] for item in items]) for i in range(len(items[0][key]))]
    if "text" in items[0]:
        batch["text"] = {key: torch.stack([item["text"][key] for item in items]) for key in items[0]["text"]}
    batch["loss_weight"] = torch.tensor([item["loss_weight"] for item in items], dtype=torch.float32)
    if any(item.get("prior_reg") for item in items):
        batch["prior_reg"] = torch.tensor([bool(item.get("prior_reg")) for item in items], dtype=torch.bool)
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
        self.start_step: int | None = None  # the optimizer step of start_batch, when iterated for training
        self.batches_per_step = 1  # gradient accumulation: each process's batches per optimizer step

    def set_epoch(self, epoch: int, start_batch: int | None = None, start_step: int | None = None) -> None:
        """Iterate epoch `epoch` from batch `start_batch` (counted over all processes: per-process batches done x
        num_processes), whose optimizer step is `start_step`. Without start_batch the start is kept when the epoch
        is unchanged (accelerate's DataLoaderShard calls set_epoch(epoch) again when iteration begins), else reset
        to 0; the same for start_step (reset to None)."""
        same = epoch == self.epoch
        if start_batch is None:
            start_batch = self.start_batch if same else 0
        if start_step is None:
            start_step = self.start_step if same else None
        if not 0 <= start_batch <= self.num_batches:
            raise ValueError(f"start_batch {start_batch} outside the epoch's {self.num_batches} batches")
        self.epoch, self.start_batch, self.start_step = epoch, start_batch, start_step

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
        epoch, start_step, per_step = self.epoch, self.start_step, self.num_processes * self.batches_per_step
        for k, batch in enumerate(self.batches(epoch)[self.start_batch:]):
            # Batches are dealt round-robin: the k-th from here is its process's (k // num_processes)-th.
            step = None if start_step is None else start_step + k // per_step
            yield [SampleKey(epoch, i, step) for i in batch]

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

    def set_tokenizer(self, tokenize: Callable[..., Any], with_controls: bool = False) -> None:
        """`with_controls`: the tokenizer is called as tokenize(caption, control pixels) for items with controls."""
        for dataset in (self.dataset, self.validation):
            if dataset is not None:
                dataset.tokenize, dataset.tokenize_controls = tokenize, with_controls

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
    def has_prior_reg(self) -> bool:
        """Whether any sample is trained towards the base model's own prediction (a prior_reg subset)."""
        return any(r.subset.prior_reg for r in self.records)

    @property
    def num_unique_images(self) -> int:
        return sum(1 for r in self.records if not r.is_reg)

    @property
    def batches_per_epoch(self) -> int:
        """Over all processes (each process gets batches_per_epoch / num_processes)."""
        return self.sampler.num_batches

    def dataloader(self, num_workers: int = 0, persistent_workers: bool = False,
                   batches_per_step: int = 1) -> torch.utils.data.DataLoader:
        self.sampler.batches_per_step = batches_per_step
        return torch.utils.data.DataLoader(self.dataset, batch_sampler=self.sampler, collate_fn=collate,
                                           num_workers=num_workers,
                                           persistent_workers=persistent_workers and num_workers > 0)

    def bucket_histogram(self) -> list[tuple[int, tuple[int, ...], int, int]]:
        """(dataset index, bucket (w, h), or (w, h, frames) for video clips, samples per epoch, images or clips),
        sorted."""
        samples: Counter = Counter()
        images: Counter = Counter()
        for r in self.records:
            if r.repeats:
                samples[(r.dataset_index, r.bucket_key)] += r.repeats
                images[(r.dataset_index, r.bucket_key)] += 1
        return [(d, b, samples[(d, b)], images[(d, b)]) for d, b in sorted(samples)]

    def drop_records(self, paths: set[Path], reasons: Sequence[str]) -> None:
        """Leave images out after the build (e.g. NaN latents under skip_bad_images); rebuilds the sampler."""
        self.records[:] = [r for r in self.records if r.path not in paths]
        self.left_out.extend(reasons)
        dataset, sampler = _assemble(self.specs, self.records, self.seed, self.num_processes,
                                     self.dataset.tokenize, self.dataset.prior_loss_weight)
        dataset.latents, dataset.text_encoder_outputs = self.dataset.latents, self.dataset.text_encoder_outputs
        dataset.control_latents = self.dataset.control_latents
        dataset.tokenize_controls = self.dataset.tokenize_controls
        self.dataset, self.sampler = dataset, sampler
        if not self.sampler.num_batches:
            raise UserError(["the dataset has no usable images left"] + list(reasons))

    def fingerprint(self) -> str:
        """Hash of what the sampler and items depend on (images, sizes, buckets, repeats, captions, batch sizes):
        a resumed run can compare it to tell whether the data path will be the same."""
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr([(s.batch_size, s.resolution) for s in self.specs]).encode())
        for r in self.records:
            entry: tuple = (str(r.path), r.size, r.bucket, r.resized, r.repeats, r.is_reg, r.caption, r.subset)
            if r.controls:  # only here, so a dataset without control images keeps its fingerprint
                entry += (r.controls, r.subset.no_resize_control, r.subset.control_resolution)
            if r.frames is not None:  # the same for video clips
                entry += (r.frames,)
            if r.subset.prior_reg:  # and for the base's own targets
                entry += ("prior_reg",)
            digest.update(repr(entry).encode())
        return digest.hexdigest()


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
    # A batch's items share their bucket and their controls' count and sizes, so controls stack too.
    # Video clips also share their frame count, and never share a batch with images.
    groups: dict[tuple[int, tuple[int, ...], tuple[tuple[int, int], ...]], list[int]] = {}
    for record_index, r in enumerate(records):
        members = groups.setdefault((r.dataset_index, r.bucket_key, tuple(c.target for c in r.controls)), [])
        for _ in range(r.repeats):
            members.append(len(samples))
            samples.append(record_index)
    dataset = TrainingDataset(records, samples, seed, tokenize, prior_loss_weight)
    sampler = BucketBatchSampler([(specs[key[0]].batch_size, groups[key]) for key in sorted(groups)], seed,
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
    """(training records, validation records): a seeded share of the training images (never regularisation, nor
    the base's own targets of prior_reg)."""
    candidates = [i for i, r in enumerate(records) if not r.is_reg and not r.subset.prior_reg]
    held = {candidates[i] for i in split_validation(candidates, fraction, seed)}
    return ([r for i, r in enumerate(records) if i not in held],
            [r for i, r in enumerate(records) if i in held])


def collect_training_data(config: Config, tokenize: Callable[[str], torch.Tensor] | None, seed: int,
                          num_processes: int, frames_rule: FramesRule | None = None,
                          ) -> tuple[TrainingData | None, list[str], list[str]]:
    """Build what can be built; returns (data or None, problems, warnings) without raising for data problems.
    `frames_rule`: the model's family's clip lengths and rate (None: it trains images only)."""
    warnings: list[str] = []
    problems: list[str] = []
    specs = resolve_datasets(config, warnings, problems)
    scan = scan_datasets(specs, frames_rule=frames_rule)
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
                        num_processes: int = 1, frames_rule: FramesRule | None = None) -> TrainingData:
    """Resolve the datasets, read and check every image and caption, assign buckets, build dataset and sampler.

    Raises UserError listing every problem (ConfigError for dataset TOML mistakes) unless skip_bad_images, which
    leaves unusable files out and logs each with its reason. An empty result is always an error.
    """
    data, problems, warnings = collect_training_data(config, tokenize, seed, num_processes, frames_rule)
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
