"""A judge for the digits base model: a classifier trained on the real digits, applied to generated images.

    python -m library.digits.judge [--model models/digits-base] [--lora FILE] [--n 100] [--seed 0] [--grids DIR]
    python -m library.digits.judge --model models/digits-flux [--lora FILE] ...
    python -m library.digits.judge --model models/digits-z-image [--lora FILE] ...

Each prompt is rendered `n` times from fixed seeds, in batches, with the base model's sampler, and each image is
classified by a support-vector machine fitted on scikit-learn's real digits (seen through the same 32x32 upscaling
the training images went through). A prompt's rate is the share of its images judged to be the digit it asks for;
for the trigger prompt that is the held-out digit. With `--lora` the same images are rendered with and without the
LoRA and both rates are shown.

The family is told from the folder by the family registry: a Z-Image model (models/digits-z-image) is rendered by
ZImagePipeline with flow-matching Euler and classifier-free guidance; a FLUX.1 model (models/digits-flux) by
FluxPipeline with flow-matching Euler and its embedded guidance (no classifier-free guidance, as FLUX.1 dev
samples); a Stable Diffusion model by StableDiffusionPipeline with classifier-free guidance.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from library import digits
from library.config import UserError
from library.families.flux.family import Flux, pack_latents
from library.families.flux.lora import to_peft
from library.families.registry import entry_for
from library.monitoring.sampling import build_scheduler

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "models" / "digits-base"
DEFAULT_STEPS = 20
DEFAULT_SCALE = 3.0  # SD: classifier-free guidance
DEFAULT_SAMPLER = "ddim"
FLUX_GUIDANCE = 3.5  # FLUX.1 dev: the embedded guidance (FluxPipeline's and kohya's default)
FLUX_SAMPLER = "euler"  # flow-matching Euler, FLUX's only sampler here
Z_IMAGE_SCALE = 4.0  # Z-Image: classifier-free guidance (musubi-tuner's sampling default, Z-Image base's)
BATCH = 100


# --------------------------------------------------------------------------------------------- the classifier


def _fit(images: np.ndarray, labels: np.ndarray) -> Any:
    from sklearn.svm import SVC

    return SVC(gamma=0.001).fit(digits.ink_features(images), labels)


@functools.lru_cache(maxsize=1)
def classifier() -> Any:
    """An SVM fitted on all 1,797 real digits (the held-out digit included: it must be recognised)."""
    images, labels = digits.load()
    return _fit(images, labels)


def judge(images: np.ndarray) -> np.ndarray:
    """(N, H, W) grey or (N, H, W, 3) RGB uint8 images, sides multiples of 8 -> (N,) judged digits."""
    images = np.asarray(images)
    if images.ndim == 4:
        images = digits.to_gray(images)
    return classifier().predict(digits.ink_features(images)).astype(np.int64)


def real_accuracy(seed: int = 0, test_share: float = 1 / 3) -> dict[int, float]:
    """The judge's accuracy per digit on real digits it was not fitted on (a seeded split)."""
    images, labels = digits.load()
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = int(len(labels) * (1 - test_share))
    fitted = _fit(images[order[:cut]], labels[order[:cut]])
    test = order[cut:]
    predicted = fitted.predict(digits.ink_features(images[test]))
    return {d: float(np.mean(predicted[labels[test] == d] == d)) for d in range(10)}


# --------------------------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class Settings:
    """How prompts are rendered for judging."""
    n: int = 100  # images per prompt
    seed: int = 0  # image i of every prompt starts from the same noise
    steps: int = DEFAULT_STEPS
    scale: float | None = None  # None: the family's default (DEFAULT_SCALE for SD, FLUX_GUIDANCE for FLUX,
    # Z_IMAGE_SCALE for Z-Image)
    sampler: str | None = None  # None: the family's default (DEFAULT_SAMPLER for SD, FLUX_SAMPLER for FLUX and
    # Z-Image)


JUDGED = {"sd": "StableDiffusionPipeline", "flux": "FluxPipeline", "z_image": "ZImagePipeline"}


