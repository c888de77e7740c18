"""LoRA training speed and memory on a GPU at real model sizes, then the tests that need CUDA: one command that
writes one JSON report and one log, sized for a 15-minute loan of an H100 or H200 (under 8 minutes in all).

    python bench/gpu.py [--out DIR] [--time_limit_s 420] [--only NAME ...] [--no_tests] [--peak_tflops T]
    python bench/gpu.py --grid [--models sd15,sdxl,flux] [--resolution 512,1024,1024] [--batch_size 1]
                        [--steps 10] [--warmup 3] [--cells NAME ...]      # precision x checkpointing x compile x cl
    python bench/gpu.py --tiny      # the tiny models on the CPU, end to end (tests/bench/test_bench_gpu.py)

The default plan (PLAN below, in this order): SD1.5 at 512 px and SDXL at 1024 px in bf16 (with and without
gradient checkpointing) and fp16 with the GradScaler; FLUX.1-dev at 1024 px with an fp8 base computing in bf16,
without and with 16 blocks swapped, at batch 2, and with a bf16 base; then regional torch.compile cells. A cell
starts only if its estimated seconds fit before the time limit less what the tests keep (`--tests_reserve_s`);
the rest are reported as skipped. Then `pytest -m cuda tests/cuda` runs in a subprocess, and its outcome per test
goes into the same report.

Each cell trains the denoiser the way `train_network.py` does with cached latents and text-encoder outputs: the
Config comes from `library.config.parse_config`, the Accelerator from `prepare_accelerator` (autocast, and the
GradScaler for fp16), the LoRA (rank 16, UNet / transformer only), the fp8 base and block swap from `build_model`,
regional compilation from `compile_repeated_blocks`, AdamW (fused) from `build_optimizer`, the loss from
`diffusion_loss` with the family's objective, then backward, gradient clipping at 1.0 and the optimizer step. The
frozen base is built from the released configs in `library/families/configs` with random weights, directly in the
weight dtype on the device (nothing is downloaded); the latents and encoder states are random tensors of the real
shapes. Attention is PyTorch's scaled_dot_product_attention (diffusers' default).

Per cell: s/step (median over the steps after the warm-up, the clock read after `torch.cuda.synchronize()`),
images/s, the first step's seconds (compilation included), peak allocated and reserved CUDA memory over the timed
steps (the statistics are reset after the warm-up, so a swapped model's peak is its steady state) and over the
load and warm-up, the forward FLOPs of the denoiser counted by `torch.utils.flop_counter.FlopCounterMode`, MFU =
3 x forward FLOPs / s/step / the GPU's dense bf16 peak (the usual "model FLOPs", so the recomputation of gradient
checkpointing is not counted), the frozen weights' storage dtypes, the blocks actually swapped, and whether every
loss was finite. A cell that fails (out of memory or otherwise) is reported with its error and the plan goes on.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from real_size_files import CONFIGS, models_and_resolutions  # noqa: E402

TINY_RESOLUTION = 64
# Dense bf16 tensor-core peaks (TFLOPS, without sparsity) from NVIDIA's data sheets; the first name found in
# torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "GH200": 989.0,
                    "B200": 2250.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 70.0, "RTX 4090": 165.0}
TIME_LIMIT_S = 420.0  # with the wheels' install and Python's start, under 8 minutes
TESTS_RESERVE_S = 150.0
PACKAGES = ("torch", "diffusers", "transformers", "peft", "accelerate", "safetensors", "huggingface_hub", "numpy")
logger = logging.getLogger("bench.gpu")


# --- the cells -----------------------------------------------------------------------------------------------------

def cell_name(precision: str, checkpointing: bool, compiled: bool, channels_last: bool, base: str | None = None,
              blocks_to_swap: int = 0, batch_size: int = 1) -> str:
    name = (f"{precision}-{'gc' if checkpointing else 'nogc'}-{'compile' if compiled else 'eager'}-"
            f"{'cl' if channels_last else 'nchw'}")
    if base:
        name += f"-{base}base"
    if blocks_to_swap:
        name += f"-swap{blocks_to_swap}"
    if batch_size != 1:
        name += f"-b{batch_size}"
    return name


def make_cell(model: str, resolution: int, precision: str, checkpointing: bool, compiled: bool = False,
              channels_last: bool = False, base: str | None = None, blocks_to_swap: int = 0, batch_size: int = 1,
              warmup: int = 3, steps: int = 10, estimate_s: float = 30.0) -> dict[str, Any]:
    return {"model": model, "resolution": resolution, "batch_size": batch_size,
            "name": cell_name(precision, checkpointing, compiled, channels_last, base, blocks_to_swap, batch_size),
            "precision": precision, "gradient_checkpointing": checkpointing, "torch_compile": compiled,
            "channels_last": channels_last, "base": base, "blocks_to_swap": blocks_to_swap, "warmup": warmup,
            "steps": steps, "estimate_s": estimate_s}


# The one-command plan, most wanted first. Estimates (seconds per cell on an H100: building the base, the FLOP
# count, warm-up and timed steps, compilation) decide what still fits the time limit: SD1.5 about 0.1 s/step, SDXL
# at 1024 px about 0.4, FLUX.1-dev at 1024 px about 2 (about 3 with 16 blocks swapped over PCIe); compiling a
# model's repeated blocks costs one to two minutes. Eager cells: about 4 minutes; the compile cells run in what
# is left.
PLAN = [
    make_cell("sd15", 512, "bf16", True, estimate_s=10), make_cell("sd15", 512, "bf16", False, channels_last=True,
                                                                    estimate_s=10),
    make_cell("sd15", 512, "fp16", True, estimate_s=10),
    make_cell("sdxl", 1024, "bf16", True, estimate_s=20), make_cell("sdxl", 1024, "bf16", False, estimate_s=20),
    make_cell("sdxl", 1024, "fp16", True, estimate_s=20),
    make_cell("flux", 1024, "bf16", True, base="fp8", warmup=2, steps=5, estimate_s=40),
    make_cell("flux", 1024, "bf16", True, base="fp8", blocks_to_swap=16, warmup=2, steps=5, estimate_s=50),
    make_cell("flux", 1024, "bf16", True, base="fp8", batch_size=2, warmup=2, steps=4, estimate_s=45),
    make_cell("flux", 1024, "bf16", True, warmup=2, steps=5, estimate_s=40),
    make_cell("sd15", 512, "bf16", False, compiled=True, estimate_s=90),
    make_cell("sdxl", 1024, "bf16", True, compiled=True, estimate_s=120),
    make_cell("flux", 1024, "bf16", True, compiled=True, base="fp8", warmup=3, steps=5, estimate_s=150),
]


def plan(tiny: bool, warmup: int | None = None, steps: int | None = None) -> list[dict[str, Any]]:
    """PLAN; with `tiny`, at 64 px on the tiny models and without compilation (minutes on a CPU)."""
    cells = [dict(c) for c in PLAN if not (tiny and c["torch_compile"])]
    for cell in cells:
        if tiny:
            cell.update(resolution=TINY_RESOLUTION, estimate_s=5)
        if warmup is not None:
            cell["warmup"] = warmup
        if steps is not None:
            cell["steps"] = steps
    return cells


def grid(model: str, tiny: bool) -> list[dict[str, Any]]:
    """bf16 over checkpointing x compile x channels-last (channels-last only for the UNets), and one fp16 cell with
    the GradScaler. The tiny CPU grid leaves out torch.compile (minutes of compilation on a CPU) and keeps one
    cell for each setting."""
    unet = model != "flux"
    if tiny:
        settings = [("bf16", True, False, False), ("bf16", False, False, unet), ("fp16", True, False, False)]
    else:
        settings = [("bf16", gc_, compiled, cl) for gc_ in (True, False) for compiled in (False, True)
                    for cl in ((False, True) if unet else (False,))]
        settings.append(("fp16", True, False, False))
    return [{"name": cell_name(*s), "precision": s[0], "gradient_checkpointing": s[1], "torch_compile": s[2],
             "channels_last": s[3]} for s in settings]


def grid_cells(args: argparse.Namespace) -> list[dict[str, Any]]:
    pairs = models_and_resolutions(args.models, args.resolution, (lambda model: TINY_RESOLUTION) if args.tiny
                                   else None)
    return [make_cell(model, resolution, g["precision"], g["gradient_checkpointing"], g["torch_compile"],
                      g["channels_last"], batch_size=args.batch_size, warmup=args.warmup, steps=args.steps,
                      estimate_s=0)
            for model, resolution in pairs for g in grid(model, args.tiny)]


# --- the model and its inputs ------------------------------------------------------------------------------------

_TINY: dict[str, torch.nn.Module] = {}  # each tiny denoiser is built once (its builder also makes a tokenizer)


def build_denoiser(model: str, tiny: bool, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The frozen base: a tiny builder's, or the released architecture with random weights made in `dtype` on
    `device` (no float32 copy on the host)."""
    if tiny:
        if model not in _TINY:
            from library.families.flux.tiny import build_tiny_flux
            from library.families.sd.tiny import build_tiny_sd1, build_tiny_sdxl

            _TINY[model] = {"sd15": lambda: build_tiny_sd1()["unet"], "sdxl": lambda: build_tiny_sdxl()["unet"],
                            "flux": lambda: build_tiny_flux()["transformer"]}[model]()
        modeling_logger = logging.getLogger("diffusers.models.modeling_utils")
        level = modeling_logger.level
        modeling_logger.setLevel(logging.ERROR)  # `.to(dtype)` warns about fp32 modules even when there are none
        try:
            return copy.deepcopy(_TINY[model]).to(device=device, dtype=dtype)
        finally:
            modeling_logger.setLevel(level)
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    torch.manual_seed(0)
    try:
        with torch.device(device):
            if model == "flux":
                return FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(CONFIGS / "flux1" /
                                                                                             "transformer"))
            folder = CONFIGS / {"sd15": "sd1", "sdxl": "sdxl"}[model] / "unet"
            return UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder))
    finally:
        torch.set_default_dtype(previous)


