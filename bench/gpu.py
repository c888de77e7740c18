"""LoRA training speed on a GPU at real model sizes: images/s, s/step, peak allocated memory and model FLOPs
utilisation, over a grid of precision, gradient checkpointing, torch.compile and channels-last.

    python bench/gpu.py [--models sd15,sdxl,flux] [--resolution 512,1024,1024] [--batch_size 1] [--steps 10]
                        [--warmup 3] [--cells NAME ...] [--peak_tflops T] [--json PATH]
    python bench/gpu.py --tiny      # the tiny models on the CPU, a reduced grid (tests/bench/test_bench_gpu.py)

Each cell trains the denoiser the way `train_network.py` does with cached latents and text-encoder outputs: the
Config comes from `library.config.parse_config`, the Accelerator from `prepare_accelerator` (autocast, and the
GradScaler for fp16), the LoRA (rank 16, UNet / transformer only) from `build_model`, AdamW (fused) from
`build_optimizer`, the loss from `diffusion_loss` with the family's objective, then backward, gradient clipping at
1.0 and the optimizer step. The frozen base is built from the released configs in `library/families/configs` with
random weights, directly in the weight dtype on the device (nothing is downloaded); the latents and encoder states
are random tensors of the real shapes. Attention is PyTorch's scaled_dot_product_attention (diffusers' default).

Per cell: s/step (median over the steps after the warm-up, the clock read after `torch.cuda.synchronize()`),
images/s, the first step's seconds (compilation included), peak allocated CUDA memory, the forward FLOPs of the
denoiser counted by `torch.utils.flop_counter.FlopCounterMode` at the cell's batch, MFU = 3 x forward FLOPs /
s/step / the GPU's dense bf16 peak (the usual "model FLOPs", so the recomputation of gradient checkpointing is not
counted), and whether every loss was finite. A cell that runs out of memory is reported as such.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from real_size_files import CONFIGS, models_and_resolutions  # noqa: E402

TINY_RESOLUTION = 64
# Dense bf16 tensor-core peaks (TFLOPS, without sparsity) from NVIDIA's data sheets; the first name found in
# torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "GH200": 989.0,
                    "B200": 2250.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 70.0, "RTX 4090": 165.0}


# --- the grid --------------------------------------------------------------------------------------------------

def cell_name(precision: str, checkpointing: bool, compiled: bool, channels_last: bool) -> str:
    return (f"{precision}-{'gc' if checkpointing else 'nogc'}-{'compile' if compiled else 'eager'}-"
            f"{'cl' if channels_last else 'nchw'}")


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
    from library.config import parse_config

    argv = ["--pretrained_model_name_or_path", folder, "--train_data_dir", folder, "--output_dir", folder,
            "--resolution", f"{resolution},{resolution}", "--mixed_precision", cell["precision"],
            "--network_dim", "16", "--network_alpha", "16", "--network_train_unet_only", "--max_grad_norm", "1.0",
            "--optimizer_type", "AdamW", "--optimizer_args", "fused=True", "--learning_rate", "1e-4",
            "--torch_compile", str(cell["torch_compile"]).lower(),
            "--gradient_checkpointing", str(cell["gradient_checkpointing"]).lower()]
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


def run_cell(model: str, cell: dict[str, Any], args: argparse.Namespace, device: torch.device,
             resolution: int, peak_tflops: float | None) -> dict[str, Any]:
    from accelerate.state import AcceleratorState

    from library.families.family import Components
    from library.families.settings import settings_from
    from library.training.accelerator import prepare_accelerator
    from library.training.model import WEIGHT_DTYPES, NetworkSpec, build_model, diffusion_loss
    from library.training.optim import build_optimizer

    AcceleratorState._reset_state(reset_partial_state=True)
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as folder:
        config = cell_config(model, cell, resolution, folder)
    accelerator = prepare_accelerator(config)
    dtype = WEIGHT_DTYPES[config.mixed_precision]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    denoiser = build_denoiser(model, args.tiny, dtype, device)
    family, scheduler = family_and_scheduler(model, config)
    components = Components(denoiser=denoiser, vae=torch.nn.Module(), text_encoders=[], tokenizers=[],
                            noise_scheduler=scheduler, v_prediction=False, family=family)
    objective = family.objective(components, settings_from(family.settings_type, config), device)
    trained, groups = build_model(config, components, device, NetworkSpec(config.network_dim, config.network_alpha))
    latents, text, conditioning = make_inputs(model, denoiser, args.batch_size, resolution, args.tiny, dtype, device)
    if cell["channels_last"]:
        denoiser.to(memory_format=torch.channels_last)
        latents = latents.contiguous(memory_format=torch.channels_last)
    trainable = [p for group in groups for p in group["params"]]
    optimizer = build_optimizer(config.optimizer_type, groups, config.learning_rate, config.optimizer_args)
    forward_flops = count_forward_flops(trained, latents, text, conditioning, objective, accelerator)
    model_module, optimizer = accelerator.prepare(trained, optimizer)

    losses: list[float] = []
    times: list[float] = []
    for step in range(args.warmup + args.steps):
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
    timed = times[args.warmup:] or times
    s_per_step = statistics.median(timed)
    result = {
        "model": model, "resolution": resolution, "batch_size": args.batch_size, **cell,
        "weight_dtype": str(dtype).removeprefix("torch."),
        "grad_scaler": accelerator.scaler is not None, "fused_adamw": bool(optimizer.defaults.get("fused")),
        "steps": len(timed), "first_step_s": times[0], "s_per_step": s_per_step,
        "images_per_s": args.batch_size / s_per_step,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "forward_tflop": forward_flops / 1e12, "step_model_tflop": 3 * forward_flops / 1e12,
        "achieved_tflops": 3 * forward_flops / s_per_step / 1e12,
        "mfu": 3 * forward_flops / s_per_step / (peak_tflops * 1e12) if peak_tflops else None,
        "losses": losses, "finite_losses": all(math.isfinite(v) for v in losses),
        "lora_parameters": sum(p.numel() for p in trainable),
    }
    del model_module, optimizer, trained, denoiser, components, trainable, groups
    if device.type == "cuda":  # a full collection costs a second or more in a big process: only where memory counts
        gc.collect()
        torch.cuda.empty_cache()
    AcceleratorState._reset_state(reset_partial_state=True)
    return result


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


def environment(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "device": str(device), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    sdpa={"flash": torch.backends.cuda.flash_sdp_enabled(),
                          "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                          "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                          "math": torch.backends.cuda.math_sdp_enabled()},
                    tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return info


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    try:
        pairs = models_and_resolutions(args.models, args.resolution,
                                       (lambda model: TINY_RESOLUTION) if args.tiny else None)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    peak, peak_source = peak_of(device, args.peak_tflops)
    report: dict[str, Any] = {"environment": environment(device), "peak_tflops": peak, "peak_source": peak_source,
                              "tiny": args.tiny, "cells": []}
    for model, resolution in pairs:
        for cell in grid(model, args.tiny):
            if args.cells and cell["name"] not in args.cells:
                continue
            try:
                result = run_cell(model, cell, args, device, resolution, peak)
            except torch.cuda.OutOfMemoryError as e:
                result = {"model": model, "resolution": resolution, **cell, "error": f"out of memory: {e}"[:300]}
                gc.collect()
                torch.cuda.empty_cache()
            report["cells"].append(result)
            print(summary_line(result), flush=True)
    return report


def summary_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['model']:5} {r['resolution']:5} {r['name']:22} {r['error']}"
    memory = f"{r['peak_allocated_gib']:.1f} GiB" if r["peak_allocated_gib"] is not None else "-"
    mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "-"
    return (f"{r['model']:5} {r['resolution']:5} {r['name']:22} {r['s_per_step']:.3f} s/step "
            f"{r['images_per_s']:.2f} img/s  first {r['first_step_s']:.1f} s  peak {memory}  "
            f"fwd {r['forward_tflop']:.3g} TFLOP  MFU {mfu}  finite={r['finite_losses']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sd15,sdxl,flux", help="comma-separated: sd15, sdxl, flux")
    parser.add_argument("--resolution", default=None, help="comma-separated, one per model (default 512 for sd15, "
                        "1024 for sdxl and flux; 64 with --tiny)")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=3, help="steps per cell before the timed ones")
    parser.add_argument("--cells", nargs="*", default=None, help="only these cells, e.g. bf16-gc-eager-nchw")
    parser.add_argument("--peak_tflops", type=float, default=None, help="the device's dense bf16 peak")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="the tiny models and a reduced grid (runs on a CPU)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
