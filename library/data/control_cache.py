"""Control images' latents (edit datasets), cached as the targets' are (library.data.cache): in memory, or on disk in
`<control file>.control.safetensors` beside the control image. The file holds one entry per size, flip and resize
filter the control is fed at, each keyed by the file's content hash, those settings, the VAE (config + weights hash)
and its dtype; an entry whose key differs is encoded again, so a changed control file never reuses its old latents.

An entry is the VAE posterior's mean: a reference image is encoded at its mode, as diffusers' edit pipelines do
(`sample_mode="argmax"`). Items carry them as `control_latents` (library.data.controls.control_inputs).
"""
from __future__ import annotations

import json
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from library.config import UserError
from library.data.controls import ControlImage
from library.data.encoding import DiskShare, VaeEncoder, file_digest, finite, read_entries, write_entries
from library.data.images import prepare_image
from library.data.scan import ImageRecord

CONTROL_FORMAT = 1  # bump when the pixels fed to the VAE change for the same settings
CONTROL_SUFFIX = ".control.safetensors"


@dataclass(frozen=True)
class ControlUse:
    """One control image at one size, flip and resize filter: one cache entry."""
    control: ControlImage
    flipped: bool
    interpolation: str | None

    @property
    def name(self) -> str:
        width, height = self.control.target
        return (f"{'flipped' if self.flipped else 'plain'}.{width}x{height}"
                + (f".{self.interpolation}" if self.interpolation else ""))

    def pixels(self) -> torch.Tensor:
        c = self.control
        return prepare_image(c.path, c.size, c.resized, c.target, c.crop, self.flipped, self.interpolation)


def control_cache_path(path: Path) -> Path:
    return path.with_name(path.name + CONTROL_SUFFIX)


def control_key(use: ControlUse, image_digest: str, vae_id: str, dtype: torch.dtype) -> str:
    c = use.control
    return json.dumps({"format": CONTROL_FORMAT, "image": image_digest, "size": c.size, "resized": c.resized,
                       "target": c.target, "crop": c.crop, "flipped": use.flipped,
                       "interpolation": use.interpolation, "vae": vae_id, "dtype": str(dtype)}, sort_keys=True)


class ControlLatents:
    """(control, flipped, resize filter) -> posterior mean: held in memory, or read from the control's cache file
    at each use."""

    def __init__(self, to_disk: bool):
        self.to_disk = to_disk
        self.entries: dict[ControlUse, torch.Tensor] = {}

    def get(self, control: ControlImage, flipped: bool, interpolation: str | None) -> torch.Tensor:
        use = ControlUse(control, flipped, interpolation)
        if not self.to_disk:
            return self.entries[use]
        from safetensors import safe_open

        with safe_open(control_cache_path(control.path), framework="pt") as f:
            return f.get_tensor(f"{use.name}.mean")


def control_uses(records: Sequence[ImageRecord]) -> dict[ControlUse, list[ImageRecord]]:
    """Every control encoding the used records need, with the records that need it."""
    uses: dict[ControlUse, list[ImageRecord]] = {}
    for record in records:
        if not record.repeats:
            continue
        for flipped in ((False, True) if record.subset.flip_aug else (False,)):
            for control in record.controls:
                uses.setdefault(ControlUse(control, flipped, record.subset.resize_interpolation), []).append(record)
    return uses


def _nan_problems(bad: Sequence[ControlUse],
                  uses: dict[ControlUse, list[ImageRecord]]) -> list[tuple[ImageRecord, str]]:
    """(record, message) for every record that needs a control whose latents are not finite."""
    return [(record, f"{use.control.path}: the VAE gave NaN or inf latents for this control image of {record.path} "
                     f"({use.control.target[0]}x{use.control.target[1]}{', flipped' if use.flipped else ''}); the "
                     "image may be broken, or the VAE overflows in half precision (try no_half_vae)")
            for use in bad for record in uses[use]]


def cache_control_latents(records: Sequence[ImageRecord], store: ControlLatents, encoder: VaeEncoder,
                          share: DiskShare) -> list[tuple[ImageRecord, str]]:
    """Encode every control the used records need into `store` (on disk: bring each entry up to date, each
    process writing its share of the files); returns (record, message) for records whose controls gave NaN/inf."""
    uses = control_uses(records)
    if not store.to_disk:
        def keep(use: ControlUse, _: bool, mean: torch.Tensor, __: torch.Tensor) -> None:
            store.entries[use] = mean

        missing = [(use, use.flipped) for use in uses if use not in store.entries]
        encoder.encode(missing, lambda use: use.control.target, lambda use, _: use.pixels(), keep)
        return _nan_problems([use for use in uses if not finite(store.entries[use])], uses)
    by_file: dict[Path, list[ControlUse]] = {}
    for use in uses:
        by_file.setdefault(use.control.path, []).append(use)
    paths = sorted(by_file)
    new = [path for path in paths if path not in share.digests]
    share.digests.update(zip(new, encoder.pool.map(file_digest, new), strict=True))
    keys = {use: control_key(use, share.digests[use.control.path], share.vae_id, encoder.dtype) for use in uses}
    stale: list[ControlUse] = []
    for path in paths[share.process_index::share.num_processes]:
        entries = read_entries(control_cache_path(path))
        stale += [use for use in by_file[path] if entries.get(use.name, {}).get("key") != keys[use]]
    encoder.stats.reused += sum(len(by_file[p]) for p in paths[share.process_index::share.num_processes])
    encoder.stats.reused -= len(stale)
    _encode_to_disk(stale, keys, encoder)
    if share.num_processes > 1 and share.wait_for_everyone is not None:
        share.wait_for_everyone()
    bad, missing = [], []
    for path in paths:
        entries = read_entries(control_cache_path(path))
        for use in by_file[path]:
            entry = entries.get(use.name, {})
            if entry.get("key") != keys[use]:
                missing.append(f"{control_cache_path(path)}: control latent cache entry {use.name} missing or stale "
                               "after caching (was the file changed by another run?)")
            elif not entry.get("finite", False):
                bad.append(use)
    if missing:
        raise UserError(missing)
    return _nan_problems(bad, uses)


def _encode_to_disk(stale: Sequence[ControlUse], keys: dict[ControlUse, str], encoder: VaeEncoder) -> None:
    """Encode the stale entries and write each file once all of its stale entries are encoded."""
    expected: dict[Path, int] = {}
    for use in stale:
        expected[use.control.path] = expected.get(use.control.path, 0) + 1
    pending: dict[Path, dict[str, tuple[str, dict[str, torch.Tensor], bool]]] = {}
    writes: list[Future] = []

    def write(use: ControlUse, _: bool, mean: torch.Tensor, __: torch.Tensor) -> None:
        entries = pending.setdefault(use.control.path, {})
        entries[use.name] = (keys[use], {"mean": mean}, finite(mean))
        if len(entries) == expected[use.control.path]:
            writes.append(encoder.pool.submit(write_entries, control_cache_path(use.control.path),
                                              pending.pop(use.control.path)))

    encoder.encode([(use, use.flipped) for use in stale], lambda use: use.control.target,
                   lambda use, _: use.pixels(), write)
    for future in writes:
        future.result()
