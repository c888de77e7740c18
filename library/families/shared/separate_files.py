"""What the families' separate-file readers share: finding a family's marker keys in a file, reading a file with
the parts of a split one, assigning read weights to a model built on
the meta device, one message for files that cannot be read, and the shipped T5 and Qwen tokenizers (stored
gzipped)."""
from __future__ import annotations

import functools
import gzip
import json
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from library.config import UserError
from library.families.shared.safetensors_io import read_safetensors

_SHARD = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.safetensors$")


def file_keys(path: Path) -> list[str]:
    """The tensor names of a .safetensors file. Telling a file's family asks each family's detector in turn: the
    header is read once per file version (path, modification time, size), not once per detector."""
    stat = path.stat()
    return list(_header_keys(str(path.resolve()), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=16)
def _header_keys(path: str, mtime_ns: int, size: int) -> tuple[str, ...]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return tuple(f.keys())


def marked_keys(path: Path, prefix: str) -> set[str]:
    """The tensor names of a .safetensors file without `prefix`, to look for a family's marker keys in; none when
    `path` is not a readable .safetensors file (the SD single-file loader reports those)."""
    if path.suffix != ".safetensors":
        return set()
    try:
        return {key.removeprefix(prefix) for key in file_keys(path)}
    except Exception:
        return set()


def shards(path: Path) -> list[Path]:
    """The parts of a split file (`name-00001-of-00003.safetensors` -> all three), or [path]."""
    match = _SHARD.match(path.name)
    if match is None:
        return [path]
    stem, _, count = match.groups()
    parts = [path.with_name(f"{stem}-{i:05d}-of-{count}.safetensors") for i in range(1, int(count) + 1)]
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise UserError(f"{path}: the split file misses {', '.join(missing)} beside it")
    return parts


def read_split(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A .safetensors file's tensors in `dtype`, with those of the other parts of a split file (`shards`)."""
    state: dict[str, torch.Tensor] = {}
    for part in shards(path):
        state.update(read_safetensors(part, dtype=dtype))
    return state


@contextmanager
def reading(path: Path, what: str) -> Iterator[None]:
    """A file that cannot be read, or does not fit the configs, while loading `what` (say "the FLUX files") from
    `path` is a UserError naming both."""
    try:
        yield
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot load {what}: {e}") from None


def assign(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str,
           tied: tuple[str, ...] = (), family: str = "FLUX") -> None:
    """Load `state` into `model` built on the meta device (its tensors taken, not copied), naming the file and
    what is missing or misfits; `tied` weights may be absent from the file."""
    expected = set(model.state_dict())
    missing = sorted(expected - set(state) - set(tied))
    if missing:
        raise UserError(f"{source}: {len(missing)} weights missing, e.g. {', '.join(missing[:3])}; is it the right "
                        f"file? (a model of other widths needs model_config: a diffusers {family} folder describing "
                        "it)")
    try:
        model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False, assign=True)
    except RuntimeError as e:
        raise UserError(f"{source}: the weights do not fit the config's shapes (a model of other widths needs "
                        f"model_config: a diffusers {family} folder describing it): {str(e)[:300]}") from None
    if tied:
        model.tie_weights()


def assign_streamed(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], source: str,
                    path: str | Path | None = None, tied: tuple[str, ...] = (), family: str = "FLUX") -> None:
    """`assign` for tensors that arrive one at a time (read and converted lazily), each taken as it comes. When
    the active precision rule quantizes the model read from `path` (int8 / nf4,
    library.memory.precision.quantized_while_read), each linear layer it stores low is quantized as soon as its
    weight and bias are in, so the load holds the quantized model plus the layer being read, never the whole
    model in fp8 / bf16."""
    from library.memory.precision import managed_layers, quantize_layer, quantized_while_read, replace_layer

    slots: dict[str, tuple[torch.nn.Module, str, bool]] = {}  # key -> (module, name, is a parameter)
    for prefix, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None:  # as state_dict: a LayerNorm without affine weights has None
                slots[f"{prefix}.{name}" if prefix else name] = (module, name, True)
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                slots[f"{prefix}.{name}" if prefix else name] = (module, name, False)
    quantizing = quantized_while_read(path) if path is not None else None
    pending: dict[str, set[str]] = {}
    if quantizing:
        for name, layer in managed_layers(model, fp8=False).items():
            pending[name] = {f"{name}.{part}" for part, value in layer._parameters.items() if value is not None}
    done: set[str] = set()
    misfits: list[str] = []
    for key, tensor in tensors:
        slot = slots.get(key)
        if slot is None or key in done:
            continue  # a weight the model has no place for, as load_state_dict(strict=False) ignores it
        module, name, is_param = slot
        old = module._parameters[name] if is_param else module._buffers[name]
        if old.shape != tensor.shape:
            misfits.append(f"{key}: {tuple(tensor.shape)} in the file, {tuple(old.shape)} in the model")
            continue
        if is_param:
            module._parameters[name] = torch.nn.Parameter(tensor, requires_grad=old.requires_grad)
        else:
            module._buffers[name] = tensor
        done.add(key)
        layer_name = key.rpartition(".")[0]
        if quantizing and layer_name in pending:
            pending[layer_name].discard(key)
            if not pending[layer_name]:
                del pending[layer_name]
                replace_layer(model, layer_name, quantize_layer(module, *quantizing))
                for part in module._parameters:  # `slots` still names the replaced layer: its read weights go now
                    module._parameters[part] = None
        del tensor, old
    if misfits:
        raise UserError(f"{source}: the weights do not fit the config's shapes (a model of other widths needs "
                        f"model_config: a diffusers {family} folder describing it): {'; '.join(misfits[:3])}")
    missing = sorted(set(slots) - done - set(tied))
    if missing:
        raise UserError(f"{source}: {len(missing)} weights missing, e.g. {', '.join(missing[:3])}; is it the right "
                        f"file? (a model of other widths needs model_config: a diffusers {family} folder describing "
                        "it)")
    if tied:
        model.tie_weights()


def load_t5_tokenizer(folder: Path) -> Any:
    """A T5 tokenizer from a diffusers tokenizer_2 folder, or from the shipped one, whose tokenizer.json is
    gzipped."""
    from transformers import AutoTokenizer

    packed = folder / "tokenizer.json.gz"
    if not packed.is_file():
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    with tempfile.TemporaryDirectory(prefix="t5-tokenizer-") as tmp:
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(folder / name, tmp)
        (Path(tmp) / "tokenizer.json").write_bytes(gzip.decompress(packed.read_bytes()))
        return AutoTokenizer.from_pretrained(tmp, local_files_only=True)


def load_qwen_tokenizer(folder: Path) -> Any:
    """A Qwen tokenizer from a diffusers tokenizer folder, or from the shipped one (vocab.json and merges.txt
    gzipped)."""
    from transformers import AutoTokenizer

    if not (folder / "vocab.json.gz").is_file():
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    with tempfile.TemporaryDirectory(prefix="qwen-tokenizer-") as tmp:
        shutil.copy(folder / "tokenizer_config.json", tmp)
        for name in ("vocab.json", "merges.txt"):
            (Path(tmp) / name).write_bytes(gzip.decompress((folder / f"{name}.gz").read_bytes()))
        return AutoTokenizer.from_pretrained(tmp, local_files_only=True)
