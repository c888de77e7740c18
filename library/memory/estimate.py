"""What a run will hold, estimated before anything is loaded: from the model files' headers (every tensor's shape
and dtype) and the chosen precisions.

The load holds the denoiser, the text encoders and the VAE at once (the encoders leave once their outputs are
cached); training adds the LoRA with its gradient and AdamW's two moments (fp32; counted as if every matrix of the
denoiser had a LoRA, an upper bound) and the activations, for which only a rough allowance is made (they depend on
the resolution, the batch and checkpointing far more than on the weights).

A model whose text encoder alone outweighs what a card holds (FLUX.2 [dev]: a 24 B Mistral beside a 32 B
transformer) is planned by phase instead (`phases`): a text-encoding phase (the text encoders and the VAE, while their
outputs are cached) and a training phase (the denoiser as stored, less its swapped blocks, the VAE, the LoRA and
optimizer, the activations), each against the device on its own, as when the encoders are freed before the
denoiser is placed on it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

import torch

from library.core.safetensors_header import read_safetensors_header
from library.memory.precision import stored_bytes_per_weight

GIB = 1024 ** 3
_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
          "I8": 1, "U8": 1, "BOOL": 1}
# Key prefixes of a single file's components (LDM / ComfyUI layouts); keys under none belong to the file's part.
_PREFIXES = {"denoiser": ("model.diffusion_model.",), "vae": ("first_stage_model.", "vae."),
             "text": ("cond_stage_model.", "conditioner.", "text_encoders.")}


@dataclass(frozen=True)
class Counts:
    """Parameters of one component: in matrices (what a low precision stores low) and the rest, and the LoRA
    parameters a rank-1 adapter on every matrix would have."""
    matrices: int = 0
    other: int = 0
    lora_per_rank: int = 0
    stored_fp8: int = 0  # of the matrices, those the file stores in fp8 (read as they are)
    largest: int = 0  # the largest matrix (what a load that quantizes layer by layer holds unquantized at once)

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.matrices + other.matrices, self.other + other.other,
                      self.lora_per_rank + other.lora_per_rank, self.stored_fp8 + other.stored_fp8,
                      max(self.largest, other.largest))


def count_file(path: Path, part: str) -> dict[str, Counts]:
    """component ("denoiser", "text", "vae") -> Counts of a safetensors file; keys under another component's
    prefix count there."""
    out: dict[str, Counts] = {}
    for key, entry in read_safetensors_header(path)[1].items():
        if entry["dtype"] not in _BYTES:
            continue
        owner = next((name for name, prefixes in _PREFIXES.items() if key.startswith(prefixes)), part)
        out[owner] = out.get(owner, Counts()) + count_tensor(entry["shape"], entry["dtype"].startswith("F8"))
    return out


def count_tensor(shape: Iterable[int], fp8: bool = False) -> Counts:
    """One tensor's Counts: a matrix (2 or more sides, 4096 weights or more) or the rest."""
    shape = tuple(shape)
    numel = 1
    for side in shape:
        numel *= side
    if len(shape) >= 2 and numel >= 4096:
        return Counts(numel, 0, shape[0] + numel // shape[0], numel if fp8 else 0, numel)
    return Counts(0, numel, 0)


def model_files(model: str | Path, separate: dict[str, Iterable[str | None]]) -> list[tuple[Path, str]] | None:
    """(file, component) for the model: a diffusers folder's safetensors by subfolder, or the model file and the
    separate component files (clip_l, t5xxl, ae, ...). None when a part cannot be read (pickles, .bin)."""
    model = Path(model)
    files: list[tuple[Path, str]] = []
    if model.is_dir():
        for path in sorted(model.glob("*/*.safetensors")):
            folder = path.parent.name
            part = "vae" if folder == "vae" else "text" if folder.startswith("text_encoder") else \
                "denoiser" if folder in ("unet", "transformer") else None
            if part:
                files.append((path, part))
        if not files:
            return None
    elif model.suffix == ".safetensors":
        files.append((model, "denoiser"))
    else:
        return None
    for part, paths in separate.items():
        for path in paths:
            if path:
                if Path(path).suffix != ".safetensors":
                    return None
                files += [(shard, part) for shard in shards(Path(path))]
    return files


_SHARD = re.compile(r"^(?P<stem>.*)-(?P<index>\d+)-of-(?P<count>\d+)\.safetensors$")


def shards(path: Path) -> list[Path]:
    """Every part of a split file (`model-00001-of-00004.safetensors` names all four, as transformers reads them
    beside it), or the file alone."""
    match = _SHARD.match(path.name)
    if match is None:
        return [path]
    width, count = len(match["index"]), int(match["count"])
    return [path.with_name(f"{match['stem']}-{i:0{width}d}-of-{match['count']}.safetensors")
            for i in range(1, count + 1)]


@dataclass(frozen=True)
class Settings:
    """What the estimate depends on besides the files."""
    denoiser: str | None  # None (the compute dtype), "fp8", "int8", "nf4"
    text_encoders: str | None
    compute_dtype: torch.dtype
    vae_dtype: torch.dtype
    rank: int
    gradient_checkpointing: bool
    swapped_fraction: float = 0.0  # blocks_to_swap's share of the denoiser's blocks, held in host memory
    reads_low: bool = True  # safetensors files read tensor by tensor (False: a diffusers folder, read whole)
    # the denoiser's file is quantized layer by layer as it is read (int8 / nf4; FamilyEntry.quantizes_while_reading)
    quantized_as_read: bool = False


TEXT_PHASE, PLACING_PHASE, TRAINING_PHASE, SAMPLING_PHASE = ("text encoding", "placing the denoiser", "training",
                                                             "sampling")


@dataclass(frozen=True)
class Estimate:
    parts: dict[str, float]  # name -> bytes

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {size / GIB:.1f}" for name, size in self.parts.items()) + \
            f" GiB; about {self.total / GIB:.1f} GiB in all"


def held_bytes(part: Counts, kind: str | None, settings: Settings) -> float:
    """A component stored under `kind` (its matrices; the rest in the compute dtype)."""
    compute = torch.finfo(settings.compute_dtype).bits / 8
    return part.matrices * stored_bytes_per_weight(kind, settings.compute_dtype) + part.other * compute


def lora_bytes(denoiser: Counts, settings: Settings) -> float:
    """fp32 weight, gradient, two AdamW moments; never more than the matrices themselves (a LyCORIS "full matrix"
    network_dim such as 100000 is not a rank)."""
    return min(denoiser.lora_per_rank * settings.rank, denoiser.matrices) * 16


def activation_bytes(denoiser: Counts, settings: Settings) -> float:
    """A rough allowance: the checkpointed block inputs and one block's working set, or every block's
    activations."""
    compute = torch.finfo(settings.compute_dtype).bits / 8
    return (0.15 if settings.gradient_checkpointing else 1.0) * denoiser.matrices * compute + 0.5 * GIB


def estimate(counts: dict[str, Counts], settings: Settings) -> Estimate:
    """The peak of the load and of training (`load_and_training`), whichever is larger, by part."""
    return max(load_and_training(counts, settings), key=lambda phase: phase.total)


def load_and_training(counts: dict[str, Counts], settings: Settings) -> tuple[Estimate, Estimate]:
    """The peak of the load (every component as read: fp8 for fp8, the file's fp8 or else the compute dtype
    before int8 / nf4 quantize it, the compute dtype for a diffusers folder) and of training (the base as
    stored, LoRA, optimizer, activations), by part."""
    denoiser, text, vae = (counts.get(name, Counts()) for name in ("denoiser", "text", "vae"))

    def held(part: Counts, kind: str | None) -> float:
        return held_bytes(part, kind, settings)

    def read(part: Counts, kind: str | None, denoiser: bool = False) -> float:
        return read_bytes(part, kind, settings, denoiser)

    vae_bytes = (vae.matrices + vae.other) * torch.finfo(settings.vae_dtype).bits / 8
    stored = held(denoiser, settings.denoiser) * (1 - settings.swapped_fraction)
    lora, activations = lora_bytes(denoiser, settings), activation_bytes(denoiser, settings)
    loading = {"denoiser as read": read(denoiser, settings.denoiser, denoiser=True),
               "text encoders (until their outputs are cached)": read(text, settings.text_encoders),
               "VAE": vae_bytes}
    training = {"denoiser as stored": stored, "text encoders (until their outputs are cached)": held(
        text, settings.text_encoders), "VAE": vae_bytes, "LoRA and optimizer": lora,
        "activations (rough)": activations}
    return Estimate(loading), Estimate(training)


def phases(counts: dict[str, Counts], settings: Settings, sampling: bool = False,
           host: bool = False) -> dict[str, Estimate]:
    """What the device holds in each phase of a run by phase (the text encoders' outputs cached and the encoders
    freed before the denoiser is read): while encoding (the text encoders, as read on the host, as stored on a
    GPU, which gets them stored low; the VAE caching latents), while placing
    the denoiser (as read, before a low precision stores it, less its swapped share), while training (the
    denoiser as stored less its swapped share, the VAE, LoRA and optimizer, activations) and, with sample prompts
    (`sampling`), while sampling, when the parked text encoders come back beside the denoiser. `host`: the device
    is the host (CPU), where the parked encoders stay through training. Reading the files happens in host memory
    and is not counted for a GPU."""
    denoiser, text, vae = (counts.get(name, Counts()) for name in ("denoiser", "text", "vae"))
    vae_bytes = (vae.matrices + vae.other) * torch.finfo(settings.vae_dtype).bits / 8
    kept = 1 - settings.swapped_fraction
    stored = held_bytes(denoiser, settings.denoiser, settings) * kept
    text_held = held_bytes(text, settings.text_encoders, settings)
    lora = lora_bytes(denoiser, settings)
    # On a GPU the text encoders are stored low before they are placed; the host holds them as read first.
    text_placed = read_bytes(text, settings.text_encoders, settings) if host else text_held
    planned = {TEXT_PHASE: Estimate({"text encoders": text_placed, "VAE": vae_bytes}),
               PLACING_PHASE: Estimate({"denoiser as read": max(stored, read_bytes(denoiser, settings.denoiser,
                                                                                   settings, True) * kept),
                                        "VAE": vae_bytes}),
               TRAINING_PHASE: Estimate({"denoiser as stored": stored, "VAE": vae_bytes, "LoRA and optimizer": lora,
                                         "activations (rough)": activation_bytes(denoiser, settings)})}
    if sampling and host:
        for name in (PLACING_PHASE, TRAINING_PHASE):
            planned[name] = Estimate({**planned[name].parts, "text encoders (kept for sampling)": text_held})
    elif sampling:
        planned[SAMPLING_PHASE] = Estimate({"denoiser as stored": stored, "text encoders": text_held,
                                            "VAE": vae_bytes, "LoRA and optimizer": lora})
    return planned


def read_bytes(part: Counts, kind: str | None, settings: Settings, denoiser: bool = False) -> float:
    """A component as read, before a low precision stores it: fp8 read as fp8 from files read tensor by tensor,
    a file's fp8 tensors as they are, the rest in the compute dtype; a denoiser quantized layer by layer as it is
    read (`quantized_as_read`) as stored, with its largest matrix in the compute dtype."""
    compute = torch.finfo(settings.compute_dtype).bits / 8
    if kind == "fp8" and settings.reads_low:
        return held_bytes(part, "fp8", settings)
    if denoiser and kind in ("int8", "nf4") and settings.quantized_as_read:
        return held_bytes(part, kind, settings) + part.largest * compute
    low = part.stored_fp8 if kind and settings.reads_low else 0
    return low + (part.matrices - low) * compute + part.other * compute


def peak(planned: dict[str, Estimate]) -> Estimate:
    """The largest phase."""
    return max(planned.values(), key=lambda phase: phase.total)


def swapped_share(denoiser: torch.nn.Module, plan: Iterable[tuple[Iterable[torch.nn.Module], int]]) -> float:
    """The share of the denoiser's weights a block-swap plan (a family's block_swap_plan: each block list and how
    many of it are swapped) keeps in host memory; the model may be on the meta device."""
    total = sum(p.numel() for p in denoiser.parameters())
    swapped = sum(p.numel() for blocks, count in plan for block in list(blocks)[:count] for p in block.parameters())
    return swapped / total


def describe_phases(planned: dict[str, Estimate]) -> str:
    return "; ".join(f"{name}: {phase.describe()}" for name, phase in planned.items())


def alternatives(counts: dict[str, Counts], settings: Settings, available: float,
                 cuda: bool, need: Callable[[Settings], float] | None = None) -> list[str]:
    """The option changes (alone) under which the estimate (`need`, by default `estimate`'s total) fits
    `available`."""
    need = need or (lambda changed: estimate(counts, changed).total)
    tries = [("base_model_precision = \"fp8\" (kohya's fp8_base)", replace(settings, denoiser="fp8",
                                                                          text_encoders="fp8")),
             ("base_model_precision = \"int8\"", replace(settings, denoiser="int8", text_encoders="fp8")),
             ("base_model_precision = \"nf4\"", replace(settings, denoiser="nf4", text_encoders="fp8")),
             ("gradient_checkpointing = true", replace(settings, gradient_checkpointing=True))]
    if cuda:
        tries.append(("blocks_to_swap (about half the blocks)", replace(settings, swapped_fraction=0.5)))
    if cuda and settings.swapped_fraction:
        tries.pop()  # blocks are swapped already
    fits = [name for name, changed in tries if changed != settings and need(changed) <= available]
    both = replace(settings, denoiser="nf4", text_encoders="fp8", gradient_checkpointing=True)
    if not fits and both != settings and need(both) <= available:
        fits.append("base_model_precision = \"nf4\" with gradient_checkpointing = true")
    return fits


def available_memory(device: torch.device) -> float:
    """Free memory of the CUDA device, or the host's available memory (MemAvailable)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")
