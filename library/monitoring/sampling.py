"""Sample images and videos during training: samplers by kohya name and a sampling round (the prompt files are read
by library.monitoring.sample_prompts).

A round renders each prompt with the family's diffusers pipeline built around the trainer's own modules (LoRA
attached), writes `<output_dir>/sample/<output_name>_<step or e<epoch>>_<index>_<seed>.png` (for an edit model's
prompt with control images, musubi's --ci, those images left of the result in the one PNG; for a video family's
prompt of more than one frame, musubi's --f, an animated lossless `.webp` of the clip at the family's frame rate),
and leaves the training state exactly as it found it: train/eval flags, grad mode, autocast and every global
random stream.
"""
from __future__ import annotations

import gc
import hashlib
import logging
import os
import random
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from library.config import UserError
from library.config.samplers import SAMPLERS, canonical_sampler
from library.core.atomic import write_atomically
from library.monitoring.sample_prompts import SamplePrompt

logger = logging.getLogger(__name__)

IMAGE_DESCRIPTION = 0x010E  # the EXIF tag a clip's "parameters" text goes in
@dataclass(frozen=True)
class SamplingModels:
    """The modules a round samples with (unwrapped, already on their device), the training noise schedule, and the
    model family, which builds the pipeline (`family.pipeline(...)`) and turns encoded prompts into its arguments
    (`family.prompt_embeds(positive, negative)`)."""
    denoiser: torch.nn.Module
    text_encoders: Sequence[torch.nn.Module]
    vae: torch.nn.Module
    tokenizers: Sequence[Any]
    scheduler_config: Mapping[str, Any]
    family: Any
    prediction_type: str | None = None  # None: the schedule's; "v_prediction" for v_parameterization
    # text -> the family's encoded prompt, as training encodes it (clip_skip, max_token_length); None: the
    # pipeline's own encoding
    encode_text: Callable[[str], Mapping[str, torch.Tensor]] | None = None

    @property
    def modules(self) -> list[torch.nn.Module]:
        return [self.denoiser, *self.text_encoders, self.vae]


class Sample(NamedTuple):
    """One image or clip a round wrote, for the trainer to log to its trackers."""
    prompt: SamplePrompt
    seed: int
    path: Path
    image: Any  # PIL.Image.Image; a clip's first frame
    frames: tuple[Any, ...] = ()  # a clip's frames (PIL images); () for an image


def build_scheduler(sampler: str, scheduler_config: Mapping[str, Any], prediction_type: str | None = None) -> Any:
    """A diffusers scheduler for a kohya sampler name, on the training noise schedule (betas, prediction type)."""
    import diffusers

    class_name, overrides = SAMPLERS[canonical_sampler(sampler)]
    if prediction_type is not None:
        overrides = {**overrides, "prediction_type": prediction_type}
    with warnings.catch_warnings():
        # diffusers announces the end of algorithm_type="dpmsolver"; kohya users ask for it by name.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"diffusers\.")
        return getattr(diffusers, class_name).from_config(dict(scheduler_config), **overrides)


