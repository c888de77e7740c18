"""LoRA through peft, and the kohya-format LoRA file that ComfyUI, AUTOMATIC1111 and diffusers read.

peft owns the trainable layers (so DDP/DeepSpeed see ordinary parameters); this module only chooses the
targets like kohya's `networks.lora`, and converts between peft's layers and kohya's flat file:

    lora_unet_<module path, "." -> "_">.lora_down.weight   [r, in] or [r, in, 1, 1]
    lora_unet_<module path, "." -> "_">.lora_up.weight     [out, r] or [out, r, 1, 1]
    lora_unet_<module path, "." -> "_">.alpha              0-dim; scale = alpha / r

Conv LoRA (kohya's conv_dim, LyCORIS' LoCon) on 3x3 convs has the same keys with lora_down [r, in, 3, 3] and
lora_up [out, r, 1, 1]. DoRA adds `.dora_scale` [out, 1] or [out, 1, 1, 1]: the magnitude per output channel
(LyCORIS wd_on_output), which ComfyUI recognises by its first dimension matching the weight's. LoHa and LoKr
keys are written by library.network.lycoris.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

from library.network import lycoris
from library.core.atomic import write_atomically

PREFIX_UNET = "lora_unet"
PREFIX_TE = "lora_te"  # SD1.x / SD2.x text encoder
PREFIX_TE1 = "lora_te1"  # SDXL text encoders
PREFIX_TE2 = "lora_te2"

# kohya networks/lora.py: LoRA goes on every Linear / 1x1 Conv2d inside these blocks.
UNET_TARGET_BLOCKS = ("Transformer2DModel",)
# kohya's LoRA_TARGET_REPLACE_MODULE_CONV2D_3X3, used with conv_dim: 3x3 convs get conv_dim / conv_alpha, the
# Linear and 1x1 convs there (time_emb_proj, conv_shortcut) network_dim / network_alpha.
UNET_CONV_TARGET_BLOCKS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
TEXT_ENCODER_TARGET_BLOCKS = ("CLIPAttention", "CLIPSdpaAttention", "CLIPFlashAttention2", "CLIPMLP")

_DOWN = "lora_down.weight"
_UP = "lora_up.weight"
_ALPHA = "alpha"
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

    return isinstance(module, BaseTunerLayer)


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
    """Exact module names kohya's default LoRA trains in a CLIP text encoder.

    q_proj, k_proj, v_proj, out_proj and mlp.fc1 / mlp.fc2 of every encoder layer.
    """
    names = _targets_inside(text_encoder, TEXT_ENCODER_TARGET_BLOCKS, allow_conv_1x1=False)
    if not names:
        raise ValueError(f"no CLIP attention/MLP blocks found in {type(text_encoder).__name__}: not a CLIP text model?")
    return names


# --------------------------------------------------------------------------------------------- attach


def _is_lora(layer: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(layer, LoraLayer)


def _has_dora(layer: nn.Module, adapter_name: str) -> bool:
    return adapter_name in getattr(layer, "lora_magnitude_vector", {})


def lora_layers(model: nn.Module, adapter_name: str = "default") -> list[tuple[str, nn.Module]]:
    """(module name, peft layer) for every LoRA / LoHa / LoKr layer carrying `adapter_name`, in model order."""
    found = []
    for name, module in model.named_modules():
        if _is_lora(module) and adapter_name in module.lora_A:
            found.append((name, module))
        elif lycoris.is_lycoris_layer(module) and adapter_name in module.r:
            found.append((name, module))
    return found


def layer_parameters(layer: nn.Module, adapter_name: str = "default") -> dict[str, nn.Parameter]:
    """One layer's trainable tensors by their role in the file: lora_down / lora_up (/ dora_scale), or the
    LyCORIS roles."""
    if not _is_lora(layer):
        return lycoris.roles(layer, adapter_name)
    params = {_DOWN: layer.lora_A[adapter_name].weight, _UP: layer.lora_B[adapter_name].weight}
    if _has_dora(layer, adapter_name):
        params[_DORA] = layer.lora_magnitude_vector[adapter_name].weight
    return params


def lora_parameters(model: nn.Module, adapter_name: str = "default") -> list[nn.Parameter]:
    """The adapter's trainable weights (LoRA down/up, DoRA magnitude, LoHa/LoKr factors), as a list (safe to
    iterate twice)."""
    return [param for _, layer in lora_layers(model, adapter_name)
            for param in layer_parameters(layer, adapter_name).values()]


def is_up_weight(layer: nn.Module, param: nn.Parameter, adapter_name: str = "default") -> bool:
    """Whether `param` is a LoRA up (B) weight, the one LoRA+ trains with a larger learning rate."""
    return _is_lora(layer) and param is layer.lora_B[adapter_name].weight


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
    rank_dropout: float = 0.0,
    module_dropout: float = 0.0,
    factor: int = -1,
    decompose_both: bool = False,
) -> list[nn.Parameter]:
    """Inject peft LoRA (or LoHa / LoKr) layers into `model` in place; return the trainable parameters.

    Init as kohya (down: Kaiming-uniform, up: zeros), scale alpha / rank. `overrides` gives some targets their
    own (rank, alpha), as conv_dim / conv_alpha do for 3x3 convs. Adapter weights are kept in fp32 whatever the
    base dtype, and only they require grad afterwards. `dropout` is peft's lora_dropout, applied to the layer
    input before lora_down (kohya's network_dropout drops lora_down's output instead). `rank_dropout` and
    `module_dropout` are LyCORIS' (peft's) for LoHa / LoKr; for LoRA, library.network.targets adds kohya's.
    """
    from peft import LoraConfig, inject_adapter_in_model

    targets = list(dict.fromkeys(target_modules))
    if not targets:
        raise ValueError("attach_lora: no target modules given")
    if rank <= 0:
        raise ValueError(f"attach_lora: rank must be positive, got {rank}")
    existing = {name for name, _ in model.named_modules()}
    unknown = [t for t in targets if t not in existing]
    if unknown:
        raise ValueError(f"attach_lora: {len(unknown)} target modules not in the model, e.g. {unknown[:_MAX_LISTED]}")
    overrides = {name: (int(r), float(a)) for name, (r, a) in (overrides or {}).items()}
    if any(r <= 0 for r, _ in overrides.values()):
        raise ValueError("attach_lora: every rank must be positive")

    if algo == "lora" and (rank_dropout or module_dropout):
        raise ValueError("attach_lora: kohya's rank/module dropout for LoRA is network_setup.add_kohya_dropout")
    if algo in ("loha", "lokr"):
        lycoris.attach_lycoris(model, algo, targets, rank, alpha, overrides, rank_dropout, module_dropout, factor,
                               decompose_both, adapter_name)
    elif algo == "lora":
        extra: dict[str, object] = {}
        if overrides:
            # peft reads these as regular expressions matched against the end of each module name.
            extra["rank_pattern"] = {re.escape(name): r for name, (r, _) in overrides.items()}
            extra["alpha_pattern"] = {re.escape(name): a for name, (_, a) in overrides.items()}
        if use_dora:
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
    else:
        raise ValueError(f"attach_lora: unknown algo {algo!r}")

    wrapped = lora_layers(model, adapter_name)
    # peft matches list entries as name suffixes too; with full names the set must come out exact.
    got = {name for name, _ in wrapped}
    if got != set(targets):
        raise RuntimeError(
            f"peft attached LoRA to {sorted(got ^ set(targets))[:_MAX_LISTED]} unlike the requested targets"
        )
    for name, layer in wrapped:
        want_rank, want_alpha = overrides.get(name, (rank, alpha))
        got_alpha = float(layer.lora_alpha[adapter_name] if _is_lora(layer) else layer.alpha[adapter_name])
        whole_lokr = "lokr_w1" in layer_parameters(layer, adapter_name) and "lokr_w2" in layer_parameters(
            layer, adapter_name)
        if layer.r[adapter_name] != want_rank or not (whole_lokr or math.isclose(got_alpha, want_alpha)):
            raise RuntimeError(f"peft built {name} with rank {layer.r[adapter_name]}, alpha {got_alpha}; "
                               f"asked for {want_rank}, {want_alpha}")

    for _, layer in wrapped:
        if not _is_lora(layer):
            continue  # attach_lycoris keeps its factors in fp32
        # inject_adapter_in_model casts the adapter to the base dtype (bf16/fp16); the optimizer needs fp32.
        # peft's forward casts the input to the LoRA dtype and the sum back to the base dtype.
        layer.lora_A[adapter_name].to(torch.float32)
        layer.lora_B[adapter_name].to(torch.float32)
        if _has_dora(layer, adapter_name):
            layer.lora_magnitude_vector[adapter_name].to(torch.float32)

    params = lora_parameters(model, adapter_name)
    trainable = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    return params


# --------------------------------------------------------------------------------------------- kohya keys


def kohya_lora_name(prefix: str, module_name: str) -> str:
    """kohya's name for one LoRA module: `<prefix>_<module path with "." -> "_">`.

    Text-encoder paths are written from `text_model.` on, as kohya, ComfyUI and AUTOMATIC1111 expect, even
    though transformers >= 5 flattened CLIPTextModel (its modules now start at `encoder.`).
    """
    if prefix.startswith(PREFIX_TE) and not module_name.startswith("text_model."):
        module_name = "text_model." + module_name
    return f"{prefix}_{module_name.replace('.', '_')}"


def kohya_layer_names(modules: Mapping[str, nn.Module],
                      adapter_name: str = "default") -> dict[str, tuple[str, nn.Module]]:
    """kohya module name -> (module path, peft layer) over every model in `modules` (keyed by kohya prefix)."""
    names: dict[str, tuple[str, nn.Module]] = {}
    for prefix, model in modules.items():
        layers = lora_layers(model, adapter_name)
        if not layers:
            raise ValueError(f"{prefix}: {type(model).__name__} has no LoRA layers for adapter {adapter_name!r}")
        for module_name, layer in layers:
            name = kohya_lora_name(prefix, module_name)
            if name in names:
                # "." -> "_" is not injective ("a_b.c" vs "a.b_c"); a clash would silently merge two layers.
                raise ValueError(f"kohya name {name} is produced by two modules: {names[name][0]} and {module_name}")
            names[name] = (module_name, layer)
    return names


def kohya_state_dict(
    modules: Mapping[str, nn.Module],
    alpha: float | None = None,
    dtype: torch.dtype | None = None,
    adapter_name: str = "default",
) -> dict[str, torch.Tensor]:
    """Export the peft LoRA weights of each model as one kohya-format state dict.

    `modules` maps a kohya prefix ("lora_unet", "lora_te", "lora_te1", "lora_te2") to a model with LoRA
    attached. `alpha`, when given, must equal the alpha the layers were built with (guards a file whose scale
    differs from training). Weights are cast to `dtype` (save precision); `.alpha` stays fp32 so that
    alpha / rank is exact in every reader. LoHa / LoKr layers are written with LyCORIS keys, DoRA magnitudes as
    `.dora_scale`.
    """
    state_dict: dict[str, torch.Tensor] = {}
    for name, (module_name, layer) in kohya_layer_names(modules, adapter_name).items():
        if not _is_lora(layer):
            for role, tensor in lycoris.export(layer, adapter_name, dtype).items():
                state_dict[f"{name}.{role}"] = tensor
            continue
        rank = layer.r[adapter_name]
        layer_alpha = float(layer.lora_alpha[adapter_name])
        if alpha is not None and not math.isclose(layer_alpha, alpha, rel_tol=1e-6):
            raise ValueError(f"{module_name}: LoRA built with alpha {layer_alpha}, export asked for alpha {alpha}")
        if not math.isclose(layer.scaling[adapter_name], layer_alpha / rank, rel_tol=1e-6):
            # e.g. diffusers' scale_lora_layers changed the live scale; the file would not reproduce it.
            raise ValueError(
                f"{module_name}: peft scaling {layer.scaling[adapter_name]} != alpha / rank = {layer_alpha / rank}"
            )
        for key, weight in ((_DOWN, layer.lora_A[adapter_name].weight), (_UP, layer.lora_B[adapter_name].weight)):
            tensor = weight.detach().to(device="cpu", dtype=dtype or weight.dtype)
            # clone: never alias a live parameter that the optimizer keeps updating
            state_dict[f"{name}.{key}"] = tensor.clone().contiguous()
        state_dict[f"{name}.{_ALPHA}"] = torch.tensor(layer_alpha, dtype=torch.float32)
        if _has_dora(layer, adapter_name):
            state_dict[f"{name}.{_DORA}"] = dora_scale_of(layer, adapter_name, dtype)
    return state_dict


def dora_scale_of(layer: nn.Module, adapter_name: str = "default",
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """peft's DoRA magnitude as `.dora_scale`: [out, 1] for Linear, [out, 1, 1, 1] for conv.

    A column, not peft's flat [out] (or [1, out, 1, 1] for conv): ComfyUI takes a first dimension equal to the
    weight's as "per output channel" and divides it by a [out, 1, ...] norm, which a flat vector would broadcast
    into an [out, out] matrix.
    """
    magnitude = layer.lora_magnitude_vector[adapter_name].weight.detach()
    weight_shape = layer.get_base_layer().weight.shape
    column = magnitude.reshape(weight_shape[0], *[1] * (len(weight_shape) - 1))
    return column.to(device="cpu", dtype=dtype or magnitude.dtype).clone().contiguous()


# --------------------------------------------------------------------------------------------- file


def safetensors_hashes(state_dict: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[str, str]:
    """(sshs_model_hash, sshs_legacy_hash) as kohya precomputes them for sd-webui-additional-networks.

    Both hash the file as it would be written with only the `ss_*` metadata (other metadata may change
    later): the model hash is sha256 of everything after the header, the legacy hash the first 8 hex digits
    of sha256 of the 64 KiB at offset 1 MiB (sha256 of nothing for files under 1 MiB, as kohya).
    """
    training_metadata = {k: v for k, v in metadata.items() if k.startswith("ss_")}
    blob = safetensors.torch.save(dict(state_dict), training_metadata)
    header_len = int.from_bytes(blob[:8], "little")
    model_hash = hashlib.sha256(blob[8 + header_len :]).hexdigest()
    legacy_hash = hashlib.sha256(blob[0x100000 : 0x100000 + 0x10000]).hexdigest()[:8]
    return model_hash, legacy_hash


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_lora_file(
    path: str | os.PathLike,
    state_dict: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    add_hashes: bool = True,
) -> None:
    """Write a safetensors LoRA file atomically (temp file beside it, fsync, os.replace).

    Metadata values must be strings. With `add_hashes`, sshs_model_hash / sshs_legacy_hash are added as
    kohya's save_weights does.
    """
    metadata = dict(metadata or {})
    bad = sorted(k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str))
    if bad:
        raise TypeError(f"safetensors metadata keys and values must be str; not so for: {bad}")
    if add_hashes:
        metadata["sshs_model_hash"], metadata["sshs_legacy_hash"] = safetensors_hashes(state_dict, metadata)

    def write(tmp: Path) -> None:
        safetensors.torch.save_file(dict(state_dict), str(tmp), metadata=metadata or None)
        # safetensors creates the file owner-only; a LoRA is meant to be read by other programs and users.
        os.chmod(tmp, 0o666 & ~_umask())

    write_atomically(Path(path).absolute(), write)


def load_kohya_lora(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a kohya-format safetensors LoRA: (state dict on CPU, metadata)."""
    with safetensors.safe_open(os.fspath(path), framework="pt", device="cpu") as f:
        metadata = dict(f.metadata() or {})
        state_dict = {key: f.get_tensor(key) for key in f.keys()}
    return state_dict, metadata


