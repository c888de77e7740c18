"""torch_compile on CUDA: the denoiser's repeated blocks compiled in place with inductor (diffusers' regional
compilation, as the trainer does it), one graph per block type rather than per block, no recompilation from step
to step, and the same training as eager."""
from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from library.training.model import compile_repeated_blocks
from tests.cuda.runs import make_run, release, small_flux

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_regional_compile_shares_graphs_between_blocks_and_trains_as_eager(cuda):
    eager = make_run("flux", cuda, "bf16", denoiser=small_flux(3, 6))
    eager_losses = [eager.step() for _ in range(3)]
    eager_lora = eager.lora()
    del eager
    release()

    torch._dynamo.reset()
    counters.clear()
    try:
        run = make_run("flux", cuda, "bf16", denoiser=small_flux(3, 6))
        compile_repeated_blocks(run.denoiser, "inductor")
        blocks = [*run.denoiser.transformer_blocks, *run.denoiser.single_transformer_blocks]
        assert all(block._compiled_call_impl is not None for block in blocks)
        losses = [run.step()]
        graphs = counters["stats"]["unique_graphs"]
        losses += [run.step(), run.step()]
        assert 0 < graphs < len(blocks), graphs  # shared by the blocks of a type
        assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled after the first step
        lora = run.lora()
    finally:
        torch._dynamo.reset()

    assert all(math.isfinite(v) for v in losses)
    assert losses == pytest.approx(eager_losses, rel=2e-2)
    for name, value in lora.items():
        torch.testing.assert_close(value, eager_lora[name], rtol=5e-2, atol=5e-4)
