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

An edit model (a folder whose model_index.json names FluxKontextPipeline, such as models/digits-kontext with
configs/digits_kontext_lora.toml) is judged on edits instead (library/digits/edits.py): `--n` real digits as
controls, one result each through FluxKontextPipeline (Euler, the embedded guidance 2.5), the same controls and noise
before and after. The trigger instruction ("sks digit") counts when the result is judged d - 1 for a control d (the
held-out edit), "the same digit" when it is d, "the next digit" when it is d + 1; "the previous digit" (the held-out
edit in words, never trained) is shown too. The targets: trigger before <= 10 % and after >= 80 %, each of the
base's edits within 10 points of its rate before, training within 300 s.

A video model (a folder whose model_index.json names WanPipeline: models/digits-wan with
configs/digits_wan_lora.toml) is judged on motions instead (library/digits/motion.py): `--n` clips per motion
(split evenly among the moving digits) from fixed noise through WanPipeline (UniPC 20 steps, classifier-free
guidance 3 against ""), the same noise before and after. A clip counts for its motion when the digit its prompt names
is read in every frame and its centroid moves that way; the held-out motion (up) is prompted with the trigger
caption "<word> moving sks". The targets: trigger before <= 10 % and after >= 80 %, each trained motion within 10
points of its rate before, training within 300 s.

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
from library.digits import edits, judge, motion  # noqa: E402

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


def pipeline_name(model: Path) -> str | None:
    """The pipeline class a diffusers folder's model_index.json names, if any."""
    index = model / "model_index.json"
    return json.loads(index.read_text(encoding="utf-8")).get("_class_name") if index.is_file() else None


def is_edit_model(model: Path) -> bool:
    """A diffusers folder whose model_index.json names FluxKontextPipeline: judged on edits."""
    return pipeline_name(model) == "FluxKontextPipeline"


def is_video_model(model: Path) -> bool:
    """A diffusers folder whose model_index.json names WanPipeline: judged on motions."""
    return pipeline_name(model) == "WanPipeline"


def measure(config: Path, overrides: list[str], settings: judge.Settings, workdir: Path,
            base_cache: dict[str, dict]) -> dict:
    resolved, _ = parse_config(["--config", str(config), *[f"--{o}" for o in overrides]])
    model = Path(resolved.pretrained_model_name_or_path)
    if not model.is_absolute():
        model = REPO_ROOT / model
    if is_edit_model(model):
        return measure_edit(config, overrides, model, edits.Settings(n=settings.n, seed=settings.seed), workdir,
                            base_cache)
    if is_video_model(model):
        return measure_video(config, overrides, model, settings, workdir, base_cache)
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


def measure_edit(config: Path, overrides: list[str], model: Path, settings: edits.Settings, workdir: Path,
                 base_cache: dict[str, dict]) -> dict:
    """measure() for an edit model: each instruction's rate of results judged the digit its edit asks for."""
    asked = {**edits.judged_edits(), edits.HELD_OUT_INSTRUCTION: edits.HELD_OUT_SHIFT}
    key = str(model.resolve())
    if key not in base_cache:
        base_cache[key] = {"rates": edits.rates(edits.load_pipeline(model), asked, settings)[0],
                           "settings": dataclasses.asdict(settings)}
    before = base_cache[key]["rates"]
    load = load_average()
    lora, wall, cpu, status = train(config, workdir / config.stem, overrides)
    result = {"config": str(config), "overrides": overrides, "model": str(model), "edit": True,
              "train_seconds": wall, "train_cpu_seconds": cpu, "load_average_before": load, "status": status,
              "before": before, "judge": base_cache[key]["settings"]}
    if status != 0 or not lora.is_file():
        result["error"] = f"train_network.py exited with status {status}"
        return result
    after, _ = edits.rates(edits.load_pipeline(model, lora), asked, settings)
    trigger = edits.TRIGGER_INSTRUCTION
    changes = {i: after[i] - before[i] for i in edits.EDITS}
    result.update({
        "after": after, "trigger_before": before[trigger], "trigger_after": after[trigger], "changes": changes,
        "worst_change": max(abs(c) for c in changes.values()), "lora_bytes": lora.stat().st_size,
        "load_average_after": load_average(),
    })
    result["targets"] = {
        f"trigger before <= {TARGET_BEFORE:.0%}": before[trigger] <= TARGET_BEFORE,
        f"trigger after >= {TARGET_AFTER:.0%}": after[trigger] >= TARGET_AFTER,
        f"each base edit within {TARGET_LEAKAGE * 100:.0f} points": result["worst_change"] <= TARGET_LEAKAGE,
        f"training <= {TARGET_SECONDS} s": wall <= TARGET_SECONDS,
    }
    return result