def family_and_scheduler(model: str, config: Any) -> tuple[Any, Any]:
    if model == "flux":
        from diffusers import FlowMatchEulerDiscreteScheduler

        from library.families.flux.family import Flux
        from library.families.settings import settings_from

        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(CONFIGS / "flux1", subfolder="scheduler")
        return Flux(schnell=False).configured(settings_from(Flux.settings_type, config)), scheduler
    from diffusers import DDPMScheduler

    from library.families.sd.family import SD1
    from library.families.sd.sdxl import SDXL

    folder = CONFIGS / {"sd15": "sd1", "sdxl": "sdxl"}[model]
    return {"sd15": SD1, "sdxl": SDXL}[model], DDPMScheduler.from_pretrained(folder, subfolder="scheduler")


def make_inputs(model: str, denoiser: torch.nn.Module, batch: int, resolution: int, tiny: bool,
                dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, dict, dict]:
    """Cached-latent and cached-text-encoder-output shaped inputs: (latents, text, conditioning)."""
    g = torch.Generator().manual_seed(0)
    config = denoiser.config
    side = resolution // 8

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    if model == "flux":
        tokens = 16 if tiny else 512  # kohya's t5xxl_max_token_length for dev
        latents = randn(batch, config.in_channels // 4, side, side)
        text = {"encoder_hidden_states": randn(batch, tokens, config.joint_attention_dim),
                "pooled": randn(batch, config.pooled_projection_dim),
                "t5_attn_mask": torch.ones(batch, tokens, dtype=torch.long, device=device)}
        return latents, text, {}
    latents = randn(batch, config.in_channels, side, side)
    text = {"encoder_hidden_states": randn(batch, 77, config.cross_attention_dim)}
    conditioning = {}
    if model == "sdxl":
        text["pooled"] = randn(batch, config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim)
        size = [resolution, resolution, 0, 0, resolution, resolution]
        conditioning["time_ids"] = torch.tensor([size] * batch, dtype=dtype, device=device)
    return latents, text, conditioning


# --- one cell ------------------------------------------------------------------------------------------------------

def cell_config(model: str, cell: dict[str, Any], resolution: int, folder: str) -> Any:
    import library.families.registry  # noqa: F401 - the families' options are part of the schema
    from library.config import parse_config

    argv = ["--pretrained_model_name_or_path", folder, "--train_data_dir", folder, "--output_dir", folder,
            "--resolution", f"{resolution},{resolution}", "--mixed_precision", cell["precision"],
            "--network_dim", "16", "--network_alpha", "16", "--network_train_unet_only", "--max_grad_norm", "1.0",
            "--optimizer_type", "AdamW", "--optimizer_args", "fused=True", "--learning_rate", "1e-4",
            "--torch_compile", str(cell["torch_compile"]).lower(),
            "--gradient_checkpointing", str(cell["gradient_checkpointing"]).lower()]
    if cell.get("base"):
        argv += ["--base_model_precision", cell["base"]]
    if cell.get("blocks_to_swap"):
        argv += ["--blocks_to_swap", str(cell["blocks_to_swap"])]
    if model == "flux":
        argv += ["--timestep_sampling", "shift", "--discrete_flow_shift", "3.1582", "--model_prediction_type", "raw",
                 "--guidance_scale", "1.0", "--network_module", "networks.lora_flux"]
    return parse_config(argv)[0]


def count_forward_flops(model: torch.nn.Module, latents: torch.Tensor, text: dict, conditioning: dict,
                        objective: Any, accelerator: Any) -> int:
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    timesteps = objective.sample_timesteps(latents.shape[0], torch.Generator().manual_seed(0), latents.device,
                                           latents.shape[-2:])
    # torch counts the CUDA attention kernels (flash, memory-efficient, cuDNN) but not the CPU one, which would
    # leave attention out of the tiny CPU mode's count; it costs what the others do.
    custom = {}
    cpu_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu_attention is not None:
        def attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:  # noqa: ARG001
            return sdpa_flop_count(query, key, value)

        custom[cpu_attention] = attention_flops
    with torch.no_grad(), accelerator.autocast(), FlopCounterMode(display=False, custom_mapping=custom) as counter:
        model(latents, timesteps, text, conditioning)
    return int(counter.get_total_flops())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gib(n_bytes: float) -> float:
    return n_bytes / 2**30


def swapped_blocks(config: Any, family: Any, denoiser: torch.nn.Module, device: torch.device) -> int:
    """How many blocks build_model set to swap: blocks_to_swap acts only where there is a CUDA device."""
    if not config.blocks_to_swap or device.type != "cuda":
        return 0
    return sum(count for _, count in family.block_swap_plan(denoiser, config.blocks_to_swap))


def run_cell(cell: dict[str, Any], device: torch.device, tiny: bool, peak_tflops: float | None) -> dict[str, Any]:
    from accelerate.state import AcceleratorState

    from library.families.family import Components
    from library.families.settings import settings_from
    from library.training.accelerator import prepare_accelerator
    from library.training.model import WEIGHT_DTYPES, NetworkSpec, build_model, compile_repeated_blocks, diffusion_loss
    from library.training.optim import build_optimizer

    model, resolution, batch = cell["model"], cell["resolution"], cell["batch_size"]
    AcceleratorState._reset_state(reset_partial_state=True)
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as folder:
        config = cell_config(model, cell, resolution, folder)
    accelerator = prepare_accelerator(config)
    dtype = WEIGHT_DTYPES[config.mixed_precision]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    denoiser = build_denoiser(model, tiny, dtype, device)
    family, scheduler = family_and_scheduler(model, config)
    components = Components(denoiser=denoiser, vae=torch.nn.Module(), text_encoders=[], tokenizers=[],
                            noise_scheduler=scheduler, v_prediction=False, family=family)
    objective = family.objective(components, settings_from(family.settings_type, config), device)
    trained, groups = build_model(config, components, device, NetworkSpec(config.network_dim, config.network_alpha))
    frozen = [p for p in denoiser.parameters() if not p.requires_grad]
    storage = Counter(str(p.dtype).removeprefix("torch.") for p in frozen)
    base_bytes = sum(p.numel() * p.element_size() for p in frozen)
    latents, text, conditioning = make_inputs(model, denoiser, batch, resolution, tiny, dtype, device)
    if cell["channels_last"]:
        denoiser.to(memory_format=torch.channels_last)
        latents = latents.contiguous(memory_format=torch.channels_last)
    trainable = [p for group in groups for p in group["params"]]
    optimizer = build_optimizer(config.optimizer_type, groups, config.learning_rate, config.optimizer_args)
    forward_flops = count_forward_flops(trained, latents, text, conditioning, objective, accelerator)
    if config.torch_compile:  # after the count: FlopCounterMode counts the eager forward
        compile_repeated_blocks(denoiser, "inductor")
    model_module, optimizer = accelerator.prepare(trained, optimizer)

    losses: list[float] = []
    times: list[float] = []
    load_peak = load_reserved = None
    for step in range(cell["warmup"] + cell["steps"]):
        if step == cell["warmup"] and device.type == "cuda":
            # The timed steps' own peak: a swapped model held every block until its first forward.
            load_peak, load_reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        generator = torch.Generator().manual_seed(step)
        noise = objective.sample_noise(latents, generator)
        timesteps = objective.sample_timesteps(latents.shape[0], generator, device, latents.shape[-2:])
        synchronize(device)
        started = time.perf_counter()
        with accelerator.autocast():
            loss = diffusion_loss(model_module, latents, text, conditioning, noise, timesteps, objective).mean()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(trainable, config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the trainer reads the loss every step too
        synchronize(device)
        times.append(time.perf_counter() - started)
    timed = times[cell["warmup"]:] or times
    s_per_step = statistics.median(timed)
    cuda = device.type == "cuda"
    result = {
        **{k: v for k, v in cell.items() if k != "estimate_s"},
        "weight_dtype": str(dtype).removeprefix("torch."), "frozen_storage": dict(storage),
        "frozen_weights_gib": gib(base_bytes), "swapped_blocks": swapped_blocks(config, family, denoiser, device),
        "grad_scaler": accelerator.scaler is not None, "fused_adamw": bool(optimizer.defaults.get("fused")),
        "timed_steps": len(timed), "first_step_s": times[0], "s_per_step": s_per_step,
        "images_per_s": batch / s_per_step,
        "peak_allocated_gib": gib(torch.cuda.max_memory_allocated(device)) if cuda else None,
        "peak_reserved_gib": gib(torch.cuda.max_memory_reserved(device)) if cuda else None,
        "load_peak_allocated_gib": gib(load_peak) if load_peak is not None else None,
        "load_peak_reserved_gib": gib(load_reserved) if load_reserved is not None else None,
        "forward_tflop": forward_flops / 1e12, "step_model_tflop": 3 * forward_flops / 1e12,
        "achieved_tflops": 3 * forward_flops / s_per_step / 1e12,
        "mfu": 3 * forward_flops / s_per_step / (peak_tflops * 1e12) if peak_tflops else None,
        "losses": losses, "finite_losses": all(math.isfinite(v) for v in losses),
        "lora_parameters": sum(p.numel() for p in trainable),
    }
    del model_module, optimizer, trained, denoiser, components, trainable, groups, frozen
    if cuda:  # a full collection costs a second or more in a big process: only where memory counts
        gc.collect()
        torch.cuda.empty_cache()
    AcceleratorState._reset_state(reset_partial_state=True)
    torch._dynamo.reset()
    return result


# --- the machine ---------------------------------------------------------------------------------------------------

def peak_of(device: torch.device, override: float | None) -> tuple[float | None, str]:
    if override is not None:
        return override, "--peak_tflops"
    if device.type != "cuda":
        return None, "no peak known for a CPU (give --peak_tflops)"
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops, f"{name}: table entry {key!r}"
    return None, f"{name}: not in the table (give --peak_tflops)"


def package_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def environment(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "packages": package_versions(), "device": str(device),
                            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), gpu_memory_gib=gib(properties.total_memory),
                    cuda=torch.version.cuda,
                    sdpa={"flash": torch.backends.cuda.flash_sdp_enabled(),
                          "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                          "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                          "math": torch.backends.cuda.math_sdp_enabled()},
                    tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return info


# --- the run -------------------------------------------------------------------------------------------------------

class Clock:
    """The time limit: cells start while their estimate fits before it, less what the tests keep."""

    def __init__(self, limit_s: float, tests_reserve_s: float):
        self.started = time.monotonic()
        self.limit_s, self.tests_reserve_s = limit_s, tests_reserve_s

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def fits(self, estimate_s: float) -> bool:
        return self.elapsed() + estimate_s <= self.limit_s - self.tests_reserve_s

    def left(self) -> float:
        return self.limit_s - self.elapsed()


def run_cells(cells: list[dict[str, Any]], device: torch.device, tiny: bool, peak: float | None, clock: Clock,
              say: Callable[[str], None]) -> list[dict[str, Any]]:
    results = []
    for cell in cells:
        base = {k: v for k, v in cell.items() if k != "estimate_s"}
        started = time.monotonic()
        if not clock.fits(cell["estimate_s"]):
            result = {**base, "skipped": f"time limit: {clock.elapsed():.0f} s used, about {cell['estimate_s']:.0f} "
                                         f"s needed, {clock.left():.0f} s left with the tests to run"}
        else:
            try:
                result = run_cell(cell, device, tiny, peak)
            except Exception as e:  # noqa: BLE001 - one failing cell must not cost the rest of the plan
                out_of_memory = isinstance(e, torch.cuda.OutOfMemoryError)
                logger.error("%s %s failed:\n%s", cell["model"], cell["name"], traceback.format_exc())
                result = {**base, "error": (f"out of memory: {e}" if out_of_memory else f"{type(e).__name__}: {e}")[
                    :500]}
            if "error" in result:  # the failed cell's tensors are free once its traceback is gone
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            result["cell_s"] = time.monotonic() - started
        results.append(result)
        say(summary_line(result))
    return results


def run_tests(clock: Clock, say: Callable[[str], None], minimum_s: float = 60.0) -> dict[str, Any]:
    """`pytest -m cuda tests/cuda` in a subprocess with what is left of the time limit; its outcome per test."""
    timeout = max(minimum_s, clock.left())
    with tempfile.TemporaryDirectory(prefix="gpu-bench-tests-") as folder:
        junit = Path(folder) / "junit.xml"
        # addopts replaced: the suite's xdist workers are not wanted here (and pytest-xdist may be absent).
        command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o",
                   "addopts=--strict-markers", "-m", "cuda", "tests/cuda", f"--junitxml={junit}"]
        say(f"$ {' '.join(command)}   (timeout {timeout:.0f} s)")
        started = time.monotonic()
        try:
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
            returncode, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            returncode = None
            output = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))
            output += f"\n(stopped after {timeout:.0f} s)"
        seconds = time.monotonic() - started
        say(output.rstrip())
        cases = read_junit(junit) if junit.exists() else []
    counts = Counter(case["outcome"] for case in cases)
    return {"command": " ".join(command[1:]), "returncode": returncode, "timed_out": returncode is None,
            "seconds": seconds, "counts": dict(counts), "cases": cases}


