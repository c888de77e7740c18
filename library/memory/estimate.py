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
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from library.core.safetensors_header import read_safetensors_header
from library.memory.precision import SKIP_PATTERNS, stored_bytes_per_weight

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
    # The blocks (keys under `<name>.<index>.`): how many, the matrices of the largest, and the width most of their
    # matrices share (a transformer's hidden size), for the activations
    blocks: int = 0
    largest_block: int = 0
    width: int = 0
    raised: int = 0  # of the matrices, those a low precision leaves in the compute dtype (embeddings: _RAISED)

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.matrices + other.matrices, self.other + other.other,
                      self.lora_per_rank + other.lora_per_rank, self.stored_fp8 + other.stored_fp8,
                      max(self.largest, other.largest), self.blocks + other.blocks,
                      max(self.largest_block, other.largest_block), max(self.width, other.width),
                      self.raised + other.raised)


_BLOCK = re.compile(r"^(.*?\.\d+)\.")
# The layers a low precision leaves in the compute dtype (library.memory.precision: SKIP_PATTERNS, and T5's shared
# embedding, which its encoder's embed_tokens shares), by their keys' module names: Qwen2.5-VL's 545 M embedding
# weights are 2 GiB in float32.
_RAISED = tuple(re.compile(pattern) for pattern in (*SKIP_PATTERNS, r"(^|\.)shared$"))
# Fused projections that the loaders split into several layers, each with its own LoRA (BFL's and SAI's layouts:
# q, k, v; FLUX's single-block linear1: q, k, v and the MLP's input): a LoRA per piece has pieces x in + out
# parameters a rank, not in + out.
_SPLIT = ((re.compile(r"\.qkv\.weight$"), 3), (re.compile(r"single_blocks\.\d+\.linear1\.weight$"), 4))


def count_file(path: Path, part: str) -> dict[str, Counts]:
    """component ("denoiser", "text", "vae") -> Counts of a safetensors file; keys under another component's
    prefix count there."""
    header = read_safetensors_header(path)[1]
    return count_tensors(((key, entry["shape"], entry["dtype"]) for key, entry in header.items()
                          if entry["dtype"] in _BYTES), part)


