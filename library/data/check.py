"""--dataset_check: a readable report on the dataset, made without loading the UNet."""
from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any

from library.config import Config, ConfigError
from library.data.dataset import collect_training_data
from library.data.scan import listing
from library.data.video import FramesRule

logger = logging.getLogger(__name__)


def _control_lines(data: Any, dataset_index: int) -> list[str]:
    """How a dataset's control images are fed: per target bucket, the controls' sizes (a batch shares both)."""
    paired = [r for r in data.records if r.dataset_index == dataset_index and r.controls]
    if not paired:
        return []
    shapes = Counter((r.bucket, tuple(c.target for c in r.controls)) for r in paired)
    return ([f"  control images: {sum(len(r.controls) for r in paired)} for {len(paired)} images; target bucket "
             "with the controls' sizes: images"]
            + [f"    {b[0]}x{b[1]} with {', '.join(f'{w}x{h}' for w, h in sizes)}: {n}"
               for (b, sizes), n in sorted(shapes.items())])


def _bucket(bucket: tuple[int, ...]) -> str:
    return f"{bucket[0]}x{bucket[1]}" + (f", {bucket[2]} frames" if len(bucket) > 2 else "")


def dataset_report(config: Config, tokenizer: Any = None, num_processes: int = 1,
                   frames_rule: FramesRule | None = None) -> tuple[str, bool]:
    """A readable check of the dataset without loading the UNet: (text, usable).

    Images (videos and their clips) per subset with repeats, the bucket histogram, batches and steps per epoch,
    caption coverage and every problem. With a tokenizer, caption lengths in tokens and how many are truncated.
    `frames_rule`: the model's family's clip lengths and rate (None: it trains images only).
    """
    lines: list[str] = []
    try:
        data, problems, warnings = collect_training_data(config, None, 0, num_processes, frames_rule)
    except ConfigError as e:
        return "\n".join(["dataset check: the dataset configuration is not usable:"]
                         + [f"  - {p}" for p in e.problems]), False
    assert data is not None
    source = config.dataset_config or config.train_data_dir
    lines.append(f"dataset check: {source}" + (f" (+ reg_data_dir {config.reg_data_dir})"
                                               if config.reg_data_dir else ""))
    for d, spec in enumerate(data.specs):
        bucketing = (f"buckets {spec.min_bucket_reso}..{spec.max_bucket_reso} step {spec.bucket_reso_steps}"
                     + (", no upscale" if spec.bucket_no_upscale else "")) if spec.enable_bucket else "no buckets"
        lines.append(f"dataset {d}: resolution {spec.resolution[0]}x{spec.resolution[1]}, batch size "
                     f"{spec.batch_size}, {bucketing}")
        for report in (r for r in data.subsets if r.dataset_index == d):
            spec_s = report.spec
            kind = ("reg " if spec_s.is_reg else "") + ("prior_reg " if spec_s.prior_reg else "")
            usable = report.images - report.left_out
            source = spec_s.video_jsonl_file or spec_s.image_dir
            if not report.used:
                lines.append(f"  {kind}subset {report.subset_index}: {source}: not used")
                continue
            per_epoch = sum(r.repeats for r in data.records if r.subset is spec_s)
            if spec_s.is_video:
                lines.append(f"  {kind}subset {report.subset_index}: {source}: {usable} videos and images"
                             + (f" ({report.left_out} left out)" if report.left_out else "")
                             + f" -> {report.clips} clips ({spec_s.frame_extraction}, target_frames "
                             f"{list(spec_s.target_frames)}) x {spec_s.num_repeats} repeats -> {per_epoch} samples "
                             f"per epoch; captions: {report.captions_from_file} from files or the JSONL")
                continue
            lines.append(f"  {kind}subset {report.subset_index}: {spec_s.image_dir}: {usable} images"
                         + (f" ({report.left_out} left out)" if report.left_out else "")
                         + f" x {spec_s.num_repeats} repeats -> {per_epoch} samples per epoch; captions: "
                         f"{report.captions_from_file} from files, {usable - report.captions_from_file} class tokens")
        histogram = [h for h in data.bucket_histogram() if h[0] == d]
        if histogram:
            lines.append("  buckets (width x height[, frames]: samples per epoch / images or clips):")
            lines.extend(f"    {_bucket(b)}: {n} / {m}" for _, b, n, m in histogram)
        lines.extend(_control_lines(data, d))
    batches = data.batches_per_epoch // num_processes
    steps = math.ceil(batches / config.gradient_accumulation_steps) if batches else 0
    lines.append(f"per epoch: {data.num_train_images} training samples, "
                 f"{sum(r.repeats for r in data.records if r.is_reg)} regularisation samples; {batches} batches "
                 f"and {steps} optimizer steps per process ({num_processes} process(es), gradient_accumulation_steps "
                 f"{config.gradient_accumulation_steps})")
    from_files = sum(r.caption_from_file for r in data.records)
    total = len(data.records)
    what = "images and video clips" if any(r.frames is not None for r in data.records) else "images"
    lines.append(f"captions: {from_files} of {total} usable {what} have a caption file"
                 + (f" ({100 * from_files / total:.0f}%)" if total else ""))
    if tokenizer is not None and data.records:
        limit = config.max_token_length or tokenizer.model_max_length - 2  # kohya's 75 / 150 / 225
        texts = [" ".join(t for t in (r.subset.caption_prefix, r.caption, r.subset.caption_suffix) if t)
                 for r in data.records]
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids]
        long = [str(r.path) for r, n in zip(data.records, lengths, strict=True) if n > limit]
        lines.append(f"  longest caption {max(lengths)} tokens; {len(long)} longer than {limit} tokens are "
                     "truncated" + (f": {listing(long)}" if long else ""))
    if warnings:
        lines.append(f"warnings ({len(warnings)}):")
        lines.extend(f"  - {w}" for w in warnings)
    if data.left_out and not problems:
        lines.append(f"left out by skip_bad_images ({len(data.left_out)}):")
        lines.extend(f"  - {p}" for p in data.left_out)
    if problems:
        lines.append(f"problems ({len(problems)}):")
        lines.extend(f"  - {p}" for p in problems)
        lines.append("result: NOT USABLE" + ("" if config.skip_bad_images else
                                             " (fix these, or set skip_bad_images to leave unusable files out)"))
    else:
        lines.append("result: usable")
    return "\n".join(lines), not problems
