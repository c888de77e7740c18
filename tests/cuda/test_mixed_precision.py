"""Mixed precision on CUDA as the trainer runs it: fp16 autocast with accelerate's GradScaler (overflowing steps
skipped, the scale backed off) and bf16 autocast, the LoRA in float32 over a half-precision base."""
from __future__ import annotations

import math

import pytest
import torch

from tests.cuda.runs import make_run

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> int:
    return sum(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("kind", ["sd15", "flux"])
def test_fp16_autocast_with_the_grad_scaler_trains_the_lora(cuda, kind):
    run = make_run(kind, cuda, "fp16")
    scaler = run.accelerator.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    assert {p.dtype for p in run.trainable} == {torch.float32}
    assert {p.dtype for p in run.denoiser.parameters() if not p.requires_grad} == {torch.float16}
    frozen, before = run.frozen(), run.lora()
    losses = [run.step() for _ in range(10)]
    assert all(math.isfinite(v) for v in losses), losses
    assert run.skipped.count(False) >= 6, run.skipped  # a few first steps may overflow at the initial scale
    assert losses[-1] < losses[0], losses
    after = run.lora()
    assert all(bool(t.isfinite().all()) for t in after.values())
    assert changed(before, after) == len(before)
    assert changed(frozen, run.frozen()) == 0


def test_an_overflowing_fp16_step_is_skipped_and_the_scale_backs_off(cuda):
    run = make_run("sd15", cuda, "fp16")
    run.step()
    scale, before = run.accelerator.scaler.get_scale(), run.lora()
    run.step(loss_scale=float("inf"))
    assert run.skipped[-1]
    assert run.accelerator.scaler.get_scale() == scale * 0.5
    assert changed(before, run.lora()) == 0
    assert math.isfinite(run.step())  # and training goes on


@pytest.mark.parametrize("kind", ["sd15", "flux"])
def test_bf16_autocast_trains_the_lora_in_float32(cuda, kind):
    run = make_run(kind, cuda, "bf16")
    assert run.accelerator.scaler is None
    assert {p.dtype for p in run.trainable} == {torch.float32}
    assert {p.dtype for p in run.denoiser.parameters() if not p.requires_grad} == {torch.bfloat16}
    frozen, before = run.frozen(), run.lora()
    losses = [run.step() for _ in range(8)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert changed(before, run.lora()) == len(before)
    assert changed(frozen, run.frozen()) == 0
