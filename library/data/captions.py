"""Caption files and what a caption becomes each time it is used: prefix/suffix, shuffling with kept tokens, tag
and whole-caption dropout."""
from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import NamedTuple

from library.data.dataset_config import SubsetSpec


class CaptionRead(NamedTuple):
    text: str | None  # None: no caption file
    path: Path | None
    problem: str | None


def read_caption(image_path: Path, caption_extension: str, all_lines: bool = False) -> CaptionRead:
    """The caption beside an image (`caption_extension`, then `.txt`): its first non-blank line, or with
    `all_lines` (kohya's enable_wildcard, where each line is an alternative) every non-blank line."""
    for extension in dict.fromkeys((caption_extension, ".txt")):
        candidate = image_path.with_name(image_path.stem + extension)
        if not candidate.is_file():
            continue
        try:
            text = candidate.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as e:
            return CaptionRead(None, candidate, f"{candidate}: caption is not UTF-8 text ({e.reason} at byte "
                                                f"{e.start}); re-save it as UTF-8")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            return CaptionRead(None, candidate, f"{candidate}: caption file is empty; write a caption or delete "
                                                "the file to train with the folder's class tokens")
        return CaptionRead("\n".join(lines) if all_lines else lines[0], candidate, None)
    return CaptionRead(None, None, None)


def subset_caption(path: Path, subset: SubsetSpec, given_caption: str | None, given_from: Path | None,
                   problems: list[str], why_empty: str = "") -> CaptionRead:
    """The caption of one image or video: `given_caption` (read from the file `given_from`) when there is one, else
    its caption file. A caption file that cannot be read, or a missing one in a subset without class tokens, adds a
    problem; `why_empty` goes after "no caption file (...)" in that message."""
    caption = (CaptionRead(given_caption, given_from, None) if given_caption is not None
               else read_caption(path, subset.caption_extension, all_lines=subset.enable_wildcard))
    if caption.problem:
        problems.append(caption.problem)
    elif caption.text is None and subset.class_tokens is None:
        problems.append(f"{path}: no caption file ({subset.caption_extension}"
                        f"{', .txt' if subset.caption_extension != '.txt' else ''}){why_empty}; it would train with "
                        "an empty caption")
    return caption


def process_caption(caption: str, subset: SubsetSpec, epoch: int, rng: random.Random, step: int | None = None,
                    total_steps: int = 0) -> str:
    """kohya's process_caption: prefix/suffix, whole-caption dropout, wildcards, kept tokens, token warm-up,
    shuffle, tag dropout, then the secondary separator.

    `epoch` counts from 0; caption_dropout_every_n_epochs drops in epochs n, 2n, ... counted from 1, as kohya does.
    `step` is the optimizer step the caption is trained at (None: not in training, no warm-up); `total_steps` turns
    a fractional token_warmup_step into steps.
    """
    caption = _process_caption(caption, subset, epoch, rng, step, total_steps)
    if subset.secondary_separator and caption:
        caption = caption.replace(subset.secondary_separator, subset.caption_separator)
    return caption


def expand_wildcards(caption: str, rng: random.Random) -> str:
    """kohya's enable_wildcard: one of a multi-line caption's lines, and one choice of each {a|b|c}; {{ and }}
    stand for literal braces."""
    if "\n" in caption:
        caption = rng.choice(caption.split("\n"))
    opening, closing = "\x00", "\x01"  # stand-ins for {{ and }}: control characters no caption holds
    caption = caption.replace("{{", opening).replace("}}", closing)
    caption = re.sub(r"\{([^}]+)\}", lambda match: rng.choice(match.group(1).split("|")), caption)
    return caption.replace(opening, "{").replace(closing, "}")


def warmup_tags(step: int | None, tags: int, minimum: int, warmup_step: float, total_steps: int) -> int | None:
    """kohya's token warm-up: how many tags a caption keeps at `step`, or None for all of them. From `minimum` at
    step 0 it grows linearly to every tag at `warmup_step` (warmup_step x total_steps when below 1)."""
    warmup = math.floor(warmup_step * total_steps) if warmup_step < 1 else int(warmup_step)
    if not warmup or step is None or step >= warmup:
        return None
    return math.floor(step * (tags - minimum) / warmup) + minimum


def _process_caption(caption: str, subset: SubsetSpec, epoch: int, rng: random.Random, step: int | None,
                     total_steps: int) -> str:
    if subset.caption_prefix:
        caption = subset.caption_prefix + " " + caption
    if subset.caption_suffix:
        caption = caption + " " + subset.caption_suffix
    dropped = subset.caption_dropout_rate > 0 and rng.random() < subset.caption_dropout_rate
    every = subset.caption_dropout_every_n_epochs
    if dropped or (every > 0 and (epoch + 1) % every == 0):
        return ""
    caption = expand_wildcards(caption, rng) if subset.enable_wildcard else caption.split("\n")[0]
    separator, keep_separator = subset.caption_separator, subset.keep_tokens_separator
    has_keep_separator = bool(keep_separator) and keep_separator in caption
    if not (subset.shuffle_caption or subset.caption_tag_dropout_rate > 0 or has_keep_separator
            or subset.token_warmup_step > 0):
        return caption

    def tags(text: str) -> list[str]:
        return [t.strip() for t in text.split(separator) if t.strip()]

    fixed_suffix: list[str] = []
    if has_keep_separator:
        fixed_part, flex_part = caption.split(keep_separator, 1)
        if keep_separator in flex_part:
            flex_part, suffix_part = flex_part.split(keep_separator, 1)
            fixed_suffix = tags(suffix_part)
        fixed, flex = tags(fixed_part), tags(flex_part)
    else:
        all_tags = tags(caption)
        fixed, flex = all_tags[:subset.keep_tokens], all_tags[subset.keep_tokens:]
    kept = warmup_tags(step, len(flex), subset.token_warmup_min, subset.token_warmup_step, total_steps)
    if kept is not None:  # the first tags as written, before shuffling (kohya's order)
        flex = flex[:kept]
    if subset.shuffle_caption:
        rng.shuffle(flex)
    if subset.caption_tag_dropout_rate > 0:
        flex = [t for t in flex if rng.random() >= subset.caption_tag_dropout_rate]
    return ", ".join(fixed + flex + fixed_suffix)
