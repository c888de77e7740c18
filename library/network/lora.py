"""LoRA through peft: kohya's targets inside blocks, attaching LoRA / DoRA / LoHa / LoKr, and their layers.

peft owns the trainable layers (so DDP/DeepSpeed see ordinary parameters); this module only chooses the targets like
kohya's `networks.lora`. The kohya-format file is library.network.kohya_format.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from library.network import dora, lycoris, lycoris_layers

# kohya networks/lora.py: LoRA goes on every Linear / 1x1 Conv2d inside these blocks.
UNET_TARGET_BLOCKS = ("Transformer2DModel",)
# kohya's LoRA_TARGET_REPLACE_MODULE_CONV2D_3X3, used with conv_dim: 3x3 convs get conv_dim / conv_alpha, the
# Linear and 1x1 convs there (time_emb_proj, conv_shortcut) network_dim / network_alpha.
UNET_CONV_TARGET_BLOCKS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
TEXT_ENCODER_TARGET_BLOCKS = ("CLIPAttention", "CLIPSdpaAttention", "CLIPFlashAttention2", "CLIPMLP",
                              "T5Attention", "T5DenseGatedActDense")  # T5: FLUX's train_t5xxl (kohya's lora_flux)

_DOWN = "lora_down.weight"
_UP = "lora_up.weight"
_DORA = "dora_scale"
_MAX_LISTED = 10


# --------------------------------------------------------------------------------------------- targets


def _base_layer(module: nn.Module) -> nn.Module:
    # After attach the Linear sits inside a peft wrapper under the same name; look through it so that
    # listing targets gives the same answer before and after attach.
    get_base = getattr(module, "get_base_layer", None)
    return get_base() if callable(get_base) else module


def _is_lora_wrapper(module: nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, (BaseTunerLayer, lycoris_layers.AdapterLayer))


def _is_conv_3x3(layer: nn.Module) -> bool:
    return isinstance(layer, nn.Conv2d) and tuple(layer.kernel_size) != (1, 1)


def _targets_inside(model: nn.Module, block_classes: tuple[str, ...], allow_conv_1x1: bool,
                    allow_conv: bool = False) -> list[str]:
    found: list[str] = []
    seen: set[str] = set()
    for block_name, block in model.named_modules():
        if not any(cls.__name__ in block_classes for cls in type(block).__mro__):
            continue
        wrappers: list[str] = []
        for name, module in block.named_modules(prefix=block_name):
            if any(name.startswith(w + ".") for w in wrappers):
                continue  # peft's own lora_A / lora_B / base_layer
            if _is_lora_wrapper(module):
                wrappers.append(name)
            layer = _base_layer(module)
            is_target = isinstance(layer, nn.Linear) or (
                allow_conv_1x1 and isinstance(layer, nn.Conv2d) and tuple(layer.kernel_size) == (1, 1)
            ) or (allow_conv and _is_conv_3x3(layer))
            if is_target and name not in seen:
                seen.add(name)
                found.append(name)
    return found


def unet_target_modules(unet: nn.Module) -> list[str]:
    """Exact module names kohya's default LoRA trains in a diffusers UNet (SD1.x, SD2.x, SDXL).

    Every Linear and 1x1 Conv2d inside each Transformer2DModel: proj_in/proj_out (1x1 conv in SD1.x, Linear in
    SD2.x/SDXL), attn1/attn2 to_q/to_k/to_v/to_out.0, ff.net.0.proj, ff.net.2. ResNets, samplers and the time
    embedding are not targeted (kohya needs conv_dim for those).
    """
    names = _targets_inside(unet, UNET_TARGET_BLOCKS, allow_conv_1x1=True)
    if not names:
        raise ValueError(f"no Transformer2DModel blocks found in {type(unet).__name__}: not an SD UNet?")
    return names


def unet_conv_target_modules(unet: nn.Module) -> tuple[list[str], list[str]]:
    """What kohya's conv_dim adds to the default targets: (Linear / 1x1 conv names, 3x3 conv names).

    Inside every ResnetBlock2D, Downsample2D and Upsample2D: conv1, conv2 and the samplers' conv (3x3, trained
    with conv_dim / conv_alpha), time_emb_proj and conv_shortcut (trained with network_dim / network_alpha).
    """
    names = _targets_inside(unet, UNET_CONV_TARGET_BLOCKS, allow_conv_1x1=True, allow_conv=True)
    if not names:
        raise ValueError(f"no ResnetBlock2D blocks found in {type(unet).__name__}: not an SD UNet?")
    modules = dict(unet.named_modules())
    conv = [name for name in names if _is_conv_3x3(_base_layer(modules[name]))]
    return [name for name in names if name not in set(conv)], conv


def text_encoder_target_modules(text_encoder: nn.Module) -> list[str]:
    """Exact module names kohya's default LoRA trains in a CLIP text encoder (q_proj, k_proj, v_proj, out_proj and
    mlp.fc1 / mlp.fc2 of every encoder layer) or in T5 (SelfAttention q, k, v, o and DenseReluDense wi_0, wi_1,
    wo of every block).
    """
    names = _targets_inside(text_encoder, TEXT_ENCODER_TARGET_BLOCKS, allow_conv_1x1=False)
    if not names:
        raise ValueError(f"no CLIP or T5 attention/MLP blocks found in {type(text_encoder).__name__}: not a text "
                         "encoder kohya trains?")
    return names


# --------------------------------------------------------------------------------------------- attach


def _is_lora(layer: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(layer, LoraLayer)


def _has_output_dora(layer: nn.Module, adapter_name: str) -> bool:
    return adapter_name in getattr(layer, "lora_magnitude_vector", {})


def _has_dora(layer: nn.Module, adapter_name: str) -> bool:
    return _has_output_dora(layer, adapter_name) or dora.has_input_dora(layer, adapter_name)


def lora_layers(model: nn.Module, adapter_name: str = "default") -> list[tuple[str, nn.Module]]:
    """(module name, layer) for every LoRA / LoHa / LoKr (peft) or IA3 / Diag-OFT / DyLoRA / norm layer
    (library.network.lycoris_layers) carrying `adapter_name`, in model order."""
    found = []
    for name, module in model.named_modules():
        if _is_lora(module) and adapter_name in module.lora_A:
            found.append((name, module))
        elif lycoris.is_lycoris_layer(module) and adapter_name in module.r:
            found.append((name, module))
        elif isinstance(module, lycoris_layers.AdapterLayer) and module.adapter_name == adapter_name:
            found.append((name, module))
    return found


def layer_parameters(layer: nn.Module, adapter_name: str = "default") -> dict[str, nn.Parameter]:
    """One layer's trainable tensors by their role in the file: lora_down / lora_up (/ dora_scale), or the
    LyCORIS roles."""
    if isinstance(layer, lycoris_layers.AdapterLayer):
        return layer.roles()
    if not _is_lora(layer):
        return lycoris.roles(layer, adapter_name)
    params = {_DOWN: layer.lora_A[adapter_name].weight, _UP: layer.lora_B[adapter_name].weight}
    if _has_output_dora(layer, adapter_name):
        params[_DORA] = layer.lora_magnitude_vector[adapter_name].weight
    elif dora.has_input_dora(layer, adapter_name):
        params[_DORA] = getattr(layer, dora.MAGNITUDE)[adapter_name]
    return params


def lora_parameters(model: nn.Module, adapter_name: str = "default") -> list[nn.Parameter]:
    """The adapter's trainable weights (LoRA down/up, DoRA magnitude, LoHa/LoKr factors), as a list (safe to
    iterate twice)."""
    return [param for _, layer in lora_layers(model, adapter_name)
            for param in layer_parameters(layer, adapter_name).values()]


def is_up_weight(layer: nn.Module, param: nn.Parameter, adapter_name: str = "default") -> bool:
    """Whether `param` is a LoRA up (B) weight, the one LoRA+ trains with a larger learning rate."""
    return _is_lora(layer) and param is layer.lora_B[adapter_name].weight


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Inside the block `model` is its base alone: every adapter layer passes its base layer's output through.
    peft's own switch (`enable_adapters`) also clears and sets requires_grad on the adapter weights, which would
    change what the optimizer trains between two forwards of one step; this flips only the flag their forwards
    read."""
    layers = [module for module in model.modules() if _is_lora_wrapper(module)]
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, was in zip(layers, before, strict=True):
            layer._disable_adapters = was


