"""LoHa and LoKr through peft, in the LyCORIS key format that ComfyUI and AUTOMATIC1111 read.

    <kohya name>.hada_w1_a [out, r]   .hada_w1_b [r, in*k*k]   .hada_w2_a   .hada_w2_b   .alpha
        delta = (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / r, reshaped to the layer's weight
    <kohya name>.lokr_w1 [a, c] (or .lokr_w1_a [a, r], .lokr_w1_b [r, c])
    <kohya name>.lokr_w2 [b, d(, k, k)] (or .lokr_w2_a [b, r], .lokr_w2_b [r, d*k*k])   .alpha
        delta = kron(w1, w2) * alpha / r; a reader takes r from w1_b or w2_b and uses scale 1 when both
        matrices are whole, so such layers are trained with scale 1 here too (as LyCORIS does)

peft's LoHaLayer / LoKrLayer use the same parameter names, shapes and scale (alpha / r), so the file holds the
parameters as they are. Conv layers use the flattened form, or with LyCORIS' use_tucker the Tucker form that peft
calls effective conv2d and LyCORIS writes the same way: `hada_t1` / `hada_t2` [r, r, k, k] with `hada_w*_a` [r, out]
and `hada_w*_b` [r, in]; `lokr_t2` [r, r, k, k] with `lokr_w2_a` [r, b], `lokr_w2_b` [r, d].
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

LOHA_ROLES = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
LOKR_ROLES = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


def is_lycoris_layer(module: nn.Module) -> bool:
    from peft.tuners.lycoris_utils import LycorisLayer

    return isinstance(module, LycorisLayer)


def roles(layer: nn.Module, adapter_name: str = "default") -> dict[str, nn.Parameter]:
    """The layer's parameters for `adapter_name` by their LyCORIS key role, in a fixed order."""
    names = LOHA_ROLES if hasattr(layer, "hada_w1_a") else LOKR_ROLES
    found = {}
    for name in names:
        params = getattr(layer, name)
        if adapter_name in params:
            found[name] = params[adapter_name]
    return found


@contextlib.contextmanager
def _lycoris_factorization() -> Iterator[None]:
    """peft's LoKr split of a dimension by `factor`, ordered as LyCORIS orders it (smaller part first).

    For a dimension divisible by `factor`, peft returns (factor, dimension // factor) as it comes, LyCORIS
    (functional/general.py factorization) the smaller first: with factor=8 a 32-wide layer is kron([4, 4], [8, 8])
    in LyCORIS and kron([8, 8], [4, 4]) in peft. Both files are applied exactly, but a kohya LyCORIS config should
    give LyCORIS' shapes (and its ranks, which depend on them), so peft's helper is wrapped while layers are built.
    """
    import peft.tuners.lokr.layer as lokr_layer

    original = lokr_layer.factorization

    def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
        m, n = original(dimension, factor)
        return (n, m) if m > n else (m, n)

    lokr_layer.factorization = factorization
    try:
        yield
    finally:
        lokr_layer.factorization = original


def attach_lycoris(
    model: nn.Module,
    algo: str,
    targets: Iterable[str],
    rank: int,
    alpha: float,
    overrides: Mapping[str, tuple[int, float]] | None = None,
    rank_dropout: float = 0.0,
    module_dropout: float = 0.0,
    factor: int = -1,
    decompose_both: bool = False,
    adapter_name: str = "default",
    lycoris_shapes: bool = False,
    use_tucker: bool = False,
) -> None:
    """Inject peft LoHa (`algo="loha"`) or LoKr (`"lokr"`) layers; `overrides` maps a target to its (rank, alpha).

    rank_dropout / module_dropout are peft's, which follow LyCORIS (rows of the weight delta are dropped and the
    rest rescaled; module dropout skips the whole delta). `lycoris_shapes` splits LoKr dimensions as LyCORIS does
    (network_module = "lycoris.kohya"); without it peft's split is kept, as files written before have it.
    `use_tucker` gives k x k convs LyCORIS' Tucker factors.
    """
    from peft import LoHaConfig, LoKrConfig, inject_adapter_in_model

    targets = list(targets)
    overrides = dict(overrides or {})
    patterns = {
        "rank_pattern": {re.escape(name): r for name, (r, _) in overrides.items()},
        "alpha_pattern": {re.escape(name): a for name, (_, a) in overrides.items()},
    }
    common = dict(r=rank, alpha=alpha, target_modules=targets, rank_dropout=rank_dropout,
                  module_dropout=module_dropout, use_effective_conv2d=use_tucker, **patterns)
    if algo == "loha":
        config = LoHaConfig(init_weights=True, **common)
    elif algo == "lokr":
        # "lycoris": w2 starts at zero and w1 random, as LyCORIS (peft's own default is the other way round).
        config = LoKrConfig(init_weights="lycoris", decompose_both=decompose_both, decompose_factor=factor,
                            rank_dropout_scale=False, **common)
    else:
        raise ValueError(f"attach_lycoris: unknown algo {algo!r}")
    with _lycoris_factorization() if lycoris_shapes else contextlib.nullcontext():
        inject_adapter_in_model(config, model, adapter_name=adapter_name)
    for _, layer in model.named_modules():
        if not is_lycoris_layer(layer) or adapter_name not in layer.r:
            continue
        parts = roles(layer, adapter_name)
        if "lokr_w1" in parts and "lokr_w2" in parts:
            # Both Kronecker factors whole: readers ignore alpha and apply the delta unscaled (LyCORIS sets
            # alpha = r there); train with the same scale so the file reproduces the model.
            layer.alpha[adapter_name] = float(layer.r[adapter_name])
            layer.scaling[adapter_name] = 1.0
        for param in parts.values():
            param.data = param.data.to(torch.float32)


def export(layer: nn.Module, adapter_name: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The layer's LyCORIS tensors by key role (without the name prefix)."""
    tensors = {}
    for role, param in roles(layer, adapter_name).items():
        tensors[role] = param.detach().to(device="cpu", dtype=dtype or param.dtype).clone().contiguous()
    tensors["alpha"] = torch.tensor(float(layer.alpha[adapter_name]), dtype=torch.float32)
    return tensors


def file_rank(found: Mapping[str, torch.Tensor]) -> int | None:
    """The rank a reader derives from a module's LyCORIS tensors (None for a LoKr whose factors are whole)."""
    for role in ("hada_w1_b", "lokr_w1_b", "lokr_w2_b"):
        if role in found:
            return int(found[role].shape[0])
    return None
