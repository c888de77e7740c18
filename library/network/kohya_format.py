"""The kohya-format LoRA file that ComfyUI, AUTOMATIC1111 and diffusers read: key names, export, save, load.

Converts between peft's layers (library.network.lora) and kohya's flat file:

    lora_unet_<module path, "." -> "_">.lora_down.weight   [r, in] or [r, in, 1, 1]
    lora_unet_<module path, "." -> "_">.lora_up.weight     [out, r] or [out, r, 1, 1]
    lora_unet_<module path, "." -> "_">.alpha              0-dim; scale = alpha / r

Conv LoRA (kohya's conv_dim, LyCORIS' LoCon) on 3x3 convs has the same keys with lora_down [r, in, 3, 3] and
lora_up [out, r, 1, 1]. DoRA adds `.dora_scale`: [1, in] / [1, in, 1, 1], the magnitude per input channel that
ComfyUI and AUTOMATIC1111 apply with the patched weight's norm (library.network.dora), or with wd_on_output
[out, 1] / [out, 1, 1, 1], which ComfyUI recognises by its first dimension matching the weight's. LoHa and LoKr
keys are written by library.network.lycoris, IA3 / Diag-OFT / DyLoRA / norm keys by library.network.lycoris_layers.
The module path is the family's (`rename`): diffusers' for SD1.x / SD2.x, the original-SD layout for SDXL's UNet, as
kohya writes each.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import nn

from library.core.atomic import write_atomically
from library.network import lycoris, lycoris_layers
from library.network.lora import (
    _DORA,
    _DOWN,
    _MAX_LISTED,
    _UP,
    _has_dora,
    _is_lora,
    dora_scale_of,
    layer_parameters,
    lora_layers,
)

PREFIX_TE = "lora_te"  # SD1.x / SD2.x's text encoder; SDXL's are lora_te1 / lora_te2

_ALPHA = "alpha"

# (kohya prefix, module path, the prefix's model) -> the path kohya names the module after; the model family's
# kohya_module_path (SDXL's UNet uses the original-SD layout). None: the diffusers path as it is.
Rename = Callable[[str, str, nn.Module], str]


# --------------------------------------------------------------------------------------------- kohya keys


def kohya_lora_name(prefix: str, module_name: str) -> str:
    """kohya's name for one LoRA module: `<prefix>_<module path with "." -> "_">`.

    CLIP text-encoder paths are written from `text_model.` on, as kohya, ComfyUI and AUTOMATIC1111 expect, even
    though transformers >= 5 flattened CLIPTextModel (its layers now start at `encoder.layers.`). T5's paths
    (`encoder.block.`) are kohya's as they are.
    """
    if prefix.startswith(PREFIX_TE) and module_name.startswith("encoder.layers."):
        module_name = "text_model." + module_name
    return f"{prefix}_{module_name.replace('.', '_')}"


def kohya_layer_names(modules: Mapping[str, nn.Module], adapter_name: str = "default",
                      rename: Rename | None = None) -> dict[str, tuple[str, nn.Module]]:
    """kohya module name -> (module path, peft layer) over every model in `modules` (keyed by kohya prefix)."""
    names: dict[str, tuple[str, nn.Module]] = {}
    for prefix, model in modules.items():
        layers = lora_layers(model, adapter_name)
        if not layers:
            raise ValueError(f"{prefix}: {type(model).__name__} has no LoRA layers for adapter {adapter_name!r}")
        for module_name, layer in layers:
            path = rename(prefix, module_name, model) if rename is not None else module_name
            name = kohya_lora_name(prefix, path)
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
    rename: Rename | None = None,
) -> dict[str, torch.Tensor]:
    """Export the peft LoRA weights of each model as one kohya-format state dict.

    `modules` maps a kohya prefix ("lora_unet", "lora_te", "lora_te1", "lora_te2") to a model with LoRA
    attached. `alpha`, when given, must equal the alpha the layers were built with (guards a file whose scale
    differs from training). Weights are cast to `dtype` (save precision); `.alpha` stays fp32 so that
    alpha / rank is exact in every reader. LoHa / LoKr layers are written with LyCORIS keys, DoRA magnitudes as
    `.dora_scale`. `rename` gives the family's kohya layout (SDXL: original-SD UNet paths).
    """
    state_dict: dict[str, torch.Tensor] = {}
    for name, (module_name, layer) in kohya_layer_names(modules, adapter_name, rename).items():
        if isinstance(layer, lycoris_layers.AdapterLayer):
            for role, tensor in layer.export(dtype).items():
                state_dict[f"{name}.{role}"] = tensor
            continue
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
_CONV_3X3_NAME = re.compile(
    r"_(resnets_\d+_conv[12]|(down|up)samplers_\d+_conv|in_layers_2|out_layers_3|op|output_blocks_\d+_[12]_conv)$")


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
        if has_no_rank(state_dict):
            raise ValueError("IA3 / Diag-OFT / norm weights have no rank to read: set network_dim and network_alpha "
                             "(conv_dim, constraint) as they were trained instead of dim_from_weights")
        raise ValueError("no '.lora_down.weight' (or LoHa / LoKr) keys: not a kohya-format LoRA")
    per_module = {name: (rank, alphas.get(name, float(rank))) for name, rank in ranks.items()}
    distinct = sorted(set(per_module.values()))
    if len(distinct) > 1:
        raise ValueError(f"LoRA modules have different (rank, alpha): {distinct[:_MAX_LISTED]}; expected one")
    rank, alpha = distinct[0]
    return rank, alpha


_RANKLESS_ROLES = ("weight", "on_input", "oft_blocks", "rescale", "w_norm", "b_norm")


def has_no_rank(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """Whether a file holds only LyCORIS IA3 / Diag-OFT / norm weights (and alphas), which have no rank."""
    roles = {_split_key(key)[1] for key in state_dict}
    return bool(roles & set(_RANKLESS_ROLES)) and roles <= {*_RANKLESS_ROLES, _ALPHA}


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
    rename: Rename | None = None,
) -> LoadReport:
    """Load a kohya-format state dict into peft LoRA layers attached with attach_lora (inverse of export).

    Shape or alpha mismatches always raise (a different alpha would silently change the scale, so it asks for
    network_alpha / dim_from_weights to match the file). Missing or unexpected keys raise when `strict`,
    otherwise they are only reported. Nothing is written unless every check passes. With `rename`, a module is
    found under the family's kohya name or under its diffusers path (files written before, or by other tools).
    """
    expected = kohya_layer_names(modules, adapter_name, rename)
    params_of = {name: layer_parameters(layer, adapter_name) for name, (_, layer) in expected.items()}
    # IA3 / Diag-OFT / DyLoRA / norm layers: the file's keys are not always their trainable tensors
    file_roles = {name: layer.file_roles() for name, (_, layer) in expected.items()
                  if isinstance(layer, lycoris_layers.AdapterLayer)}
    loading = _Loading()
    in_file = _by_layer(state_dict, _aliases(modules, adapter_name, rename, expected), params_of, file_roles,
                        loading.report.unexpected)
    for name, (_, layer) in expected.items():
        found = in_file.get(name, {})
        if name in file_roles:
            loading.adapter_layer(name, layer, file_roles[name], found)
        else:
            loading.lora_layer(name, layer, params_of[name], found, adapter_name)
    loading.check(strict)
    loading.write()
    return loading.report


def _aliases(modules: Mapping[str, nn.Module], adapter_name: str, rename: Rename | None,
             expected: Mapping[str, tuple[str, nn.Module]]) -> dict[str, str]:
    """The diffusers-path kohya names of the layers that `rename` names otherwise -> their family's names."""
    if rename is None:
        return {}
    plain = kohya_layer_names(modules, adapter_name)
    by_layer = {id(layer): name for name, (_, layer) in expected.items()}
    return {alias: by_layer[id(layer)] for alias, (_, layer) in plain.items() if alias not in expected}