def prompt_seed(prompt: SamplePrompt, base_seed: int) -> int:
    """The prompt's own seed, else one derived from (base seed, prompt index): the same image every round."""
    if prompt.seed is not None:
        return prompt.seed
    digest = hashlib.blake2b(repr(("sample", base_seed, prompt.index)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def sample_frames(prompt: SamplePrompt, family: Any) -> int | None:
    """The clip length a prompt draws: its --f (1 when it has none) for a video family, rounded down to a length
    the family takes as musubi does ((f - 1) // 4 * 4 + 1 for Wan); None for an image family (--f is ignored,
    logged)."""
    rule = getattr(family, "frames_rule", None)
    if rule is None:
        if prompt.frames is not None:
            logger.warning("sample prompt %d --f %d: %s draws images; the frame count is ignored", prompt.index,
                           prompt.frames, getattr(family, "display_name", "this model"))
        return None
    frames = rule.round_down(prompt.frames or 1)
    if frames != (prompt.frames or 1):
        logger.warning("sample prompt %d --f %d: %s draws 1 + %dn frames; drawing %d", prompt.index, prompt.frames,
                       family.display_name, rule.step, frames)
    return frames


@torch.no_grad()
def generate_image(prompt: SamplePrompt, models: SamplingModels, seed: int, sampler: str = "ddim") -> Any:
    """Render one prompt to a PIL image (with its control images on the left, for an edit model's prompt with
    --ci), or, for a video family's prompt of more than one frame (--f), to a list of PIL frames. Call inside
    `sampling_mode`; the modules must be on their device."""
    family = models.family
    frames = sample_frames(prompt, family)
    scheduler = family.sampling_scheduler(models.scheduler_config)
    if scheduler is None:
        scheduler = build_scheduler(prompt.sampler or sampler, models.scheduler_config, models.prediction_type)
    pipe = family.pipeline(models.denoiser, models.vae, models.text_encoders, models.tokenizers, scheduler)
    pipe.set_progress_bar_config(disable=True)
    # Noise drawn on CPU: the same seed gives the same starting latents on any device.
    generator = torch.Generator(device="cpu").manual_seed(seed)
    positive: Mapping[str, torch.Tensor] = {}
    if models.encode_text is not None and not family.prompt_reads_controls:
        positive, negative = models.encode_text(prompt.prompt), models.encode_text(prompt.negative_prompt)
        text = family.prompt_embeds(positive, negative)
    else:
        text = {"prompt": prompt.prompt, "negative_prompt": prompt.negative_prompt or None}
    guidance = family.sampling_guidance(sampling_scale(prompt, family), prompt.guidance, positive, prompt.width,
                                        prompt.height)
    if frames is not None:
        guidance = {**guidance, "num_frames": frames}
    controls = [_control_image(path) for path in prompt.control_images]
    if controls:
        guidance = family.sampling_controls(controls, guidance)
    latents = pipe(**text, width=prompt.width, height=prompt.height, num_inference_steps=prompt.steps,
                   generator=generator, output_type="latent", return_dict=False, **guidance)[0]
    # Decoded here rather than by the pipeline: the VAE may be fp32 beside an fp16 UNet (no_half_vae), and
    # without autocast the pipeline would feed it fp16 latents.
    vae_dtype = next(models.vae.parameters()).dtype
    vae_input = family.vae_latents(latents.to(vae_dtype), models.vae.config, prompt.width, prompt.height)
    pixels = models.vae.decode(vae_input, return_dict=False)[0]
    if pixels.ndim == 5:  # a clip: (B, C, F, H, W)
        clip = [pipe.image_processor.postprocess(pixels[:, :, f], output_type="pil")[0] for f in range(pixels.shape[2])]
        return clip if len(clip) > 1 else clip[0]
    image = pipe.image_processor.postprocess(pixels, output_type="pil")[0]
    return side_by_side([*controls, image]) if controls else image


def _control_image(path: str) -> Any:
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return ImageOps.exif_transpose(image).convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise UserError(f"sample prompt --ci {path}: cannot read the image ({e})") from None


def side_by_side(images: Sequence[Any]) -> Any:
    """One image holding `images` left to right, top-aligned on white (a sample's control images, then the
    result)."""
    from PIL import Image

    canvas = Image.new("RGB", (sum(i.width for i in images), max(i.height for i in images)), "white")
    left = 0
    for image in images:
        canvas.paste(image, (left, 0))
        left += image.width
    return canvas


@contextmanager
def sampling_mode(modules: Iterable[torch.nn.Module], device: torch.device | str = "cpu",
                  autocast_dtype: torch.dtype | None = None) -> Iterator[None]:
    """Eval mode, no grad, autocast as asked (off by default); afterwards restore every module's own training
    flag, the torch (CPU and CUDA), Python and numpy random states, and release what sampling held."""
    modules = list(modules)
    # Each submodule's flag, not just the top one: train(True) on the root would overwrite mixed flags.
    flags = [(m, m.training) for module in modules for m in module.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    python_rng, numpy_rng = random.getstate(), np.random.get_state()
    try:
        for module in modules:
            module.eval()
        # no_grad, not inference_mode: a buffer created lazily while sampling must stay usable by autograd.
        with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=autocast_dtype,
                                             enabled=autocast_dtype is not None):
            yield
    finally:
        for module, flag in flags:
            module.training = flag
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- a round


def sample_file_name(output_name: str | None, index: int, seed: int, step: int | None = None,
                     epoch: int | None = None, suffix: str = ".png") -> str:
    """`{output_name}_{step:06d}_{index:02d}_{seed}.png`, or `..._e{epoch:06d}_...` at an epoch end (kohya); a
    clip's ends in `.webp`."""
    if step is None and epoch is None:
        raise ValueError("sample_file_name needs a step or an epoch")
    when = f"e{epoch:06d}" if epoch is not None else f"{step:06d}"
    return f"{output_name + '_' if output_name else ''}{when}_{index:02d}_{seed}{suffix}"


def sampling_scale(prompt: SamplePrompt, family: Any) -> float:
    """The prompt's --l, else the family's default."""
    return family.default_sampling_scale if prompt.scale is None else prompt.scale


def _parameters(prompt: SamplePrompt, seed: int, sampler: str, scale: float, frames: int = 1) -> str:
    """AUTOMATIC1111's "parameters" text: image viewers and web UIs show how the sample was made."""
    negative = f"\nNegative prompt: {prompt.negative_prompt}" if prompt.negative_prompt else ""
    clip = f", Frames: {frames}" if frames > 1 else ""
    return (f"{prompt.prompt}{negative}\nSteps: {prompt.steps}, Sampler: {sampler}, CFG scale: {scale:g}, "
            f"Seed: {seed}, Size: {prompt.width}x{prompt.height}{clip}")


def _write_png(image: Any, path: Path, prompt: SamplePrompt, seed: int, sampler: str, scale: float) -> None:
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("parameters", _parameters(prompt, seed, sampler, scale))
    write_atomically(path, lambda tmp: image.save(tmp, format="PNG", pnginfo=info))


def write_webp_clip(frames: Sequence[Any], path: Path, fps: float, parameters: str) -> None:
    """An animated, lossless WebP of `frames` at `fps`, looping, its "parameters" text in the EXIF
    ImageDescription (where the web UI reads a sample's prompt). Lossless: decoding it gives the frames back."""
    from PIL import Image

    exif = Image.Exif()
    exif[IMAGE_DESCRIPTION] = parameters
    write_atomically(path, lambda tmp: frames[0].save(
        tmp, format="WEBP", save_all=True, append_images=list(frames[1:]), lossless=True,
        duration=round(1000 / fps), loop=0, exif=exif.tobytes()))


def sample_images(prompts: Sequence[SamplePrompt], models: SamplingModels, out_dir: str | os.PathLike,
                  output_name: str | None, *, base_seed: int, step: int | None = None, epoch: int | None = None,
                  default_sampler: str = "ddim", device: torch.device | str | None = None,
                  autocast_dtype: torch.dtype | None = None, process_index: int = 0, num_processes: int = 1,
                  gather: Callable[[list[Any]], list[Any]] | None = None) -> list[Sample]:
    """One sampling round. Prompt i is rendered by process i % num_processes; the images are gathered
    (`accelerate.utils.gather_object` unless `gather` is given) and the main process writes them atomically.

    `device` (default: the UNet's) picks the autocast that `autocast_dtype` turns on or, when None, off.
    Every process must call this. Returns what was written, in prompt order, on the main process; [] elsewhere.
    """
    if step is None and epoch is None:
        raise ValueError("sample_images needs a step or an epoch")
    default_sampler = canonical_sampler(default_sampler)
    rendered: list[tuple[int, int, Any]] = []
    device = device if device is not None else next(models.denoiser.parameters()).device
    with sampling_mode(models.modules, device, autocast_dtype):
        for i, prompt in enumerate(prompts):
            if i % num_processes == process_index:
                seed = prompt_seed(prompt, base_seed)
                rendered.append((i, seed, generate_image(prompt, models, seed, default_sampler)))
    if num_processes > 1:
        if gather is None:
            from accelerate.utils import gather_object as gather
        rendered = gather(rendered)
    if process_index != 0:
        return []

    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    samples: list[Sample] = []
    for i, seed, image in sorted(rendered, key=lambda r: r[0]):
        prompt = prompts[i]
        sampler, scale = prompt.sampler or default_sampler, sampling_scale(prompt, models.family)
        if isinstance(image, list):  # a clip
            path = directory / sample_file_name(output_name, prompt.index, seed, step, epoch, ".webp")
            write_webp_clip(image, path, models.family.frames_rule.fps,
                            _parameters(prompt, seed, sampler, scale, len(image)))
            samples.append(Sample(prompt, seed, path, image[0], tuple(image)))
        else:
            path = directory / sample_file_name(output_name, prompt.index, seed, step, epoch)
            _write_png(image, path, prompt, seed, sampler, scale)
            samples.append(Sample(prompt, seed, path, image))
    logger.info("wrote %d samples to %s", len(samples), directory)
    return samples
