"""Runs: the trainer as its own process (an argument list, never a shell), a queue of one at a time, stop and
resume, and each run's status read from what it left: its event stream, its lock, its process and exit status.

A run is an output folder. The UI writes three files there: run_config.toml (the config it starts the trainer
with), train.log (the trainer's console output) and ui_runs.json (each launch: command, pid, exit status when the
UI saw it end). Everything else comes from the trainer itself (events.jsonl, train.lock), so a run started from the
command line in the same folder tree shows too, and a restarted UI finds its runs again.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from library.core.atomic import write_atomically
from library.core.run_files import LOCK_FILE  # the trainer's lock on the folder (library/training/preflight.py)
from library.monitoring.events import EVENTS_FILE, read_events

RUN_CONFIG = "run_config.toml"
LOG_FILE = "train.log"
LAUNCHES = "ui_runs.json"
TRAINER = Path(__file__).resolve().parents[2] / "train_network.py"
_SKIP_DIRS = {".git", "node_modules", "__pycache__", "sample", "logs", ".venv", "venv"}


@dataclass
class Job:
    run_dir: Path
    argv: list[str]
    process: subprocess.Popen | None = None
    queued_at: float = field(default_factory=time.time)


@dataclass
class RunStatus:
    run_dir: Path
    status: str  # queued, running, finished, stopped, failed
    step: int = 0
    total_steps: int | None = None
    message: str = ""
    log_tail: list[str] = field(default_factory=list)
    output_name: str | None = None
    files: list[str] = field(default_factory=list)  # LoRA files, newest last
    states: list[str] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # of the latest invocation
    can_resume: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"dir": str(self.run_dir), "name": self.run_dir.name, "status": self.status, "step": self.step,
                "total_steps": self.total_steps, "message": self.message, "log_tail": self.log_tail,
                "output_name": self.output_name, "files": self.files, "states": self.states,
                "samples": self.samples, "can_resume": self.can_resume}


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


def _numbered(run_dir: Path, suffix: str, directories: bool) -> list[str]:
    try:
        entries = [p for p in run_dir.iterdir() if p.name.endswith(suffix) and p.is_dir() == directories
                   and not p.name.startswith(".")]
    except OSError:
        return []
    return [p.name for p in sorted(entries, key=lambda p: p.stat().st_mtime)]


def run_status(run_dir: Path, job: Job | None = None, queued: bool = False) -> RunStatus:
    """A run's status from its files and, when the UI started it, its process."""
    events = list(read_events(run_dir / EVENTS_FILE))
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    latest = events[starts[-1]:] if starts else []
    launches = read_launches(run_dir)
    launch = launches[-1] if launches else None
    start_time = latest[0].get("time", 0) if latest else None
    # The latest launch never wrote its "start": it is loading, or it failed before locking the folder.
    unstarted = launch is not None and (start_time is None or start_time < launch.get("time", 0) - 1)
    status = RunStatus(run_dir, "failed", events=[] if unstarted else latest)
    status.output_name = next((e.get("output_name") for e in latest if e["event"] == "start"), None)
    for event in status.events:
        if event["event"] in ("plan", "step"):
            status.step = event.get("step", status.step)
            status.total_steps = event.get("total_steps", status.total_steps)
    status.files = _numbered(run_dir, ".safetensors", False)
    status.states = _numbered(run_dir, "-state", True)
    status.samples = [f"sample/{name}" for name in _numbered(run_dir / "sample", ".png", False)]
    end = next((e for e in reversed(status.events) if e["event"] == "end"), None)
    alive = job is not None and job.process is not None and job.process.poll() is None
    pid = (launch or {}).get("pid") if unstarted else next(
        (e.get("pid") for e in latest if e["event"] == "start"), None)
    if queued:
        status.status, status.message = "queued", "waiting for the run before it to finish"
    elif alive or (end is None and (lock_holder(run_dir) or trainer_alive(pid))):
        status.status = "running"
        status.message = "loading" if unstarted or status.total_steps is None else ""
    elif end is not None and not unstarted:
        status.status, status.message = end.get("status", "failed"), end.get("message", "")
    else:
        exit_status = (launch or {}).get("exit") if (unstarted or end is None) else None
        status.status = "finished" if exit_status == 0 else "failed"
        status.message = describe_exit(exit_status)
    if status.status in ("failed", "stopped", "running"):
        status.log_tail = log_tail(run_dir)
    status.can_resume = (run_dir / RUN_CONFIG).is_file() and bool(status.states) and status.status in (
        "stopped", "failed", "finished")
    return status


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


