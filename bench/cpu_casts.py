"""Per-matrix cost of what a low-precision FLUX base does on the CPU: fp8 -> bf16 cast, NF4 quantize / dequantize
(bitsandbytes), and matrix products with 256 tokens in fp32 and bf16, on one 3072 x 12288 matrix (the size of a
FLUX single block's MLP matrices).

    OMP_NUM_THREADS=1 python bench/cpu_casts.py
"""
from __future__ import annotations

import time
from typing import Callable

import bitsandbytes.functional as F
import torch


def timed(work: Callable[[], object]) -> tuple[float, object]:
    started = time.time()
    result = work()
    return time.time() - started, result


def main() -> None:
    torch.manual_seed(0)
    w = (torch.randn(3072, 12288) * 0.02).to(torch.float8_e4m3fn)
    n = w.numel() / 1e6
    fp8, b = timed(lambda: w.to(torch.bfloat16))
    quant, (q, state) = timed(lambda: F.quantize_4bit(b, quant_type="nf4"))
    dequant, _ = timed(lambda: F.dequantize_4bit(q, state))
    print(f"{n:.1f} M weights: fp8->bf16 {fp8:.2f} s ({n / fp8:.0f} M/s), nf4 quantize {quant:.2f} s "
          f"({n / quant:.1f} M/s), nf4 dequantize {dequant:.2f} s ({n / dequant:.0f} M/s)")
    x, weight = torch.randn(256, 12288), torch.randn(3072, 12288)
    for dtype in (torch.float32, torch.bfloat16):
        a, m = x.to(dtype), weight.to(dtype)
        seconds, _ = timed(lambda a=a, m=m: torch.nn.functional.linear(a, m))
        print(f"{dtype} matmul, 256 tokens: {seconds:.2f} s, {2 * 256 * 12288 * 3072 / seconds / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
