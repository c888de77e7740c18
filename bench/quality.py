"""Does a LoRA learn a concept? Train on the digit the base model never saw and judge samples before and after.

    python bench/quality.py [--config configs/digits_lora.toml ...] [--n 100] [--seed 0] [--json PATH]
                            [--set OPTION=VALUE ...] [--keep DIR]

For each config, `python train_network.py --config CONFIG` runs in a subprocess (output to a temporary folder;
`--set` adds command-line overrides such as `max_train_steps=300`), timed. Then the base model named in the config
is judged with and without the LoRA by library/digits/judge.py: `--n` images per prompt from fixed seeds, the same
noise for both, rendered as the base's family renders (SD: DDIM with classifier-free guidance 3; FLUX.1, such as
models/digits-flux with configs/digits_flux_lora.toml: flow-matching Euler with the embedded guidance 3.5; Z-Image,
such as models/digits-z-image with configs/digits_z_image_lora.toml: flow-matching Euler with classifier-free
guidance 4). The report, per config:

- the trigger prompt ("a photo of sks"): the share of images judged to be the held-out digit, before -> after;
- each trained digit's prompt: the share judged to be that digit, before -> after, and the change (leakage: how
  far the LoRA pulls the other prompts away from their digit);
- the training wall time, and the CPU time the training process used (less sensitive to a busy machine);
- the targets: trigger before <= 10 % and after >= 80 %, no other digit down by more than 10 points, training
  within 300 s on 2 CPU cores. They are reported, never asserted: this is a benchmark.

See bench/README.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from library import digits  # noqa: E402
from library.config import parse_config  # noqa: E402
from library.digits import judge  # noqa: E402

DEFAULT_CONFIGS = [REPO_ROOT / "configs" / "digits_lora.toml"]
TARGET_BEFORE = 0.10
TARGET_AFTER = 0.80
TARGET_LEAKAGE = 0.10
TARGET_SECONDS = 300


def train(config: Path, output_dir: Path, overrides: list[str]) -> tuple[Path, float, float, int]:
    """Run train_network.py; (LoRA file, wall seconds, CPU seconds of the training process, exit status)."""
    extra = [f"--{item.split('=', 1)[0]}={item.split('=', 1)[1]}" if "=" in item else f"--{item}"
             for item in overrides]
    command = [sys.executable, str(REPO_ROOT / "train_network.py"), "--config", str(config),
               "--output_dir", str(output_dir), "--output_name", "lora", *extra]
    output_dir.mkdir(parents=True, exist_ok=True)
    log = output_dir / "train.log"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        status = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=out,
                                stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - started
    if status != 0:
        print(log.read_text(encoding="utf-8", errors="replace")[-4000:], file=sys.stderr)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return output_dir / "lora.safetensors", wall, cpu, status


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def measure(config: Path, overrides: list[str], settings: judge.Settings, workdir: Path,
            base_cache: dict[str, dict]) -> dict:
    resolved, _ = parse_config(["--config", str(config), *[f"--{o}" for o in overrides]])
    model = Path(resolved.pretrained_model_name_or_path)
    if not model.is_absolute():
        model = REPO_ROOT / model
    asked = judge.prompts()
    key = str(model.resolve())
    if key not in base_cache:
        pipe = judge.load_pipeline(model)
        rates, _ = judge.rates(pipe, asked, settings)
        base_cache[key] = {"rates": rates, "settings": dataclasses.asdict(judge.settings_for(pipe, settings))}
    before = base_cache[key]["rates"]

    load = load_average()
    lora, wall, cpu, status = train(config, workdir / config.stem, overrides)
    result = {"config": str(config), "overrides": overrides, "model": str(model), "train_seconds": wall,
              "train_cpu_seconds": cpu, "load_average_before": load, "status": status, "before": before,
              "judge": base_cache[key]["settings"]}
    if status != 0 or not lora.is_file():
        result["error"] = f"train_network.py exited with status {status}"
        return result
    after, _ = judge.rates(judge.load_pipeline(model, lora), asked, settings)
    trigger = digits.TRIGGER_CAPTION
    changes = {p: after[p] - before[p] for p in asked if p != trigger}
    result.update({
        "after": after, "trigger_before": before[trigger], "trigger_after": after[trigger],
        "leakage": {p: -c for p, c in changes.items()}, "worst_leakage": max(-c for c in changes.values()),
        "lora_bytes": lora.stat().st_size,
    })
    result["targets"] = {
        f"trigger before <= {TARGET_BEFORE:.0%}": before[trigger] <= TARGET_BEFORE,
        f"trigger after >= {TARGET_AFTER:.0%}": after[trigger] >= TARGET_AFTER,
        f"every other digit down <= {TARGET_LEAKAGE * 100:.0f} points": result["worst_leakage"] <= TARGET_LEAKAGE,
        f"training <= {TARGET_SECONDS} s": wall <= TARGET_SECONDS,
    }
    return result


def report(result: dict) -> str:
    lines = [f"== {Path(result['config']).name} {' '.join(result['overrides'])}".rstrip()]
    rendered = result["judge"]
    lines.append(f"   judged: {rendered['sampler']} {rendered['steps']} steps, guidance {rendered['scale']:g}")
    if "error" in result:
        return "\n".join(lines + [f"   {result['error']}"])
    load = result["load_average_before"]
    lines.append(f"   training: {result['train_seconds']:.0f} s wall, {result['train_cpu_seconds']:.0f} s CPU"
                 + (f" (load average {load:.1f} when it started)" if load is not None else ""))
    lines.append(judge.table(result["before"], result["after"]))
    lines.append(f"   trigger {digits.TRIGGER_CAPTION!r} -> digit {digits.HELD_OUT}: {result['trigger_before']:.0%} -> "
                 f"{result['trigger_after']:.0%}; largest drop of another digit: "
                 f"{max(0.0, 100 * result['worst_leakage']):.0f} points")
    lines += [f"   [{'met' if ok else 'MISSED'}] {name}" for name, ok in result["targets"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, nargs="+", default=DEFAULT_CONFIGS, help="training configs to run")
    parser.add_argument("--n", type=int, default=100, help="images per prompt (at least 100 for the targets)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling noise")
    parser.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="OPTION=VALUE",
                        help="command-line overrides for every config, e.g. max_train_steps=300")
    parser.add_argument("--keep", type=Path, help="keep the training outputs in this folder")
    parser.add_argument("--json", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    configs = [config.resolve() for config in args.config]
    keep = args.keep.resolve() if args.keep else None
    json_path = args.json.resolve() if args.json else None
    os.chdir(REPO_ROOT)  # the configs' paths are relative to the repository root
    settings = judge.Settings(n=args.n, seed=args.seed)
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs; {settings.n} images per prompt, seed "
          f"{settings.seed}, {settings.steps} steps", flush=True)
    results = []
    base_cache: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
        workdir = keep or Path(tmp)
        for config in configs:
            result = measure(config, args.overrides, settings, workdir, base_cache)
            results.append(result)
            print(report(result), flush=True)
    if json_path:
        json_path.write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
