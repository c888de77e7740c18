"""The storage precision of the frozen base: fp8 (kohya's fp8_base / fp8_base_unet), int8 or NF4 weight-only.

Only the denoiser's and text encoders' linear (and, for fp8, conv) layers are stored low; they compute in the
mixed-precision dtype, and the LoRA stays fp32 whatever the base holds, so the LoRA file is the same.

- fp8: each layer's weight is stored as float8_e4m3fn and a compute-dtype copy is made for its forward only
  (`cast_around_forward`; the layers chosen as diffusers' layerwise casting chooses them, whose in-place cast
  breaks a convolution's backward). It is done in two halves: `prepare` before the adapter is attached (cast, and
  tell peft the compute dtype, so the LoRA starts exactly as it would on a bf16 base), `finish` after (the hooks,
  on the layers peft now wraps).
- int8 / nf4: bitsandbytes' Linear8bitLt / Linear4bit (QLoRA's layers), which peft wraps with its own LoRA layers;
  bitsandbytes (>= 0.48) runs both forward and backward on CPU as well as CUDA. NF4 weights are quantized by
  library.memory.nf4 (bitsandbytes' layout, to the bit, many times faster on CPU).

With mixed_precision = "no" the compute dtype is float32: every low precision computes in fp32 (a CPU without bf16
instructions, or a GPU without bf16, trains at its fp32 rate).

Reading: inside `reading(rule)`, library.families.shared.safetensors_io reads the matrices the rule names straight
into fp8 (fp8 files stay fp8), so a 12 B transformer is never held in bf16 first (loaders that hand the tensors to
diffusers' from_single_file or from_pretrained get the compute dtype instead: those cast what they are given).
Whatever of those stays high precision (embeddings, skipped layers) is cast up again by `prepare`. The FLUX.1 and
Qwen-Image file loaders read their transformer layer by layer, and under an int8 / nf4 rule quantize each linear
layer as soon as it is assigned (`quantized_while_read`), so that the load holds the quantized transformer plus one
layer, never the whole fp8 / bf16 transformer; `prepare` then quantizes only what is left.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from library.memory.nf4 import nf4_linear

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
LOW_PRECISIONS = ("fp8", "int8", "nf4")

# Layers that stay in the compute dtype: the adapters themselves, and the small input / output layers where a
# coarse weight costs most (diffusers' own default list, less its "norm", which would keep FLUX's and SD3's large
# adaptive-norm linears - a quarter of FLUX's weights - in bf16).
SKIP_PATTERNS = ("lora_", "lycoris", "pos_embed", "patch_embed", "^proj_in$", "^proj_out$", "norm_out", "^conv_in$",
                 "^conv_out$", "time_embed", "time_text_embed", "embedder", "embed_tokens", "embeddings")
# The layer types diffusers' apply_layerwise_casting casts (diffusers.hooks._common).
_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d,
           torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d, torch.nn.Embedding)

# (path, tensor key, stored dtype) -> the dtype to read a floating matrix as, or None for the caller's dtype.
ReadRule = Callable[[Path, str, torch.dtype], "torch.dtype | None"]
_READ_RULE: contextvars.ContextVar[ReadRule | None] = contextvars.ContextVar("read_rule", default=None)


@dataclass(frozen=True)
class BasePrecision:
    """How the frozen base is stored: `denoiser` and `text_encoders` are None (the compute dtype), "fp8", "int8"
    or "nf4" (text encoders: None or "fp8")."""
    denoiser: str | None
    text_encoders: str | None
    compute_dtype: torch.dtype

    @classmethod
    def from_config(cls, config: Any, compute_dtype: torch.dtype) -> BasePrecision:
        chosen = config.base_model_precision if config.base_model_precision in LOW_PRECISIONS else None
        denoiser = chosen or ("fp8" if config.fp8_base or config.fp8_base_unet else None)
        text = "fp8" if (chosen or config.fp8_base) and not config.fp8_base_unet else None
        return cls(denoiser, text, compute_dtype)

    @property
    def lowered(self) -> bool:
        return self.denoiser is not None

    def describe(self) -> str:
        if not self.lowered:
            return "no_change"
        return f"{self.denoiser} (text encoders {self.text_encoders or 'unchanged'})"

    # --- reading -----------------------------------------------------------------------------------------------
    def read_rule(self, denoiser_files: Sequence[str | Path], text_encoder_files: Sequence[str | Path],
                  denoiser_prefixes: tuple[str, ...] = ("model.diffusion_model.",),
                  text_prefixes: tuple[str, ...] = ("cond_stage_model.", "conditioner.", "text_encoders.")
                  ) -> ReadRule | None:
        """Which tensors are read low: every matrix of the denoiser's (and, with fp8 text encoders, the text
        encoders') separate files; in a file of several components, those under the component's key prefix. fp8
        keeps fp8-stored tensors as they are and lowers the rest; int8 / nf4 keep fp8-stored ones (they are
        quantized from them, as they are read where the loader streams) and read the rest in the compute dtype."""
        if not self.lowered:
            return None
        files: dict[Path, str] = {}
        for path in denoiser_files:
            files[Path(path).resolve()] = self.denoiser
        if self.text_encoders:
            for path in text_encoder_files:
                files.setdefault(Path(path).resolve(), self.text_encoders)
        known = denoiser_prefixes + text_prefixes + ("first_stage_model.", "vae.")
        allowed = denoiser_prefixes + (text_prefixes if self.text_encoders else ())
        return FileRule(files, known, allowed, self.compute_dtype)

    # --- the modules -------------------------------------------------------------------------------------------
    def prepare(self, denoiser: torch.nn.Module, text_encoders: Sequence[torch.nn.Module]) -> None:
        """Before the adapter is attached: store the base low (see the module's docstring)."""
        for module, kind in self._parts(denoiser, text_encoders):
            if kind == "fp8":
                for layer in (*managed_layers(module, fp8=True).values(), *kept_layers(module).values()):
                    layer.to(dtype=FP8)
                    layer.compute_dtype = self.compute_dtype  # peft reads it: the adapter starts in this dtype
            else:
                _quantize(module, kind, self.compute_dtype)
            _raise_leftovers(module, self.compute_dtype)

    def finish(self, denoiser: torch.nn.Module, text_encoders: Sequence[torch.nn.Module]) -> None:
        """After the adapter is attached: the fp8 layers cast to the compute dtype around their forward."""
        for module, kind in self._parts(denoiser, text_encoders):
            if kind == "fp8":
                for layer in managed_layers(module, fp8=True).values():
                    if layer.weight.dtype == FP8:
                        cast_around_forward(layer, self.compute_dtype)
                for name, layer in kept_layers(module).items():
                    if layer.weight.dtype == FP8:
                        cast_around_forward(layer, self.compute_dtype, around=module.get_submodule(
                            name.rpartition(".")[0]))
        if self.lowered:
            logger.info("frozen base stored as %s, computed in %s; the LoRA stays float32", self.describe(),
                        str(self.compute_dtype).removeprefix("torch."))

    def _parts(self, denoiser: torch.nn.Module,
               text_encoders: Sequence[torch.nn.Module]) -> list[tuple[torch.nn.Module, str]]:
        parts = [(denoiser, self.denoiser)] if self.denoiser else []
        if self.text_encoders:
            parts += [(encoder, self.text_encoders) for encoder in text_encoders]
        return parts


def skip_patterns(module: torch.nn.Module, kept: bool = True) -> tuple[str, ...]:
    """SKIP_PATTERNS, the layers whose weight another module shares (T5's `shared` embedding is also its
    encoder's embed_tokens, which a cast of one layer would leave in fp8 for the other), and (`kept`) the model's
    `_keep_in_fp32_modules` (kept_layers)."""
    owners: dict[int, list[str]] = {}
    for name, layer in module.named_modules(remove_duplicate=False):
        for param in layer.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    tied = sorted({name for names in owners.values() if len(names) > 1 for name in names})
    return SKIP_PATTERNS + tuple(f"^{re.escape(name)}$" for name in tied) + (_kept_patterns(module) if kept else ())


def _kept_patterns(module: torch.nn.Module) -> tuple[str, ...]:
    return tuple(f"(^|\\.){re.escape(name)}$" for name in getattr(module, "_keep_in_fp32_modules", None) or [])


def kept_layers(module: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The linear layers a transformers model keeps out of a low precision (`_keep_in_fp32_modules`: T5's and UMT5's
    feed-forward `wo`, whose parent casts its input to the layer's weight dtype), by name. Under fp8 they are stored
    fp8 too and cast to the compute dtype around their parent's forward, so the parent sees the dtype it saw when
    they were held in it (the same values, to the bit); T5-XXL's billion `wo` weights held in float32 were 3 GiB
    more than in fp8."""
    kept = _kept_patterns(module)
    if not kept:
        return {}
    others = skip_patterns(module, kept=False)
    found = {}
    for name, layer in module.named_modules():
        name = name.removesuffix(".base_layer")  # the layer once peft wraps it: named by the wrapper's name
        if isinstance(layer, torch.nn.Linear) and "." in name and any(re.search(p, name) for p in kept) \
                and not any(re.search(p, name) for p in others):
            found[name] = layer
    return found


def managed_layers(module: torch.nn.Module, fp8: bool) -> dict[str, torch.nn.Module]:
    """The layers stored low, by name: those diffusers' apply_layerwise_casting would take with `skip_patterns`
    (the same walk: a skipped name ends the descent), linear layers only for int8 / nf4 (their bitsandbytes twins
    exist only for those)."""
    kinds = _LAYERS if fp8 else (torch.nn.Linear,)
    found: dict[str, torch.nn.Module] = {}
    patterns = skip_patterns(module)

    def walk(layer: torch.nn.Module, name: str) -> None:
        if name and any(re.search(pattern, name) for pattern in patterns):
            return
        if isinstance(layer, _LAYERS):
            if isinstance(layer, kinds):
                found[name] = layer
            return
        for child_name, child in layer.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name)

    walk(module, "")
    return found


def cast_around_forward(layer: torch.nn.Module, dtype: torch.dtype, around: torch.nn.Module | None = None) -> None:
    """The layer computes with compute-dtype copies of its fp8 parameters, made for each forward (of the layer, or
    of the module `around` it) and dropped after it. diffusers' apply_layerwise_casting casts the parameters in
    place and back after the forward instead, so a convolution's backward, which reads the weight it saved, found
    fp8 there ("expected scalar type BFloat16"); here what backward saved is the copy, whatever the layer."""
    stored: dict[str, torch.nn.Parameter] = {}

    def before(module: torch.nn.Module, args: Any) -> None:
        for name, param in layer._parameters.items():
            if param is not None and param.dtype in FP8_DTYPES:
                stored[name] = param
                layer._parameters[name] = torch.nn.Parameter(param.to(dtype), requires_grad=False)

    def after(module: torch.nn.Module, args: Any, output: Any) -> None:
        layer._parameters.update(stored)
        stored.clear()

    (around or layer).register_forward_pre_hook(before)
    (around or layer).register_forward_hook(after)


def _raise_leftovers(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Tensors read as fp8 that no fp8 layer manages (embeddings, skipped layers) go back to the compute dtype."""
    managed = {id(p) for layer in (*managed_layers(module, fp8=True).values(), *kept_layers(module).values())
               for p in layer.parameters() if getattr(layer, "compute_dtype", None) is not None}
    for param in module.parameters():
        if param.dtype in FP8_DTYPES and id(param) not in managed:
            param.data = param.data.to(dtype)
    for sub in module.modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer.dtype in FP8_DTYPES:
                setattr(sub, name, buffer.to(dtype))


def _quantize(module: torch.nn.Module, kind: str, compute_dtype: torch.dtype) -> None:
    """Every managed linear layer not quantized yet (a loader may have quantized them as it read them) replaced by
    its bitsandbytes twin, one layer at a time (each original layer is dropped once replaced: held to the end, a
    12 B FLUX transformer's fp8 weights stayed beside their whole NF4 copy, 17 GiB instead of 11)."""
    layers = managed_layers(module, fp8=False)
    for name in list(layers):
        layer = layers.pop(name)
        if layer.weight.dtype.is_floating_point:
            replace_layer(module, name, quantize_layer(layer, kind, compute_dtype))
        del layer


def replace_layer(module: torch.nn.Module, name: str, layer: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(module.get_submodule(parent_name) if parent_name else module, child, layer)


def quantize_layer(layer: torch.nn.Linear, kind: str, compute_dtype: torch.dtype) -> torch.nn.Module:
    """`layer` as a bitsandbytes Linear4bit (NF4, quantized by library.memory.nf4 in bitsandbytes' layout) or
    Linear8bitLt, on its device; it computes in `compute_dtype` (float32 too)."""
    import bitsandbytes as bnb

    if kind == "nf4":
        quantized = nf4_linear(layer, compute_dtype)
    else:
        with torch.device("meta"):
            quantized = bnb.nn.Linear8bitLt(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                            has_fp16_weights=False)
        quantized.weight = bnb.nn.Int8Params(layer.weight.data.to(compute_dtype), requires_grad=False,
                                             has_fp16_weights=False)
        if layer.bias is not None:
            quantized.bias = torch.nn.Parameter(layer.bias.data.to(compute_dtype), requires_grad=False)
    quantized = quantized.to(layer.weight.device)  # bitsandbytes quantizes int8 on the move
    quantized.compute_dtype = compute_dtype  # (Linear4bit has it) peft starts the adapter in this dtype
    return quantized


@dataclass(frozen=True)
class FileRule:
    """BasePrecision.read_rule's rule: each lowered file's storage kind, by resolved path."""
    files: dict[Path, str]
    known: tuple[str, ...]  # the component prefixes of a file of several components
    allowed: tuple[str, ...]  # those read low
    compute_dtype: torch.dtype

    def __call__(self, path: Path, key: str, stored: torch.dtype) -> torch.dtype | None:
        kind = self.files.get(path.resolve())
        if kind is None or (key.startswith(self.known) and not key.startswith(self.allowed)):
            return None  # not a lowered file, or another component of a single file (the VAE, ...)
        if stored in FP8_DTYPES:
            return stored
        return FP8 if kind == "fp8" else None


def quantized_while_read(path: str | Path) -> tuple[str, torch.dtype] | None:
    """(int8 or nf4, the compute dtype) when the active rule quantizes the model read from `path` (a denoiser's
    file): its loader quantizes each linear layer as soon as its weights are assigned
    (library.families.shared.separate_files.assign_streamed), so the whole fp8 / bf16 denoiser is never held."""
    rule = _READ_RULE.get()
    if not isinstance(rule, FileRule):
        return None
    kind = rule.files.get(Path(path).resolve())
    return (kind, rule.compute_dtype) if kind in ("int8", "nf4") else None


@contextlib.contextmanager
def reading(rule: ReadRule | None) -> Iterator[None]:
    """Within the block, safetensors reads follow `rule` (library.families.shared.safetensors_io)."""
    token = _READ_RULE.set(rule)
    try:
        yield
    finally:
        _READ_RULE.reset(token)


def read_dtype(path: Path, key: str, stored: torch.dtype, shape: Sequence[int]) -> torch.dtype | None:
    """The dtype the active rule reads a floating matrix as, or None for the caller's."""
    rule = _READ_RULE.get()
    if rule is None or len(shape) < 2 or not stored.is_floating_point:
        return None
    return rule(path, key, stored)


def stored_bytes_per_weight(kind: str | None, compute_dtype: torch.dtype) -> float:
    """Bytes a managed weight takes in memory under a precision (NF4: 4 bits plus a 4-byte scale per 64)."""
    return {None: torch.finfo(compute_dtype).bits / 8, "fp8": 1.0, "int8": 1.0 + 4 / 4096,
            "nf4": 0.5 + 4 / 64}[kind]