def judged_family(pipe_or_folder: Any) -> str:
    """The registered family of a pipeline, or of a folder (told by the family registry): sd, flux or z_image."""
    if isinstance(pipe_or_folder, (str, Path)):
        name = entry_for(pipe_or_folder).name
    else:
        name = next((family for family, cls in JUDGED.items() if type(pipe_or_folder).__name__ == cls), "")
    if name not in JUDGED:
        raise ValueError(f"{pipe_or_folder}: the judge renders {', '.join(JUDGED)} models, not {name or 'this'}")
    return name


def is_z_image(pipe_or_folder: Any) -> bool:
    return judged_family(pipe_or_folder) == "z_image"


def is_flux(pipe_or_folder: Any) -> bool:
    return judged_family(pipe_or_folder) == "flux"


def settings_for(pipe: Any, settings: Settings) -> Settings:
    """`settings` with the family's defaults filled in; FLUX and Z-Image have one sampler."""
    flow = "FLUX" if is_flux(pipe) else "Z-Image" if is_z_image(pipe) else None
    if flow and settings.sampler not in (None, FLUX_SAMPLER):
        raise ValueError(f"{flow} renders with flow-matching {FLUX_SAMPLER!r}, not {settings.sampler!r}")
    if flow == "FLUX":
        defaults = (FLUX_GUIDANCE, FLUX_SAMPLER)
    elif flow:
        defaults = (Z_IMAGE_SCALE, FLUX_SAMPLER)
    else:
        defaults = (DEFAULT_SCALE, DEFAULT_SAMPLER)
    return dataclasses.replace(settings, scale=defaults[0] if settings.scale is None else settings.scale,
                               sampler=settings.sampler or defaults[1])


def find_model(path: Path) -> Path:
    """A model folder given on the command line: as given when it exists, else a relative path read from the
    repository root, so `--model models/digits-flux` works from any folder."""
    if path.exists() or path.is_absolute() or not (REPO_ROOT / path).exists():
        return path
    return REPO_ROOT / path


