"""The checks the transformer families (FLUX.1, Chroma, SD3, Z-Image, Qwen-Image) share: their latents come from an
8x VAE in 2x2 patches, so image sides, and bucket steps, must be multiples of 16; and kohya's T5 options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from library.config import UserError

MULTIPLE = 16  # pixels: the VAE's 8x times the 2x2 patch


@dataclass(frozen=True)
class ImageSizes:
    """The options that size the latents (a group of a family's settings; the field names are the config's)."""
    resolution: tuple[int, int]
    enable_bucket: bool
    bucket_reso_steps: int


def size_problems(sizes: ImageSizes, family: str) -> list[str]:
    """The configured resolution and bucket steps that do not fit the patches, one line each."""
    problems = []
    if any(side % MULTIPLE for side in sizes.resolution):
        problems.append(f"resolution {sizes.resolution}: {family} needs sides that are multiples of {MULTIPLE}")
    if sizes.enable_bucket and sizes.bucket_reso_steps % MULTIPLE:
        problems.append(f"bucket_reso_steps {sizes.bucket_reso_steps}: {family} needs a multiple of {MULTIPLE}")
    return problems


def check_latent_size(family: str, height: int, width: int) -> None:
    """Latents of a batch: a dataset_config subset's own resolution can get past the configured checks."""
    if height % 2 or width % 2:
        raise UserError(f"{family} needs image sides that are multiples of {MULTIPLE}; got {8 * width}x{8 * height} "
                        f"pixels: set resolution (and bucket_reso_steps) to multiples of {MULTIPLE}")


def train_t5xxl_problems(network_train_unet_only: bool, train_t5xxl: bool) -> list[str]:
    """kohya's train_t5xxl and network_train_unet_only ask for opposite things."""
    if train_t5xxl and network_train_unet_only:
        return ["network_args train_t5xxl: T5 trains with the text encoders, and network_train_unet_only trains the "
                "transformer only; drop one"]
    return []


def raise_kohya_t5_problems(problems: list[str], settings: Any, family: str) -> bool:
    """`problems` with those of the sizes and of kohya's train_t5xxl (`settings`: a FLUX.1 or SD3 family's), raised
    together if there are any; else whether T5 trains."""
    train_t5xxl = bool(settings.network_args.train_t5xxl)
    problems = [*problems, *size_problems(settings.sizes, family),
                *train_t5xxl_problems(settings.network_train_unet_only, train_t5xxl)]
    if problems:
        raise UserError(problems)
    return train_t5xxl