def attach_lora(
    model: nn.Module,
    target_modules: Iterable[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    adapter_name: str = "default",
    *,
    overrides: Mapping[str, tuple[int, float]] | None = None,
    algo: str = "lora",
    use_dora: bool = False,
    dora_on_output: bool = False,
    rank_dropout: float = 0.0,
    module_dropout: float = 0.0,
    factor: int = -1,
    decompose_both: bool = False,
    lycoris_shapes: bool = False,
    use_tucker: bool = False,
    norm_targets: Iterable[str] = (),
    lycoris_options: Mapping[str, object] | None = None,
) -> list[nn.Parameter]:
    """Inject peft LoRA (or LoHa / LoKr) layers into `model` in place; return the trainable parameters.

    Init as kohya (down: Kaiming-uniform, up: zeros), scale alpha / rank. `overrides` gives some targets their
    own (rank, alpha), as conv_dim / conv_alpha do for 3x3 convs. Adapter weights are kept in fp32 whatever the
    base dtype, and only they require grad afterwards. `dropout` is peft's lora_dropout, applied to the layer
    input before lora_down (kohya's network_dropout, on lora_down's output, is library.network.targets').
    `rank_dropout` and `module_dropout` are LyCORIS' (peft's) for LoHa / LoKr; for LoRA, library.network.targets
    adds kohya's. `use_dora` puts the DoRA magnitude on the input axis (library.network.dora), or with
    `dora_on_output` per output channel (peft's DoRA, LyCORIS wd_on_output).
    """
    targets = list(dict.fromkeys(target_modules))
    norm_targets = list(dict.fromkeys(norm_targets))
    overrides = _checked_request(model, targets, norm_targets, rank, overrides)
    if algo == "lora" and (rank_dropout or module_dropout):
        raise ValueError("attach_lora: kohya's rank/module dropout for LoRA is network_setup.add_kohya_dropout")
    if algo in lycoris_layers.ALGOS:
        lycoris_layers.attach(model, algo, targets, rank, alpha, overrides, adapter_name,
                              module_dropout=module_dropout, **dict(lycoris_options or {}))
    elif algo in ("loha", "lokr"):
        lycoris.attach_lycoris(model, algo, targets, rank, alpha, overrides, rank_dropout, module_dropout, factor,
                               decompose_both, adapter_name, lycoris_shapes, use_tucker)
    elif algo == "lora":
        _inject_lora(model, targets, rank, alpha, dropout, adapter_name, overrides, use_dora, dora_on_output)
    else:
        raise ValueError(f"attach_lora: unknown algo {algo!r}")
    if norm_targets:
        lycoris_layers.attach(model, "norm", norm_targets, rank, alpha, {}, adapter_name,
                              module_dropout=module_dropout)
    wrapped = lora_layers(model, adapter_name)
    _check_attached(wrapped, targets + norm_targets, rank, alpha, overrides, adapter_name)
    _keep_lora_in_fp32(wrapped, adapter_name)
    return _train_only(model, adapter_name)


def _checked_request(model: nn.Module, targets: list[str], norm_targets: list[str], rank: int,
                     overrides: Mapping[str, tuple[int, float]] | None) -> dict[str, tuple[int, float]]:
    """attach_lora's request checked against the model: the overrides as (int rank, float alpha)."""
    if not targets:
        raise ValueError("attach_lora: no target modules given")
    if rank <= 0:
        raise ValueError(f"attach_lora: rank must be positive, got {rank}")
    existing = {name for name, _ in model.named_modules()}
    unknown = [t for t in targets + norm_targets if t not in existing]
    if unknown:
        raise ValueError(f"attach_lora: {len(unknown)} target modules not in the model, e.g. {unknown[:_MAX_LISTED]}")
    checked = {name: (int(r), float(a)) for name, (r, a) in (overrides or {}).items()}
    if any(r <= 0 for r, _ in checked.values()):
        raise ValueError("attach_lora: every rank must be positive")
    return checked


def _inject_lora(model: nn.Module, targets: list[str], rank: int, alpha: float, dropout: float, adapter_name: str,
                 overrides: Mapping[str, tuple[int, float]], use_dora: bool, dora_on_output: bool) -> None:
    """peft's LoRA on the targets, with DoRA on the output axis (peft's) or on the input axis (ours)."""
    from peft import LoraConfig, inject_adapter_in_model

    extra: dict[str, object] = {}
    if overrides:
        # peft reads these as regular expressions matched against the end of each module name.
        extra["rank_pattern"] = {re.escape(name): r for name, (r, _) in overrides.items()}
        extra["alpha_pattern"] = {re.escape(name): a for name, (_, a) in overrides.items()}
    if use_dora and dora_on_output:
        extra["use_dora"] = True
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        init_lora_weights=True,
        bias="none",
        **extra,
    )
    inject_adapter_in_model(config, model, adapter_name=adapter_name)
    if use_dora and not dora_on_output:
        for _, layer in lora_layers(model, adapter_name):
            dora.add_input_dora(layer, adapter_name)


