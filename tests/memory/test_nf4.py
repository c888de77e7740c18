"""The torch NF4 quantizer writes bitsandbytes' layout to the bit: packed codes, absmax per block of 64 and the
nested statistics, for odd sizes, partial blocks, blocks of zeros, and fp32 / bf16 / fp8 weights."""
from __future__ import annotations

import pytest
import torch

from library.memory.nf4 import nf4_linear, quantize_nf4

bnb = pytest.importorskip("bitsandbytes")
FP8, F32, BF16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16


def _weight(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=generator) * torch.rand(shape, generator=generator) * 3
    flat = weight.view(-1)
    flat[:64] = 0  # a block of zeros
    if flat.numel() > 200:
        flat[128:192] = -0.0  # negative zeros
        flat[200] = 50.0  # an outlier
    return weight.to(dtype)


def _bnb(weight, dtype, compress_statistics):
    # bitsandbytes is handed the weight in the compute dtype, as the trainer handed it before
    return bnb.functional.quantize_4bit(weight.to(dtype), blocksize=64, compress_statistics=compress_statistics,
                                        quant_type="nf4")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    bytes_a, bytes_b = (t.reshape(-1).view(torch.uint8) for t in (a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bytes_a, bytes_b)


@pytest.mark.parametrize("shape", [(64, 64), (3, 37), (1, 1), (130, 67), (257, 128), (1000, 3)])
@pytest.mark.parametrize("dtype, compute", [(F32, F32), (F32, BF16), (BF16, BF16), (BF16, F32), (FP8, F32),
                                            (FP8, BF16)])
@pytest.mark.parametrize("compress_statistics", [True, False])
def test_the_layout_is_bitsandbytes_to_the_bit(shape, dtype, compute, compress_statistics):
    weight = _weight(shape, dtype)
    # a slice of 3 blocks, so that several slices and the seams between them are checked
    packed, state = quantize_nf4(weight, dtype=compute, compress_statistics=compress_statistics, chunk_blocks=3)
    expected_packed, expected = _bnb(weight, compute, compress_statistics)
    assert _same(packed, expected_packed)
    assert _same(state.absmax, expected.absmax)
    assert _same(state.code, expected.code)
    assert state.shape == expected.shape and state.dtype == expected.dtype
    assert state.blocksize == expected.blocksize == 64 and state.quant_type == "nf4"
    assert state.nested == expected.nested == compress_statistics
    if compress_statistics:
        assert _same(state.offset, expected.offset)
        assert _same(state.state2.absmax, expected.state2.absmax)
        assert _same(state.state2.code, expected.state2.code)
        assert state.state2.blocksize == expected.state2.blocksize


def test_the_default_slices_agree_with_small_ones():
    weight = _weight((300, 1000), torch.float32, seed=3)
    one, state = quantize_nf4(weight)
    many, many_state = quantize_nf4(weight, chunk_blocks=7)
    assert torch.equal(one, many) and torch.equal(state.absmax, many_state.absmax)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_the_layer_computes_as_bitsandbytes_own(compute_dtype):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 40)
    ours = nf4_linear(layer, compute_dtype)
    theirs = bnb.nn.Linear4bit(96, 40, compute_dtype=compute_dtype, quant_type="nf4")
    theirs.weight = bnb.nn.Params4bit(layer.weight.data.to(compute_dtype), requires_grad=False, quant_type="nf4")
    theirs.bias = torch.nn.Parameter(layer.bias.data.to(compute_dtype), requires_grad=False)
    theirs = theirs.to("cpu")
    assert _same(ours.weight.data, theirs.weight.data)
    x = torch.randn(5, 96, dtype=compute_dtype)
    assert torch.equal(ours(x), theirs(x))
    assert ours.bias.dtype == compute_dtype and ours.weight.quant_state.dtype == compute_dtype


def test_values_on_a_midpoint_take_bitsandbytes_code():
    """bitsandbytes' bucketize gives a value on a midpoint the lower code; so must the comparisons."""
    code = bnb.functional.get_4bit_type("nf4", device="cpu")
    bounds = (code[:-1] + code[1:]) / 2
    block = torch.cat([torch.tensor([1.0]), bounds, code, -bounds, torch.nextafter(bounds, torch.ones(15)),
                       torch.zeros(64 - 1 - 15 * 3 - 16 + 16)])[:64]
    weight = torch.cat([block, block * 0.5]).reshape(2, 64)  # a block whose absmax is 1, and one of 0.5
    packed, state = quantize_nf4(weight, compress_statistics=False)
    expected_packed, expected = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=False,
                                                             quant_type="nf4")
    assert torch.equal(packed, expected_packed) and torch.equal(state.absmax, expected.absmax)
