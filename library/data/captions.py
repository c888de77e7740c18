"""Caption files and what a caption becomes each time it is used: prefix/suffix, shuffling with kept tokens, tag
and whole-caption dropout."""
from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

from library.data.dataset_config import SubsetSpec


class CaptionRead(NamedTuple):
    text: str | None  # None: no caption file
    path: Path | None
    problem: str | None


def read_caption(image_path: Path, caption_extension: str) -> CaptionRead:
    """The caption beside an image (`caption_extension`, then `.txt`): its first non-blank line."""
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
        return CaptionRead(lines[0], candidate, None)
    return CaptionRead(None, None, None)


def process_caption(caption: str, subset: SubsetSpec, epoch: int, rng: random.Random) -> str:
    """kohya's process_caption: prefix/suffix, whole-caption dropout, kept tokens, shuffle, tag dropout.

    `epoch` counts from 0; caption_dropout_every_n_epochs drops in epochs n, 2n, ... counted from 1, as kohya does.
    """
    if subset.caption_prefix:
        caption = subset.caption_prefix + " " + caption
    if subset.caption_suffix:
        caption = caption + " " + subset.caption_suffix
    dropped = subset.caption_dropout_rate > 0 and rng.random() < subset.caption_dropout_rate
    every = subset.caption_dropout_every_n_epochs
    if dropped or (every > 0 and (epoch + 1) % every == 0):
        return ""
    separator, keep_separator = subset.caption_separator, subset.keep_tokens_separator
    has_keep_separator = bool(keep_separator) and keep_separator in caption
    if not (subset.shuffle_caption or subset.caption_tag_dropout_rate > 0 or has_keep_separator):
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
    if subset.shuffle_caption:
        rng.shuffle(flex)
    if subset.caption_tag_dropout_rate > 0:
        flex = [t for t in flex if rng.random() >= subset.caption_tag_dropout_rate]
    return ", ".join(fixed + flex + fixed_suffix)