def _split_key(key: str) -> tuple[str, str]:
    # kohya names contain no "."; everything after the first one is the tensor role
    name, _, role = key.partition(".")
    return name, role


# kohya names of the 3x3 convs that conv_dim trains (diffusers and LDM spellings); their rank is conv_dim's.
_CONV_3X3_NAME = re.compile(r"_(resnets_\d+_conv[12]|(down|up)samplers_\d+_conv|in_layers_2|out_layers_3|op)$")


def dims_from_state_dict(state_dict: Mapping[str, torch.Tensor]) -> tuple[int, float]:
    """(rank, alpha) of a kohya LoRA (or LyCORIS LoHa / LoKr); alpha defaults to the rank where `.alpha` is
    absent, as in kohya. 3x3 conv modules (conv_dim's) and whole-matrix LoKr modules are not counted."""
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for key, tensor in state_dict.items():
        name, role = _split_key(key)
        if _CONV_3X3_NAME.search(name) or (role == _DOWN and tensor.dim() == 4 and tuple(tensor.shape[2:]) != (1, 1)):
            continue
        if role in (_DOWN, "hada_w1_b", "lokr_w1_b", "lokr_w2_b"):
            ranks[name] = int(tensor.shape[0])
        elif role == _ALPHA:
            alphas[name] = float(tensor.item())
    if not ranks:
        raise ValueError("no '.lora_down.weight' (or LoHa / LoKr) keys: not a kohya-format LoRA")
    per_module = {name: (rank, alphas.get(name, float(rank))) for name, rank in ranks.items()}
    distinct = sorted(set(per_module.values()))
    if len(distinct) > 1:
        raise ValueError(f"LoRA modules have different (rank, alpha): {distinct[:_MAX_LISTED]}; expected one")
    rank, alpha = distinct[0]
    return rank, alpha


