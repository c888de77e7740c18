"""NF4 quantization in bitsandbytes' exact layout, in torch, block by block.

bitsandbytes' own CPU quantizer (`quantize_4bit`, its "default" torch kernel) makes several full-size float32
temporaries of the whole weight (the float copy, the absolute values, the scaled values, int32 bucket indices):
measured at 2.7-23.7 M weights/s per thread, over an hour for FLUX.1-dev's 11.9 B weights. Here the same arithmetic
runs over slices of a few thousand blocks, so every temporary stays in the CPU's cache and nothing the size of the
weight is made but the packed result, and the codes come from fifteen vectorised comparisons rather than a binary
search per weight. The output is bitsandbytes' to the bit (tests/memory/test_nf4.py): the packed
uint8 codes (two per byte, the first in the high nibble), one float32 absmax per block of 64 (the last, partial block
scaled by division, as bitsandbytes does), and with `compress_statistics` (Linear4bit's default) the absmax values
less their mean quantized by bitsandbytes' own 8-bit blockwise quantizer (blocks of 256; 1/64 of the work).
"""
from __future__ import annotations

import functools

import torch

BLOCKSIZE = 64
CHUNK_BLOCKS = 4096  # 256 K weights per slice: 1 MiB of float32, in a core's cache
_COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=4)
def _bounds(device: torch.device) -> tuple[torch.Tensor, tuple[float, ...]]:
    """bitsandbytes' NF4 code and the midpoints between its (sorted) values, which it bucketizes against (as
    Python floats: a float32 value converts to one exactly, and back when compared with a float32 tensor)."""
    from bitsandbytes.functional import get_4bit_type

    code = get_4bit_type("nf4", device=device)
    return code, tuple(((code[:-1] + code[1:]) / 2).tolist())


def quantize_nf4(weight: torch.Tensor, dtype: torch.dtype | None = None, compress_statistics: bool = True,
                 chunk_blocks: int = CHUNK_BLOCKS) -> tuple[torch.Tensor, object]:
    """(packed codes `[ceil(n / 2), 1]` uint8, bitsandbytes QuantState) for `weight` of any floating dtype, as
    bitsandbytes quantizes `weight.to(dtype)` (fp8 included, without that copy being made). `dtype` is the dtype
    the weight dequantizes to, the compute dtype (default: the weight's own)."""
    from bitsandbytes.functional import QuantState, quantize_blockwise

    dtype = dtype or weight.dtype
    if dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"NF4 weights dequantize to float32, float16 or bfloat16, not {dtype}")
    code, bounds = _bounds(weight.device)
    flat = weight.detach().reshape(-1)
    n = flat.numel()
    rem = n % BLOCKSIZE
    full = n - rem
    blocks = full // BLOCKSIZE
    packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=weight.device)
    absmax = torch.empty(blocks + (1 if rem else 0), dtype=torch.float32, device=weight.device)
    out = packed.view(-1)
    for first in range(0, blocks, chunk_blocks):
        last = min(first + chunk_blocks, blocks)
        x = _as_handed(flat[first * BLOCKSIZE:last * BLOCKSIZE].view(-1, BLOCKSIZE), dtype)
        low, high = torch.aminmax(x, dim=-1)
        block_max = torch.maximum(high, low.neg()).abs_()  # |x|'s maximum (abs_: never -0.0)
        absmax[first:last] = block_max
        # bitsandbytes' arithmetic (a reciprocal, then a product); its clamp to [-1, 1] changes no bucket
        scaled = x * (1.0 / block_max.clamp(min=1e-38)).view(-1, 1)
        out[first * BLOCKSIZE // 2:last * BLOCKSIZE // 2] = _pack(_codes(scaled, bounds))
    if rem:
        tail = _as_handed(flat[full:], dtype)
        tail_max = tail.abs().max().clamp(min=1e-38)
        absmax[blocks] = tail_max
        scaled = torch.clamp(tail / tail_max, -1, 1)
        if rem % 2:
            scaled = torch.nn.functional.pad(scaled, (0, 1))
        out[full // 2:] = _pack(_codes(scaled, bounds))
    if not compress_statistics:
        return packed, QuantState(absmax=absmax, shape=weight.shape, dtype=dtype, blocksize=BLOCKSIZE, code=code,
                                  quant_type="nf4")
    offset = absmax.mean()
    nested, state2 = quantize_blockwise(absmax - offset, blocksize=256)
    return packed, QuantState(absmax=nested, shape=weight.shape, dtype=dtype, blocksize=BLOCKSIZE, code=code,
                              quant_type="nf4", offset=offset, state2=state2)


def _as_handed(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` as bitsandbytes computes with them when handed the weight in `dtype`: rounded to it (an fp32 weight
    trained in bf16 is quantized from its bf16 copy; fp8 and bf16 values are exact in bf16), then read as float32."""
    if values.dtype != dtype and values.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16):
        values = values.to(dtype)
    return values.to(torch.float32)


def _codes(scaled: torch.Tensor, bounds: tuple[float, ...]) -> torch.Tensor:
    """The NF4 code of each value: how many midpoints lie below it, which is what bitsandbytes' bucketize gives
    (right=False: a value on a midpoint takes the lower code). Fifteen vectorised comparisons instead of a
    branching binary search per weight."""
    codes = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    above = torch.empty(scaled.shape, dtype=torch.bool, device=scaled.device)
    for bound in bounds:
        codes.add_(torch.gt(scaled, bound, out=above))
    return codes.reshape(-1)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.view(-1, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1]


def nf4_linear(layer: torch.nn.Linear, compute_dtype: torch.dtype) -> torch.nn.Module:
    """A bitsandbytes Linear4bit (NF4, nested statistics: Linear4bit's defaults) holding `layer`'s weight quantized
    here, its bias in `compute_dtype`; on `layer`'s device."""
    import bitsandbytes as bnb

    with torch.device("meta"):
        quantized = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                      compute_dtype=compute_dtype, quant_type="nf4")
    packed, state = quantize_nf4(layer.weight.data, dtype=compute_dtype)
    quantized.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=BLOCKSIZE,
                                         compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8,
                                         module=quantized, bnb_quantized=True)
    quantized.quant_state = state
    if layer.bias is not None:
        quantized.bias = torch.nn.Parameter(layer.bias.data.to(compute_dtype), requires_grad=False)
    return quantized
