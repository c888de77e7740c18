"""Full-size LoRA steps on this machine: FLUX.1-dev and Qwen-Image from the files users have, low-precision bases
computing in float32, peak RSS and the memory estimate per phase.

    python bench/full_size.py [--runs flux-nf4,flux-fp8,flux-nf4-swap,qwen-nf4] [--steps 3] [--threads 2]
                              [--work DIR] [--out bench/results/full_size.json] [--force]
    python bench/full_size.py --tiny          # the same pipeline on the tiny models, in seconds

Each run writes (once, kept in --work) random-weight files of the released architecture as users download them
(bench/real_size_files.py): FLUX.1-dev as kohya's four files with the transformer and T5-XXL in float8_e4m3fn
(`flux1-dev-fp8`, `t5xxl_fp8_e4m3fn`), Qwen-Image as ComfyUI's three with the transformer in float8_e4m3fn; a few
images at 256 px with captions; a TOML config (batch 1, LoRA rank 16, gradient checkpointing, cached latents and
text-encoder outputs, FLUX's T5 prompt length 64, `mixed_precision = "no"`: the base computes in float32), and runs
`python train_network.py --config CONFIG` in a child process that marks the end of each phase:

- load: from the launch to the end of the first `load_components` (reading the files; in a run by phase the text
  encoders and the VAE only, else the transformer too, an NF4 one quantized layer by layer as it is read);
- quantize: to the end of `build_model` (the rest of the base's quantization or fp8 cast, and the LoRA);
- caching: to the end of the caching of latents and text-encoder outputs, the encoders freed (`encode_first` in a
  run by phase, else `prepare_inputs`);
- load_denoiser (a run by phase): to the end of the second `load_components`, which reads the transformer alone;
- first_step: to the end of the first optimizer step;
- steps: to the end of the run.

The phases are taken in the order they ran (`phase_order`: a run whose text-encoder outputs are cached fills the
caches before `build_model`, so caching comes before quantize there), each from the end of the one before.
At each mark the child reads the kernel's high-water mark (VmHWM, the peak RSS since the previous mark) and
restarts it (`/proc/self/clear_refs`), so each phase's peak is its own; s/step comes from the run's events.jsonl
(the steps after the first). The memory estimate (library/memory/estimate.py, from the files' headers as the
trainer's check makes it) is set beside each phase, with its error against the phase's peak less what the process
held before reading any model (the check weighs its estimate against the memory available then).

One record per run is appended to --out (a JSON list): model, base precision, compute dtype, resolution,
blocks_to_swap, s_per_step, seconds and peak_rss_gib per phase and overall, estimate_gib per phase, the load
average before the run (os.getloadavg) and the CPU model. A run starts only when the 1-minute load average is at most
2.5 (other jobs on the cores make the figures wrong): over it the script stops with a message, unless --force.

Runs: flux-nf4 (base_model_precision nf4), flux-fp8 (fp8_base), flux-nf4-swap (nf4 with half the blocks swapped:
blocks_to_swap has no effect without a CUDA device, so on a CPU it shows the option's cost only), qwen-nf4.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_size import write_images  # noqa: E402  (the same benchmark images as the real-size bench)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "full_size.json"
PHASES = ("load", "quantize", "caching", "first_step", "steps")  # and load_denoiser in a run by phase
MAX_LOAD = 2.5
GIB = 1024 ** 3


@dataclass(frozen=True)
class Run:
    model: str  # "flux" or "qwen_image"
    precision: str  # "nf4" or "fp8"
    swap: bool = False  # half the blocks swapped


RUNS = {"flux-nf4": Run("flux", "nf4"), "flux-fp8": Run("flux", "fp8"), "flux-nf4-swap": Run("flux", "nf4", True),
        "qwen-nf4": Run("qwen_image", "nf4")}

# Runs inside the child: train_network.main with a mark at the end of each phase.
CHILD = r"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
out, argv = sys.argv[1], sys.argv[2:]
record = {"launched": float(os.environ["BENCH_LAUNCHED"]), "marks": {}, "reset": True}
def mark(phase):
    found = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmHWM:", "VmRSS:")):
            found[line.split(":")[0]] = int(line.split()[1]) * 1024
    record["marks"][phase] = {"time": time.time(), "peak_bytes": found["VmHWM"], "rss_bytes": found["VmRSS"]}
    try:  # restart the high-water mark: the next phase's peak is its own
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        record["reset"] = False
    with open(out, "w") as f:
        json.dump(record, f)
import train_network
import library.families.registry  # the families' options, before the config is parsed
from library.config import parse_config
train_network.hide_unused_packages(parse_config(argv)[0])  # as train_network.py does before any library loads
from library.training import base_loading, loop, setup
def marking(function, phase):
    def marked(*args, **kwargs):
        result = function(*args, **kwargs)
        mark(phase)
        return result
    return marked
original_load = base_loading.load_components
def load_components(*args, **kwargs):
    if "start" not in record["marks"]:
        mark("start")  # what the process holds before any model is read (its libraries): the check's baseline
    result = original_load(*args, **kwargs)
    mark("load" if "load" not in record["marks"] else "load_denoiser")  # a run by phase reads the denoiser apart
    return result
base_loading.load_components = load_components
setup.build_model = marking(setup.build_model, "quantize")
def caching(function):  # a run by phase fills its caches in encode_first, another in prepare_inputs
    def marked(*args, **kwargs):
        result = function(*args, **kwargs)
        if "caching" not in record["marks"] and (function is not original_encode_first or result[1]):
            mark("caching")  # with the encoders freed: their memory is the caching phase's, not the next one's
        return result
    return marked
original_encode_first = setup.encode_first
setup.encode_first = caching(setup.encode_first)
setup.prepare_inputs = caching(setup.prepare_inputs)
original_log_step = loop.Trainer.log_step
def log_step(self, *args, **kwargs):
    original_log_step(self, *args, **kwargs)
    if "first_step" not in record["marks"]:
        mark("first_step")
loop.Trainer.log_step = log_step
record["status"] = train_network.main(argv, own_process=True)
mark("steps")
"""


