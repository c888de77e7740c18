"""An fp8 base on CUDA (base_model_precision = "fp8", kohya's fp8_base): the frozen linear weights held as
float8_e4m3fn on the device, computed in bf16, the LoRA trained in float32 on top."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tests.cuda.runs import make_run, release, small_flux

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_fp8_base_halves_the_weights_on_the_device_and_trains_the_lora(cuda):
    release()
    held = torch.cuda.memory_allocated(cuda)
    bf16 = make_run("flux", cuda, "bf16", denoiser=small_flux(2, 4))
    bf16_bytes, bf16_prediction = torch.cuda.memory_allocated(cuda) - held, bf16.predict()
    del bf16
    release()

    held = torch.cuda.memory_allocated(cuda)
    run = make_run("flux", cuda, "bf16", base="fp8", denoiser=small_flux(2, 4))
    fp8_bytes = torch.cuda.memory_allocated(cuda) - held
    frozen = [p for p in run.denoiser.parameters() if not p.requires_grad]
    storage = Counter(p.dtype for p in frozen)
    weights_in_fp8 = sum(p.numel() for p in frozen if p.dtype == torch.float8_e4m3fn)
    assert weights_in_fp8 > 0.9 * sum(p.numel() for p in frozen), storage
    assert all(p.device.type == "cuda" for p in frozen)
    assert {p.dtype for p in run.trainable} == {torch.float32}
    assert fp8_bytes < 0.7 * bf16_bytes, (fp8_bytes, bf16_bytes)  # 0.56 counted by parameters

    # Same initial LoRA (B = 0), so the prediction is the base's: fp8 weights give nearly the bf16 one.
    prediction = run.predict()
    assert prediction.dtype == torch.float32 and bool(prediction.isfinite().all())
    assert (prediction - bf16_prediction).norm() < 0.05 * bf16_prediction.norm()

    before_frozen, before = run.frozen(), run.lora()
    losses = [run.step() for _ in range(8)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    after = run.lora()
    assert all(not torch.equal(before[name], after[name]) for name in before)
    after_frozen = run.frozen()
    assert all(torch.equal(before_frozen[name], after_frozen[name]) for name in before_frozen)
    assert Counter(p.dtype for p in run.denoiser.parameters() if not p.requires_grad) == storage
