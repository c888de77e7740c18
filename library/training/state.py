"""Training state: train_state.json, adapter-only state dirs, checkpoint names, retention, atomic saves, resume.

A state dir is written under a temporary name and renamed into place only when complete, so a crash at any moment
leaves either the previous state or the new one, never a half-written dir that `--resume latest` would pick.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pickle
import re
import shutil
import zipfile
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Callable, ContextManager

import safetensors
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors import SafetensorError

from library.config import UserError
from library.core.atomic import STALE_TEMPORARY, TMP_DIR_PREFIX, fsync_dir, remove_path, replace_dir

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.json"
ADAPTER_FILE = "adapter.safetensors"
MANIFEST_FILE = "manifest.json"  # every other file of the state and its size, written last
EMA_FILE = "ema.safetensors"  # only with ema_decay: the EMA of the adapter weights
_VERSIONED = ("torch", "diffusers", "peft", "accelerate", "transformers")


@dataclasses.dataclass
class TrainState:
    """Where training stands. `batch_in_epoch` counts the batches each process has consumed in `epoch`."""
    epoch: int = 0
    global_step: int = 0
    batch_in_epoch: int = 0
    seed: int = 0
    world_size: int = 1
    fingerprint: dict[str, Any] = dataclasses.field(default_factory=dict)  # must match to resume
    path_settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # change the path if they differ
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)  # running metrics (binned loss, average)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def read(cls, state_dir: Path) -> "TrainState":
        path = Path(state_dir) / STATE_FILE
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            fields = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in raw.items() if k in fields})
        except FileNotFoundError:
            raise UserError(f"{state_dir}: not a state dir (no {STATE_FILE})") from None
        except (json.JSONDecodeError, TypeError) as e:
            raise UserError(f"{path}: unreadable train state: {e}") from None


def library_versions() -> dict[str, str]:
    versions = {}
    for name in _VERSIONED:
        try:
            versions[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            pass
    return versions


def incompatibilities(saved: TrainState, current: TrainState) -> list[str]:
    """What makes a saved state unusable with the current run (adapter shape, model, optimizer)."""
    problems = []
    for key in sorted(set(saved.fingerprint) | set(current.fingerprint)):
        before, now = saved.fingerprint.get(key), current.fingerprint.get(key)
        if before != now:
            problems.append(f"{key}: the state has {_short(before)}, this run has {_short(now)}")
    return problems


def path_changes(saved: TrainState, current: TrainState) -> list[str]:
    """Settings that may change on resume but make the continued run differ from an uninterrupted one."""
    changes = [f"{key}: {_short(saved.path_settings.get(key))} -> {_short(current.path_settings.get(key))}"
               for key in sorted(set(saved.path_settings) | set(current.path_settings))
               if saved.path_settings.get(key) != current.path_settings.get(key)]
    if saved.world_size != current.world_size:
        changes.append(f"number of processes: {saved.world_size} -> {current.world_size}")
    return changes


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


# --- names (kohya's) -------------------------------------------------------------------------------------------

def epoch_name(output_name: str, epoch: int) -> str:
    return f"{output_name}-{epoch:06d}"


def step_name(output_name: str, step: int) -> str:
    return f"{output_name}-step{step:08d}"


def state_dir_name(snapshot_name: str) -> str:
    return f"{snapshot_name}-state"


# A LoRA file of a save: `<name>.safetensors`, or one per adapter of a family that trains several
# (`<name>_high_noise.safetensors`; library.training.model.adapter_files).
LORA_FILE = r"(?:_[a-z][a-z0-9_]*)?\.safetensors"


def _numbered(output_dir: Path, pattern: str) -> list[tuple[int, Path]]:
    """Paths in output_dir whose names fully match `pattern` (one number group), sorted by that number."""
    regex = re.compile(pattern)
    found = []
    for path in output_dir.iterdir() if output_dir.is_dir() else []:
        match = regex.fullmatch(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def prune_steps(output_dir: Path, output_name: str, current_step: int, keep_steps: int | None, state: bool) -> None:
    """kohya's save_last_n_steps(_state): drop step saves older than `keep_steps` steps before current_step."""
    if keep_steps is None:
        return
    suffix = r"-state" if state else LORA_FILE
    for step, path in _numbered(output_dir, re.escape(output_name) + r"-step(\d{8})" + suffix):
        if step <= current_step - keep_steps:
            logger.info("removing %s (save_last_n_steps%s)", path, "_state" if state else "")
            remove_path(path)


