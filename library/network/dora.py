"""DoRA with the magnitude on the input axis, the form ComfyUI and AUTOMATIC1111 apply exactly.

    W' = m * (W + dW) / ||W + dW||_col        m: `.dora_scale`, [1, in] (Linear) or [1, in, 1, 1] (conv)

where ||.||_col is the norm over every axis but the input one (LyCORIS `wd_on_output = false`). peft's DoRA keeps the
magnitude per output channel, which AUTOMATIC1111 cannot read and ComfyUI normalises with the norm of W instead.

The layer is peft's plain LoRA plus one fp32 `nn.Parameter` per layer and a forward pre-hook, so DDP / ZeRO see an
ordinary parameter of the prepared module and the LoRA path (dropout hooks, export, LoRA+) stays peft's. A
per-column scale commutes with the matrix product: W' x = (W + dW)(c * x) with c = m / ||W + dW||_col, so the hook
scales the layer's input by c and the wrapped layer computes base + LoRA as usual (the bias is untouched).
"""
from __future__ import annotations

import torch
from torch import nn

MAGNITUDE = "lora_input_magnitude"  # the ParameterDict on each peft layer, keyed by adapter name


def _delta(layer: nn.Module, adapter_name: str) -> torch.Tensor:
    down = layer.lora_A[adapter_name].weight
    up = layer.lora_B[adapter_name].weight
    weight = layer.get_base_layer().weight
    delta = (up.flatten(start_dim=1) @ down.flatten(start_dim=1)).reshape(weight.shape)
    return delta * layer.scaling[adapter_name]


def column_norm(weight: torch.Tensor) -> torch.Tensor:
    """||W||_col shaped [1, in(, 1, 1)]: the norm over the output (and kernel) axes for each input channel."""
    columns = weight.transpose(0, 1).reshape(weight.shape[1], -1).norm(dim=1)
    return columns.reshape(1, weight.shape[1], *[1] * (weight.dim() - 2))


def column_scale(layer: nn.Module, adapter_name: str = "default") -> torch.Tensor:
    """c = m / (||W + dW||_col + eps), [1, in(, 1, 1)] in fp32; eps as LyCORIS and ComfyUI add it.

    The norm is a constant for the gradient (DoRA paper section 4.3, as peft's output-axis DoRA): its value is
    exact, only dW's gradient does not flow through the normalisation.
    """
    magnitude = getattr(layer, MAGNITUDE)[adapter_name]
    with torch.no_grad():
        adapted = layer.get_base_layer().weight.to(torch.float32) + _delta(layer, adapter_name).to(torch.float32)
        norm = column_norm(adapted) + torch.finfo(torch.float32).eps
    return magnitude.to(torch.float32) / norm


class _ScaleInput:
    """Forward pre-hook: the layer's input times c along its channel axis (last for Linear, 1 for conv)."""

    def __init__(self, adapter_name: str):
        self.adapter_name = adapter_name

    def __call__(self, layer: nn.Module, args: tuple) -> tuple:
        if self.adapter_name not in getattr(layer, "active_adapters", [self.adapter_name]) or layer.disable_adapters:
            return args
        x, *rest = args
        scale = column_scale(layer, self.adapter_name)
        scale = scale.reshape(-1) if scale.dim() == 2 else scale.reshape(1, -1, 1, 1)
        return (x * scale.to(dtype=x.dtype), *rest)


def has_input_dora(layer: nn.Module, adapter_name: str = "default") -> bool:
    return adapter_name in getattr(layer, MAGNITUDE, {})


def add_input_dora(layer: nn.Module, adapter_name: str = "default") -> nn.Parameter:
    """Give a peft LoRA layer an input-axis DoRA magnitude, started at ||W||_col so a fresh adapter changes nothing."""
    base = layer.get_base_layer()
    if isinstance(base, nn.Conv2d) and base.groups != 1:
        raise ValueError("input-axis DoRA needs an ungrouped convolution")
    if not hasattr(layer, MAGNITUDE):
        setattr(layer, MAGNITUDE, nn.ParameterDict())
        layer.register_forward_pre_hook(_ScaleInput(adapter_name))
    with torch.no_grad():
        start = column_norm(base.weight.detach().to(torch.float32))
    magnitude = nn.Parameter(start.to(device=base.weight.device))
    getattr(layer, MAGNITUDE)[adapter_name] = magnitude
    return magnitude

