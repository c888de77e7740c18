"""A run's status read from what it left in its folder: its event stream, its lock, its process, the UI's launch
records (ui_runs.json) and its console output. Nothing here starts or stops a process (library.ui.runs does)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from library.config import read_toml
from library.core.run_files import LOCK_FILE, SAMPLE_NOW, SAVE_NOW  # the trainer's (library/training)
from library.monitoring.events import EVENTS_FILE, read_events
from library.ui.samples import SAMPLE_SUFFIXES, sample_views

RUN_CONFIG = "run_config.toml"
LOG_FILE = "train.log"
LAUNCHES = "ui_runs.json"
PROMPTS_FILE = "sample_prompts.txt"  # sample prompts typed in the UI's form (kohya's .txt format)
_SKIP_DIRS = {".git", "node_modules", "__pycache__", "sample", "logs", ".venv", "venv"}


@dataclass
class RunStatus:
    run_dir: Path
    status: str  # queued, running, finished, stopped, failed, not started
    step: int = 0
    total_steps: int | None = None
    message: str = ""
    log_tail: list[str] = field(default_factory=list)
    output_name: str | None = None
    files: list[str] = field(default_factory=list)  # LoRA files, newest last
    states: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)  # path, when (step / epoch), order, prompt
    events: list[dict[str, Any]] = field(default_factory=list)  # of the latest invocation
    can_resume: bool = False
    started: float | None = None  # the run's first start (earlier attempts it resumed from included)
    duration: float | None = None  # seconds its attempts ran, the current one up to now
    family: str = ""  # the model's family, as the UI detected it when it queued the run
    phase: str = ""  # while running: loading, training, sampling, saving, finishing or stopping
    requests: list[str] = field(default_factory=list)  # sample_now / save_now files the trainer has not done yet
    can_sample: bool = False  # the run samples (prompts and a schedule): Sample now has something to draw

    @property
    def name(self) -> str:
        return self.output_name or self.run_dir.name

    def as_dict(self) -> dict[str, Any]:
        return {"dir": str(self.run_dir), "name": self.name, "folder": self.run_dir.name, "status": self.status,
                "step": self.step, "total_steps": self.total_steps, "message": self.message,
                "log_tail": self.log_tail, "output_name": self.output_name, "files": self.files,
                "states": self.states, "samples": self.samples, "can_resume": self.can_resume,
                "started": self.started, "duration": self.duration, "family": self.family, "phase": self.phase,
                "requests": self.requests, "can_sample": self.can_sample}


def trainer_alive(pid: int | None) -> bool:
    """Whether `pid` is a live trainer process (not a zombie, not a reused pid running something else)."""
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"train_network" in cmdline


def lock_holder(run_dir: Path) -> int | None:
    """The pid of the trainer holding the folder on this host, if it is alive."""
    try:
        holder = json.loads((run_dir / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None
    pid = holder.get("pid") if isinstance(holder, dict) else None
    if holder.get("host") not in (None, socket.gethostname()) or not trainer_alive(pid):
        return None
    return pid


def read_launches(run_dir: Path) -> list[dict[str, Any]]:
    try:
        launches = json.loads((run_dir / LAUNCHES).read_text())
    except (OSError, ValueError):
        return []
    return launches if isinstance(launches, list) else []


def log_tail(run_dir: Path, lines: int = 30) -> list[str]:
    """The last lines of the trainer's console output (progress bars' carriage returns count as line ends)."""
    try:
        with open(run_dir / LOG_FILE, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    parts = [p.rstrip() for p in text.replace("\r", "\n").split("\n")]
    return [p for p in parts if p][-lines:]


def _numbered(run_dir: Path, suffix: str | tuple[str, ...], directories: bool) -> list[str]:
    try:
        entries = [p for p in run_dir.iterdir() if p.name.endswith(suffix) and p.is_dir() == directories
                   and not p.name.startswith(".")]
    except OSError:
        return []
    return [p.name for p in sorted(entries, key=lambda p: p.stat().st_mtime)]


def run_status(run_dir: Path, process: subprocess.Popen | None = None, queued: bool = False) -> RunStatus:
    """A run's status from its files and, when this UI started it, its process."""
    attempts = split_attempts(list(read_events(run_dir / EVENTS_FILE)))
    latest = attempts[-1] if attempts else []
    launches = read_launches(run_dir)
    launch = launches[-1] if launches else {}
    if "queued" in launch and "time" not in launch:
        return waiting_run(run_dir, launch, queued)
    if not launch and not attempts:
        return RunStatus(run_dir, "not started", message="no trainer has run in this folder")
    start_time = latest[0].get("time", 0) if latest else None
    # The latest launch never wrote its "start": it is loading, or it failed before locking the folder.
    unstarted = bool(launch) and (start_time is None or start_time < launch.get("time", 0) - 1)
    config = run_config(run_dir)
    status = RunStatus(run_dir, "failed", events=[] if unstarted else latest, family=launch.get("family") or "")
    status.output_name = next((e.get("output_name") for e in latest if e["event"] == "start"),
                              None) or config.get("output_name")
    for event in status.events:
        if event["event"] in ("plan", "step"):
            status.step = event.get("step", status.step)
            status.total_steps = event.get("total_steps", status.total_steps)
    status.files = _numbered(run_dir, ".safetensors", False)
    status.states = _numbered(run_dir, "-state", True)
    status.samples = sample_views(run_dir, [f"sample/{name}"
                                            for name in _numbered(run_dir / "sample", SAMPLE_SUFFIXES, False)])
    end = next((e for e in reversed(status.events) if e["event"] == "end"), None)
    alive = process is not None and process.poll() is None
    pid = launch.get("pid") if unstarted else next((e.get("pid") for e in latest if e["event"] == "start"), None)
    if queued:
        status.status, status.message = "queued", "waiting for the run before it to finish"
    elif alive or (end is None and (lock_holder(run_dir) or trainer_alive(pid))):
        status.status = "running"
        status.phase = phase(status.events, config, unstarted, bool(launch.get("stop_requested")))
        status.requests = [name for name in REQUESTS if (run_dir / name).exists()]
        # The trainer reads the prompts (and keeps the VAE) only for a run that samples on a schedule.
        status.can_sample = bool(config.get("sample_prompts")) and any(
            config.get(name) for name in ("sample_every_n_steps", "sample_every_n_epochs", "sample_at_first"))
        status.message = "; ".join(m for m in (PHASES[status.phase], *(REQUESTS[r] for r in status.requests)) if m)
    elif end is not None and not unstarted:
        status.status, status.message = end.get("status", "failed"), end.get("message", "")
    else:
        exit_status = launch.get("exit") if (unstarted or end is None) else None
        status.status = "finished" if exit_status == 0 else "failed"
        status.message = describe_exit(exit_status)
    if status.status in ("failed", "stopped", "running"):
        status.log_tail = log_tail(run_dir)
    status.can_resume = (run_dir / RUN_CONFIG).is_file() and bool(status.states) and status.status in (
        "stopped", "failed", "finished")
    status.started, status.duration = timing(history(attempts), launch, status.status == "running")
    return status