def prune_epochs(output_dir: Path, output_name: str, keep: int | None, state: bool) -> None:
    """kohya's save_last_n_epochs(_state): keep the newest `keep` epoch saves."""
    if keep is None:
        return
    suffix = r"-state" if state else LORA_FILE
    saves = _numbered(output_dir, re.escape(output_name) + r"-(\d{6})" + suffix)
    epochs = sorted({epoch for epoch, _ in saves})  # an epoch may have one file per adapter
    dropped = set(epochs[:-keep] if keep < len(epochs) else [])
    for epoch, path in saves:
        if epoch in dropped:
            logger.info("removing %s (save_last_n_epochs%s)", path, "_state" if state else "")
            remove_path(path)


# --- finding states -------------------------------------------------------------------------------------------

def is_state_candidate(path: Path) -> bool:
    """A folder that is, or was meant to be, a finished state dir (not one being written)."""
    return (path.is_dir() and not path.name.startswith(TMP_DIR_PREFIX)
            and (path.name.endswith("-state") or (path / STATE_FILE).exists()))


def write_manifest(state_dir: Path) -> None:
    """Record every file of a just-written state dir and its size: a file deleted or cut short later (a copy
    that stopped, a full disk on a sync) is then found before resuming instead of failing inside torch."""
    files = {p.relative_to(state_dir).as_posix(): p.stat().st_size
             for p in sorted(state_dir.rglob("*")) if p.is_file()}
    (state_dir / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1), encoding="utf-8")


