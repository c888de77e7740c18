"""What both latent caches (targets: library.data.cache, controls: library.data.control_cache) share: content and
VAE fingerprints, and encoding in VAE batches of one size with the pixels prepared ahead."""
from __future__ import annotations

import hashlib
import json
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from library.core.atomic import write_atomically


def file_digest(path: Path) -> str:
    """The content hash of a file, or of a frame folder (its files' names and contents, in name order)."""
    digest = hashlib.blake2b(digest_size=16)
    for file in sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]:
        if file is not path:
            digest.update(f"{file.name}\0".encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def vae_fingerprint(vae: torch.nn.Module) -> str:
    """Hash of the VAE's config and weights: another VAE, or changed weights, never reuse a cache entry."""
    digest = hashlib.blake2b(digest_size=16)
    config = getattr(vae, "config", None)
    digest.update(json.dumps(dict(config) if config is not None else {}, sort_keys=True, default=str).encode())
    for name, tensor in sorted(vae.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy())
    return digest.hexdigest()


class InlineExecutor:
    """Runs submitted work at once in the calling thread."""

    _max_workers = 1

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            future.set_exception(e)
        return future

    def map(self, fn: Callable[..., Any], items: Iterable[Any]) -> Iterable[Any]:
        return map(fn, items)


@dataclass
class CacheStats:
    encoded: int = 0  # variants encoded by this process
    reused: int = 0  # variants found valid on disk
    vae_batches: int = 0
    seconds: float = 0.0


def finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def read_entries(path: Path) -> dict[str, dict[str, Any]]:
    """{entry name: {"key": ..., "finite": bool}} from a cache file's header (tensors are not read); a missing or
    broken file has none."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
        return json.loads(metadata.get("entries", "{}"))
    except (OSError, ValueError, json.JSONDecodeError, Exception):  # noqa: BLE001 - a broken file is a stale file
        return {}


def write_entries(path: Path, new: dict[str, tuple[str, dict[str, torch.Tensor], bool]]) -> None:
    """Write the new entries (name -> (key, tensors, finite); tensor `part` of entry `name` is stored as
    `name.part`) plus the file's other entries, atomically."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    old = read_entries(path) if path.exists() else {}
    keep = [name for name in old if name not in new]
    if keep:
        with safe_open(path, framework="pt") as f:
            stored = list(f.keys())
            for name in keep:
                for tensor_name in (t for t in stored if t.rsplit(".", 1)[0] == name):
                    tensors[tensor_name] = f.get_tensor(tensor_name)
                entries[name] = old[name]
    for name, (key, parts, finite_) in new.items():
        tensors.update({f"{name}.{part}": tensor.contiguous() for part, tensor in parts.items()})
        entries[name] = {"key": key, "finite": finite_}
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata={"entries": json.dumps(entries)}),
                     durable=False)


@dataclass
class DiskShare:
    """How a disk cache is shared: the VAE's fingerprint, the files' content hashes so far, and this process's part
    (the i-th file or record where i % num_processes == process_index); all wait for everyone's files."""
    vae_id: str
    digests: dict[Path, str]
    process_index: int = 0
    num_processes: int = 1
    wait_for_everyone: Callable[[], Any] | None = None


@dataclass
class VaeEncoder:
    """The VAE and how to call it: encode(items, ...) runs (source, flipped) items through it in VAE batches of one
    size each (`size_of(source)`: (width, height), or (width, height, frames) for video clips), with
    `pixels_of(source, flipped)` prepared ahead in the pool's threads, and calls `on_encoded(source, flipped, mean,
    logvar)` (float32, on the CPU) per item. Video clips go to the VAE as (B, 3, F, H, W): a video family's VAE
    takes them so."""
    vae: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    batch_size: int
    pool: Any  # a ThreadPoolExecutor or an InlineExecutor
    stats: CacheStats

    def encode(self, items: Sequence[tuple[Any, bool]], size_of: Callable[[Any], tuple[int, ...]],
               pixels_of: Callable[[Any, bool], torch.Tensor],
               on_encoded: Callable[[Any, bool, torch.Tensor, torch.Tensor], None]) -> None:
        by_size: dict[tuple[int, ...], list[tuple[Any, bool]]] = {}
        for item in items:
            by_size.setdefault(size_of(item[0]), []).append(item)
        batches = [group[i:i + self.batch_size] for _, group in sorted(by_size.items(), key=lambda kv: kv[0])
                   for i in range(0, len(group), self.batch_size)]

        def pixels(batch: list[tuple[Any, bool]]) -> torch.Tensor:
            return torch.stack([pixels_of(source, flipped) for source, flipped in batch])

        ahead = max(2, getattr(self.pool, "_max_workers", 2))
        pending: deque[tuple[list[tuple[Any, bool]], Future]] = deque()
        queue = iter(batches)
        for batch in queue:
            pending.append((batch, self.pool.submit(pixels, batch)))
            if len(pending) >= ahead:
                break
        while pending:
            batch, future = pending.popleft()
            next_batch = next(queue, None)
            if next_batch is not None:
                pending.append((next_batch, self.pool.submit(pixels, next_batch)))
            with torch.inference_mode():
                distribution = self.vae.encode(future.result().to(device=self.device, dtype=self.dtype)).latent_dist
                mean, logvar = distribution.mean.float().cpu(), distribution.logvar.float().cpu()
            self.stats.vae_batches += 1
            for j, (source, flipped) in enumerate(batch):
                on_encoded(source, flipped, mean[j].clone(), logvar[j].clone())
                self.stats.encoded += 1