def load_pipeline(model: str | Path = DEFAULT_MODEL, lora: str | Path | None = None) -> Any:
    """The base model as a diffusers StableDiffusionPipeline, FluxPipeline or ZImagePipeline (told from the folder)
    on CPU, with a LoRA file this trainer wrote loaded if given."""
    from diffusers import FluxPipeline, StableDiffusionPipeline, ZImagePipeline
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    family = judged_family(model)
    if family == "z_image":
        pipe = ZImagePipeline.from_pretrained(model, local_files_only=True)
    elif family == "flux":
        pipe = FluxPipeline.from_pretrained(model, local_files_only=True)
    else:
        pipe = StableDiffusionPipeline.from_pretrained(model, local_files_only=True, safety_checker=None,
                                                       requires_safety_checker=False)
    if lora is not None:
        # diffusers warns when a LoRA has no text-encoder part, which is how network_train_unet_only saves it.
        verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()
        try:
            if is_flux(pipe):
                # diffusers reads kohya's FLUX single-block keys only at FLUX.1's own widths: hand it peft keys.
                from safetensors.torch import load_file

                pipe.load_lora_weights(to_peft(load_file(str(lora)), {"transformer": pipe.transformer,
                                                                      "text_encoder": pipe.text_encoder}))
            else:
                pipe.load_lora_weights(str(lora))
        finally:
            diffusers_logging.set_verbosity(verbosity)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def render(pipe: Any, prompt: str, settings: Settings = Settings()) -> np.ndarray:
    """`settings.n` images of `prompt` -> (n, H, W) grey uint8. Image i starts from noise i of `settings.seed`,
    whatever n, the batch size or the prompt."""
    settings = settings_for(pipe, settings)
    if is_flux(pipe):
        return _render_flux(pipe, prompt, settings)
    if is_z_image(pipe):
        return _render_z_image(pipe, prompt, settings)

    pipe.scheduler = build_scheduler(settings.sampler, pipe.scheduler.config)
    vae = pipe.vae
    scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    shape = (settings.n, pipe.unet.config.in_channels, digits.SIZE // scale_factor, digits.SIZE // scale_factor)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(settings.seed))
    out = []
    for start in range(0, settings.n, BATCH):
        batch = noise[start:start + BATCH]
        latents = pipe(prompt, num_images_per_prompt=len(batch), latents=batch,
                       height=digits.SIZE, width=digits.SIZE, num_inference_steps=settings.steps,
                       guidance_scale=settings.scale, output_type="latent", return_dict=False)[0]
        pixels = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
        out.append(_grey(pixels))
    return np.concatenate(out)


def _grey(pixels: torch.Tensor) -> np.ndarray:
    # The pipeline's own 0..255 rounding, then the channel mean: the images a user would save, in grey.
    rgb = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round()
    return rgb.mean(dim=1).round().to(torch.uint8).numpy()


def _render_flux(pipe: Any, prompt: str, settings: Settings) -> np.ndarray:
    """FluxPipeline with the embedded guidance, T5 read to its tokenizer's model_max_length; the noise is drawn
    unpacked ([n, 16, h, w]) and packed 2x2 as the pipeline packs its own."""

    vae = pipe.vae
    side = 2 * (digits.SIZE // (pipe.vae_scale_factor * 2))
    channels = pipe.transformer.config.in_channels // 4
    noise = torch.randn((settings.n, channels, side, side), generator=torch.Generator().manual_seed(settings.seed))
    out = []
    for start in range(0, settings.n, BATCH):
        batch = noise[start:start + BATCH]
        latents = pipe(prompt, num_images_per_prompt=len(batch), latents=pack_latents(batch), height=digits.SIZE,
                       width=digits.SIZE, num_inference_steps=settings.steps, guidance_scale=settings.scale,
                       max_sequence_length=min(512, pipe.tokenizer_2.model_max_length), output_type="latent",
                       return_dict=False)[0]
        # What the trainer's sampling decodes: unpacked, unscaled, unshifted.
        latents = Flux().vae_latents(latents, vae.config, digits.SIZE, digits.SIZE)
        out.append(_grey(vae.decode(latents, return_dict=False)[0]))
    return np.concatenate(out)


def _render_z_image(pipe: Any, prompt: str, settings: Settings) -> np.ndarray:
    """ZImagePipeline with classifier-free guidance against the empty prompt (none at scale 0); the noise is
    drawn as [n, 16, h, w], the pipeline's own latent shape."""
    vae = pipe.vae
    side = 2 * (digits.SIZE // (pipe.vae_scale_factor * 2))
    noise = torch.randn((settings.n, pipe.transformer.in_channels, side, side),
                        generator=torch.Generator().manual_seed(settings.seed))
    out = []
    for start in range(0, settings.n, BATCH):
        batch = noise[start:start + BATCH]
        latents = pipe(prompt, num_images_per_prompt=len(batch), latents=batch, height=digits.SIZE,
                       width=digits.SIZE, num_inference_steps=settings.steps, guidance_scale=settings.scale,
                       output_type="latent", return_dict=False)[0]
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        out.append(_grey(vae.decode(latents, return_dict=False)[0]))
    return np.concatenate(out)


def prompts() -> dict[str, int]:
    """Prompt -> the digit it asks for: the trigger prompt (the held-out digit) first, then every trained digit."""
    return {digits.TRIGGER_CAPTION: digits.HELD_OUT, **{digits.caption(d): d for d in digits.trained_digits()}}


def rates(pipe: Any, asked: Mapping[str, int], settings: Settings = Settings()) -> tuple[dict[str, float],
                                                                                        dict[str, np.ndarray]]:
    """(prompt -> share of its images judged the digit it asks for, prompt -> its images)."""
    images = {prompt: render(pipe, prompt, settings) for prompt in asked}
    return {prompt: float(np.mean(judge(images[prompt]) == digit)) for prompt, digit in asked.items()}, images


def grid(rows: Mapping[str, np.ndarray], columns: int = 10, zoom: int = 2) -> Any:
    """A PIL image: one row per prompt (its label at the left), the first `columns` images of each."""
    from PIL import Image, ImageDraw, ImageFont

    try:
        font = ImageFont.load_default(size=13)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        font = ImageFont.load_default()
    label_width = 130
    cell = digits.SIZE * zoom
    canvas = Image.new("L", (label_width + columns * cell, len(rows) * cell), 255)
    draw = ImageDraw.Draw(canvas)
    for r, (label, images) in enumerate(rows.items()):
        draw.text((6, r * cell + cell // 2), label, fill=0, font=font, anchor="lm")
        for c, image in enumerate(images[:columns]):
            tile = Image.fromarray(np.asarray(image, dtype=np.uint8), "L")
            tile = tile.resize((cell, cell), Image.Resampling.NEAREST)
            canvas.paste(tile, (label_width + c * cell, r * cell))
    return canvas


def table(before: Mapping[str, float], after: Mapping[str, float] | None = None,
          asked: Mapping[str, int] | None = None) -> str:
    """Rates as a text table: one row per prompt, the digit it asks for, before / after / change."""
    asked = asked or prompts()
    head = f"{'prompt':<22} {'digit':>5} {'base':>7}"
    if after is not None:
        head += f" {'LoRA':>7} {'change':>7}"
    lines = [head]
    for prompt, rate in before.items():
        line = f"{prompt:<22} {asked[prompt]:>5} {rate:>7.0%}"
        if after is not None:
            line += f" {after[prompt]:>7.0%} {100 * (after[prompt] - rate):>+6.0f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m library.digits.judge", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the base model folder")
    parser.add_argument("--lora", type=Path, help="a kohya-format LoRA file: judge the base with and without it")
    parser.add_argument("--n", type=int, default=Settings.n, help="images per prompt")
    parser.add_argument("--seed", type=int, default=Settings.seed)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--scale", type=float, help=f"SD: classifier-free guidance scale (default {DEFAULT_SCALE:g}); "
                        f"FLUX: the embedded guidance (default {FLUX_GUIDANCE:g}); Z-Image: classifier-free "
                        f"guidance scale (default {Z_IMAGE_SCALE:g})")
    parser.add_argument("--sampler", help=f"SD: a kohya sampler name (default {DEFAULT_SAMPLER}); FLUX and Z-Image: "
                        f"{FLUX_SAMPLER} only")
    parser.add_argument("--grids", type=Path, help="write base.png (and lora.png) sample grids into this folder")
    args = parser.parse_args(argv)
    args.model = find_model(args.model)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    problems = [f"{what} {path} does not exist" for path, what in ((args.model, "model folder"),
                                                                    (args.lora, "LoRA file"))
                if path is not None and not path.exists()]
    problems += [f"--{name} must be at least 1, got {getattr(args, name)}" for name in ("n", "steps")
                 if getattr(args, name) < 1]
    if problems:
        parser.exit(2, "".join(f"error: {problem}\n" for problem in problems))
    settings = Settings(args.n, args.seed, args.steps, args.scale, args.sampler)
    asked = prompts()
    try:
        base = load_pipeline(args.model)
        with_lora = load_pipeline(args.model, args.lora) if args.lora is not None else None
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        parser.exit(2, f"error: cannot load {args.model}{f' with {args.lora}' if args.lora else ''}: {error}\n")
    try:
        settings = settings_for(base, settings)
        if not is_flux(base) and not is_z_image(base):
            build_scheduler(settings.sampler, base.scheduler.config)
    except (UserError, ValueError) as error:
        parser.exit(2, f"error: {error}\n")
    before, before_images = rates(base, asked, settings)
    after = after_images = None
    if with_lora is not None:
        after, after_images = rates(with_lora, asked, settings)
    print(f"{settings.n} images per prompt, seed {settings.seed}, {settings.sampler} {settings.steps} steps, "
          f"guidance {settings.scale:g}; trigger {digits.TRIGGER_CAPTION!r} asks for the "
          f"held-out digit {digits.HELD_OUT}")
    print(table(before, after, asked))
    if args.grids is not None:
        args.grids.mkdir(parents=True, exist_ok=True)
        written = [args.grids / "base.png"]
        grid(before_images).save(written[0])
        if after_images is not None:
            written.append(args.grids / "lora.png")
            grid(after_images).save(written[1])
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
