"""blocks_to_swap and cpu_offload_checkpointing: the frozen base's blocks, and the activations checkpointing saves,
held in CPU memory while the GPU computes.

Block swap follows kohya's schedule (sd-scripts' custom_offloading_utils): of a run of n blocks, the last k start
in CPU memory; after block i < k runs forward, it leaves the device and block n - k + i arrives; in backward, once
block b is done (b counted from the end: p = n - b - 1 blocks done, 0 < p <= k), block n - p leaves and k - p
arrives, so the next forward finds the first n - k blocks on the device again. Only the frozen weights move: the
LoRA parameters, their gradients and optimizer state stay on the device. Moves are hooks on the blocks, so the
family's forward is unchanged; with gradient checkpointing a block's recomputation in backward moves nothing.
diffusers' group offloading was not used: it moves whole groups back and forth around every forward and has no
backward schedule (it onloads again in backward), which costs twice the transfers of kohya's swap.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Sequence

import torch

logger = logging.getLogger(__name__)

Move = Callable[[torch.nn.Module, torch.device], None]
HOST = torch.device("cpu")


def forward_swaps(num_blocks: int, to_swap: int) -> dict[int, tuple[int, int]]:
    """After block i's forward: (block that leaves the device, block that arrives)."""
    return {i: (i, num_blocks - to_swap + i) for i in range(to_swap)}


def backward_swaps(num_blocks: int, to_swap: int) -> dict[int, tuple[int, int]]:
    """Once block b's backward is done: (block that leaves the device, block that arrives)."""
    swaps = {}
    for b in range(num_blocks):
        done = num_blocks - b - 1
        if 0 < done <= to_swap:
            swaps[b] = (num_blocks - done, to_swap - done)
    return swaps


def move_frozen(block: torch.nn.Module, device: torch.device) -> None:
    """The block's frozen weights to `device`; trained parameters stay where the optimizer has them."""
    for param in block.parameters():
        if not param.requires_grad and param.device != device:
            param.data = param.data.to(device, non_blocking=True)


class BlockSwap:
    """kohya's swap schedule on one run of blocks (a ModuleList), as hooks."""

    def __init__(self, blocks: Sequence[torch.nn.Module], to_swap: int, device: torch.device,
                 host: torch.device = HOST, move: Move = move_frozen):
        self.blocks, self.to_swap, self.device, self.host, self.move = list(blocks), to_swap, device, host, move
        n = len(self.blocks)
        self.forward_swaps, self.backward_swaps = forward_swaps(n, to_swap), backward_swaps(n, to_swap)
        self.in_forward = False
        self.handles: list[Any] = []

    def _swap(self, leaves: int, arrives: int) -> None:
        self.move(self.blocks[leaves], self.host)
        self.move(self.blocks[arrives], self.device)

    def start(self) -> None:
        """Before the model's forward: the first n - k blocks on the device, the rest in host memory."""
        self.in_forward = True
        for i, block in enumerate(self.blocks):
            self.move(block, self.device if i < len(self.blocks) - self.to_swap else self.host)

    def end(self) -> None:
        self.in_forward = False

    def install(self) -> None:
        for index, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_hook(self._after_forward(index)))

    def _after_forward(self, index: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not self.in_forward:
                return  # a recomputation inside backward (gradient checkpointing)
            if index in self.forward_swaps:
                self._swap(*self.forward_swaps[index])
            # The gradient of this block's output is ready once the next block's backward is done.
            swap = self.backward_swaps.get(index + 1)
            tensor = _first_grad_tensor(output)
            if swap is not None and tensor is not None:
                fired: list[bool] = []

                def on_grad(grad: torch.Tensor) -> None:
                    if not fired:
                        fired.append(True)
                        self._swap(*swap)
                tensor.register_hook(on_grad)
        return hook


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    items = output if isinstance(output, (tuple, list)) else (output,)
    return next((t for t in items if isinstance(t, torch.Tensor) and t.requires_grad), None)


class Offloading:
    """The run's block swaps and checkpoint offload around the denoiser's forward."""

    def __init__(self, swaps: Sequence[BlockSwap], offload_checkpoints: bool):
        self.swaps, self.offload_checkpoints = list(swaps), offload_checkpoints
        self._saving: contextlib.AbstractContextManager | None = None

    def install(self, denoiser: torch.nn.Module) -> None:
        for swap in self.swaps:
            swap.install()
        denoiser.register_forward_pre_hook(self._before)
        denoiser.register_forward_hook(self._after)

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        for swap in self.swaps:
            swap.start()
        if self.offload_checkpoints and torch.is_grad_enabled():
            self._saving = torch.autograd.graph.save_on_cpu(pin_memory=True)
            self._saving.__enter__()

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._saving is not None:
            self._saving.__exit__(None, None, None)
            self._saving = None
        for swap in self.swaps:
            swap.end()


def install_offloading(denoiser: torch.nn.Module, plan: Sequence[tuple[Sequence[torch.nn.Module], int]],
                       offload_checkpoints: bool, device: torch.device, move: Move = move_frozen,
                       host: torch.device = HOST) -> Offloading | None:
    """Hooks for the family's swap plan ((blocks, how many of them to swap) per run of blocks) and for
    cpu_offload_checkpointing. `move` and `host` are for tests, which stand in for a device."""
    swaps = [BlockSwap(blocks, count, device, host, move) for blocks, count in plan if count]
    if not swaps and not offload_checkpoints:
        return None
    offloading = Offloading(swaps, offload_checkpoints)
    offloading.install(denoiser)
    return offloading
