"""A stand-in device for block swapping on the CPU: where each block is, what it found when it ran, every move."""
from __future__ import annotations

import torch

DEVICE, HOST = torch.device("cpu", 0), torch.device("cpu", 1)  # two names for the same memory


class Recorder:
    """The stand-in device: where each block is, what each block found when it ran, and every move."""

    def __init__(self, blocks):
        self.index = {id(b): i for i, b in enumerate(blocks)}
        self.where: dict[int, torch.device] = {}
        self.moves: list[tuple[int, str]] = []
        self.seen: list[tuple[int, bool, int]] = []  # (block, resident, blocks resident)

    def move(self, block, device):
        i = self.index[id(block)]
        if self.where.get(i) != device:
            self.moves.append((i, "device" if device == DEVICE else "host"))
            for param in block.parameters():
                if not param.requires_grad:
                    param.data = param.data.clone()  # a real move gives the weights new storage
        self.where[i] = device

    def watch(self, blocks):
        for block in blocks:
            block.register_forward_pre_hook(lambda m, a: self.seen.append(
                (self.index[id(m)], self.where.get(self.index[id(m)]) == DEVICE,
                 sum(d == DEVICE for d in self.where.values()))))
