"""Out of the box: a minimal config with this trainer's defaults against the same config with caching off, and
the cost of getting to the first step.

    python bench/startup_defaults.py [--models tiny small quickstart sd15] [--steps N] [--repeats R] [--threads T]
                                     [--work DIR] [--json PATH]

Each run is `train_network.py` in its own process (one thread unless --threads), on the offline bench model and
data/quickstart, with only the model, data, resolution, batch size (4) and steps given (`quickstart`:
configs/quickstart.toml as shipped, with its step count cut to N). `sd15` is the released SD1.5 architecture with
random weights, written as an fp16 single file by bench/real_size_files.py, trained at 512 px on 4 images of that
size at the default batch size (1); --work keeps that file for the next run. The "caching off" variant adds
`--cache_latents false --cache_text_encoder_outputs false` (the defaults before caching became automatic). The
variants alternate. Reported per run: launch -> end of the first optimizer step (wall seconds from starting the
process), CPU seconds per step after the first (user + system of the process, read at each step), and peak RSS
(VmHWM).
Nothing is asserted; read the numbers next to the machine's load, which is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from step_time import RESOLUTION  # the bench models' training resolutions

REAL_SIZE = {"sd15": 512}  # real-size architectures and their training resolutions
REAL_SIZE_IMAGES = 4
REPO = Path(__file__).resolve().parent.parent
STEPS = 12  # per run: the first is launch -> first step, the other 11 give the CPU per step
VARIANTS = {"defaults": (), "caching off": ("--cache_latents", "false", "--cache_text_encoder_outputs", "false")}
# Runs inside the child: train_network.main with a hook that records the process's CPU time and the wall clock at
# the end of each optimizer step, then the peak RSS. Written to the JSON file named in argv[1].
CHILD = r"""
import json, os, resource, sys, time
sys.path.insert(0, os.getcwd())
out, argv = sys.argv[1], sys.argv[2:]
marks = []
import train_network
from library.config import parse_config
hide = getattr(train_network, "hide_unused_packages", None)  # None in trees older than it: they import everything
if hide is not None:
    hide(parse_config(argv)[0])  # as train_network.py does before any library loads
from library.training import loop
original = loop.Trainer.log_step
def log_step(self, *args, **kwargs):
    original(self, *args, **kwargs)
    t = resource.getrusage(resource.RUSAGE_SELF)  # microseconds; os.times() counts 10 ms clock ticks
    marks.append((time.time(), t.ru_utime + t.ru_stime))
