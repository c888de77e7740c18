"""torch_compile on CPU: what compiling the repeated blocks costs and what it buys on the bench models.

    python bench/compile.py [--models small] [--steps N] [--repeats R] [--backend inductor] [--json PATH]

Each run is `train_network.py` in its own process (one thread) on the offline bench model and data/quickstart, with
the minimal config of bench/startup_defaults.py (UNet-only LoRA, so the text cache is on), with and without
`--torch_compile`. Reported: launch -> end of the first optimizer step (wall seconds; with torch_compile this holds
the compile time of the first forward and backward), and the median CPU seconds per step over the later steps.
Nothing is asserted; read the numbers next to the machine's load, which is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup_defaults import RESOLUTION, compare, print_results  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=tuple(RESOLUTION), default=["small"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    common = ("--network_train_unet_only",)
    variants = {f"compiled ({args.backend})": (*common, "--torch_compile", "--dynamo_backend", args.backend),
                "eager": common}
    results = compare(args.models, args.steps, args.repeats, variants, timeout=3600)
    print_results(results)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