def _check_attached(wrapped: list[tuple[str, nn.Module]], requested: list[str], rank: int, alpha: float,
                    overrides: Mapping[str, tuple[int, float]], adapter_name: str) -> None:
    """The layers came out exactly on the requested modules, each with its requested rank and alpha."""
    # peft matches list entries as name suffixes too; with full names the set must come out exact.
    got = {name for name, _ in wrapped}
    if got != set(requested):
        raise RuntimeError(
            f"peft attached LoRA to {sorted(got ^ set(requested))[:_MAX_LISTED]} unlike the requested targets"
        )
    for name, layer in wrapped:
        if isinstance(layer, lycoris_layers.AdapterLayer):
            continue  # built with the requested shapes; no peft rank / alpha to check
        want_rank, want_alpha = overrides.get(name, (rank, alpha))
        got_alpha = float(layer.lora_alpha[adapter_name] if _is_lora(layer) else layer.alpha[adapter_name])
        whole_lokr = "lokr_w1" in layer_parameters(layer, adapter_name) and "lokr_w2" in layer_parameters(
            layer, adapter_name)
        if layer.r[adapter_name] != want_rank or not (whole_lokr or math.isclose(got_alpha, want_alpha)):
            raise RuntimeError(f"peft built {name} with rank {layer.r[adapter_name]}, alpha {got_alpha}; "
                               f"asked for {want_rank}, {want_alpha}")


