"""NF4 quantization rate: library.memory.nf4 against bitsandbytes' own quantize_4bit, on FLUX.1-dev-shaped fp8
weights (or any shapes), M weights per second per thread.

    python bench/nf4_rate.py                         # 3072x3072, 12288x3072, 3072x12288, 21504x3072 from fp8
    python bench/nf4_rate.py --threads 2 --repeats 5 --skip-bitsandbytes
    python bench/nf4_rate.py --shapes 4096x4096 --dtype bf16

Run on a quiet machine (record `uptime` beside the figures): the rate is what tells whether FLUX.1-dev's 11.9 B
weights quantize within 5 minutes on 2 cores (at least 20 M weights/s per core; the aim is well above 40).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from library.memory.nf4 import quantize_nf4  # noqa: E402

DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}
FLUX_SHAPES = ("3072x3072", "12288x3072", "3072x12288", "21504x3072")
FLUX_WEIGHTS = 11.9e9


def _rate(fn, weight: torch.Tensor, repeats: int) -> float:
    fn(weight)  # the first call loads bitsandbytes' code table
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn(weight)
        best = min(best, time.process_time() - start)
    return weight.numel() / max(best, 1e-6) / 1e6  # M weights per CPU-second (a clock tick at least)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(FLUX_SHAPES))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp8", help="the stored weight's dtype")
    parser.add_argument("--compute", choices=("fp32", "bf16"), default="fp32", help="the compute dtype")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-bitsandbytes", action="store_true", help="ours only (bitsandbytes' is slow)")
    parser.add_argument("--out", type=Path, help="append the record (JSON lines) here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    compute = DTYPES[args.compute]
    record = {"dtype": args.dtype, "compute": args.compute, "threads": args.threads, "load_average": os.getloadavg(),
              "cpu": platform.processor() or platform.machine(), "shapes": {}}
    for text in args.shapes:
        shape = tuple(int(part) for part in text.split("x"))
        weight = (torch.randn(shape) * 0.02).to(DTYPES[args.dtype])
        ours = _rate(lambda w: quantize_nf4(w, dtype=compute), weight, args.repeats)
        row = {"ours_m_per_cpu_s": ours}
        if not args.skip_bitsandbytes:
            import bitsandbytes as bnb

            theirs = _rate(lambda w: bnb.functional.quantize_4bit(w.to(compute), blocksize=64,
                                                                  compress_statistics=True, quant_type="nf4"),
                           weight, args.repeats)
            row["bitsandbytes_m_per_cpu_s"] = theirs
        record["shapes"][text] = row
        print(f"{text:>12} {args.dtype}: ours {ours:8.1f} M weights/CPU-s"
              + (f", bitsandbytes {row['bitsandbytes_m_per_cpu_s']:8.1f}" if "bitsandbytes_m_per_cpu_s" in row else ""))
    rates = [row["ours_m_per_cpu_s"] for row in record["shapes"].values()]
    minutes = FLUX_WEIGHTS / (min(rates) * 1e6 * 2) / 60
    print(f"FLUX.1-dev's {FLUX_WEIGHTS / 1e9:.1f} B weights on 2 cores at the slowest shape's rate: {minutes:.1f} min")
    if args.out:
        with args.out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