def state_problems(state_dir: Path) -> list[str]:
    """Why `state_dir` cannot be resumed from; empty when every file it needs is present and readable."""
    if not state_dir.is_dir():
        return [f"{state_dir}: not a folder"]
    expected: dict[str, int | None] = {STATE_FILE: None, ADAPTER_FILE: None}  # states saved before the manifest
    manifest = state_dir / MANIFEST_FILE
    if manifest.exists():
        try:
            expected = {str(k): int(v) for k, v in json.loads(manifest.read_text(encoding="utf-8"))["files"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return [f"{manifest}: unreadable ({e})"]
    problems = []
    for name, size in expected.items():
        path = state_dir / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif size is not None and path.stat().st_size != size:
            problems.append(f"{path}: {path.stat().st_size} bytes, but {size} were saved (cut short or changed)")
        else:
            problems += _unreadable(path)
    for path in sorted(state_dir.rglob("*")):
        if path.is_file() and path.relative_to(state_dir).as_posix() not in expected and path != manifest:
            problems += _unreadable(path)
    return problems


def _unreadable(path: Path) -> list[str]:
    """Cheap checks that a state file can be read: JSON parses, a safetensors header, a torch zip archive."""
    if path.name == STATE_FILE:
        try:
            TrainState.read(path.parent)
        except UserError as e:
            return list(e.problems)
    elif path.suffix == ".safetensors":
        try:
            with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
                f.keys()
        except (OSError, RuntimeError, SafetensorError) as e:  # a file gone since listed raises RuntimeError
            return [f"{path}: unreadable ({e})"]
    elif path.suffix in (".bin", ".pt", ".pkl") and not zipfile.is_zipfile(path):
        return [f"{path}: not a readable torch file (cut short or damaged)"]
    return []


def find_latest_state(output_dir: Path, skipped: list[str] | None = None) -> Path | None:
    """The complete state dir in output_dir with the highest global step (newest on ties). Damaged or incomplete
    ones are passed over and described in `skipped`."""
    best: tuple[int, float, Path] | None = None
    for path in sorted(output_dir.iterdir()) if output_dir.is_dir() else []:
        if not is_state_candidate(path):
            continue
        problems = state_problems(path)
        if problems:
            if skipped is not None:
                skipped.append(f"{path.name}: " + "; ".join(problems))
            continue
        try:
            key = (TrainState.read(path).global_step, path.stat().st_mtime, path)
        except (UserError, OSError):  # removed since it was checked (another run pruning its old states)
            continue
        best = key if best is None or key[:2] > best[:2] else best
    return best[2] if best else None


def resolve_resume(resume: str | None, output_dir: Path) -> Path | None:
    """The state dir to resume from: a path, or 'latest' (None when output_dir holds no complete state yet)."""
    if resume is None:
        return None
    if resume == "latest":
        skipped: list[str] = []
        found = find_latest_state(output_dir, skipped)
        for reason in skipped:
            logger.warning("resume = latest: skipping a damaged or incomplete state: %s", reason)
        if found is None:
            logger.warning("resume = latest: no complete state in %s yet; starting from step 0", output_dir)
        else:
            logger.info("resume = latest: %s", found)
        return found
    path = Path(resume)
    if not path.is_dir():
        raise UserError(f"resume: {path} is not a folder (give a state dir or 'latest')")
    problems = state_problems(path)
    if problems:
        raise UserError([f"resume: {path} is not a complete, readable state dir (resume from an older state, or "
                         "use --resume latest, which skips damaged ones):"] + problems)
    return path


def remove_stale_temporaries(output_dir: Path, *subfolders: str) -> None:
    """Half-written saves (LoRA files, state dirs, charts, and in `subfolders` such as the samples) from a run
    that was killed; they are never resumed from."""
    for folder in (output_dir, *(output_dir / name for name in subfolders)):
        for path in folder.iterdir() if folder.is_dir() else []:
            if path.name.startswith(TMP_DIR_PREFIX) or STALE_TEMPORARY.fullmatch(path.name):
                logger.info("removing an incomplete save left by an interrupted run: %s", path)
                remove_path(path)


# --- saving and loading -----------------------------------------------------------------------------------------

class Checkpointer:
    """Adapter-only state dirs through accelerate's save_state/load_state and their pre-hooks."""

    def __init__(self, accelerator: Accelerator, write_adapter: Callable[[Path], None],
                 read_adapter: Callable[[Path], None], write_ema: Callable[[Path], None] | None = None,
                 read_ema: Callable[[Path], None] | None = None,
                 gather: Callable[[bool], ContextManager[None]] | None = None):
        self.accelerator = accelerator
        # ZeRO-3: the adapter's whole tensors on every process while they are written or read (True: keep writes)
        self._gather = gather or (lambda modify: contextlib.nullcontext())
        self._write_adapter = write_adapter
        self._read_adapter = read_adapter
        self._write_ema = write_ema
        self._read_ema = read_ema
        self._pending: TrainState | None = None
        accelerator.register_save_state_pre_hook(self._save_hook)
        accelerator.register_load_state_pre_hook(self._load_hook)

    def _save_hook(self, models: list, weights: list, output_dir: str) -> None:
        # accelerate would write the whole UNet and text encoder; the state keeps only the adapter.
        weights.clear()
        with self._gather(False):
            if self.accelerator.is_main_process:
                self._write_adapter(Path(output_dir) / ADAPTER_FILE)
                if self._write_ema is not None:
                    self._write_ema(Path(output_dir) / EMA_FILE)
        if self.accelerator.is_main_process:
            assert self._pending is not None
            (Path(output_dir) / STATE_FILE).write_text(self._pending.to_json(), encoding="utf-8")

    def _load_hook(self, models: list, input_dir: str) -> None:
        models.clear()  # the base weights come from the model folder; only the adapter is in the state
        with self._gather(True):
            self._read_adapter(Path(input_dir) / ADAPTER_FILE)
        if self._read_ema is not None:
            self._read_ema(Path(input_dir) / EMA_FILE)  # after the adapter: a state without EMA starts it there

    def save(self, state_dir: Path, train_state: TrainState) -> None:
        """Write a complete state dir at `state_dir`, atomically. Every process must call this."""
        accelerator = self.accelerator
        tmp = state_dir.with_name(TMP_DIR_PREFIX + state_dir.name)
        if accelerator.is_main_process and tmp.exists():
            shutil.rmtree(tmp)
        accelerator.wait_for_everyone()
        self._pending = train_state
        try:
            # DeepSpeed writes its own module file; without the frozen base it holds just the adapter.
            accelerator.save_state(str(tmp), **self._deepspeed_kwargs(exclude_frozen_parameters=True))
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                write_manifest(tmp)
                _fsync_tree(tmp)
                replace_dir(tmp, state_dir)
                logger.info("saved state %s", state_dir)
        except BaseException:
            # A full disk, a refused write, a second Ctrl-C: give back the space the half-written state took (it
            # would never be resumed from).
            if accelerator.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            self._pending = None
        accelerator.wait_for_everyone()

    def load(self, state_dir: Path) -> None:
        try:
            self.accelerator.load_state(str(state_dir), **self._deepspeed_kwargs(load_module_strict=False))
        except (OSError, RuntimeError, EOFError, SafetensorError, pickle.UnpicklingError) as e:
            # Damage the pre-flight checks cannot see (a file rewritten with its size kept, a full read error).
            raise UserError(f"cannot resume from {state_dir}: a file of the state cannot be read "
                            f"({type(e).__name__}: {e}); resume from an older state") from e

    def _deepspeed_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        return kwargs if self.accelerator.distributed_type == DistributedType.DEEPSPEED else {}


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(root)