def load_average() -> float:
    return os.getloadavg()[0]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def available_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return round(int(line.split()[1]) / 1024 ** 2, 1)
    except OSError:
        pass
    return None


# --- files -------------------------------------------------------------------------------------------------------
def tiny_folders(work: Path) -> dict[str, Path]:
    """The tiny FLUX and Qwen-Image folders (their configs describe the tiny files, their tokenizers read them)."""
    from library.families.flux.tiny import save_tiny_flux
    from library.families.qwen_image.tiny import save_tiny_qwen_image

    folders = {"flux": work / "tiny-flux", "qwen_image": work / "tiny-qwen-image"}
    for name, save in (("flux", save_tiny_flux), ("qwen_image", save_tiny_qwen_image)):
        if not folders[name].exists():
            save(folders[name])
    return folders


def flux_files(work: Path, config_dir: Path | None) -> dict[str, Path]:
    import torch
    from real_size_files import write_flux_files

    paths = write_flux_files(work / "flux1-dev-fp8", config_dir=config_dir, large_dtype=torch.float8_e4m3fn)
    return {"pretrained_model_name_or_path": paths["transformer"], **{k: paths[k] for k in ("clip_l", "t5xxl", "ae")}}


def qwen_image_files(work: Path, config_dir: Path | None) -> dict[str, Path]:
    """Qwen-Image as ComfyUI's three files (diffusion_models/ with `model.diffusion_model.` and the transformer in
    float8_e4m3fn, text_encoders/ Qwen2.5-VL 7B with ComfyUI's names in bf16, vae/ in the Wan 2.1 layout in bf16),
    random weights, written one tensor at a time (bench/real_size_files.py)."""
    import torch
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from real_size_files import CONFIGS, _write_random
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from library.families.qwen_image.files import COMFY_PREFIX
    from library.families.qwen_image.tiny import comfy_vae_state_dict

    config = config_dir or CONFIGS / "qwen_image"
    folder = work / "qwen-image-fp8"
    folder.mkdir(parents=True, exist_ok=True)

    def comfy_text(parts: dict[str, Any]) -> dict[str, Any]:
        return {k.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1): v
                for k, v in parts["text_encoder"].state_dict().items()}

    files = {
        "pretrained_model_name_or_path": (
            "qwen_image_fp8_e4m3fn.safetensors", torch.float8_e4m3fn,
            lambda: QwenImageTransformer2DModel.from_config(QwenImageTransformer2DModel.load_config(
                config, subfolder="transformer")),
            lambda parts: {COMFY_PREFIX + k: v
                           for k, v in parts["pretrained_model_name_or_path"].state_dict().items()}),
        "text_encoder": (
            "qwen_2.5_vl_7b.safetensors", torch.bfloat16,
            lambda: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig.from_pretrained(config,
                                                                                        subfolder="text_encoder")),
            comfy_text),
        "ae": ("qwen_image_vae.safetensors", torch.bfloat16,
               lambda: AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(config, subfolder="vae")),
               lambda parts: comfy_vae_state_dict(parts["ae"])),
    }
    paths = {}
    for index, (name, (filename, dtype, build, to_state)) in enumerate(files.items()):
        paths[name] = folder / filename
        if not paths[name].exists():
            _write_random(paths[name], build, to_state, name, dtype, 10 * index, print)
    return paths