def count_tensors(tensors: Iterable[tuple[str, Sequence[int], str]], part: str) -> dict[str, Counts]:
    """count_file's Counts of (key, shape, safetensors dtype) triples (a header's, or a model's on the meta device)."""
    out: dict[str, Counts] = {}
    blocks: dict[str, Counter[str]] = {}  # owner -> block -> its matrices
    widths: dict[str, Counter[int]] = {}
    for key, shape, dtype in tensors:
        owner = next((name for name, prefixes in _PREFIXES.items() if key.startswith(prefixes)), part)
        found = count_tensor(shape, dtype.startswith("F8"))
        if found.matrices and any(pattern.search(key.rpartition(".")[0]) for pattern in _RAISED):
            found = replace(found, raised=found.matrices)
        pieces = next((count for pattern, count in _SPLIT if pattern.search(key)), 1)
        if found.matrices and pieces > 1:
            found = replace(found, lora_per_rank=found.lora_per_rank + (pieces - 1) * found.matrices // shape[0])
        out[owner] = out.get(owner, Counts()) + found
        block = _BLOCK.match(key)
        if block and found.matrices:
            blocks.setdefault(owner, Counter())[block[1]] += found.matrices
            widths.setdefault(owner, Counter()).update(shape[:2])
    for owner, sizes in blocks.items():
        out[owner] = replace(out[owner], blocks=len(sizes), largest_block=max(sizes.values()),
                             width=widths[owner].most_common(1)[0][0])
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
    # the largest batch's latent tokens (batch x patches x latent frames, library.training.memory_check.batch_tokens);
    # 0: not known, taken as one 1024 x 1024 image
    tokens: int = 0
    offload_checkpoints: bool = False  # cpu_offload_checkpointing on CUDA: the blocks' inputs wait in host memory


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
    """A component stored under `kind` (its matrices but those it leaves raised; the rest in the compute dtype)."""
    compute = torch.finfo(settings.compute_dtype).bits / 8
    raised = part.raised if kind else 0
    return ((part.matrices - raised) * stored_bytes_per_weight(kind, settings.compute_dtype)
            + (part.other + raised) * compute)


def lora_bytes(denoiser: Counts, settings: Settings) -> float:
    """fp32 weight, gradient, two AdamW moments; never more than the matrices themselves (a LyCORIS "full matrix"
    network_dim such as 100000 is not a rank)."""
    return min(denoiser.lora_per_rank * settings.rank, denoiser.matrices) * 16


PIXELS_PER_TOKEN = 16  # an 8x VAE and 2x2 patches: FLUX.1, SD3, Qwen-Image, Wan 2.1 (a UNet's top level: 4x the
# tokens at a quarter of the width, the same product)
DEFAULT_TOKENS = (1024 // PIXELS_PER_TOKEN) ** 2
BLOCK_WORKING_SET = 32  # values per token and width that one block's forward keeps for its backward (attention,
# the MLP's widened hidden states, norms and modulation)
RUNTIME = 2.5 * GIB  # work buffers and allocator slack, autograd's graph, the data loader, the optimizer's step
# (fitted to the FLUX.1-dev runs of bench/full_size.py, bench/README.md)


def activation_bytes(denoiser: Counts, settings: Settings) -> float:
    """What training holds beside the weights: the activations the backward reads and the compute-dtype copies of a
    low-precision base's weights that it needs. From the denoiser's blocks (their count and width, read from the
    file's keys) and the largest batch's tokens (frames x patches for video). With gradient checkpointing each
    block keeps its input (in host memory with cpu_offload_checkpointing) and one block at a time its working set,
    and an fp8 base the block being recomputed its weights in the compute dtype (the cast copy is what the backward
    reads; bitsandbytes' int8 / NF4 keep only their packed weights and dequantize a layer at a time); without it
    every block keeps its working set, and an fp8 base every weight's compute-dtype copy. A model whose blocks
    cannot be told (counted without its keys) gets the former rough allowance, a share of its matrices."""
    compute = torch.finfo(settings.compute_dtype).bits / 8
    if not denoiser.blocks:
        return (0.15 if settings.gradient_checkpointing else 1.0) * denoiser.matrices * compute + 0.5 * GIB
    stream = (settings.tokens or DEFAULT_TOKENS) * denoiser.width * compute  # one block's input
    if settings.gradient_checkpointing:
        kept = stream * ((0 if settings.offload_checkpoints else denoiser.blocks) + BLOCK_WORKING_SET)
        copies = denoiser.largest_block if settings.denoiser == "fp8" else 0
    else:
        kept = stream * denoiser.blocks * BLOCK_WORKING_SET
        copies = denoiser.matrices if settings.denoiser == "fp8" else 0
    return kept + copies * compute + RUNTIME


def estimate(counts: dict[str, Counts], settings: Settings) -> Estimate:
    """The peak of the load and of training (`load_and_training`), whichever is larger, by part."""
    return max(load_and_training(counts, settings), key=lambda phase: phase.total)


def load_and_training(counts: dict[str, Counts], settings: Settings) -> tuple[Estimate, Estimate]:
    """The peak of the load (every component as read: fp8 for fp8, the file's fp8 or else the compute dtype
    before int8 / nf4 quantize it, the compute dtype for a diffusers folder) and of training (the base as
    stored, LoRA, optimizer, activations), by part."""
    denoiser, text, vae = (counts.get(name, Counts()) for name in ("denoiser", "text", "vae"))
    vae_bytes = (vae.matrices + vae.other) * torch.finfo(settings.vae_dtype).bits / 8
    stored = held_bytes(denoiser, settings.denoiser, settings) * (1 - settings.swapped_fraction)
    until_cached = "text encoders (until their outputs are cached)"
    loading = {"denoiser as read": read_bytes(denoiser, settings.denoiser, settings, denoiser=True),
               until_cached: read_bytes(text, settings.text_encoders, settings), "VAE": vae_bytes}
    training = {"denoiser as stored": stored, until_cached: held_bytes(text, settings.text_encoders, settings),
                "VAE": vae_bytes, "LoRA and optimizer": lora_bytes(denoiser, settings),
                "activations": activation_bytes(denoiser, settings)}
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
    # On a GPU the text encoders are stored low before they are placed; the host holds them as read first, then
    # as stored.
    text_placed = max(read_bytes(text, settings.text_encoders, settings), text_held) if host else text_held
    encoding = encoding_bytes(text, settings, host)
    planned = {TEXT_PHASE: Estimate({"text encoders": text_placed, "VAE": vae_bytes,
                                     **({"encoding": encoding} if encoding else {})}),
               PLACING_PHASE: Estimate({"denoiser as read": max(stored, read_bytes(denoiser, settings.denoiser,
                                                                                   settings, True) * kept),
                                        "VAE": vae_bytes}),
               TRAINING_PHASE: Estimate({"denoiser as stored": stored, "VAE": vae_bytes, "LoRA and optimizer": lora,
                                         "activations": activation_bytes(denoiser, settings)})}
    if sampling and host:
        for name in (PLACING_PHASE, TRAINING_PHASE):
            planned[name] = Estimate({**planned[name].parts, "text encoders (kept for sampling)": text_held})
    elif sampling:
        planned[SAMPLING_PHASE] = Estimate({"denoiser as stored": stored, "text encoders": text_held,
                                            "VAE": vae_bytes, "LoRA and optimizer": lora})
    return planned


def encoding_bytes(text: Counts, settings: Settings, host: bool) -> float:
    """What filling the caches needs on the host beside the encoders' weights: a compute-dtype copy of their largest
    matrix (an embedding raised while its stored copy is still held, or a layer's cast for its forward) and work
    buffers, fitted to the Qwen-Image run of bench/full_size.py (bench/README.md). Not counted on a GPU, where
    nothing of it was measured (the raise happens on the host before the encoders are placed)."""
    if not (host and text.matrices):
        return 0.0
    return text.largest * torch.finfo(settings.compute_dtype).bits / 8 + 0.5 * GIB


def read_bytes(part: Counts, kind: str | None, settings: Settings, denoiser: bool = False) -> float:
    """A component as read, before a low precision stores it: fp8 read as fp8 from files read tensor by tensor,
    a file's fp8 tensors as they are, the rest in the compute dtype; a denoiser quantized layer by layer as it is
    read (`quantized_as_read`) as stored, with its largest matrix in the compute dtype."""
    compute = torch.finfo(settings.compute_dtype).bits / 8
    if kind == "fp8" and settings.reads_low:
        return held_bytes(replace(part, raised=0), "fp8", settings)  # raised once stored
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
