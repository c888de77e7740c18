"""What the web UI's tests share: a TestClient on an app over some roots, and run folders as the trainer leaves them
(its event stream, LoRA files, states, samples) without training."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from library.ui.app import Settings, create_app
from tests.helpers import REPO

ORIGIN = {"Origin": "http://127.0.0.1:7860"}


def client(roots: list[Path], **settings: Any) -> TestClient:
    app = create_app(Settings(roots=roots, cwd=REPO, **settings))
    return TestClient(app, base_url="http://127.0.0.1:7860")


def write_events(run_dir: Path, events: list[dict[str, Any]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)


def attempt(first: int, last: int, total: int, start: float, output_name: str = "mine",
            pid: int = 999999) -> list[dict[str, Any]]:
    """One invocation's events from step `first` (0: a fresh start, else a resumed state's) to step `last`."""
    steps = [{"event": "step", "time": start + 2 + s, "step": s, "total_steps": total, "loss": 1.0 / s,
              "s_per_step": 0.5, "timestep_loss": [[0, 499, 0.2]], "lr": {}} for s in range(first + 1, last + 1)]
    return [{"event": "start", "time": start, "pid": pid, "output_name": output_name},
            {"event": "plan", "time": start + 1, "total_steps": total, "step": first}, *steps]


def sample_png(path: Path, prompt: str) -> None:
    """A sample image carrying its prompt as the trainer writes it (AUTOMATIC1111's "parameters" text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    info = PngInfo()
    info.add_text("parameters", f"{prompt}\nSteps: 8, Sampler: ddim, CFG scale: 7.5, Seed: 1, Size: 8x8")
    Image.new("RGB", (8, 8), (200, 30, 30)).save(path, pnginfo=info)


def lora_file(path: Path, metadata: dict[str, str] | None = None) -> None:
    """A .safetensors file holding only its header (enough for the UI, which reads no tensor)."""
    header = json.dumps({"__metadata__": metadata or {"ss_network_dim": "4"}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def finished_run(run_dir: Path, output_name: str = "mine", total: int = 4) -> Path:
    """A run folder as a finished run leaves it: its config, events, final LoRA file and a state."""
    write_events(run_dir, [*attempt(0, total, total, 1_700_000_000.0, output_name),
                           {"event": "state", "time": 1_700_000_050.0, "step": 2,
                            "path": f"{output_name}-step00000002-state"},
                           {"event": "save", "time": 1_700_000_100.0, "step": total,
                            "path": f"{output_name}.safetensors"},
                           {"event": "end", "time": 1_700_000_101.0, "status": "finished", "step": total}])
    (run_dir / "run_config.toml").write_text(
        f'output_dir = "{run_dir}"\noutput_name = "{output_name}"\npretrained_model_name_or_path = '
        f'"models/digits-base"\ntrain_data_dir = "data/digits/train"\n', encoding="utf-8")
    (run_dir / "ui_runs.json").write_text(json.dumps([{"time": 1_699_999_999.0, "argv": [], "pid": 999999, "exit": 0,
                                                        "family": "sd"}]), encoding="utf-8")
    lora_file(run_dir / f"{output_name}.safetensors")
    (run_dir / f"{output_name}-step00000002-state").mkdir()
    return run_dir


def stand_in_python(folder: Path, release: Path | None = None) -> str:
    """An executable the UI can run in place of python: it takes train_network.py's command line (so the UI sees a
    trainer among the processes) and exits 0 at once, or once `release` exists."""
    script = folder / "stand_in_python"
    # Waiting, it lets SIGTERM pass (as the trainer finishes its step first) so a test sees "stopping".
    wait = f'trap "" TERM\nwhile [ ! -e "{release}" ]; do sleep 0.1; done\n' if release is not None else ""
    script.write_text(f"#!/bin/sh\n{wait}exit 0\n", encoding="utf-8")
    script.chmod(0o755)
    return str(script)


PRETEND_TRAINER = """
import json, os, signal, socket, sys, time
run = sys.argv[1]
def write(event, **fields):
    with open(os.path.join(run, "events.jsonl"), "a") as f:
        f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\\n")
def stop(*_):
    write("end", status="stopped", message="stopped by SIGTERM; state saved")
    os.remove(os.path.join(run, "train.lock"))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
with open(os.path.join(run, "train.lock"), "w") as f:
    json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
write("start", pid=os.getpid(), output_name="pretend")
write("plan", total_steps=100000, step=0)
for step in range(1, 100000):
    write("step", step=step, total_steps=100000, loss=1.0, s_per_step=0.2, timestep_loss=[], lr={})
    time.sleep(0.2)
"""


def pretend_trainer(run_dir: Path) -> subprocess.Popen:
    """A process the UI takes for a trainer (train_network in its command line, the folder's lock, its events): it
    steps until SIGTERM, then writes a stopped end as the trainer does."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", PRETEND_TRAINER, str(run_dir), "train_network"])


def reap_runs(root: Path) -> None:
    """Kill what trainers the UI started under `root` still run. A run outlives its UI by design (a restarted UI
    finds it), so a test that ends early, or a UI process stopped at teardown, would leave it training."""
    for record_file in root.rglob("ui_runs.json"):
        try:
            records = json.loads(record_file.read_text())
        except (OSError, ValueError):
            continue
        for pid in {record.get("pid") for record in records if isinstance(record, dict)}:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, TypeError):
                continue  # not running (or no /proc): nothing to kill
            if b"train_network.py" in command or b"stand_in_python" in command:
                os.kill(pid, signal.SIGKILL)
