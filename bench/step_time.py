"""Time per training step and peak memory of train_network.py's loop against a bare PyTorch + peft loop.

    python bench/step_time.py [--models tiny small] [--steps N] [--repeats R]
                              [--warmup W] [--batch_size B] [--threads T] [--device auto|cpu|cuda]
                              [--mixed_precision no|fp16|bf16] [--timeout S] [--retries K] [--budget S]
                              [--json PATH] [--profile DIR] [--no-defaults]

"ours" is `library.training.loop.run(config)` with a Config built by `library.config.parse_config` (the same path as
`python train_network.py ...`); its RunResult.step_times are the wall seconds of each optimizer step. "bare" is a
minimal hand-written loop (diffusers + transformers + peft + torch, nothing from library/) doing the same
computation: PIL images -> VAE posterior sample -> noise / timesteps -> text encoder -> UNet -> MSE -> backward ->
clip -> AdamW -> LR scheduler, reading the loss once per step. Both time a step the same way: wall time from the
end of the previous step (data loading included) to the end of this one.

Every (variant, model, repeat) runs in its own subprocess, so peak memory is per variant (VmHWM reset after the
imports, or CUDA max_memory_allocated), and the variants alternate (ours, bare, then bare, ours, ...) so that slow
stretches of a shared machine hit both. A run during which other processes kept the CPU busy is marked noisy and
run again once; noisy runs are left out of the table when quiet runs of both variants exist. The first W steps of
each run are dropped; the table shows the median and mean of the rest, pooled over runs, and the ratio ours / bare
(target: within 1.05x), then per-run medians, the best-run ratio and the ratio of each same-repeat pair.

Then, unless --no-defaults, the out-of-the-box comparison of bench/startup_defaults.py for the same models and
repeats: the minimal config (model, data, resolution, batch, steps) with this trainer's defaults against the same
config with caching off, each a `train_network.py` process with one thread: launch -> first step, CPU seconds per
step, peak RSS.

This is a benchmark, not a test: it asserts nothing about time. See bench/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data" / "quickstart"
RESOLUTION = {"tiny": 64, "small": 128}
DEFAULT_STEPS = {"tiny": 30, "small": 20}
RESULT_TAG = "STEP_TIME_RESULT "
TARGET_RATIO = 1.05
NOISY_LOAD = 0.25  # cores used by other processes during a run above which the run is marked noisy

# Kept here rather than taken from library.network.lora so that the bare loop stays independent of the trainer; the
# parent checks that both loops trained exactly the same modules.
BARE_UNET_TARGETS = ["proj_in", "proj_out", "to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
BARE_TEXT_ENCODER_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


# --------------------------------------------------------------------------------------------- child: measurement


def _proc_status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0), so that the import peak of
    transformers/diffusers does not hide the peak of loading and training."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _memory_start(device: str) -> dict:
    """Baseline taken after the libraries both loops need are imported: only loading the model and training count."""
    import diffusers  # noqa: F401
    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel  # noqa: F401
    from transformers import CLIPTextModel, CLIPTokenizer  # noqa: F401

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if _reset_peak_rss() and _proc_status_mib("VmRSS") is not None:
        return {"method": "VmHWM", "rss": _proc_status_mib("VmRSS")}
    # ru_maxrss cannot be reset: growth is then only what exceeds the peak reached so far (imports included).
    return {"method": "ru_maxrss", "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _memory_end(device: str, start: dict) -> dict:
    import torch

    if start["method"] == "VmHWM":
        peak = _proc_status_mib("VmHWM")
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    memory = {"peak_rss_mib": peak, "peak_rss_growth_mib": peak - start["rss"], "rss_method": start["method"]}
    if device == "cuda":
        memory["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return memory


def run_ours(args: argparse.Namespace) -> dict:
    """The real loop: train_network.py's config parsing and library.training.loop.run."""
    import torch
    from safetensors import safe_open

    from library.config import parse_config
    from library.training import loop

    torch.set_num_threads(args.threads)
    out_dir = Path(args.work_dir) / "out"
    argv = [
        "--pretrained_model_name_or_path", args.model_dir,
        "--train_data_dir", str(DATA_DIR),
        "--caption_extension", ".txt",
        "--resolution", str(RESOLUTION[args.model]),
        "--train_batch_size", str(args.batch_size),
        "--seed", str(args.seed),
        "--learning_rate", "1e-4",
        "--max_train_steps", str(args.steps),
        "--network_dim", str(args.rank),
        "--network_alpha", str(args.alpha),
        "--mixed_precision", args.mixed_precision,
        "--output_dir", str(out_dir),
        "--output_name", "bench",
        # The bare loop encodes every image each step; latents are cached by default here, so say it.
        "--cache_latents", "false",
    ]
    config, _notes = parse_config(argv)
    memory_start = _memory_start(args.device)
    result = loop.run(config)
    memory = _memory_end(args.device, memory_start)

    # What was trained, read back from the LoRA file, so the parent can check both loops trained the same modules.
    names, lora_params = set(), 0
    with safe_open(str(result.output_file), framework="pt") as f:
        for key in f.keys():
            name, _, role = key.partition(".")
            if role in ("lora_down.weight", "lora_up.weight"):
                names.add(name)
                lora_params += _numel(f.get_slice(key).get_shape())
    return {"step_times": result.step_times, "losses": result.losses, "lora_modules": sorted(names),
            "lora_params": lora_params, "threads_after": torch.get_num_threads(), **memory}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def run_bare(args: argparse.Namespace) -> dict:
    """A minimal LoRA training script, written as a person would without this repository."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from diffusers.optimization import get_scheduler
    from peft import LoraConfig, inject_adapter_in_model
    from PIL import Image
    from transformers import CLIPTextModel, CLIPTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.mixed_precision]
    size = RESOLUTION[args.model]
    memory_start = _memory_start(args.device)

    model = args.model_dir
    tokenizer = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(model, subfolder="text_encoder", dtype=dtype)
    vae = AutoencoderKL.from_pretrained(model, subfolder="vae", torch_dtype=dtype)
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet", torch_dtype=dtype)
    noise_scheduler = DDPMScheduler.from_pretrained(model, subfolder="scheduler")
    for m in (unet, text_encoder, vae):
        m.requires_grad_(False)
        m.to(device)

    inject_adapter_in_model(LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=BARE_UNET_TARGETS), unet)
    inject_adapter_in_model(LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=BARE_TEXT_ENCODER_TARGETS),
                            text_encoder)
    params = []
    for m in (unet, text_encoder):
        for p in m.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # fp32 LoRA weights under fp16/bf16
                params.append(p)
    unet.train()
    text_encoder.train()
    vae.eval()

    class Images(torch.utils.data.Dataset):
        def __init__(self, root):
            self.items = []
            for folder in sorted(Path(root).iterdir()):
                if folder.is_dir():
                    repeats = int(folder.name.split("_", 1)[0])  # kohya: "10_sks shape"
                    for image in sorted(folder.glob("*.png")):
                        self.items += [(image, image.with_suffix(".txt").read_text().strip())] * repeats

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            path, caption = self.items[i]
            image = Image.open(path).convert("RGB")
            scale = size / min(image.size)
            image = image.resize((max(size, round(image.width * scale)), max(size, round(image.height * scale))),
                                 Image.Resampling.LANCZOS)
            left, top = (image.width - size) // 2, (image.height - size) // 2
            image = image.crop((left, top, left + size, top + size))
            pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)
            ids = tokenizer(caption, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                            return_tensors="pt").input_ids[0]
            return pixels, ids

    loader = torch.utils.data.DataLoader(Images(DATA_DIR), batch_size=args.batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    lr_scheduler = get_scheduler("constant", optimizer)
    use_autocast = args.mixed_precision != "no"
    scaler = torch.amp.GradScaler(device.type, enabled=args.mixed_precision == "fp16")  # a no-op otherwise

    step_times, losses = [], []
    step = 0
    last = time.perf_counter()
    while step < args.steps:
        for pixels, ids in loader:
            pixels, ids = pixels.to(device, dtype), ids.to(device)
            with torch.no_grad():
                latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                      device=device)
            noisy = noise_scheduler.add_noise(latents, noise, timesteps)
            with torch.autocast(device.type, dtype=dtype, enabled=use_autocast):
                hidden = text_encoder(ids, return_dict=False)[0]
                prediction = unet(noisy, timesteps, hidden, return_dict=False)[0]
            loss = F.mse_loss(prediction.float(), noise.float())
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            lr_scheduler.step()
            losses.append(loss.item())
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            step_times.append(now - last)
            last = now
            step += 1
            if step >= args.steps:
                break
    memory = _memory_end(args.device, memory_start)

    names = []
    for prefix, m in (("lora_unet", unet), ("lora_te", text_encoder)):
        for name, module in m.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                if prefix == "lora_te" and not name.startswith("text_model."):
                    name = "text_model." + name  # kohya's text-encoder names start at text_model.
                names.append(f"{prefix}_{name.replace('.', '_')}")
    return {"step_times": step_times, "losses": losses, "lora_modules": sorted(names),
            "lora_params": sum(p.numel() for p in params), "threads_after": torch.get_num_threads(), **memory}


def child_main(args: argparse.Namespace) -> int:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    runner = run_ours if args.variant == "ours" else run_bare
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        result = profiler.runcall(runner, args)
        profiler.dump_stats(args.profile)
    else:
        result = runner(args)
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------------------------- parent: orchestration


def _child_command(args: argparse.Namespace, variant: str, model: str, model_dir: Path, work_dir: Path,
                   steps: int, profile: Path | None) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--variant", variant, "--model", model,
               "--model_dir", str(model_dir), "--work_dir", str(work_dir), "--steps", str(steps),
               "--batch_size", str(args.batch_size), "--threads", str(args.threads), "--device", args.device,
               "--mixed_precision", args.mixed_precision, "--seed", str(args.seed), "--rank", str(args.rank),
               "--alpha", str(args.alpha)]
    if profile is not None:
        command += ["--profile", str(profile)]
    return command


def _busy_cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has spent busy since boot (Linux /proc/stat), else None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already in user


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_child(command: list[str], log: Path, env: dict[str, str], timeout: float) -> dict | None:
    """One measured run in a fresh process; None when it ran past `timeout` (a busy machine)."""
    busy_before, child_before, t0 = _busy_cpu_seconds(), _children_cpu_seconds(), time.perf_counter()
    with open(log, "w") as stderr:
        try:
            proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=REPO_ROOT,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
    wall = time.perf_counter() - t0
    busy_after, child_cpu = _busy_cpu_seconds(), _children_cpu_seconds() - child_before
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"child failed (exit {proc.returncode}): {shlex.join(command)}\n{proc.stdout[-2000:]}\n{tail}")
    result = json.loads(lines[-1][len(RESULT_TAG):])
    result["wall_s"] = wall
    # Cores kept busy by other processes while this run ran: the noise it was measured under.
    result["other_load"] = (None if busy_before is None or busy_after is None
                            else max(0.0, (busy_after - busy_before - child_cpu) / wall))
    return result


def _load_note(result: dict) -> str:
    load = result.get("other_load")
    if load is None:
        return ""
    return f", other processes kept {load:.2f} cores busy" + (" - NOISY" if load > NOISY_LOAD else "")


def _stats(times: list[float]) -> tuple[float, float]:
    return statistics.median(times), statistics.fmean(times)


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f}"


def parent_main(args: argparse.Namespace) -> int:
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads is None:
        args.threads = torch.get_num_threads()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # otherwise accelerate would put "ours" on the GPU

    print("command:", shlex.join([sys.executable] + sys.argv))
    print(f"torch {torch.__version__}, python {platform.python_version()}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else f" ({os.cpu_count()} CPUs)")
          + f", threads {args.threads}, mixed_precision {args.mixed_precision}, batch {args.batch_size}, "
          f"rank {args.rank}, alpha {args.alpha}, seed {args.seed}")
    if hasattr(os, "getloadavg"):
        print("load average at start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))

    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from library.families.sd.tiny import save_tiny_sd1

    steps = {m: args.steps or DEFAULT_STEPS[m] for m in args.models}
    for m in args.models:
        if steps[m] <= args.warmup:
            raise SystemExit(f"--steps ({steps[m]}) must exceed --warmup ({args.warmup})")
    started = time.perf_counter()
    runs: dict[tuple[str, str], list[dict]] = {(m, v): [] for m in args.models for v in ("ours", "bare")}
    with tempfile.TemporaryDirectory(prefix="bench-step-time-") as tmp:
        tmp_path = Path(tmp)
        model_dirs = {m: save_tiny_sd1(tmp_path / f"model-{m}", size=m, seed=0) for m in args.models}
        for repeat in range(args.repeats):
            over_budget = time.perf_counter() - started > args.budget
            if repeat > 0 and over_budget and all(runs.values()):
                print(f"  --budget {args.budget:.0f} s spent: {args.repeats - repeat} repeats skipped", flush=True)
                break
            order = ("ours", "bare") if repeat % 2 == 0 else ("bare", "ours")
            for m in args.models:
                for variant in order:
                    for attempt in range(1 + args.retries):
                        name = f"{m}-{variant}-{repeat}-{attempt}"
                        work = tmp_path / name
                        work.mkdir()
                        profile = Path(args.profile) / f"{name}.prof" if args.profile else None
                        command = _child_command(args, variant, m, model_dirs[m], work, steps[m], profile)
                        result = _run_child(command, work / "stderr.log", env, args.timeout)
                        label = f"  repeat {repeat + 1}/{args.repeats} {m:5s} {variant}" + (
                            f" (retry {attempt})" if attempt else "") + ":"
                        if result is None:
                            print(f"{label} ran past --timeout {args.timeout:.0f} s and was stopped; left out",
                                  flush=True)
                        else:
                            result["noisy"] = (result["other_load"] or 0.0) > NOISY_LOAD
                            result["repeat"] = repeat
                            runs[(m, variant)].append(result)
                            measured = result["step_times"][args.warmup:]
                            print(f"{label} median {statistics.median(measured) * 1000:.1f} ms/step over "
                                  f"{len(measured)} steps (process {result['wall_s']:.0f} s{_load_note(result)})",
                                  flush=True)
                        if (result is not None and not result["noisy"]) or \
                                time.perf_counter() - started > args.budget:
                            break

    missing = [f"{m} {v}" for (m, v), rs in runs.items() if not rs]
    if missing:
        raise SystemExit(f"no finished run for: {', '.join(missing)}; try a larger --timeout or a quieter machine")
    all_runs = {key: list(value) for key, value in runs.items()}
    for m in args.models:
        quiet = {v: [r for r in runs[(m, v)] if not r["noisy"]] for v in ("ours", "bare")}
        if quiet["ours"] and quiet["bare"]:
            dropped = sum(len(runs[(m, v)]) - len(quiet[v]) for v in quiet)
            if dropped:
                print(f"  {m}: {dropped} noisy runs left out of the table (quiet runs of both variants exist)")
            runs[(m, "ours")], runs[(m, "bare")] = quiet["ours"], quiet["bare"]
        elif any(r["noisy"] for v in quiet for r in runs[(m, v)]):
            print(f"  {m}: WARNING: the table includes noisy runs (no quiet run of each variant); "
                  "read the ratio with care")
    _check_same_work(runs, args.models)
    rows = []
    for m in args.models:
        row = {"model": m, "resolution": RESOLUTION[m], "steps": steps[m], "warmup": args.warmup,
               "runs_ours": len(runs[(m, "ours")]), "runs_bare": len(runs[(m, "bare")])}
        for variant in ("ours", "bare"):
            pooled = [t for r in runs[(m, variant)] for t in r["step_times"][args.warmup:]]
            row[f"{variant}_median_s"], row[f"{variant}_mean_s"] = _stats(pooled)
            row[f"{variant}_repeat_medians_s"] = [statistics.median(r["step_times"][args.warmup:])
                                                  for r in runs[(m, variant)]]
            row[f"{variant}_peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs[(m, variant)])
            row[f"{variant}_peak_rss_growth_mib"] = max(r["peak_rss_growth_mib"] for r in runs[(m, variant)])
            if args.device == "cuda":
                row[f"{variant}_cuda_max_allocated_mib"] = max(r["cuda_max_allocated_mib"]
                                                               for r in runs[(m, variant)])
            row[f"{variant}_mean_loss"] = statistics.fmean(
                loss for r in runs[(m, variant)] for loss in r["losses"][args.warmup:])
        row["ratio_median"] = row["ours_median_s"] / row["bare_median_s"]
        row["ratio_mean"] = row["ours_mean_s"] / row["bare_mean_s"]
        # Noise only ever adds time, so the fastest run of each is a second, noise-robust view.
        row["ratio_best_run"] = min(row["ours_repeat_medians_s"]) / min(row["bare_repeat_medians_s"])
        # A third: ours against the bare run right beside it (same repeat), which saw the same stretch of machine.
        by_repeat = {v: {r["repeat"]: statistics.median(r["step_times"][args.warmup:]) for r in runs[(m, v)]}
                     for v in ("ours", "bare")}
        row["paired_ratios"] = [by_repeat["ours"][k] / by_repeat["bare"][k]
                                for k in sorted(by_repeat["ours"]) if k in by_repeat["bare"]]
        loads = [r["other_load"] for v in ("ours", "bare") for r in runs[(m, v)] if r.get("other_load") is not None]
        row["other_load_mean"] = statistics.fmean(loads) if loads else None
        rows.append(row)

    _print_table(rows, args)
    defaults = None
    if args.defaults:
        import startup_defaults

        print("\nout of the box (bench/startup_defaults.py): the minimal config with this trainer's defaults "
              "against the same config with caching off, one thread")
        defaults = startup_defaults.compare(args.models, startup_defaults.STEPS, args.repeats)
        startup_defaults.print_results(defaults)
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "torch": torch.__version__, "device": args.device,
                                               "threads": args.threads, "rows": rows, "defaults": defaults,
                                               "runs": {f"{m}/{v}": r for (m, v), r in all_runs.items()}}, indent=1))
        print("wrote", args.json)
    return 0


def _check_same_work(runs: dict[tuple[str, str], list[dict]], models: list[str]) -> None:
    for m in models:
        ours, bare = runs[(m, "ours")][0], runs[(m, "bare")][0]
        if ours["lora_modules"] != bare["lora_modules"] or ours["lora_params"] != bare["lora_params"]:
            only_ours = sorted(set(ours["lora_modules"]) - set(bare["lora_modules"]))[:5]
            only_bare = sorted(set(bare["lora_modules"]) - set(ours["lora_modules"]))[:5]
            print(f"WARNING {m}: the loops trained different LoRA modules: ours {len(ours['lora_modules'])} modules /"
                  f" {ours['lora_params']} params, bare {len(bare['lora_modules'])} / {bare['lora_params']}; "
                  f"only ours e.g. {only_ours}, only bare e.g. {only_bare}")
        else:
            print(f"{m}: both loops train the same {len(ours['lora_modules'])} LoRA modules "
                  f"({ours['lora_params']} parameters)")
        for variant in ("ours", "bare"):
            threads = {r["threads_after"] for r in runs[(m, variant)]}
            if len(threads) != 1:
                print(f"WARNING {m} {variant}: torch thread count changed during runs: {sorted(threads)}")


def _print_table(rows: list[dict], args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    mem = "CUDA peak MiB" if cuda else "peak RSS growth MiB"
    print()
    print(f"step time in ms: median / mean of the steps after the first {args.warmup} of each run, pooled over "
          f"the runs of each variant (up to {args.repeats}); {mem} (largest run): ours / bare")
    header = (f"{'model':6s} {'res':>4s} {'steps':>5s} | {'ours med':>8s} {'bare med':>8s} {'ratio':>6s} | "
              f"{'ours mean':>9s} {'bare mean':>9s} {'ratio':>6s} | {mem:>20s} | target {TARGET_RATIO:.2f}x")
    print(header)
    print("-" * len(header))
    for r in rows:
        key = "cuda_max_allocated_mib" if cuda else "peak_rss_growth_mib"
        verdict = "ok" if r["ratio_median"] <= TARGET_RATIO else "OVER"
        print(f"{r['model']:6s} {r['resolution']:4d} {r['steps']:5d} | {_fmt_ms(r['ours_median_s'])} "
              f"{_fmt_ms(r['bare_median_s'])} {r['ratio_median']:5.3f}x | {_fmt_ms(r['ours_mean_s']):>9s} "
              f"{_fmt_ms(r['bare_mean_s']):>9s} {r['ratio_mean']:5.3f}x | "
              f"{r['ours_' + key]:9.0f} / {r['bare_' + key]:8.0f} | {verdict}")
    for r in rows:
        parts = [f"per-run medians ms: ours [{_fmt_list(r['ours_repeat_medians_s'], 1000, '.1f')}], "
                 f"bare [{_fmt_list(r['bare_repeat_medians_s'], 1000, '.1f')}]",
                 f"best-run ratio {r['ratio_best_run']:.3f}x"]
        if r["paired_ratios"]:
            parts.append(f"paired (same repeat) ratios [{_fmt_list(r['paired_ratios'], 1, '.3f')}], median "
                         f"{statistics.median(r['paired_ratios']):.3f}x")
        parts.append(f"mean loss ours {r['ours_mean_loss']:.4f}, bare {r['bare_mean_loss']:.4f}")
        if r["other_load_mean"] is not None:
            parts.append(f"other processes kept {r['other_load_mean']:.2f} cores busy on average")
        print(f"  {r['model']}: " + "; ".join(parts))


def _fmt_list(values: list[float], scale: float, spec: str) -> str:
    return " ".join(format(v * scale, spec) for v in values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(RESOLUTION), default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per run (default: tiny 30, small 20)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant per model, alternated")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each run left out of the timing")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), default="no")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--defaults", action=argparse.BooleanOptionalAction, default=True,
                        help="also compare the minimal config's defaults with caching off (bench/startup_defaults.py)")
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank (network_dim)")
    parser.add_argument("--alpha", type=float, default=1.0, help="LoRA alpha (network_alpha)")
    parser.add_argument("--timeout", type=float, default=60,
                        help="seconds one measured run may take; a run past it is stopped and left out")
    parser.add_argument("--retries", type=int, default=1,
                        help="times a noisy or stopped run is run again (noisy: other processes kept more than "
                             f"{NOISY_LOAD} cores busy)")
    parser.add_argument("--budget", type=float, default=300,
                        help="seconds after which no run is retried and no further repeat is started "
                             "(once every variant has a run)")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--profile", default=None, help="write a cProfile file per run into this folder")
    # internal: one measured run in this process
    parser.add_argument("--variant", choices=("ours", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(RESOLUTION), help=argparse.SUPPRESS)
    parser.add_argument("--model_dir", help=argparse.SUPPRESS)
    parser.add_argument("--work_dir", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.variant is not None:
        return child_main(args)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