def _by_layer(state_dict: Mapping[str, torch.Tensor], aliases: Mapping[str, str],
              params_of: Mapping[str, Mapping[str, nn.Parameter]], file_roles: Mapping[str, Any],
              unexpected: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """The file's tensors by kohya module name and role; keys that no layer takes go to `unexpected`."""
    in_file: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        name, role = _split_key(key)
        name = aliases.get(name, name)
        if name in file_roles and role in file_roles[name]:
            in_file.setdefault(name, {})[role] = tensor
        elif name in params_of and name not in file_roles and (role == _ALPHA or role in params_of[name]):
            in_file.setdefault(name, {})[role] = tensor
        else:
            unexpected.append(key)
    return in_file


@dataclass
class _Loading:
    """What apply_kohya_state_dict has found so far: the report, the problems, and the tensors to copy once every
    check has passed."""

    report: LoadReport = field(default_factory=LoadReport)
    problems: list[str] = field(default_factory=list)
    alpha_mismatch: list[str] = field(default_factory=list)
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def _absent(self, name: str, roles: Iterable[str], found: Mapping[str, torch.Tensor]) -> bool:
        absent = [f"{name}.{role}" for role in roles if role not in found]
        self.report.missing.extend(absent)
        return bool(absent)

    def adapter_layer(self, name: str, layer: Any, roles: Iterable[str], found: Mapping[str, torch.Tensor]) -> None:
        """An IA3 / Diag-OFT / DyLoRA / norm layer, which reads its file tensors itself."""
        if self._absent(name, roles, found):
            return
        pairs, layer_problems = layer.import_tensors(found)
        self.problems.extend(f"{name}.{problem}" for problem in layer_problems)
        if not layer_problems:
            self.pending.extend(pairs)
            self.report.loaded.append(name)

    def lora_layer(self, name: str, layer: nn.Module, params: Mapping[str, nn.Parameter],
                   found: Mapping[str, torch.Tensor], adapter_name: str) -> None:
        """A peft LoRA / LoHa / LoKr layer: each tensor fitted to its parameter's shape, the alpha the model's."""
        if self._absent(name, params, found):
            return
        fitted = []
        for role, param in params.items():
            value = _fit_shape(found[role], param.shape)
            if value is None:
                self.problems.append(
                    f"{name}.{role}: shape {tuple(found[role].shape)} in file, {tuple(param.shape)} in model"
                )
            else:
                fitted.append((param, value))
        if len(fitted) != len(params):
            return
        file_rank = int(found[_DOWN].shape[0]) if _is_lora(layer) else lycoris.file_rank(found)
        file_alpha = float(found[_ALPHA].item()) if _ALPHA in found else float(file_rank or 0)
        model_alpha = float(layer.lora_alpha[adapter_name] if _is_lora(layer) else layer.alpha[adapter_name])
        # A LoKr with both factors whole is applied unscaled by every reader: its alpha means nothing.
        if file_rank is not None and not math.isclose(file_alpha, model_alpha, rel_tol=1e-3, abs_tol=1e-6):
            self.alpha_mismatch.append(f"{name} (file {file_alpha:g}, model {model_alpha:g})")
            return
        self.pending.extend(fitted)
        self.report.loaded.append(name)

    def check(self, strict: bool) -> None:
        """Raise ValueError naming every problem (and, when `strict`, every missing or unexpected key)."""
        problems = list(self.problems)
        if problems:
            problems.append(
                "the rank differs between file and model: set network_dim (and conv_dim, algo) to the file's or "
                "use dim_from_weights"
            )
        if self.alpha_mismatch:
            problems.append(
                _listing("modules with a different alpha", self.alpha_mismatch)
                + "; set network_alpha to the file's alpha or use dim_from_weights"
            )
        if strict and self.report.missing:
            problems.append(_listing("missing keys", self.report.missing))
        if strict and self.report.unexpected:
            problems.append(_listing("unexpected keys", self.report.unexpected))
        if problems:
            raise ValueError("cannot load LoRA weights:\n  " + "\n  ".join(problems))

    def write(self) -> None:
        with torch.no_grad():
            for param, value in self.pending:
                param.copy_(value.to(device=param.device, dtype=param.dtype))


# Key prefixes that tell which kind of model a LoRA file was made for (the first match wins).
_KEY_STYLES = (
    ("lora_unet_double_blocks_", "FLUX (kohya names)"),
    ("lora_transformer_", "a diffusers transformer (FLUX / SD3)"),
    ("lora_te1_", "SDXL (two text encoders)"),
    ("lora_unet_input_blocks_", "SDXL or an original-SD (LDM) checkpoint"),
    ("lora_unet_down_blocks_", "SD1.x / SD2.x (diffusers names)"),
    ("unet.", "diffusers / peft (dotted names, not kohya format)"),
    ("transformer.", "diffusers / peft (dotted names, not kohya format)"),
)


def describe_lora(path: str | os.PathLike) -> str:
    """What a LoRA file seems to be for, from its metadata and key names: for messages when it fits no module."""
    with safetensors.safe_open(os.fspath(path), framework="pt", device="cpu") as f:
        keys = list(f.keys())
        metadata = dict(f.metadata() or {})
    prefixes: dict[str, int] = {}
    for key in keys:
        name = key.split(".", 1)[0]
        prefix = "_".join(name.split("_")[:3]) if "_" in name else name
        prefixes[prefix] = prefixes.get(prefix, 0) + 1
    common = sorted(prefixes.items(), key=lambda item: -item[1])[:_MAX_LISTED]
    style = next((what for start, what in _KEY_STYLES if any(k.startswith(start) for k in keys)), "unknown")
    base = metadata.get("ss_base_model_version") or metadata.get("modelspec.architecture")
    return (f"{style}{f', made for {base}' if base else ''}: {len(keys)} keys, prefixes "
            + ", ".join(f"{prefix}* ({count})" for prefix, count in common))


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """Only the metadata of a safetensors file (cheap: reads the header)."""
    with safetensors.safe_open(os.fspath(path), framework="pt", device="cpu") as f:
        return dict(f.metadata() or {})
