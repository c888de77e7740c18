"""What training does to the adapter beyond the optimizer: LoRA+ and block learning-rate groups, kohya's max-norm
regularisation (scale_weight_norms) and an EMA of the adapter weights."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from library.config import UserError
from library.network import kohya_format, lora, lycoris_layers
from library.network.blocks import BlockLR

logger = logging.getLogger(__name__)

_KOHYA_GROUP = {"text_encoder": "textencoder"}  # kohya's lr/ metric names


def optimizer_groups(models: Iterable[nn.Module], lr: float, name: str, loraplus_ratio: float | None,
                     block_lr: BlockLR | None = None, adapter_name: str = "default") -> list[dict[str, Any]]:
    """Optimizer groups for the adapters of `models`: one, or with LoRA+ two (kohya: the lora_up weights in a
    second group named "<name> plus" at lr * loraplus_ratio; DoRA magnitudes stay with lora_down).

    With `block_lr` (UNet only), kohya's groups per block instead: "unet_block<i>" at lr * the block's weight, in
    the order the blocks first appear, each split for LoRA+ as above.
    """
    models = list(models)
    if block_lr is not None:
        by_block: dict[int, list[nn.Module]] = {}
        for model in models:
            for module_name, layer in lora.lora_layers(model, adapter_name):
                by_block.setdefault(block_lr.index(module_name), []).append(layer)
        groups = []
        for index, layers in by_block.items():
            weight = block_lr.weights[index] if index >= 0 else 1.0
            groups += _groups(layers, lr * weight, f"{name}_block{index}", loraplus_ratio, adapter_name)
        return groups
    layers = [layer for model in models for _, layer in lora.lora_layers(model, adapter_name)]
    return _groups(layers, lr, name, loraplus_ratio, adapter_name)


def _groups(layers: list[nn.Module], lr: float, name: str, loraplus_ratio: float | None,
            adapter_name: str) -> list[dict[str, Any]]:
    params = [(layer, param) for layer in layers for param in lora.layer_parameters(layer, adapter_name).values()]
    if loraplus_ratio is None:
        return [{"params": [param for _, param in params], "lr": lr, "name": name}]
    plus = [param for layer, param in params if lora.is_up_weight(layer, param, adapter_name)]
    rest = [param for layer, param in params if not lora.is_up_weight(layer, param, adapter_name)]
    return [{"params": rest, "lr": lr, "name": name},
            {"params": plus, "lr": lr * loraplus_ratio, "name": f"{_KOHYA_GROUP.get(name, name)} plus"}]


@torch.no_grad()
def apply_max_norm(models: Iterable[nn.Module], max_norm: float,
                   adapter_name: str = "default") -> dict[str, float]:
    """kohya's apply_max_norm_regularization over every LoRA layer; returns kohya's metrics.

    For each layer, the norm of up @ down * alpha / rank is clamped below at max_norm / 2 and compared with
    max_norm; above it, down and up are both scaled by sqrt(max_norm / norm). The metrics are the number of layers
    scaled and the mean and largest norm after scaling.
    """
    norms: list[float] = []
    keys_scaled = 0
    for model in models:
        for _, layer in lora.lora_layers(model, adapter_name):
            params = lora.layer_parameters(layer, adapter_name)
            if isinstance(layer, lycoris_layers.AdapterLayer):
                # LyCORIS' own rule per algorithm: Diag-OFT clamps its blocks' norm; IA3, DyLoRA and norms have
                # none (LyCORIS skips them)
                rule = lycoris_layers.max_norm_delta(layer)
                if rule is None:
                    continue
                updown, factors = rule
                params = {"oft_blocks": factors[0]}
            elif "lora_down.weight" in params:
                down, up = params["lora_down.weight"], params["lora_up.weight"]
                # For a 3x3 conv, up (1x1) after down (3x3) has the same Frobenius norm as the flattened product.
                updown = (up.float().flatten(1) @ down.float().flatten(1)) * layer.scaling[adapter_name]
                factors = [down, up]
            else:
                # LoHa / LoKr as LyCORIS' apply_max_norm: the norm of the scaled weight delta; each factor of the
                # product takes an equal root of the ratio (LoHa's delta is the product of four, LoKr's of its
                # Kronecker factors' parts), so the delta scales by the ratio.
                updown = layer.get_delta_weight(adapter_name).float()
                factors = list(params.values())
            norm = updown.norm().clamp(min=max_norm / 2)
            desired = norm.clamp(max=max_norm)
            ratio = (desired / norm).item()
            if ratio != 1:
                keys_scaled += 1
                root = _factor_count(params)
                for factor in factors:
                    factor.mul_(ratio ** (1 / root))
            norms.append(updown.norm().item() * ratio)
    if not norms:
        return {}
    return {"max_norm/keys_scaled": float(keys_scaled), "max_norm/average_key_norm": sum(norms) / len(norms),
            "max_norm/max_key_norm": max(norms)}


def _factor_count(params: Mapping[str, nn.Parameter]) -> int:
    """How many of a layer's tensors multiply into its delta (each is scaled by that root of the max-norm ratio).

    LoRA: down and up. LoHa: (w1_a w1_b) * (w2_a w2_b), with Tucker (t1 x w1_a x w1_b) * (t2 x w2_a x w2_b): each
    Hadamard side is a product of 2 (or 3) tensors, and a side's scale is the product of its tensors' scales, so
    every tensor takes the root of the ratio's square root. LoKr: kron(w1, w2), each side whole or a product.
    """
    if "hada_w1_a" in params:
        per_side = 3 if "hada_t1" in params else 2
        return 2 * per_side
    return len(params) if "lora_down.weight" not in params else 2


def after_optimizer_step(models: Iterable[nn.Module], max_norm: float | None,
                         ema: "AdapterEMA | None" = None) -> dict[str, float]:
    """What runs after each optimizer step that updated the weights; returns metrics to log. The EMA follows the
    weights as max-norm left them."""
    logs: dict[str, float] = {}
    if max_norm is not None:
        logs.update(apply_max_norm(models, max_norm))
    if ema is not None:
        ema.update()
    return logs


class AdapterEMA:
    """An exponential moving average of the adapter's trainable tensors, kept in fp32 beside them.

    After each optimizer step: ema = decay * ema + (1 - decay) * weight. Keyed by the kohya file keys
    ("lora_unet_..._to_q.lora_down.weight"), so the state dir's copy is readable and survives a rebuilt model. With
    several adapters (a family that trains one per expert), each adapter but "default" has its name and "/" before
    its keys; every adapter's average moves after each optimizer step, also one whose weights that step kept.
    """

    def __init__(self, modules: Mapping[str, nn.Module], decay: float,
                 adapter_names: str | Sequence[str] = "default", rename: kohya_format.Rename | None = None):
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params: dict[str, nn.Parameter] = {
            f"{'' if adapter == 'default' else adapter + '/'}{name}.{role}": param
            for adapter in ([adapter_names] if isinstance(adapter_names, str) else adapter_names)
            for name, (_, layer) in kohya_format.kohya_layer_names(modules, adapter, rename).items()
            for role, param in lora.layer_parameters(layer, adapter).items()}
        self.shadow: dict[str, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """Start the average at the current weights."""
        self.shadow = {key: param.detach().float().clone() for key, param in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for key, param in self.params.items():
            self.shadow[key].lerp_(param.detach().float(), 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {key: value.detach().cpu().clone() for key, value in self.shadow.items()}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        missing = sorted(set(self.shadow) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self.shadow))
        if missing or unexpected:
            raise ValueError(f"EMA weights do not fit the adapter: {len(missing)} missing (e.g. {missing[:3]}), "
                             f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})")
        for key, value in state_dict.items():
            if value.shape != self.shadow[key].shape:
                raise ValueError(f"EMA weight {key}: shape {tuple(value.shape)}, "
                                 f"adapter {tuple(self.shadow[key].shape)}")
            self.shadow[key].copy_(value.to(self.shadow[key].device, torch.float32))

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The adapter holds the EMA weights inside the block, and exactly its own weights again after it."""
        kept = {key: param.detach().clone() for key, param in self.params.items()}
        try:
            with torch.no_grad():
                for key, param in self.params.items():
                    param.copy_(self.shadow[key].to(param.dtype))
            yield
        finally:
            with torch.no_grad():
                for key, param in self.params.items():
                    param.copy_(kept[key])


def ema_writer(ema: AdapterEMA) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        kohya_format.save_lora_file(path, ema.state_dict(), {"ema_decay": str(ema.decay)}, add_hashes=False)
    return write


def ema_reader(ema: AdapterEMA) -> Callable[[Path], None]:
    def read(path: Path) -> None:
        if not path.is_file():
            # The run that saved this state had no EMA: start the average at the resumed weights.
            logger.warning("%s: the state has no EMA weights; the EMA starts from the resumed adapter", path.parent)
            ema.reset()
            return
        try:
            ema.load_state_dict(kohya_format.load_kohya_lora(path)[0])
        except ValueError as e:
            raise UserError(f"{path}: {e}") from None
    return read