def _keep_lora_in_fp32(wrapped: list[tuple[str, nn.Module]], adapter_name: str) -> None:
    # inject_adapter_in_model casts the adapter to the base dtype (bf16/fp16); the optimizer needs fp32.
    # peft's forward casts the input to the LoRA dtype and the sum back to the base dtype.
    for _, layer in wrapped:
        if not _is_lora(layer):
            continue  # attach_lycoris keeps its factors in fp32
        layer.lora_A[adapter_name].to(torch.float32)
        layer.lora_B[adapter_name].to(torch.float32)
        if _has_output_dora(layer, adapter_name):
            layer.lora_magnitude_vector[adapter_name].to(torch.float32)


def _train_only(model: nn.Module, adapter_name: str) -> list[nn.Parameter]:
    """Only the adapter's weights require grad; returns them."""
    params = lora_parameters(model, adapter_name)
    trainable = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    return params


def dora_scale_of(layer: nn.Module, adapter_name: str = "default",
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """The DoRA magnitude as `.dora_scale`: input axis [1, in] / [1, in, 1, 1] as trained; peft's output-axis one
    as [out, 1] for Linear, [out, 1, 1, 1] for conv.

    A column, not peft's flat [out] (or [1, out, 1, 1] for conv): ComfyUI takes a first dimension equal to the
    weight's as "per output channel" and divides it by a [out, 1, ...] norm, which a flat vector would broadcast
    into an [out, out] matrix.
    """
    if dora.has_input_dora(layer, adapter_name):
        magnitude = getattr(layer, dora.MAGNITUDE)[adapter_name].detach()
        return magnitude.to(device="cpu", dtype=dtype or magnitude.dtype).clone().contiguous()
    magnitude = layer.lora_magnitude_vector[adapter_name].weight.detach()
    weight_shape = layer.get_base_layer().weight.shape
    column = magnitude.reshape(weight_shape[0], *[1] * (len(weight_shape) - 1))
    return column.to(device="cpu", dtype=dtype or magnitude.dtype).clone().contiguous()
