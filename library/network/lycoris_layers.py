"""LyCORIS' IA3, Diag-OFT, DyLoRA and norm training as small layers wrapped around the base layer, in LyCORIS'
key format (what lycoris.kohya writes and ComfyUI / AUTOMATIC1111 read):

    IA3        <name>.weight [out] or [in] (Linear), [1, out|in, 1, 1] (conv)   <name>.on_input 0-dim int
               W' = W * (1 + weight) along the output axis, or the input axis with on_input; the bias is unchanged
    Diag-OFT   <name>.oft_blocks [n, b, b]   <name>.alpha 0-dim (the constraint)   (<name>.rescale [out, 1, ...])
               Q = B - B^T, scaled down to norm constraint * out where it is larger; R = (I + Q)(I - Q)^-1 per
               block; W' = R^T W on each block of b output rows (then rescale * W')
    DyLoRA     <name>.lora_down.weight [r, in(, k, k)]   <name>.lora_up.weight [out, r(, 1, 1)]   <name>.alpha
               a plain LoRA file; in training each step uses the first j blocks of `block_size` ranks, only block j
               learning (the others detached), scaled alpha / j as LyCORIS does; kohya's networks.dylora uses
               every rank with one random block of `unit` learning, scaled alpha / r * sqrt(r / (its first rank
               + unit))
    norms      <name>.w_norm [C]   <name>.b_norm [C]: LayerNorm / GroupNorm weight and bias + the diffs

peft has IA3 and OFT, but its IA3 scales the bias too (a file reader does not) and its OFT has another
parametrisation and constraint; it has neither DyLoRA nor norm training. lycoris-lora's own modules patch the
base layer's forward from outside the model and draw DyLoRA's rank from Python's global `random`. These layers sit
in the model like peft's (DDP / DeepSpeed see ordinary parameters), draw from the torch RNG that a state saves,
and compute LyCORIS' forward (its default, non-bypass mode).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

ALGOS = ("ia3", "diag-oft", "dylora")


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """LyCORIS' split of `dimension` into (m, n), m <= n, m as close to `factor` as divides (lycoris/functional/
    general.py)."""
    if factor > 0 and dimension % factor == 0:
        m, n = factor, dimension // factor
        return (n, m) if m > n else (m, n)
    if factor < 0:
        factor = dimension
    m, n = 1, dimension
    length = m + n
    while m < n:
        new_m = m + 1
        while dimension % new_m != 0:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > length or new_m > factor:
            break
        m, n = new_m, new_n
    return (n, m) if m > n else (m, n)


class AdapterLayer(nn.Module):
    """A base layer with one LyCORIS adapter; `roles()` are the trainable tensors, `export()` the file's."""

    algo = ""

    def __init__(self, base_layer: nn.Module, adapter_name: str, module_dropout: float = 0.0):
        super().__init__()
        self.base_layer = base_layer
        self.adapter_name = adapter_name
        self.module_dropout = module_dropout
        self._disable_adapters = False  # as peft's layers name it: the base layer's output alone (lora.adapters_off)

    def get_base_layer(self) -> nn.Module:
        return self.base_layer

    def roles(self) -> dict[str, nn.Parameter]:
        raise NotImplementedError

    def export(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        return {role: _copy(param, dtype) for role, param in self.roles().items()}

    def file_roles(self) -> tuple[str, ...]:
        """The keys the file holds for this layer (the constants included)."""
        return tuple(self.roles())

    def import_tensors(self, found: Mapping[str, torch.Tensor]) -> tuple[list[tuple[nn.Parameter, torch.Tensor]],
                                                                        list[str]]:
        """(parameter, value) pairs from a file's tensors for this layer, and problems (shapes, constants)."""
        pairs, problems = [], []
        for role, param in self.roles().items():
            value = found[role]
            if value.numel() != param.numel():
                problems.append(f"{role}: shape {tuple(value.shape)} in file, {tuple(param.shape)} in model")
            else:
                pairs.append((param, value.reshape(param.shape)))
        return pairs, problems

    def _dropped(self) -> bool:
        """Whether this call leaves the adapter out: switched off, or dropped by module_dropout."""
        return self._disable_adapters or bool(self.training and self.module_dropout
                                               and torch.rand(1) < self.module_dropout)


def _copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).clone().contiguous()


