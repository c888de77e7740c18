"""Sample prompt files: kohya's .txt lines with their --options (and musubi-tuner's --ci, --i and --f), TOML and
JSON prompt lists, read into SamplePrompts, every mistake named with its line or entry."""
from __future__ import annotations

import difflib
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import tomllib

from library.config import UserError
from library.config.samplers import canonical_sampler

logger = logging.getLogger(__name__)

DEFAULT_STEPS = 30

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
