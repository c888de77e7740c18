"""blocks_to_swap: kohya's schedule, which blocks are resident, and training with swaps equal to training without,
with a stand-in device (the moves are recorded; the weights are copied as a real move copies them)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from library.config import UserError
from library.families.loading import load_components
from library.memory.offload import backward_swaps, forward_swaps, install_offloading
from library.network import lora
from tests.helpers.offload import DEVICE, HOST, Recorder


def test_kohyas_schedule():
    # 6 blocks, 2 swapped: blocks 4 and 5 start on the host
    assert forward_swaps(6, 2) == {0: (0, 4), 1: (1, 5)}
    assert backward_swaps(6, 2) == {4: (5, 1), 3: (4, 0)}
    assert forward_swaps(6, 0) == {} and backward_swaps(6, 0) == {}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_every_block_is_resident_when_it_runs(checkpointing):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(6))
    for block in blocks:
        block.weight.requires_grad_(False)
        block.bias.requires_grad_(False)
    trained = torch.nn.Parameter(torch.ones(8))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = blocks

        def forward(self, x):
            x = x * trained
            for block in self.blocks:
                if checkpointing:
                    x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
                else:
                    x = block(x)
            return x

    model = Model()
    recorder = Recorder(blocks)
    install_offloading(model, [(blocks, 2)], False, DEVICE, move=recorder.move, host=HOST)
    recorder.watch(blocks)
    for step in range(2):
        recorder.moves.clear()
        recorder.seen.clear()
        model(torch.randn(2, 8)).sum().backward()
        assert all(resident for _, resident, _ in recorder.seen), recorder.seen
        assert max(count for _, _, count in recorder.seen) == 4  # n - k blocks on the device
        if step:  # the first step also places every block
            # forward: 0 and 1 leave as 4 and 5 arrive; backward: 5 and 4 leave as 1 and 0 arrive
            assert recorder.moves == [(0, "host"), (4, "device"), (1, "host"), (5, "device"),
                                      (5, "host"), (1, "device"), (4, "host"), (0, "device")]
        assert sorted(b for b, d in recorder.where.items() if d == DEVICE) == [0, 1, 2, 3]
    assert trained.grad is not None


def _flux(tiny_flux_dir):
    """The tiny FLUX transformer's widths with 3 double and 4 single blocks, so that kohya's limits allow a swap."""
    from diffusers import FluxTransformer2DModel

    config = dict(FluxTransformer2DModel.load_config(tiny_flux_dir, subfolder="transformer"))
    torch.manual_seed(0)
    return FluxTransformer2DModel.from_config({**config, "num_layers": 3, "num_single_layers": 4})


def _train(tiny_flux_dir, swap: bool, steps: int = 2):
    from library.config.network_args import network_args_of
    from library.families.flux.family import Flux
    from library.families.flux.lora import targets

    denoiser = _flux(tiny_flux_dir)
    denoiser.requires_grad_(False)
    names, overrides = targets(denoiser, 4, 4.0, network_args_of(SimpleNamespace(
        network_args=[], network_module="networks.lora_flux")))
    torch.manual_seed(0)
    params = lora.attach_lora(denoiser, names, 4, 4.0, overrides=overrides)
    initial = [p.detach().clone() for p in params]
    denoiser.enable_gradient_checkpointing()
    denoiser.train()
    if swap:
        plan = Flux().block_swap_plan(denoiser, 2)
        assert [count for _, count in plan] == [1, 2]  # kohya's split: 2 // 2 double, (2 - 1) * 2 single
        recorders = [Recorder(blocks) for blocks, _ in plan]
        for (blocks, count), recorder in zip(plan, recorders, strict=True):
            install_offloading(denoiser, [(blocks, count)], False, DEVICE, move=recorder.move, host=HOST)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    cfg = denoiser.config
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        out = denoiser(hidden_states=torch.randn(1, 16, cfg.in_channels, generator=generator),
                       encoder_hidden_states=torch.randn(1, 8, cfg.joint_attention_dim, generator=generator),
                       pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=generator),
                       timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]), img_ids=torch.zeros(16, 3),
                       txt_ids=torch.zeros(8, 3), return_dict=False)[0]
        out.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if swap:  # both runs of blocks swapped in forward and backward
        assert all(("host" in {d for _, d in r.moves[len(r.where):]}) for r in recorders)
    return initial, [p.detach().clone() for p in params]


def test_a_lora_trained_with_swapping_equals_one_trained_without(tiny_flux_dir):
    (initial, without), (_, with_swap) = _train(tiny_flux_dir, False), _train(tiny_flux_dir, True)
    assert all(torch.equal(a, b) for a, b in zip(without, with_swap, strict=True))
    assert sum(not torch.equal(a, b) for a, b in zip(initial, without, strict=True)) == len(initial)


def test_kohyas_limits_and_families_without_swap(tiny_flux_dir, tiny_sd1_dir):
    from library.families.flux.family import Flux

    flux = _flux(tiny_flux_dir)
    assert [count for _, count in Flux().block_swap_plan(flux, 1)] == [0, 2]
    with pytest.raises(UserError, match="at most 1 double blocks and 2 single blocks; this asks for 1 double and 4"):
        Flux().block_swap_plan(flux, 3)
    sd1 = load_components(tiny_sd1_dir)
    with pytest.raises(UserError, match="blocks_to_swap: not offered"):
        sd1.family.block_swap_plan(sd1.denoiser, 2)