def waiting_run(run_dir: Path, launch: dict[str, Any], queued: bool) -> RunStatus:
    """A run queued on disk that never started: waiting in the queue, or taken off it."""
    status = RunStatus(run_dir, "queued", message="waiting for the run before it to finish", started=launch["queued"],
                       family=launch.get("family") or "", output_name=run_config(run_dir).get("output_name"))
    if launch.get("cancelled") and not queued:
        status.status, status.message = "not started", "taken off the queue before it started"
    return status


def split_attempts(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The events of each invocation on the folder (each begins with its "start"), oldest first."""
    attempts: list[list[dict[str, Any]]] = []
    for event in events:
        if event["event"] == "start" or not attempts:
            attempts.append([])
        attempts[-1].append(event)
    return attempts


def history(attempts: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """The attempts of the latest run: back to the last one that started from step 0 (a resume starts from its
    state's step; a new run in the same folder from 0)."""
    for index in range(len(attempts) - 1, -1, -1):
        plan = next((e for e in attempts[index] if e["event"] == "plan"), None)
        if plan is not None and not plan.get("step"):
            return attempts[index:]
    return attempts


def timing(attempts: list[list[dict[str, Any]]], launch: dict[str, Any],
           running: bool) -> tuple[float | None, float | None]:
    """(the first start, the seconds the attempts ran): from each attempt's first to last event, the running
    one's up to now."""
    if not attempts:
        return launch.get("time"), None
    spans = [a[-1].get("time", 0) - a[0].get("time", 0) for a in attempts]
    if running:
        spans[-1] = time.time() - attempts[-1][0].get("time", 0)
    return attempts[0][0].get("time"), max(0.0, sum(spans))


PHASES = {"": "", "loading": "loading the model and data", "training": "",
          "sampling": "making sample images after this step", "saving": "saving a LoRA file after this step",
          "finishing": "the last step is done: final samples and saving the LoRA",
          "stopping": "stopping: the trainer finishes its step and saves a state"}
REQUESTS = {SAMPLE_NOW: "samples asked for: the trainer makes them after this step",
            SAVE_NOW: "a LoRA file asked for: the trainer saves it after this step"}


def phase(events: list[dict[str, Any]], config: dict[str, Any], unstarted: bool, stopping: bool) -> str:
    """What a running trainer is doing, from its events: they say when a step, a sample round or a save is done,
    not when one begins, so a round is told from the config's schedule and the last step written."""
    if stopping:
        return "stopping"
    plan = next((e for e in events if e["event"] == "plan"), None)
    if unstarted or plan is None:
        return "loading"
    last = events[-1]
    if last["event"] == "request":  # a sample round or a save asked for from the UI, under way
        return "sampling" if last.get("request") == SAMPLE_NOW else "saving"
    step, total = last.get("step") or 0, plan.get("total_steps") or 0
    if last["event"] in ("step", "samples", "save", "state", "validation") and total and step >= total:
        return "finishing"
    if last["event"] == "step":
        if config.get("sample_prompts") and due(step, config.get("sample_every_n_steps")):
            return "sampling"
        if due(step, config.get("save_every_n_steps")):
            return "saving"
    return "training"


def due(step: int, every: Any) -> bool:
    return isinstance(every, int) and every > 0 and step % every == 0


def run_config(run_dir: Path) -> dict[str, Any]:
    """The options of the config the UI started the run with (kohya's tables flattened); {} without one."""
    try:
        tables = read_toml(run_dir / RUN_CONFIG)
    except (OSError, ValueError):
        return {}
    flat: dict[str, Any] = {}
    for key, value in tables.items():
        flat.update(value if isinstance(value, dict) else {key: value})
    return flat


def describe_exit(exit_status: int | None) -> str:
    if exit_status is None:
        return "the trainer ended without a final status (killed, or out of memory); its last log lines follow"
    if exit_status < 0:
        return f"the trainer was killed by {signal.Signals(-exit_status).name}"
    if exit_status == 2:
        return "the trainer refused to start (exit status 2): see its log"
    return f"the trainer ended with exit status {exit_status}"


def find_runs(roots: list[Path], depth: int = 4) -> list[Path]:
    """Output folders under the roots: those with an event stream or launched by the UI."""
    found: list[Path] = []
    for root in roots:
        base = len(root.parts)
        for current, dirs, files in os.walk(root):
            here = Path(current)
            if EVENTS_FILE in files or LAUNCHES in files:
                found.append(here)
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".") and not d.endswith("-state")
                       and len(here.parts) - base < depth]
    return sorted(set(found), key=lambda p: _last_change(p), reverse=True)


def _last_change(run_dir: Path) -> float:
    times = [(run_dir / name).stat().st_mtime for name in (EVENTS_FILE, LAUNCHES) if (run_dir / name).exists()]
    return max(times, default=0.0)