def half_the_blocks(run: Run, config_dir: Path | None) -> int:
    """blocks_to_swap for half the blocks, in the family's units (FLUX: kohya's, a double block counting two), as
    many as the model can swap (none for the tiny models)."""
    from real_size_files import CONFIGS

    folder = config_dir or CONFIGS / ("flux1" if run.model == "flux" else "qwen_image")
    config = json.loads((folder / "transformer" / "config.json").read_text())
    if run.model == "flux":
        count = config["num_layers"] // 2 * 2  # half the double blocks and, doubled, half the single ones
        return count if count // 2 <= config["num_layers"] - 2 and count <= config["num_single_layers"] - 2 else 0
    return min(config["num_layers"] // 2, max(config["num_layers"] - 2, 0))


def write_config(path: Path, run: Run, files: dict[str, Path], data: Path, resolution: int, steps: int,
                 output: Path, swap: int, model_config: Path | None) -> Path:
    lines = [f'{name} = "{value}"' for name, value in files.items()]
    if model_config:
        lines.append(f'model_config = "{model_config}"')
    if run.model == "flux":
        lines += ['network_module = "networks.lora_flux"', "t5xxl_max_token_length = 64",
                  'timestep_sampling = "shift"', "discrete_flow_shift = 3.1582", 'model_prediction_type = "raw"',
                  "guidance_scale = 1.0"]
    else:
        lines += ['network_module = "networks.lora_qwen_image"', 'timestep_sampling = "shift"',
                  "discrete_flow_shift = 2.2"]
    lines.append("fp8_base = true" if run.precision == "fp8" else f'base_model_precision = "{run.precision}"')
    if swap:
        lines.append(f"blocks_to_swap = {swap}")
    lines += [
        f'train_data_dir = "{data}"', 'caption_extension = ".txt"', f'resolution = "{resolution},{resolution}"',
        "train_batch_size = 1", "cache_latents = true", "cache_text_encoder_outputs = true",
        "network_dim = 16", "network_alpha = 16", "network_train_unet_only = true", "max_data_loader_n_workers = 0",
        f'output_dir = "{output}"', 'output_name = "bench"', 'save_precision = "bf16"',
        f"max_train_steps = {steps}", 'mixed_precision = "no"', "gradient_checkpointing = true",
        "max_grad_norm = 1.0", "seed = 42", 'optimizer_type = "AdamW"', "learning_rate = 1e-4",
        'lr_scheduler = "constant"',
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


# --- the estimate ------------------------------------------------------------------------------------------------
def estimates(config: Path, read_apart: bool = True) -> dict[str, float]:
    """The trainer's memory estimate per phase, GiB, as its memory check plans the run from `config` (by phase on
    the host: the text encoders read and filling the caches, beside the denoiser where the loader reads every part
    at once; the denoiser read and placed; training): the reading (the text encoding less what encoding adds) for
    load, the text encoding for caching, the placing for load_denoiser and quantize, training for the steps."""
    import torch

    import library.families.registry  # noqa: F401  (the families' options, before the config is parsed)
    from library.config import parse_config
    from library.data.dataset import build_training_data
    from library.memory import estimate as memory
    from library.memory.precision import BasePrecision
    from library.training.memory_check import batch_tokens, memory_plan

    parsed = parse_config(["--config", str(config)])[0]
    precision = BasePrecision.from_config(parsed, torch.float32)
    tokens = batch_tokens(build_training_data(parsed, None, 0, 1), None)  # images
    run = memory_plan(parsed, torch.device("cpu"), precision, torch.float32, by_phase=True, tokens=tokens)
    if not read_apart:  # a run that read every part at once (before its loader read them apart)
        run = dataclasses.replace(run, read_apart=False)
    plan = run.planned()
    gib = {name: round(estimate.total / GIB, 3) for name, estimate in plan.items()}
    # the read, before the encoders run: their phase less what encoding adds
    reading = round(plan[memory.TEXT_PHASE].total / GIB - plan[memory.TEXT_PHASE].parts.get("encoding", 0) / GIB, 3)
    return {"load": gib.get("reading every part", reading), "quantize": gib[memory.PLACING_PHASE],
            "caching": gib[memory.TEXT_PHASE], "load_denoiser": gib[memory.PLACING_PHASE],
            "first_step": gib[memory.TRAINING_PHASE], "steps": gib[memory.TRAINING_PHASE]}


# --- one run -----------------------------------------------------------------------------------------------------
def s_per_step(events: Path) -> float | None:
    """The mean wall seconds of the optimizer steps after the first, from the run's event stream."""
    steps = []
    for line in events.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "start":
            steps = []
        elif event.get("event") == "step":
            steps.append(event["s_per_step"])
    later = steps[1:]
    return round(sum(later) / len(later), 2) if later else None


def run_one(name: str, run: Run, args: argparse.Namespace, work: Path, tiny: dict[str, Path] | None) -> dict:
    config_dir = tiny[run.model] if tiny else None
    files = flux_files(work, config_dir) if run.model == "flux" else qwen_image_files(work, config_dir)
    resolution = args.resolution
    data = write_images(work / f"data-{resolution}", resolution, args.images)
    swap = half_the_blocks(run, config_dir) if run.swap else 0
    output = work / f"out-{name}"
    config = write_config(work / f"{name}.toml", run, files, data, resolution, args.steps, output, swap, config_dir)
    record_path = work / f"marks-{name}.json"
    record_path.unlink(missing_ok=True)
    if (output / "events.jsonl").exists():
        (output / "events.jsonl").unlink()
    average = load_average()
    free = available_gib()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    log = work / f"train-{name}.log"
    command = [sys.executable, "-c", CHILD, str(record_path), "--config", str(config)]
    launched = time.time()
    env["BENCH_LAUNCHED"] = str(launched)
    with log.open("w") as handle:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                              timeout=args.timeout).returncode
    marks = json.loads(record_path.read_text())["marks"] if record_path.exists() else {}
    if code != 0 or not set(PHASES) <= set(marks):
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"{name}: train_network.py exited with {code} (phases marked: {', '.join(marks)}); "
                         f"log {log}:\n{tail}")
    # The phases in the order they ran (a run by phase fills the caches before build_model); each mark's peak is
    # the one since the mark before it.
    order = sorted((phase for phase in (*PHASES, "load_denoiser") if phase in marks),
                   key=lambda phase: marks[phase]["time"])
    seconds, peaks, previous = {}, {}, launched
    for phase in order:
        seconds[phase] = round(marks[phase]["time"] - previous, 2)
        peaks[phase] = round(marks[phase]["peak_bytes"] / GIB, 2)
        previous = marks[phase]["time"]
    peaks["overall"] = max(peaks.values())
    baseline = round(marks["start"]["rss_bytes"] / GIB, 2) if "start" in marks else None
    return {"run": name, "model": {"flux": "FLUX.1-dev", "qwen_image": "Qwen-Image"}[run.model]
            + (" (tiny)" if tiny else ""),
            "base_precision": run.precision, "compute_dtype": "float32", "resolution": resolution,
            "batch_size": 1, "rank": 16, "t5_length": 64 if run.model == "flux" else None, "blocks_to_swap": swap,
            "steps": args.steps, "s_per_step": s_per_step(output / "events.jsonl"),
            "phase_order": order, "seconds": seconds,
            "launch_to_first_step_s": round(marks["first_step"]["time"] - launched, 2),
            "peak_rss_gib": peaks, "baseline_rss_gib": baseline,
            "peak_reset_per_phase": json.loads(record_path.read_text())["reset"],
            "estimate_gib": {},
            "load_average": round(average, 2), "available_gib_before": free, "cpu_model": cpu_model(),
            "threads": args.threads, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(launched)),
            "command": f"python bench/full_size.py --runs {name}" + (" --tiny" if tiny else ""),
            "config": str(config), "log": str(log)} | estimated(config, peaks, baseline)


