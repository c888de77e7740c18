"""Training at real model sizes: load time, launch -> first step, s/step and peak RSS of `train_network.py`.

    python bench/real_size.py [--models sd15,sdxl] [--steps 2] [--resolution 512,1024] [--threads 2]
                              [--images N] [--work DIR] [--json PATH] [--load_only] [--train_options="..."]
                              [--flux_files bf16|fp8]

For each model the script writes a single-file checkpoint of the released architecture with random weights
(fp16, original layout, built piece by piece by bench/real_size_files.py; nothing is downloaded), a few images of
the training resolution with captions, and a TOML config of the usual kind (bf16, gradient checkpointing, cached
latents and text-encoder outputs, UNet-only LoRA rank 16, AdamW, batch 1), then runs `python train_network.py
--config CONFIG [TRAIN_OPTIONS]` in a child process that records:

- load: the wall seconds of `load_components` (reading the checkpoint into the training dtype), and the RSS and
  peak RSS right after it;
- caching: the seconds of encoding the latents and text-encoder outputs, and the peak RSS up to its end; the
  kernel's high-water mark (VmHWM) is then restarted (`/proc/self/clear_refs`), so that
- peak RSS in training is the training steps' own (with the weights, which stay resident);
- launch -> first step: from starting the process to the end of the first optimizer step;
- s/step: wall seconds between the ends of consecutive optimizer steps (the first step is left out).

`flux` writes FLUX.1 dev's four kohya files (transformer 11.9 B parameters, T5-XXL 4.8 B) in bf16 and trains the
transformer; the bf16 weights alone are 34 GB, so it needs a machine with well over that much RAM and is not
chosen by default. `--flux_files fp8` writes the transformer and T5-XXL in float8_e4m3fn instead (16.6 GB), as
the fp8 files users download; train them with `--train_options="--fp8_base true"` or
`--train_options="--base_model_precision nf4"`.
Resolutions pair with models in order (`--resolution 512,1024` for `--models sd15,sdxl`). Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parent.parent

# Runs inside the child: train_network.main with hooks on the model load and on each logged optimizer step.
CHILD = r"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
out, argv = sys.argv[1], sys.argv[2:]
record = {"marks": [], "load": None}
def status():
    found = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmHWM:", "VmRSS:")):
            found[line.split(":")[0]] = int(line.split()[1]) / 1024
    return found
import train_network
from library.config import parse_config
train_network.hide_unused_packages(parse_config(argv)[0])  # as train_network.py does before any library loads
from library.training import base_loading, loop, setup
original_load = base_loading.load_components
def load_components(*args, **kwargs):
    started = time.time()
    result = original_load(*args, **kwargs)
    memory = status()
    record["load"] = {"seconds": time.time() - started, "rss_mib": memory["VmRSS"], "peak_rss_mib": memory["VmHWM"]}
    return result
base_loading.load_components = load_components
original_cache = setup.cache_inputs
def cache_inputs(*args, **kwargs):
    started = time.time()
    result = original_cache(*args, **kwargs)
    memory = status()
    record["caching"] = {"seconds": time.time() - started, "peak_rss_mib": memory["VmHWM"]}
    try:  # restart the high-water mark, so that the training's own peak can be read at the end
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        record["caching"]["reset"] = True
    except OSError:
        record["caching"]["reset"] = False
    record["caching"]["rss_mib"] = status()["VmRSS"]
    return result
setup.cache_inputs = cache_inputs  # caching in one phase
base_loading.cache_inputs = cache_inputs  # caching first, by phase
original_log_step = loop.Trainer.log_step
def log_step(self, *args, **kwargs):
    original_log_step(self, *args, **kwargs)
    t = os.times()
    record["marks"].append(time.time())
    record.setdefault("cpu_marks", []).append(t.user + t.system)
    record.setdefault("losses", []).append(self.result.losses[-1])
loop.Trainer.log_step = log_step
record["status"] = train_network.main(argv, own_process=True)
record["peak_rss_mib"] = status()["VmHWM"]
json.dump(record, open(out, "w"))
"""


