"""Write and check a folder of images with caption files, as the dataset tools here generate them.

An item is (file stem, PIL image, caption): `<stem>.png` and `<stem>.txt` (the caption and a newline).
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from library.core.atomic import staged_dir

Item = tuple[str, Any, str]


def write_folder(target: Path, items: Iterable[Item]) -> Path:
    """Write the items into `target`, replacing any previous folder atomically (written beside it, then renamed)."""
    with staged_dir(target) as tmp:
        for stem, image, text in items:
            image.save(tmp / f"{stem}.png", optimize=True)
            (tmp / f"{stem}.txt").write_text(text + "\n", encoding="utf-8")
    return target


def check_folder(target: Path, items: Iterable[Item], label: str = "") -> list[str]:
    """Differences between `target` and what `write_folder` would write (pixels and mode, not PNG bytes).
    Each problem names the file, prefixed by `label`."""
    from PIL import Image

    expected: dict[str, Any] = {}
    for stem, image, text in items:
        expected[f"{stem}.png"] = image
        expected[f"{stem}.txt"] = text + "\n"
    present = {p.name for p in target.iterdir()} if target.is_dir() else set()
    problems = [f"missing {label}{name}" for name in sorted(set(expected) - present)]
    problems += [f"unexpected {label}{name}" for name in sorted(present - set(expected))]
    for name in sorted(set(expected) & present):
        if name.endswith(".png"):
            want = expected[name]
            with Image.open(target / name) as im:
                if im.mode != want.mode or not np.array_equal(np.asarray(im), np.asarray(want)):
                    problems.append(f"pixels differ in {label}{name}")
        elif (target / name).read_text(encoding="utf-8") != expected[name]:
            problems.append(f"caption differs in {label}{name}")
    return problems


def main(description: str, default_out: Path, write: Callable[[Path], list[Path]],
         check: Callable[[Path], list[str]], argv: list[str] | None = None) -> int:
    """The command line the dataset tools share: write the folders, or with --check compare them (exit 1)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=default_out, help="dataset root folder")
    parser.add_argument("--check", action="store_true", help="compare with the files on disk, write nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.check:
        problems = check(args.out)
        for problem in problems:
            logging.error("%s", problem)
        if not problems:
            logging.info("%s is up to date", args.out)
        return 1 if problems else 0
    for target in write(args.out):
        files = list(target.iterdir())
        images = sum(p.suffix == ".png" for p in files)
        print(f"wrote {images} images to {target} ({sum(p.stat().st_size for p in files) / 1024:.1f} KiB)")
    return 0