@dataclass
class LoadReport:
    """Result of apply_kohya_state_dict: kohya module names loaded, and keys that did not fit."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # keys the model expects but the file lacks
    unexpected: list[str] = field(default_factory=list)  # keys in the file that no LoRA layer takes


def _listing(what: str, items: list[str]) -> str:
    more = f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return f"{len(items)} {what}: {', '.join(items[:_MAX_LISTED])}{more}"


def _fit_shape(tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    if tensor.shape == shape:
        return tensor
    # [out, r] vs [out, r, 1, 1]: tools differ on how they store LoRA for 1x1 convs
    if tensor.numel() == math.prod(shape) and [d for d in tensor.shape if d != 1] == [d for d in shape if d != 1]:
        return tensor.reshape(shape)
    return None


def apply_kohya_state_dict(
    modules: Mapping[str, nn.Module],
    state_dict: Mapping[str, torch.Tensor],
    adapter_name: str = "default",
    strict: bool = True,
) -> LoadReport:
    """Load a kohya-format state dict into peft LoRA layers attached with attach_lora (inverse of export).

    Shape or alpha mismatches always raise (a different alpha would silently change the scale, so it asks for
    network_alpha / dim_from_weights to match the file). Missing or unexpected keys raise when `strict`,
    otherwise they are only reported. Nothing is written unless every check passes.
    """
    expected = kohya_layer_names(modules, adapter_name)
    report = LoadReport()
    problems: list[str] = []
    alpha_mismatch: list[str] = []
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    params_of = {name: layer_parameters(layer, adapter_name) for name, (_, layer) in expected.items()}
    in_file: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        name, role = _split_key(key)
        if name in expected and (role == _ALPHA or role in params_of[name]):
            in_file.setdefault(name, {})[role] = tensor
        else:
            report.unexpected.append(key)

    for name, (module_name, layer) in expected.items():
        found = in_file.get(name, {})
        params = params_of[name]
        absent = [f"{name}.{role}" for role in params if role not in found]
        if absent:
            report.missing.extend(absent)
            continue
        fitted = []
        for role, param in params.items():
            value = _fit_shape(found[role], param.shape)
            if value is None:
                problems.append(
                    f"{name}.{role}: shape {tuple(found[role].shape)} in file, {tuple(param.shape)} in model"
                )
            else:
                fitted.append((param, value))
        if len(fitted) != len(params):
            continue
        file_rank = int(found[_DOWN].shape[0]) if _is_lora(layer) else lycoris.file_rank(found)
        file_alpha = float(found[_ALPHA].item()) if _ALPHA in found else float(file_rank or 0)
        model_alpha = float(layer.lora_alpha[adapter_name] if _is_lora(layer) else layer.alpha[adapter_name])
        # A LoKr with both factors whole is applied unscaled by every reader: its alpha means nothing.
        if file_rank is not None and not math.isclose(file_alpha, model_alpha, rel_tol=1e-3, abs_tol=1e-6):
            alpha_mismatch.append(f"{name} (file {file_alpha:g}, model {model_alpha:g})")
            continue
        pending.extend(fitted)
        report.loaded.append(name)

    if problems:
        problems.append(
            "the rank differs between file and model: set network_dim (and conv_dim, algo) to the file's or use "
            "dim_from_weights"
        )
    if alpha_mismatch:
        problems.append(
            _listing("modules with a different alpha", alpha_mismatch)
            + "; set network_alpha to the file's alpha or use dim_from_weights"
        )
    if strict and report.missing:
        problems.append(_listing("missing keys", report.missing))
    if strict and report.unexpected:
        problems.append(_listing("unexpected keys", report.unexpected))
    if problems:
        raise ValueError("cannot load LoRA weights:\n  " + "\n  ".join(problems))

    with torch.no_grad():
        for param, value in pending:
            param.copy_(value.to(device=param.device, dtype=param.dtype))
    return report


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """Only the metadata of a safetensors file (cheap: reads the header)."""
    with safetensors.safe_open(os.fspath(path), framework="pt", device="cpu") as f:
        return dict(f.metadata() or {})
