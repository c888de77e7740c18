"""Write a tiny, untrained model of any registered family (a few MB, the real module names and conditioning,
random weights) as a diffusers folder, so the whole path can be tried without downloading anything.

    python -m library.families.tiny OUTPUT_DIR [--family NAME] [--files] [--seed N] [--overwrite]
                                    [--size tiny|small] [--prediction-type epsilon|v_prediction]
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from library.families.registry import tiny_models


def main(argv: list[str] | None = None) -> int:
    """CLI entry: write a tiny model folder (and with --files its separate files)."""
    models = tiny_models()
    shaped = {option: choices for model in models.values() for option, choices in model.shape.items()}
    parser = argparse.ArgumentParser(prog="python -m library.families.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="folder to write the diffusers pipeline into")
    parser.add_argument("--family", choices=tuple(models), default="sd1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty folder")
    parser.add_argument("--files", action="store_true",
                        help="also write the separate files users load (the transformer file in its own layout and "
                             "the text encoder / autoencoder files) into OUTPUT_DIR/files")
    for option, choices in shaped.items():
        takers = ", ".join(name for name, model in models.items() if option in model.shape)
        parser.add_argument(f"--{option.replace('_', '-')}", dest=option, choices=choices, default=None,
                            help=f"{takers} only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    model = models[args.family]
    given = [option for option in shaped if getattr(args, option) is not None]
    if not_taken := [option for option in given if option not in model.shape]:
        parser.error(f"{', '.join('--' + o.replace('_', '-') for o in not_taken)}: the tiny {args.family} has one "
                     "shape")
    if args.files and model.save_files is None:
        parser.error(f"--files: the tiny {args.family} is written as a folder only")
    try:
        out = model.save(args.output_dir, args.seed, args.overwrite, **{o: getattr(args, o) for o in given})
    except FileExistsError as e:
        parser.exit(2, f"error: {e}\n")
    print(f"wrote tiny {args.family} model (seed {args.seed}) to {out}")
    if args.files:
        for name, path in model.save_files(out, Path(out) / "files").items():
            print(f"  {name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