# Runs inside the child with --load_only: load_components alone, as the trainer calls it for a bf16 run.
LOAD_CHILD = r"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from library.families.loading import load_components
path, vae_dtype = sys.argv[1], getattr(torch, sys.argv[2])
extra = json.loads(sys.argv[3])
started = time.time()
components = load_components(path, weight_dtype=torch.bfloat16, vae_dtype=vae_dtype, **extra)  # kept for the RSS
seconds = time.time() - started
found = {}
for line in open("/proc/self/status"):
    if line.startswith(("VmHWM:", "VmRSS:")):
        found[line.split(":")[0]] = int(line.split()[1]) / 1024
print(json.dumps({"load_s": round(seconds, 1), "peak_rss_mib": round(found["VmHWM"]),
                  "rss_after_mib": round(found["VmRSS"])}))
"""


def load_only(model: str, files: dict[str, Path], threads: int) -> dict:
    """Load the model the way the trainer does for a bf16 run (SDXL's VAE in fp32, as with no_half_vae) in a fresh
    process: seconds, peak RSS and RSS after."""
    extra = {k: str(files[k]) for k in ("clip_l", "t5xxl", "ae") if k in files}
    vae_dtype = "float32" if model == "sdxl" else "bfloat16"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(files["model"]), vae_dtype, json.dumps(extra)],
                         cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    return {"model": model, **json.loads(out.strip().splitlines()[-1])}


def write_images(folder: Path, resolution: int, count: int) -> Path:
    """`count` smooth random RGB images of resolution x resolution with captions, in kohya's `<repeats>_<name>`
    layout."""
    import numpy as np
    from PIL import Image

    images = folder / "1_bench"
    images.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        coarse = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
        Image.fromarray(coarse).resize((resolution, resolution), Image.BICUBIC).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(f"a photo of a random pattern number {i}")
    return folder


def write_config(path: Path, model: str, files: dict[str, Path], data: Path, resolution: int, steps: int,
                 output: Path) -> Path:
    lines = [f'pretrained_model_name_or_path = "{files["model"]}"']
    if model == "flux":
        lines += [f'{name} = "{files[name]}"' for name in ("clip_l", "t5xxl", "ae")]
        lines += ["t5xxl_max_token_length = 512", 'timestep_sampling = "shift"', "discrete_flow_shift = 3.1582",
                  'model_prediction_type = "raw"', "guidance_scale = 1.0"]
    if model == "sdxl":
        lines.append("no_half_vae = true")  # as configs/sdxl_lora.toml: SDXL's VAE overflows in fp16
    lines += [
        f'train_data_dir = "{data}"', 'caption_extension = ".txt"', f'resolution = "{resolution},{resolution}"',
        "train_batch_size = 1", "cache_latents = true", "cache_text_encoder_outputs = true",
        f'network_module = "{"networks.lora_flux" if model == "flux" else "networks.lora"}"',
        "network_dim = 16", "network_alpha = 16", "network_train_unet_only = true",
        f'output_dir = "{output}"', 'output_name = "bench"', 'save_precision = "fp16"',
        f"max_train_steps = {steps}", 'mixed_precision = "bf16"', "gradient_checkpointing = true",
        "max_grad_norm = 1.0", "seed = 42", 'optimizer_type = "AdamW"', "learning_rate = 1e-4",
        'lr_scheduler = "constant"',
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def model_files(model: str, work: Path, flux_files: str = "bf16") -> dict[str, Path]:
    import torch
    from real_size_files import SD_ARCHITECTURES, write_flux_files, write_sd_checkpoint

    if model == "flux":
        if flux_files == "fp8":
            paths = write_flux_files(work / "flux1-fp8", large_dtype=torch.float8_e4m3fn)
        else:
            paths = write_flux_files(work / "flux1")
        return {"model": paths["transformer"], **{k: paths[k] for k in ("clip_l", "t5xxl", "ae")}}
    path = work / f"{model}-random-fp16.safetensors"
    if not path.exists():
        write_sd_checkpoint(SD_ARCHITECTURES[model], path, torch.float16)
    return {"model": path}


def run_model(model: str, resolution: int, args: argparse.Namespace, work: Path) -> dict:
    started = time.time()
    files = model_files(model, work, args.flux_files)
    written = time.time() - started
    size = sum(p.stat().st_size for p in files.values()) / 2**30
    print(f"{model}: files ready in {written:.0f} s ({size:.2f} GiB)", flush=True)
    data = write_images(work / f"data-{model}-{resolution}", resolution, args.images)
    config = write_config(work / f"{model}-{resolution}.toml", model, files, data, resolution, args.steps,
                          work / f"out-{model}-{resolution}")
    out = work / f"result-{model}-{resolution}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "HF_HUB_OFFLINE": "1"}
    log = work / f"train-{model}-{resolution}.log"
    launched = time.time()
    with log.open("w") as handle:
        command = [sys.executable, "-c", CHILD, str(out), "--config", str(config), *shlex.split(args.train_options)]
        code = subprocess.run(command, cwd=REPO, env=env,
                              stdout=handle, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    wall = time.time() - launched
    if code != 0 or not out.exists():
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"{model}: train_network.py exited with {code}; log {log}:\n" + "\n".join(tail))
    record = json.loads(out.read_text())
    marks = record["marks"]
    steps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return {"model": model, "resolution": resolution, "steps": len(marks), "threads": args.threads,
            "file_gib": round(size, 2), "load_s": round(record["load"]["seconds"], 1),
            "rss_after_load_mib": round(record["load"]["rss_mib"]),
            "peak_rss_at_load_mib": round(record["load"]["peak_rss_mib"]),
            "first_step_s": round(marks[0] - launched, 1) if marks else None,
            "s_per_step": round(sum(steps) / len(steps), 1) if steps else None,
            "cpu_s_per_step": round((record["cpu_marks"][-1] - record["cpu_marks"][0]) / len(steps), 1)
            if steps else None,
            "caching_s": round(record["caching"]["seconds"], 1),
            "peak_rss_through_caching_mib": round(record["caching"]["peak_rss_mib"]),
            "peak_rss_training_mib": round(record["peak_rss_mib"]) if record["caching"]["reset"] else None,
            "peak_rss_mib": max(round(record["peak_rss_mib"]), round(record["caching"]["peak_rss_mib"])),
            "losses": record.get("losses"), "wall_s": round(wall, 1),
            "config": str(config),
            "log": str(log)}


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sd15,sdxl", help="comma-separated: sd15, sdxl, flux")
    parser.add_argument("--resolution", default=None, help="comma-separated, one per model (default 512 for sd15, "
                        "1024 for sdxl and flux)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=4 * 3600, help="most seconds one training run may take")
    parser.add_argument("--work", type=Path, default=None, help="folder for the files (kept; reused when present)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--train_options", default="", help='options added to the training command line, after '
                        'the config (e.g. --train_options="--cache_latents false")')
    parser.add_argument("--flux_files", choices=("bf16", "fp8"), default="bf16", help="how the FLUX transformer and "
                        "T5-XXL files are stored: bf16, or float8_e4m3fn as the fp8 files users download (CLIP-L and "
                        "the AE stay bf16); the base precision is a training option, e.g. "
                        '--train_options="--base_model_precision nf4"')
    parser.add_argument("--load_only", action="store_true", help="only load each model as the trainer does: "
                        "seconds, peak RSS and RSS after the load")
    args = parser.parse_args(argv)
    from real_size_files import models_and_resolutions

    try:
        pairs = models_and_resolutions(args.models, args.resolution)
    except ValueError as e:
        parser.error(str(e))
    if args.steps < 2:
        parser.error("--steps must be at least 2 (s/step is measured between steps)")

    with tempfile.TemporaryDirectory(prefix="real-size-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = []
        if args.load_only:
            for model, _ in pairs:
                result = load_only(model, model_files(model, work, args.flux_files), args.threads)
                results.append(result)
                print(json.dumps(result), flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
            return 0
        for model, resolution in pairs:
            print(f"{model} at {resolution} px, {args.steps} steps, {args.threads} threads; load average "
                  f"{load_average()}", flush=True)
            result = run_model(model, resolution, args, work)
            result["load_average_after"] = load_average()
            results.append(result)
            print(json.dumps(result), flush=True)
    print("\n| model | px | steps | threads | file GiB | load s | RSS after load MiB | caching s | peak RSS to end of "
          "caching MiB | peak RSS in training MiB | launch -> 1st step s | s/step |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['resolution']} | {r['steps']} | {r['threads']} | {r['file_gib']} | {r['load_s']} "
              f"| {r['rss_after_load_mib']} | {r['caching_s']} | {r['peak_rss_through_caching_mib']} | "
              f"{r['peak_rss_training_mib']} | {r['first_step_s']} | {r['s_per_step']} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
