"""kohya's dataset fields (ss_*) for a LoRA file's metadata, counted from the built training data."""
from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from library.data.dataset import TrainingData


def kohya_dataset_fields(data: TrainingData) -> dict[str, str]:
    """ss_tag_frequency, the image and batch counts, the bucket settings, ss_dataset_dirs and ss_bucket_info, as
    sd-scripts writes them."""
    first = data.specs[0]
    dirs = {}
    for report in data.subsets:
        if report.used:
            dirs[report.spec.image_dir.name] = {"n_repeats": report.spec.num_repeats,
                                                "img_count": report.images - report.left_out}
    buckets = {str(i): {"resolution": list(b), "count": n}
               for i, (_, b, n, _) in enumerate(data.bucket_histogram())}
    tags: dict[str, Counter] = {}
    for r in data.records:
        counter = tags.setdefault(r.subset.image_dir.name, Counter())
        counter.update(t.strip().lower() for t in r.caption.split(",") if t.strip())
    return {
        "ss_tag_frequency": json.dumps({d: dict(c) for d, c in tags.items()}),
        "ss_num_train_images": str(data.num_train_images),
        "ss_num_reg_images": str(data.num_reg_images),
        "ss_num_batches_per_epoch": str(data.batches_per_epoch // data.num_processes),
        "ss_enable_bucket": str(first.enable_bucket),
        "ss_min_bucket_reso": str(first.min_bucket_reso),
        "ss_max_bucket_reso": str(first.max_bucket_reso),
        "ss_bucket_no_upscale": str(first.bucket_no_upscale),
        "ss_dataset_dirs": json.dumps(dirs),
        "ss_bucket_info": json.dumps({"buckets": buckets}),
    }
