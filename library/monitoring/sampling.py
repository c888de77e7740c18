"""Sample images and videos during training: kohya's prompt files, samplers by kohya name, and a sampling round.

A round renders each prompt with the family's diffusers pipeline built around the trainer's own modules (LoRA
attached), writes `<output_dir>/sample/<output_name>_<step or e<epoch>>_<index>_<seed>.png` (for an edit model's
prompt with control images, musubi's --ci, those images left of the result in the one PNG; for a video family's
prompt of more than one frame, musubi's --f, an animated lossless `.webp` of the clip at the family's frame rate),
and leaves the training state exactly as it found it: train/eval flags, grad mode, autocast and every global
random stream.
"""
from __future__ import annotations

import difflib
import gc
import hashlib
import json
import logging
import math
import os
import random
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import tomllib
import torch

from library.config import UserError
from library.config.samplers import SAMPLERS, canonical_sampler
from library.core.atomic import write_atomically

logger = logging.getLogger(__name__)

DEFAULT_STEPS = 30
IMAGE_DESCRIPTION = 0x010E  # the EXIF tag a clip's "parameters" text goes in
MAX_STEPS = 1000  # kohya clamps --s to 1..1000; outside that range it is reported as a mistake here
MAX_FRAMES = 1025  # --f: a bound on typing mistakes (Wan generates 81 frames; musubi sets none)

# Keys of a TOML / JSON prompt entry (kohya's names; control_image and frame_count musubi's, control_image a path
# or a list of them), and the .txt options that set them (--ci may be given more than once; --i is musubi's first
# frame of an image-to-video prompt, read as its one control image).
PROMPT_KEYS = ("prompt", "negative_prompt", "width", "height", "seed", "sample_steps", "scale", "sample_sampler",
               "guidance_scale", "control_image", "frame_count")
TXT_OPTIONS = {"n": "negative_prompt", "w": "width", "h": "height", "d": "seed", "s": "sample_steps", "l": "scale",
               "ss": "sample_sampler", "g": "guidance_scale", "ci": "control_image", "i": "control_image",
               "f": "frame_count"}


@dataclass(frozen=True)
class SamplePrompt:
    """One prompt to sample; `seed` None means derived from the run's seed, `sampler` None the run's sampler."""
    prompt: str
    negative_prompt: str = ""
    width: int = 512
    height: int = 512
    seed: int | None = None
    steps: int = DEFAULT_STEPS
    scale: float | None = None  # kohya's --l; None: the family's default (SD 7.5, FLUX 1.0: no true CFG)
    sampler: str | None = None
    index: int = 0
    guidance: float | None = None  # kohya's --g: the guidance input of FLUX.1 dev (None: the family's default)
    control_images: tuple[str, ...] = ()  # musubi's --ci: an edit model's control images, drawn left of the result
    frames: int | None = None  # musubi's --f: a video family's clip length (None: one frame, an image)


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