def read_junit(path: Path) -> list[dict[str, Any]]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "")[:500]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "message": message})
    return cases


def summary_line(r: dict[str, Any]) -> str:
    head = f"{r['model']:5} {r['resolution']:5} {r['name']:36}"
    if "skipped" in r:
        return f"{head} skipped ({r['skipped']})"
    if "error" in r:
        return f"{head} {r['error']}"
    memory = (f"peak {r['peak_allocated_gib']:.1f} GiB (load {r['load_peak_allocated_gib']:.1f})"
              if r["peak_allocated_gib"] is not None else "peak -")
    mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "-"
    return (f"{head} {r['s_per_step']:.3f} s/step {r['images_per_s']:.2f} img/s  first {r['first_step_s']:.1f} s  "
            f"{memory}  fwd {r['forward_tflop']:.3g} TFLOP  MFU {mfu}  swapped {r['swapped_blocks']}  "
            f"finite={r['finite_losses']}")


def select_cells(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The plan's cells (or the grid's), less those --only leaves out; SystemExit naming what does not exist."""
    try:
        cells = grid_cells(args) if args.grid else plan(args.tiny, args.warmup, args.steps)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.only:
        names = {c["name"] for c in cells} | {f"{c['model']}/{c['name']}" for c in cells}
        unknown = sorted(set(args.only) - names)
        if unknown:
            listed = ", ".join(f"{c['model']}/{c['name']}" for c in cells)
            raise SystemExit(f"--only: no cell named {', '.join(unknown)}; the cells: {listed}")
        cells = [c for c in cells if c["name"] in args.only or f"{c['model']}/{c['name']}" in args.only]
    return cells


def run(args: argparse.Namespace, cells: list[dict[str, Any]]) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, log_path = args.out / "gpu.json", args.out / "gpu.log"
    log_path.write_text("")
    # Both the handler and say() append (O_APPEND): neither overwrites the other's lines.
    handler = logging.FileHandler(log_path, mode="a")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    previous_level = root.level
    root.setLevel(logging.INFO)

    def say(line: str) -> None:
        print(line, flush=True)
        with open(log_path, "a") as log:
            log.write(line + "\n")

    try:
        clock = Clock(args.time_limit_s, 0 if args.no_tests else args.tests_reserve_s)
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              ("cpu" if args.device == "auto" else args.device))
        peak, peak_source = peak_of(device, args.peak_tflops)
        report: dict[str, Any] = {"environment": environment(device), "peak_tflops": peak, "peak_source": peak_source,
                                  "tiny": args.tiny, "mode": "grid" if args.grid else "plan",
                                  "time_limit_s": args.time_limit_s, "cells": [], "tests": None}
        say(f"{report['environment']}")
        report["cells"] = run_cells(cells, device, args.tiny, peak, clock, say)
        report["cells_s"] = clock.elapsed()
        json_path.write_text(json.dumps(report, indent=1))  # the figures so far survive a test run that hangs
        if not args.no_tests:
            report["tests"] = run_tests(clock, say)
        report["elapsed_s"] = clock.elapsed()
        json_path.write_text(json.dumps(report, indent=1))
        say(f"wrote {json_path} and {log_path} after {report['elapsed_s']:.0f} s")
        return report
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(previous_level)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "output" / "gpu_bench",
                        help="folder for gpu.json and gpu.log")
    parser.add_argument("--time_limit_s", type=float, default=TIME_LIMIT_S,
                        help="no cell starts that would end after this less --tests_reserve_s; the tests get what "
                        "is left (at least 60 s)")
    parser.add_argument("--tests_reserve_s", type=float, default=TESTS_RESERVE_S,
                        help="seconds kept for the CUDA tests")
    parser.add_argument("--only", nargs="*", default=None,
                        help="only these cells: NAME (of every model) or MODEL/NAME, e.g. flux/bf16-gc-eager-nchw")
    parser.add_argument("--no_tests", action="store_true", help="leave out the tests marked cuda")
    parser.add_argument("--grid", action="store_true", help="the grid of --models instead of the plan")
    parser.add_argument("--models", default="sd15,sdxl,flux", help="--grid: comma-separated: sd15, sdxl, flux")
    parser.add_argument("--resolution", default=None, help="--grid: comma-separated, one per model (default 512 for "
                        "sd15, 1024 for sdxl and flux; 64 with --tiny)")
    parser.add_argument("--batch_size", type=int, default=1, help="--grid: the batch")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per cell (the plan's own by default; "
                        "--grid: 10)")
    parser.add_argument("--warmup", type=int, default=None, help="steps per cell before the timed ones (the plan's "
                        "own by default; --grid: 3)")
    parser.add_argument("--peak_tflops", type=float, default=None, help="the device's dense bf16 peak")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="the tiny models at 64 px, no compilation (runs on a CPU; "
                        "one warm-up and one timed step unless --warmup / --steps say otherwise)")
    args = parser.parse_args(argv)
    if args.grid:
        args.steps = 10 if args.steps is None else args.steps
        args.warmup = 3 if args.warmup is None else args.warmup
    elif args.tiny:
        args.steps = 1 if args.steps is None else args.steps
        args.warmup = 1 if args.warmup is None else args.warmup
    report = run(args, select_cells(args))
    failed = [c["name"] for c in report["cells"] if "error" in c or not c.get("finite_losses", True)]
    tests = report["tests"]
    return 1 if failed or (tests is not None and tests["returncode"] != 0) else 0


if __name__ == "__main__":
    raise SystemExit(main())