loop.Trainer.log_step = log_step
status = train_network.main(argv, own_process=True) if hide is not None else train_network.main(argv)
peak = None
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        peak = int(line.split()[1]) / 1024
json.dump({"status": status, "marks": marks, "peak_rss_mib": peak}, open(out, "w"))
"""


def build_model(kind: str, folder: Path) -> Path:
    """The bench model `kind` in `folder`: a diffusers folder, or for a real size an fp16 single file in it
    (kept when already there)."""
    if kind in REAL_SIZE:
        path = folder / f"{kind}-random-fp16.safetensors"
        code = ("import sys, torch; from pathlib import Path; sys.path[:0] = ['.', 'bench']; "
                "from real_size_files import SD_ARCHITECTURES, write_sd_checkpoint; "
                f"write_sd_checkpoint(SD_ARCHITECTURES[{kind!r}], Path({str(path)!r}), torch.float16)")
    else:
        path = folder
        code = ("import sys; sys.path.insert(0, '.'); from library.families.tiny import save_tiny_sd1; "
                f"save_tiny_sd1({str(folder)!r}, size={kind!r})")
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True)
    return path


def training_data(kind: str, folder: Path) -> Path:
    """data/quickstart for the bench models; for a real size, a few images of its resolution with captions."""
    if kind not in REAL_SIZE:
        return REPO / "data" / "quickstart"
    from real_size import write_images

    return write_images(folder / f"data-{kind}", REAL_SIZE[kind], REAL_SIZE_IMAGES)


def run_once(model: Path | None, kind: str, steps: int, work: Path, extra: tuple[str, ...] = (),
             timeout: int = 900, data: Path | None = None, threads: int = 1) -> dict:
    """One training process; launch -> first step (wall s), median CPU s per later step, peak RSS (MiB)."""
    out = work / "result.json"
    if kind == "quickstart":  # the shipped config as it stands, cut to `steps` steps
        argv = ["--config", str(REPO / "configs" / "quickstart.toml")]
    elif kind in REAL_SIZE:  # the default batch size
        argv = ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data),
                "--resolution", str(REAL_SIZE[kind]), "--seed", "0"]
    else:
        argv = ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(REPO / "data" / "quickstart"),
                "--resolution", str(RESOLUTION[kind]), "--train_batch_size", "4", "--seed", "0"]
    argv += ["--max_train_steps", str(steps), "--output_dir", str(work / "out"), "--output_name", "bench", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    started = time.time()
    subprocess.run([sys.executable, "-c", CHILD, str(out), *argv], cwd=REPO, env=env, check=True,
                   capture_output=True, timeout=timeout)
    result = json.loads(out.read_text())
    marks = result["marks"]
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:], strict=False)]
    return {"first_step_s": marks[0][0] - started, "cpu_per_step_s": statistics.median(cpu),
            "peak_rss_mib": result["peak_rss_mib"]}


def compare(models: list[str], steps: int, repeats: int, variants: dict[str, tuple[str, ...]] = VARIANTS,
            timeout: int = 900, threads: int = 1, work: Path | None = None) -> dict[str, dict[str, list[dict]]]:
    """Run each model's variants (name -> extra options) `repeats` times, the order reversed every other repeat;
    the runs by model and variant. `work` keeps the models (real sizes take a while to write)."""
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-defaults-") as tmp:
        for kind in models:
            model = None if kind == "quickstart" else build_model(kind, (work or Path(tmp)) / f"model-{kind}")
            data = training_data(kind, Path(tmp))
            runs: dict[str, list[dict]] = {name: [] for name in variants}
            for repeat in range(repeats):
                for name, extra in (variants.items() if repeat % 2 == 0 else reversed(variants.items())):
                    run = Path(tmp) / f"{kind}-{name.split()[0]}-{repeat}"
                    run.mkdir()
                    runs[name].append(run_once(model, kind, steps, run, extra, timeout, data, threads))
            results[kind] = runs
    return results


def print_results(results: dict[str, dict[str, list[dict]]]) -> None:
    """Medians per model and variant, and the CPU per step of the first variant over the second."""
    print("medians over the repeats; cpu s/step: user + system CPU seconds per optimizer step after the first")
    width = max(12, *(len(name) for runs in results.values() for name in runs))
    print(f"{'model':10s} {'variant':{width}s} {'first step s':>12s} {'cpu s/step':>11s} {'peak RSS MiB':>13s}")
    for kind, runs in results.items():
        for variant, rows in runs.items():
            med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            print(f"{kind:10s} {variant:{width}s} {med['first_step_s']:12.2f} {med['cpu_per_step_s']:11.3f} "
                  f"{med['peak_rss_mib']:13.0f}")
        (first, a), (second, b) = list(runs.items())[:2]
        ratio = statistics.median(r["cpu_per_step_s"] for r in a) / statistics.median(r["cpu_per_step_s"] for r in b)
        print(f"{kind:10s} cpu s/step, {first} / {second}: {ratio:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=(*RESOLUTION, "quickstart", *REAL_SIZE),
                        default=["tiny", "small", "quickstart"])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="threads per training process")
    parser.add_argument("--work", type=Path, help="keep the written models here and reuse them")
    parser.add_argument("--timeout", type=int, default=900, help="most seconds one training run may take")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results = compare(args.models, args.steps, args.repeats, timeout=args.timeout, threads=args.threads,
                      work=args.work)
    print_results(results)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