def estimated(config: Path, peaks: dict[str, float], baseline: float | None,
              read_apart: bool = True) -> dict[str, dict[str, float]]:
    """The estimate per phase and its error against the measured peak less the baseline (what the process held
    before reading any model: the check weighs its estimate against the memory available then), in % of that."""
    gib = {phase: value for phase, value in estimates(config, read_apart).items() if phase in peaks}
    base = baseline or 0.0
    return {"estimate_gib": gib,
            "estimate_error_pct": {phase: round(100 * (gib[phase] - (peaks[phase] - base)) / (peaks[phase] - base),
                                                1) for phase in gib if peaks.get(phase)}}


def reestimate(out: Path) -> None:
    """The estimate (as the trainer's check makes it now, for the run as it read its files) and its error, again,
    for every record in `out` whose config is still at hand: after the estimate changed, without measuring
    again."""
    records = json.loads(out.read_text())
    for record in records:
        config = Path(record["config"])
        if config.exists():  # planned as it ran: the denoiser read apart (its own phase) or with the encoders
            record.update(estimated(config, record["peak_rss_gib"], record.get("baseline_rss_gib"),
                                    "load_denoiser" in record["phase_order"]))
    tmp = out.with_name(out.name + ".partial")
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    tmp.replace(out)


def append(out: Path, record: dict) -> None:
    """One more record in the JSON list at `out`, written beside and renamed."""
    records = json.loads(out.read_text()) if out.exists() else []
    records.append(record)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated: {', '.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (s/step: the steps after the "
                        "first)")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=int, default=4 * 3600, help="most seconds one run may take")
    parser.add_argument("--work", type=Path, default=None, help="folder for the files (kept; reused when present)")
    parser.add_argument("--out", type=Path, default=None, help=f"the JSON list appended to (default {RESULTS}; "
                        "with --tiny, full_size.json in --work)")
    parser.add_argument("--force", action="store_true", help=f"run even when the load average is over {MAX_LOAD}")
    parser.add_argument("--reestimate", action="store_true", help="only set the estimate (as the trainer makes it "
                        "now) and its error beside every record of --out whose config is still in --work")
    parser.add_argument("--tiny", action="store_true", help="the tiny FLUX and Qwen-Image instead of the full-size "
                        "files: the whole pipeline in seconds")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown run(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (s/step is measured on the steps after the first)")
    if args.reestimate:
        reestimate(args.out or RESULTS)
        return 0
    with tempfile.TemporaryDirectory(prefix="full-size-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        out = args.out or (work / "full_size.json" if args.tiny else RESULTS)
        tiny = tiny_folders(work) if args.tiny else None
        for name in names:
            average = load_average()
            if average > MAX_LOAD and not args.force:
                print(f"error: the 1-minute load average is {average:.2f}, over {MAX_LOAD}: other work on this "
                      "machine would make the figures wrong. Stop it and run again (uptime shows the load), or pass "
                      "--force to measure anyway", file=sys.stderr)
                return 2
            print(f"{name}: load average {average:.2f}, {available_gib()} GiB available", flush=True)
            record = run_one(name, RUNS[name], args, work, tiny)
            append(out, record)
            print(json.dumps({k: record[k] for k in ("run", "s_per_step", "peak_rss_gib", "estimate_gib",
                                                     "estimate_error_pct")}),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