# --------------------------------------------------------------------------------------------- prompt files


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _integer(value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("not an integer")
    if value < low or (high is not None and value > high):
        raise ValueError(f"must be {low} or more" if high is None else f"must be between {low} and {high}")
    return value


def _number(value: Any) -> float:
    try:
        value = float(value) if isinstance(value, str) else value
    except ValueError:
        raise ValueError("not a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("not a number")
    if not math.isfinite(value) or value < 0:
        raise ValueError("must be a finite number, 0 or more")
    return float(value)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("not a string")
    return value.strip()


def _size(value: Any) -> int:
    # kohya: max(64, w - w % 8); the VAE needs multiples of 8.
    size = _integer(value, 1)
    return max(64, size - size % 8)


def _control_images(value: Any) -> tuple[str, ...]:
    paths = tuple(_text(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    missing = [path for path in paths if not Path(path).is_file()]
    if missing or not paths:
        raise ValueError(f"not an image file: {', '.join(missing)}" if missing else "no path")
    return paths


_CONVERT: dict[str, Callable[[Any], Any]] = {
    "prompt": _text, "negative_prompt": _text, "width": _size, "height": _size,
    "seed": lambda v: _integer(v, 0, 2**64 - 1), "sample_steps": lambda v: _integer(v, 1, MAX_STEPS),
    "scale": _number, "sample_sampler": canonical_sampler, "guidance_scale": _number,
    "control_image": _control_images, "frame_count": lambda v: _integer(v, 1, MAX_FRAMES),
}


def _make_prompt(values: Mapping[str, Any], labels: Mapping[str, str], where: str, index: int,
                 default_size: tuple[int, int], problems: list[str]) -> SamplePrompt | None:
    out: dict[str, Any] = {}
    before = len(problems)
    for key, value in values.items():
        try:
            out[key] = _CONVERT[key](value)
        except (ValueError, UserError) as e:
            problems.append(f"{where}: {labels.get(key, key)} {value!r}: {e}")
    if "prompt" not in values or out.get("prompt") == "":
        problems.append(f"{where}: no prompt")
    if len(problems) > before:
        return None
    return SamplePrompt(
        prompt=out["prompt"], negative_prompt=out.get("negative_prompt", ""),
        width=out.get("width", _size(default_size[0])), height=out.get("height", _size(default_size[1])),
        seed=out.get("seed"), steps=out.get("sample_steps", DEFAULT_STEPS), scale=out.get("scale"),
        sampler=out.get("sample_sampler"), index=index, guidance=out.get("guidance_scale"),
        control_images=out.get("control_image", ()), frames=out.get("frame_count"))


def _split_line(line: str) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """kohya's line form: `prompt --n neg --w 512 ...`; returns (values, labels, unknown option names)."""
    # A line that starts with an option has an empty prompt, not a prompt called "--w 512".
    prompt, *parts = (" " + line if line.startswith("--") else line).split(" --")
    values: dict[str, Any] = {"prompt": prompt}
    labels, unknown = {}, []
    for part in parts:
        name, _, value = part.strip().partition(" ")
        key = TXT_OPTIONS.get(name.lower())
        if key is None:
            unknown.append(f"--{name}")
        elif key == "control_image":  # one --ci per control image, in order
            values[key] = [*values.get(key, []), value.strip()]
            labels[key] = f"--{name}"
        else:
            values[key], labels[key] = value.strip(), f"--{name}"
    return values, labels, unknown


def _entries(kind: str, text: str) -> list[tuple[str, Any]]:
    """(where, entry) for each prompt of a file; ValueError when the file cannot hold prompts at all."""
    if kind == ".txt":
        lines = ((number, line.strip()) for number, line in enumerate(text.splitlines(), start=1))
        return [(f"line {number}", line) for number, line in lines if line and not line.startswith("#")]
    if kind == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        if not isinstance(data, list):
            raise ValueError("must hold a list of prompt objects")
        return [(f"entry {number}", entry) for number, entry in enumerate(data, start=1)]
    try:
        table = tomllib.loads(text).get("prompt")
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"not valid TOML: {e}") from None
    subsets = table.get("subset") if isinstance(table, dict) else None
    if not isinstance(subsets, list) or not subsets:
        raise ValueError("needs a [prompt] table with at least one [[prompt.subset]] entry")
    defaults = {k: v for k, v in table.items() if k != "subset"}
    return [(f"[[prompt.subset]] {number}", {**defaults, **subset} if isinstance(subset, dict) else subset)
            for number, subset in enumerate(subsets, start=1)]


def load_prompts(path: str | os.PathLike, default_size: int | tuple[int, int] = 512) -> list[SamplePrompt]:
    """Read kohya's sample_prompts file (.txt, .toml or .json); UserError naming every problem in it.

    `default_size` (width, height) applies to prompts without their own size. Unknown options are logged and
    ignored, as kohya ignores them. A file without prompts gives none (logged), as in kohya.
    """
    path = Path(path)
    size = (default_size, default_size) if isinstance(default_size, int) else tuple(default_size)
    kind = path.suffix.lower()
    if kind not in (".txt", ".toml", ".json"):
        raise UserError(f"sample_prompts {path}: must be a .txt, .toml or .json file")
    try:
        # utf-8-sig: Windows editors put a byte-order mark in front of the first prompt.
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"sample_prompts {path}: cannot read it: {e}") from None

    try:
        entries = _entries(kind, text)
    except ValueError as e:
        raise UserError(f"sample_prompts {path}: {e}") from None
    problems: list[str] = []
    prompts: list[SamplePrompt] = []
    ignored: list[str] = []
    for index, (where, entry) in enumerate(entries):
        if isinstance(entry, str):  # a .txt line, or a kohya line inside a JSON list
            values, labels, unknown = _split_line(entry)
        elif isinstance(entry, dict):
            values = {k: v for k, v in entry.items() if k in PROMPT_KEYS}
            labels = {}
            unknown = [f"{k}{_suggest(k, PROMPT_KEYS)}" for k in entry if k not in PROMPT_KEYS]
        else:
            problems.append(f"{where}: expected a prompt object, got {type(entry).__name__}")
            continue
        ignored += [f"{where}: {name}" for name in unknown]
        prompt = _make_prompt(values, labels, where, index, size, problems)
        if prompt is not None:
            prompts.append(prompt)
    if not entries:
        # The kohya_ss GUI always writes a prompt file, empty when its box is; sd-scripts then samples nothing.
        logger.info("sample_prompts %s holds no prompts: no sample images will be made", path)
        return []
    if problems:
        raise UserError([f"sample_prompts {path}: {p}" for p in problems])
    if ignored:
        logger.warning("sample_prompts %s: ignoring unknown options: %s", path, "; ".join(ignored))
    return prompts


# --------------------------------------------------------------------------------------------- rendering


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
