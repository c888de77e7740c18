"""blocks_to_swap on CUDA: the swapped blocks' frozen weights wait in pinned host memory and travel with
non-blocking copies, the device holds less at its peak, and training is the same as without swapping."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.cuda.runs import Run, make_run, release, small_flux

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SWAP = 4  # FLUX's split: 2 of the 4 double blocks and 4 of the 8 single blocks
BIG = 32 * 1024  # bytes: a weight matrix of these blocks is 128 KiB or more; the batch's tensors are smaller


def step_peak(run: Run, baseline: int) -> tuple[float, int]:
    """One step: its loss and the most the device held during it beyond `baseline`."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss = run.step()
    torch.cuda.synchronize()
    return loss, torch.cuda.max_memory_allocated() - baseline


def profiled_copies(run: Run, folder) -> tuple[float, list[tuple[str, int]]]:
    """One step under the profiler: (loss, (name, bytes) of every copy between host and device)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loss = run.step()
        torch.cuda.synchronize()
    trace = folder / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    return loss, [(e["name"], int(e.get("args", {}).get("bytes", 0))) for e in events
                  if e.get("name", "").startswith(("Memcpy HtoD", "Memcpy DtoH"))]


def swapped_blocks(run: Run) -> list[torch.nn.Module]:
    """The blocks whose frozen weights are in host memory now."""
    blocks = [*run.denoiser.transformer_blocks, *run.denoiser.single_transformer_blocks]
    return [b for b in blocks if any(p.device.type == "cpu" for p in b.parameters() if not p.requires_grad)]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_block_swap_moves_pinned_weights_without_blocking_and_trains_the_same(cuda, tmp_path, checkpointing):
    baseline = torch.cuda.memory_allocated()
    plain = make_run("flux", cuda, "bf16", checkpointing=checkpointing, denoiser=small_flux(4, 8))
    plain_losses = [plain.step(), plain.step()]
    loss, plain_peak = step_peak(plain, baseline)
    plain_losses += [loss, plain.step()]
    plain_lora = plain.lora()
    del plain
    release()

    baseline = torch.cuda.memory_allocated()
    run = make_run("flux", cuda, "bf16", blocks_to_swap=SWAP, checkpointing=checkpointing,
                   denoiser=small_flux(4, 8))
    losses = [run.step(), run.step()]
    loss, peak = step_peak(run, baseline)
    losses.append(loss)
    loss, copies = profiled_copies(run, tmp_path)
    losses.append(loss)

    # The last 2 double and last 4 single blocks wait on the host between steps, in pinned memory.
    away = swapped_blocks(run)
    assert away == [*run.denoiser.transformer_blocks[2:], *run.denoiser.single_transformer_blocks[4:]]
    frozen_away = [p for b in away for p in b.parameters() if not p.requires_grad]
    assert all(p.is_pinned() for p in frozen_away)
    assert all(p.device.type == "cuda" for p in run.trainable)  # the LoRA and its optimizer state stay

    # Every weight that travelled went from pinned memory to the device and back (non-blocking copies: a
    # pageable source would make the copy wait on the host).
    big = [(name, size) for name, size in copies if size >= BIG]
    arrivals = [name for name, _ in big if name.startswith("Memcpy HtoD")]
    departures = [name for name, _ in big if name.startswith("Memcpy DtoH")]
    big_weights = sum(p.numel() * p.element_size() >= BIG for p in frozen_away)
    assert len(arrivals) >= big_weights and len(departures) >= big_weights, copies
    assert all("Pinned -> Device" in name for name in arrivals), sorted(set(arrivals))
    assert all("Device -> Pinned" in name for name in departures), sorted(set(departures))

    # Less on the device at the peak: at least half of what waits on the host.
    away_bytes = sum(p.numel() * p.element_size() for p in frozen_away)
    assert peak <= plain_peak - 0.5 * away_bytes, (peak, plain_peak, away_bytes)

    # The same training.
    assert all(math.isfinite(v) for v in losses)
    assert losses == pytest.approx(plain_losses, rel=1e-2)
    lora = run.lora()
    for name, value in lora.items():
        torch.testing.assert_close(value, plain_lora[name], rtol=1e-2, atol=2e-4)