class _WeightAdapter(AdapterLayer):
    """Linear / conv layers: output = base(x) + op(x, delta W), as LyCORIS' non-bypass forward."""

    def delta_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def _op(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if isinstance(base, nn.Linear):
            return F.linear(x, weight)
        conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[weight.dim() - 2]
        return conv(x, weight, None, base.stride, base.padding, base.dilation, base.groups)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        if self._dropped():
            return result
        delta = self.delta_weight()
        return result + self._op(x.to(delta.dtype), delta).to(result.dtype)

    @property
    def base_weight(self) -> torch.Tensor:
        return self.base_layer.weight


class IA3Layer(_WeightAdapter):
    algo = "ia3"

    def __init__(self, base_layer: nn.Module, adapter_name: str, train_on_input: bool, module_dropout: float = 0.0):
        super().__init__(base_layer, adapter_name, module_dropout)
        weight = base_layer.weight
        dim = weight.shape[1] if train_on_input else weight.shape[0]
        shape = (dim,) if isinstance(base_layer, nn.Linear) else (1, dim, *[1] * (weight.dim() - 2))
        self.weight = nn.Parameter(torch.zeros(shape, device=weight.device, dtype=torch.float32))
        self.on_input = bool(train_on_input)

    def roles(self) -> dict[str, nn.Parameter]:
        return {"weight": self.weight}

    def export(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        return {"weight": _copy(self.weight, dtype), "on_input": torch.tensor(int(self.on_input))}

    def file_roles(self) -> tuple[str, ...]:
        return ("weight", "on_input")

    def import_tensors(self, found):
        pairs, problems = super().import_tensors(found)
        if bool(int(found["on_input"])) != self.on_input:
            problems.append(f"on_input {int(found['on_input'])} in file, {int(self.on_input)} in model (set "
                            "train_on_input to the file's)")
        return pairs, problems

    def delta_weight(self) -> torch.Tensor:
        weight = self.base_weight.to(self.weight.dtype)
        scale = self.weight.reshape(-1)
        if self.on_input:
            return weight * scale.reshape(1, -1, *[1] * (weight.dim() - 2))
        return weight * scale.reshape(-1, *[1] * (weight.dim() - 1))


class DiagOFTLayer(_WeightAdapter):
    algo = "diag-oft"

    def __init__(self, base_layer: nn.Module, adapter_name: str, lora_dim: int, constraint: float = 0.0,
                 rescaled: bool = False, module_dropout: float = 0.0):
        super().__init__(base_layer, adapter_name, module_dropout)
        weight = base_layer.weight
        out_dim = weight.shape[0]
        self.block_size, self.block_num = factorization(out_dim, lora_dim)
        self.constraint = float(constraint)
        self.oft_blocks = nn.Parameter(torch.zeros(self.block_num, self.block_size, self.block_size,
                                                   device=weight.device, dtype=torch.float32))
        self.rescale = None
        if rescaled:
            self.rescale = nn.Parameter(torch.ones(out_dim, *[1] * (weight.dim() - 1), device=weight.device,
                                                   dtype=torch.float32))

    def roles(self) -> dict[str, nn.Parameter]:
        found = {"oft_blocks": self.oft_blocks}
        if self.rescale is not None:
            found["rescale"] = self.rescale
        return found

    def export(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        tensors = super().export(dtype)
        tensors["alpha"] = torch.tensor(self.constraint, dtype=torch.float32)
        return tensors

    def file_roles(self) -> tuple[str, ...]:
        return (*self.roles(), "alpha")

    def import_tensors(self, found):
        pairs, problems = super().import_tensors(found)
        if not math.isclose(float(found["alpha"]), self.constraint, rel_tol=1e-6, abs_tol=1e-9):
            problems.append(f"alpha (constraint) {float(found['alpha']):g} in file, {self.constraint:g} in model "
                            "(set constraint to the file's)")
        return pairs, problems

    def rotation(self) -> torch.Tensor:
        # in float32 whatever the blocks' dtype (full_bf16): the inverse needs it, and R must be near-orthogonal
        blocks = self.oft_blocks.float()
        eye = torch.eye(self.block_size, device=blocks.device, dtype=blocks.dtype)
        q = blocks - blocks.transpose(1, 2)
        limit = self.constraint * self.base_weight.shape[0]
        if limit > 0:
            norm = torch.norm(q) + 1e-8
            if norm > limit:
                q = q * limit / norm
        return (eye + q) @ (eye - q).inverse()

    def delta_weight(self) -> torch.Tensor:
        r = self.rotation()
        weight = self.base_weight.to(r.dtype)
        out_dim, *rest = weight.shape
        blocks = weight.reshape(self.block_num, self.block_size, *rest)
        rotated = torch.einsum("k n m, k n ... -> k m ...", r, blocks).reshape(out_dim, *rest)
        if self.rescale is not None:
            rotated = self.rescale * rotated
        return rotated - weight


class DyLoRALayer(_WeightAdapter):
    algo = "dylora"

    def __init__(self, base_layer: nn.Module, adapter_name: str, lora_dim: int, alpha: float, block_size: int,
                 module_dropout: float = 0.0, kohya: bool = False):
        super().__init__(base_layer, adapter_name, module_dropout)
        self.kohya = kohya
        if lora_dim % block_size:
            raise ValueError(f"DyLoRA: the rank {lora_dim} must be a multiple of block_size {block_size}")
        weight = base_layer.weight
        self.r = lora_dim
        self.block_size = block_size
        self.alpha = float(alpha) if alpha else float(lora_dim)
        fan_in = math.prod(weight.shape[1:])
        self.down = nn.ParameterList()
        self.up = nn.ParameterList()
        for _ in range(lora_dim // block_size):
            down = torch.empty(block_size, fan_in, device=weight.device, dtype=torch.float32)
            nn.init.kaiming_uniform_(down, a=math.sqrt(5))
            self.down.append(nn.Parameter(down))
            self.up.append(nn.Parameter(torch.zeros(weight.shape[0], block_size, device=weight.device,
                                                    dtype=torch.float32)))

    def roles(self) -> dict[str, nn.Parameter]:
        return {**{f"lora_down.weight.{i}": p for i, p in enumerate(self.down)},
                **{f"lora_up.weight.{i}": p for i, p in enumerate(self.up)}}

    def file_roles(self) -> tuple[str, ...]:
        return ("lora_down.weight", "lora_up.weight", "alpha")

    def export(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        shape = self.base_weight.shape
        down = torch.cat(list(self.down)).reshape(self.r, *shape[1:])
        up = torch.cat(list(self.up), dim=1).reshape(shape[0], self.r, *[1] * (len(shape) - 2))
        return {"lora_down.weight": _copy(down, dtype), "lora_up.weight": _copy(up, dtype),
                "alpha": torch.tensor(self.alpha, dtype=torch.float32)}

    def import_tensors(self, found):
        down, up = found["lora_down.weight"], found["lora_up.weight"]
        problems = []
        if down.shape[0] != self.r or down[0].numel() != self.down[0].shape[1] or up.numel() != (
                self.base_weight.shape[0] * self.r):
            return [], [f"lora_down / lora_up: shapes {tuple(down.shape)} / {tuple(up.shape)} in file, rank "
                        f"{self.r} in model"]
        if not math.isclose(float(found["alpha"]), self.alpha, rel_tol=1e-3, abs_tol=1e-6):
            problems.append(f"alpha {float(found['alpha']):g} in file, {self.alpha:g} in model")
        down = down.reshape(self.r, -1).split(self.block_size)
        up = up.reshape(up.shape[0], self.r).split(self.block_size, dim=1)
        return list(zip(self.down, down, strict=True)) + list(zip(self.up, up, strict=True)), problems

    def delta_weight(self) -> torch.Tensor:
        blocks = len(self.down)
        if self.training and self.kohya:
            # kohya's networks/dylora.py: every rank, one random block of `unit` learning, scaled by
            # alpha / rank * sqrt(rank / (the block's first rank + unit))
            first = int(torch.randint(0, self.r, (1,)).item())
            first -= first % self.block_size
            learning = first // self.block_size
            downs = [p if i == learning else p.detach() for i, p in enumerate(self.down)]
            ups = [p if i == learning else p.detach() for i, p in enumerate(self.up)]
            scale = self.alpha / self.r * math.sqrt(self.r / (first + self.block_size))
        elif self.training:
            # LyCORIS: a random number of blocks, only the last of them learning, scaled alpha / blocks
            used = int(torch.randint(0, blocks, (1,)).item()) + 1
            downs = [p.detach() for p in self.down[:used - 1]] + [self.down[used - 1]]
            ups = [p.detach() for p in self.up[:used - 1]] + [self.up[used - 1]]
            scale = self.alpha / used
        else:
            # what the file means: every rank, alpha / rank
            downs, ups, scale = list(self.down), list(self.up), self.alpha / self.r
        delta = torch.cat(ups, dim=1) @ torch.cat(downs)
        return (delta * scale).reshape(self.base_weight.shape)


class NormLayer(AdapterLayer):
    """LyCORIS' train_norm: LayerNorm / GroupNorm with trained diffs of its weight and bias."""

    algo = "norm"

    def __init__(self, base_layer: nn.Module, adapter_name: str, module_dropout: float = 0.0):
        super().__init__(base_layer, adapter_name, module_dropout)
        weight = base_layer.weight
        self.w_norm = nn.Parameter(torch.zeros(weight.numel(), device=weight.device, dtype=torch.float32))
        self.b_norm = None
        if base_layer.bias is not None:
            self.b_norm = nn.Parameter(torch.zeros(weight.numel(), device=weight.device, dtype=torch.float32))

    def roles(self) -> dict[str, nn.Parameter]:
        found = {"w_norm": self.w_norm}
        if self.b_norm is not None:
            found["b_norm"] = self.b_norm
        return found

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if self._dropped():
            return base(x)
        weight = base.weight.to(self.w_norm.dtype) + self.w_norm.reshape(base.weight.shape)
        bias = None if self.b_norm is None else base.bias.to(self.b_norm.dtype) + self.b_norm.reshape(
            base.bias.shape)
        if isinstance(base, nn.GroupNorm):
            out = F.group_norm(x.to(weight.dtype), base.num_groups, weight, bias, base.eps)
        else:
            out = F.layer_norm(x.to(weight.dtype), base.normalized_shape, weight, bias, base.eps)
        return out.to(x.dtype)


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) and module.weight is not None


def attach(model: nn.Module, algo: str, targets: list[str], rank: int, alpha: float,
           overrides: Mapping[str, tuple[int, float]], adapter_name: str = "default", *,
           train_on_input: bool = False, constraint: float = 0.0, rescaled: bool = False, block_size: int = 4,
           module_dropout: float = 0.0, kohya: bool = False) -> None:
    """Wrap each target (a Linear / conv, or with algo "norm" a LayerNorm / GroupNorm) in the algo's layer;
    `overrides` gives some targets their own (rank, alpha) (conv_dim / conv_alpha)."""
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        if isinstance(base, AdapterLayer):
            raise ValueError(f"{name} has a LyCORIS adapter already")
        layer_rank, layer_alpha = overrides.get(name, (rank, alpha))
        layer: AdapterLayer
        if algo == "norm":
            layer = NormLayer(base, adapter_name, module_dropout)
        elif algo == "ia3":
            layer = IA3Layer(base, adapter_name, train_on_input, module_dropout)
        elif algo == "diag-oft":
            layer = DiagOFTLayer(base, adapter_name, layer_rank, constraint, rescaled, module_dropout)
        elif algo == "dylora":
            layer = DyLoRALayer(base, adapter_name, layer_rank, layer_alpha, block_size, module_dropout, kohya)
        else:
            raise ValueError(f"unknown LyCORIS algo {algo!r}")
        setattr(parent, child, layer)


def layers(model: nn.Module, adapter_name: str = "default") -> list[tuple[str, AdapterLayer]]:
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, AdapterLayer) and module.adapter_name == adapter_name]


@torch.no_grad()
def max_norm_delta(layer: AdapterLayer) -> tuple[torch.Tensor, list[nn.Parameter]] | None:
    """(the norm LyCORIS' apply_max_norm clamps, the tensors it scales), or None where LyCORIS has no max-norm
    (IA3, DyLoRA and norms keep LycorisBaseModule's, which scales nothing)."""
    if isinstance(layer, DiagOFTLayer):
        return layer.oft_blocks.norm(), [layer.oft_blocks]
    return None