class RunManager:
    """Starts queued runs one at a time; each launch is recorded in its folder before the process starts."""

    def __init__(self, roots: list[Path], python: str = sys.executable, cwd: Path | None = None,
                 on_change: Callable[[], None] | None = None):
        self.roots = roots
        self.python = python
        self.cwd = cwd or Path.cwd()
        self.queue: list[Job] = []
        self.current: Job | None = None
        self._lock = threading.Lock()
        self._on_change = on_change

    def submit(self, run_dir: Path, config_text: str, resume: bool = False) -> None:
        """Queue a run of `config_text` (written to run_dir/run_config.toml), or a resume of the folder's."""
        run_dir.mkdir(parents=True, exist_ok=True)
        config = run_dir / RUN_CONFIG
        if not resume:
            write_atomically(config, lambda tmp: tmp.write_text(config_text, encoding="utf-8"))
        argv = [self.python, str(TRAINER), "--config", str(config)] + (["--resume", "latest"] if resume else [])
        with self._lock:
            self.queue.append(Job(run_dir, argv))
        self.start_next()

    def start_next(self) -> None:
        with self._lock:
            if self.current is not None and self.current.process is not None and self.current.process.poll() is None:
                return
            if self.current is not None and self.current.process is not None:
                return  # its waiter has not recorded the exit yet; it calls start_next when it has
            if not self.queue:
                return
            # A run started elsewhere (the command line, a previous UI) on the same folder holds its lock.
            job = self.queue.pop(0)
            self.current = job
        self._launch(job)

    def _launch(self, job: Job) -> None:
        launches = read_launches(job.run_dir)
        with open(job.run_dir / LOG_FILE, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(job.argv[1:])}\n".encode())
            log.flush()
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            try:
                # Its own session: stopping or restarting the UI leaves the run going.
                job.process = subprocess.Popen(job.argv, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT, env=env, start_new_session=True)
            except OSError as e:
                log.write(f"could not start the trainer: {e}\n".encode())
                launches.append({"time": time.time(), "argv": job.argv, "pid": None, "exit": 127})
                self._write_launches(job.run_dir, launches)
                with self._lock:
                    self.current = None
                self.start_next()
                return
        launches.append({"time": time.time(), "argv": job.argv, "pid": job.process.pid, "exit": None})
        self._write_launches(job.run_dir, launches)
        threading.Thread(target=self._wait, args=(job, len(launches) - 1), daemon=True).start()
        self._changed()

    def _wait(self, job: Job, index: int) -> None:
        assert job.process is not None
        exit_status = job.process.wait()
        launches = read_launches(job.run_dir)
        if index < len(launches):
            launches[index]["exit"] = exit_status
            self._write_launches(job.run_dir, launches)
        with self._lock:
            if self.current is job:
                self.current = None
        self._changed()
        self.start_next()

    @staticmethod
    def _write_launches(run_dir: Path, launches: list[dict[str, Any]]) -> None:
        text = json.dumps(launches, indent=1)
        write_atomically(run_dir / LAUNCHES, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def job_for(self, run_dir: Path) -> tuple[Job | None, bool]:
        with self._lock:
            if self.current is not None and self.current.run_dir == run_dir:
                return self.current, False
            return None, any(job.run_dir == run_dir for job in self.queue)

    def status(self, run_dir: Path) -> RunStatus:
        job, queued = self.job_for(run_dir)
        return run_status(run_dir, job, queued)

    def stop(self, run_dir: Path) -> str:
        """SIGTERM to the run's trainer (it finishes the step and saves a state), or take it off the queue."""
        with self._lock:
            for job in self.queue:
                if job.run_dir == run_dir:
                    self.queue.remove(job)
                    return "removed from the queue"
            current = self.current if self.current is not None and self.current.run_dir == run_dir else None
        if current is not None and current.process is not None and current.process.poll() is None:
            current.process.send_signal(signal.SIGTERM)
            return "stopping: the trainer finishes its step and saves a state"
        pid = lock_holder(run_dir)
        if pid is None:
            launches = read_launches(run_dir)
            pid = launches[-1].get("pid") if launches else None
            pid = pid if trainer_alive(pid) else None
        if pid is None:
            return "not running"
        os.kill(pid, signal.SIGTERM)
        return "stopping: the trainer finishes its step and saves a state"

    def all_runs(self) -> list[RunStatus]:
        with self._lock:
            known = [job.run_dir for job in self.queue] + ([self.current.run_dir] if self.current else [])
        dirs = list(dict.fromkeys(known + find_runs(self.roots)))
        return [self.status(d) for d in dirs]