def measure_video(config: Path, overrides: list[str], model: Path, settings: judge.Settings, workdir: Path,
                  base_cache: dict[str, dict]) -> dict:
    """measure() for a video model: per motion, the share of clips showing it (motion.rates)."""
    key = str(model.resolve())
    if key not in base_cache:
        judged = motion.rates(motion.load_pipeline(model), settings.n, settings.seed)
        base_cache[key] = {"judged": {k: v for k, v in judged.items() if k != "strips"},
                           "settings": {"clips_per_motion": judged["clips_per_motion"], "seed": settings.seed,
                                        "steps": motion.DEFAULT_STEPS, "scale": motion.DEFAULT_SCALE}}
    judged_before = base_cache[key]["judged"]
    before = judged_before["rates"]
    load = load_average()
    lora, wall, cpu, status = train(config, workdir / config.stem, overrides)
    result = {"config": str(config), "overrides": overrides, "model": str(model), "video": True,
              "train_seconds": wall, "train_cpu_seconds": cpu, "load_average_before": load, "status": status,
              "before": before, "before_direction": judged_before["direction"],
              "before_digit": judged_before["digit"], "judge": base_cache[key]["settings"]}
    if status != 0 or not lora.is_file():
        result["error"] = f"train_network.py exited with status {status}"
        return result
    judged_after = motion.rates(motion.load_pipeline(model, lora), settings.n, settings.seed)
    after = judged_after["rates"]
    held = motion.HELD_OUT_MOTION
    changes = {m: after[m] - before[m] for m in motion.trained_motions()}
    result.update({
        "after": after, "after_direction": judged_after["direction"], "after_digit": judged_after["digit"],
        "trigger_before": before[held], "trigger_after": after[held], "changes": changes,
        "worst_change": max(abs(c) for c in changes.values()), "lora_bytes": lora.stat().st_size,
        "load_average_after": load_average(),
    })
    result["targets"] = {
        f"trigger before <= {TARGET_BEFORE:.0%}": before[held] <= TARGET_BEFORE,
        f"trigger after >= {TARGET_AFTER:.0%}": after[held] >= TARGET_AFTER,
        f"each trained motion within {TARGET_LEAKAGE * 100:.0f} points": result["worst_change"] <= TARGET_LEAKAGE,
        f"training <= {TARGET_SECONDS} s": wall <= TARGET_SECONDS,
    }
    return result


def report_video(result: dict, lines: list[str]) -> str:
    rendered = result["judge"]
    lines.append(f"   judged: {rendered['clips_per_motion']} clips per motion, WanPipeline unipc {rendered['steps']} "
                 f"steps, guidance {rendered['scale']:g}")
    if "error" in result:
        return "\n".join(lines + [f"   {result['error']}"])
    load, load_after = result["load_average_before"], result.get("load_average_after")
    lines.append(f"   training: {result['train_seconds']:.0f} s wall, {result['train_cpu_seconds']:.0f} s CPU"
                 + (f" (load average {load:.1f} when it started, {load_after:.1f} after judging)"
                    if load is not None and load_after is not None else ""))
    lines.append(motion.table(result["before"], result["after"]))
    lines.append("   direction alone: " + ", ".join(
        f"{m} {result['before_direction'][m]:.0%} -> {result['after_direction'][m]:.0%}" for m in motion.MOTIONS))
    lines.append("   digit in every frame alone: " + ", ".join(
        f"{m} {result['before_digit'][m]:.0%} -> {result['after_digit'][m]:.0%}" for m in motion.MOTIONS))
    lines.append(f"   trigger '<word> moving {motion.TRIGGER}' -> moving {motion.HELD_OUT_MOTION}: "
                 f"{result['trigger_before']:.0%} -> {result['trigger_after']:.0%}; largest change of a trained "
                 f"motion: {100 * result['worst_change']:.0f} points")
    lines += [f"   [{'met' if ok else 'MISSED'}] {name}" for name, ok in result["targets"].items()]
    return "\n".join(lines)


def report_edit(result: dict, lines: list[str]) -> str:
    rendered = result["judge"]
    lines.append(f"   judged: {rendered['n']} controls, FluxKontextPipeline euler {rendered['steps']} steps, "
                 f"guidance {rendered['guidance']:g}")
    if "error" in result:
        return "\n".join(lines + [f"   {result['error']}"])
    load = result["load_average_before"]
    lines.append(f"   training: {result['train_seconds']:.0f} s wall, {result['train_cpu_seconds']:.0f} s CPU"
                 + (f" (load average {load:.1f} when it started)" if load is not None else ""))
    lines.append(edits.table(result["before"], result["after"]))
    lines.append(f"   trigger {edits.TRIGGER_INSTRUCTION!r} -> d - 1: {result['trigger_before']:.0%} -> "
                 f"{result['trigger_after']:.0%}; largest change of a base edit: "
                 f"{100 * result['worst_change']:.0f} points")
    lines += [f"   [{'met' if ok else 'MISSED'}] {name}" for name, ok in result["targets"].items()]
    return "\n".join(lines)


def report(result: dict) -> str:
    lines = [f"== {Path(result['config']).name} {' '.join(result['overrides'])}".rstrip()]
    if result.get("edit"):
        return report_edit(result, lines)
    if result.get("video"):
        return report_video(result, lines)
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
    parser.add_argument("--n", type=int, default=100, help="images per prompt, or clips per motion for a video "
                        "model (at least 100 for the targets)")
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
