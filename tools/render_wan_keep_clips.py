"""Render the keep clips of configs/datasets/digits_wan_base_keep.toml with models/digits-wan itself.

    OMP_NUM_THREADS=1 python tools/render_wan_keep_clips.py [--out data/digits-wan-base-keep/keep] [--overwrite]
                                                            [--per 10] [--seed 7]

`--per` clips of each moving digit in each trained motion (left, right, down), from noise seed `--seed` (the judge
renders from seed 0), each as NNN_<digit>_<motion>.mp4 with its caption beside it. These are DreamBooth's class
images for video: the base's own renders, trained towards the base's own prediction (prior_reg) beside the clips of
the held-out motion, so that the LoRA is held to the base on clips as the base draws them. The clips are written
to a folder beside `--out` and moved into place when all are written; an existing `--out` is replaced only with
`--overwrite`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from library import digits  # noqa: E402
from library.core.atomic import staged_dir  # noqa: E402
from library.digits import motion  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO_ROOT / "models" / "digits-wan")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data" / "digits-wan-base-keep" / "keep")
    parser.add_argument("--per", type=int, default=10)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    args = parser.parse_args(argv)
    if args.per < 1:
        parser.error("--per must be 1 or more")
    if args.out.exists() and not args.overwrite:
        parser.error(f"{args.out} exists: pass --overwrite to replace it")
    pipe = motion.load_pipeline(args.model)
    k = 0
    with staged_dir(args.out) as staging:
        for m in motion.trained_motions():
            for d in motion.DIGITS:
                shown = 0
                for frames in motion.render(pipe, motion.caption(d, m), args.per, seed=args.seed):
                    grey = digits.to_gray(frames)
                    shown += motion.shows(grey, d, m)
                    stem = staging / f"{k:03d}_{d}_{m}"
                    motion.write_mp4(stem.with_suffix(".mp4"), grey)
                    stem.with_suffix(".txt").write_text(motion.caption(d, m) + "\n", encoding="utf-8")
                    k += 1
                print(f"{motion.caption(d, m)}: {shown} of {args.per} judged as asked", flush=True)
    print(f"wrote {k} clips to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
