"""Checks of the dataset options given in --config or on the command line (a dataset_config's datasets get the
same checks in library.data.dataset_config, which shares bucket_steps_problem), and the helper all value checks use.
"""
from __future__ import annotations

import math
from typing import Any, Mapping


def unmet(*needs: tuple[bool, str]) -> list[str]:
    """The messages of the (condition, message) pairs whose condition does not hold, in order."""
    return [message for condition, message in needs if not condition]


def bucket_steps_problem(resolution: tuple[int, int], steps: int) -> str | None:
    """Why no bucket fits, or None: bucket sides are multiples of bucket_reso_steps within the resolution's area, so
    a square bucket needs sqrt(width x height) >= bucket_reso_steps (kohya divides by a zero-sized bucket there)."""
    width, height = resolution
    if steps <= 0 or math.isqrt(width * height) >= steps:
        return None
    fitting = math.isqrt(width * height) // 8 * 8
    lower = f"lower bucket_reso_steps to {fitting} or less, " if fitting >= 8 else ""
    return (f"resolution {width}x{height} is smaller than bucket_reso_steps {steps}: bucket sides are multiples of "
            f"bucket_reso_steps within the resolution's area, so no bucket fits; {lower}raise resolution, or turn "
            "off enable_bucket")


def dataset_option_problems(v: Mapping[str, Any]) -> list[str]:
    """Dataset options. With dataset_config they are only fallbacks; library.data.dataset_config checks each
    dataset's resolved values the same way."""
    face = v["face_crop_aug_range"]
    return unmet(
        (v["prior_loss_weight"] >= 0, f"prior_loss_weight must not be negative (got {v['prior_loss_weight']})"),
        (v["vae_batch_size"] >= 1, f"vae_batch_size must be at least 1 (got {v['vae_batch_size']})"),
        (v["bucket_reso_steps"] >= 8 and v["bucket_reso_steps"] % 8 == 0,
         f"bucket_reso_steps must be a positive multiple of 8 (got {v['bucket_reso_steps']})"),
        (1 <= v["min_bucket_reso"] <= v["max_bucket_reso"],
         f"need 1 <= min_bucket_reso <= max_bucket_reso (got {v['min_bucket_reso']}, {v['max_bucket_reso']})"),
        (v["keep_tokens"] >= 0, f"keep_tokens must not be negative (got {v['keep_tokens']})"),
        (v["caption_dropout_every_n_epochs"] >= 0,
         f"caption_dropout_every_n_epochs must not be negative (got {v['caption_dropout_every_n_epochs']})"),
        *((0 <= v[name] <= 1, f"{name} must be in [0, 1] (got {v[name]})")
          for name in ("caption_dropout_rate", "caption_tag_dropout_rate")),
        (v["caption_separator"] != "", "caption_separator must not be empty"),
        (not face or (len(face) == 2 and 0 < face[0] <= face[1]),
         f"face_crop_aug_range must be two positive numbers \"low,high\" with low <= high (got {face})"),
        (v["token_warmup_min"] >= 0, f"token_warmup_min must not be negative (got {v['token_warmup_min']})"),
        (v["token_warmup_step"] >= 0, f"token_warmup_step must not be negative (got {v['token_warmup_step']})"),
        *((not v[name] or v["network_train_unet_only"],
           f"{name} needs a frozen text encoder: set network_train_unet_only")
          for name in ("cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk")))


def command_line_dataset_problems(v: Mapping[str, Any]) -> list[str]:
    """The dataset the options describe; a dataset_config's datasets are checked when it is read."""
    if v["dataset_config"] is not None:
        return []
    return _bucket_problems(v) + _cached_augmentation_problems(v)


def _bucket_problems(v: Mapping[str, Any]) -> list[str]:
    width, height = v["resolution"]
    if not v["enable_bucket"]:
        return unmet((width % 8 == 0 and height % 8 == 0,
                       f"resolution {width}x{height}: sides must be multiples of 8 (the VAE downsamples 8x)"))
    steps_problem = bucket_steps_problem((width, height), v["bucket_reso_steps"])
    return [p for p in [steps_problem] if p] + unmet(
        (v["min_bucket_reso"] <= min(width, height),
         f"min_bucket_reso {v['min_bucket_reso']} is larger than the resolution's shorter side {min(width, height)}"),
        (v["max_bucket_reso"] >= max(width, height),
         f"max_bucket_reso {v['max_bucket_reso']} is smaller than the resolution's longer side {max(width, height)}"))


def _cached_augmentation_problems(v: Mapping[str, Any]) -> list[str]:
    """Augmentations that change an image or caption each time cannot use what a cache holds."""
    caching_latents = v["cache_latents"] or v["cache_latents_to_disk"]
    return unmet(
        (not (v["color_aug"] and caching_latents),
         "color_aug changes the pixels each time and cannot use cached latents; turn off color_aug or "
         "cache_latents / cache_latents_to_disk"),
        (not (v["face_crop_aug_range"] and not v["enable_bucket"] and caching_latents),
         "face_crop_aug_range crops around the face anew each time and cannot use cached latents; turn off one"),
        (not (v["random_crop"] and caching_latents),
         "random_crop draws a new crop each time and cannot use cached latents; turn off random_crop or "
         "cache_latents / cache_latents_to_disk"),
        (not ((v["cache_text_encoder_outputs"] or v["cache_text_encoder_outputs_to_disk"])
              and (v["shuffle_caption"] or v["caption_tag_dropout_rate"] > 0 or v["token_warmup_step"] > 0)),
         "shuffle_caption, caption_tag_dropout_rate and token_warmup_step change the caption each time and "
         "cannot use cache_text_encoder_outputs; turn off one"))
