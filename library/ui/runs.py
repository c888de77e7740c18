"""Runs: the trainer as its own process (an argument list, never a shell), a queue of one at a time, stop and
resume; each run's status is read from what it left (library.ui.run_status).

A run is an output folder. The UI writes three files there: run_config.toml (the config it starts the trainer
with), train.log (the trainer's console output) and ui_runs.json (each launch: command, pid, exit status when the
UI saw it end). Everything else comes from the trainer itself (events.jsonl, train.lock), so a run started from the
command line in the same folder tree shows too, and a restarted UI finds its runs again.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from library.core.atomic import write_atomically
from library.core.run_files import LOCK_FILE, SAMPLE_NOW, SAVE_NOW
from library.monitoring.events import EVENTS_FILE
from library.ui.model_family import model_family
from library.ui.run_status import (
    LAUNCHES,
    LOG_FILE,
    PROMPTS_FILE,
    RUN_CONFIG,
    RunStatus,
    find_runs,
    lock_holder,
    read_launches,
    run_config,
    run_status,
    trainer_alive,
)

TRAINER = Path(__file__).resolve().parents[2] / "train_network.py"
REQUESTS = {"sample": SAMPLE_NOW, "save": SAVE_NOW}  # what Sample now / Save now ask the trainer for
# The files of a run besides its outputs: the UI's, the trainer's event stream, lock and pending requests.
RUN_FILES = (RUN_CONFIG, LOG_FILE, LAUNCHES, PROMPTS_FILE, EVENTS_FILE, LOCK_FILE, SAMPLE_NOW, SAVE_NOW)
OUTPUT_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".png", ".webp", ".mp4", ".webm")  # LoRA files, the chart, samples


@dataclass
class Job:
    run_dir: Path
    argv: list[str]
    process: subprocess.Popen | None = None
    queued_at: float = field(default_factory=time.time)
    family: str = ""  # the model's, for the runs list


def model_family_of(run_dir: Path, cwd: Path) -> str:
    """The family of the model the run's config names, as the trainer's registry tells it ("" when none does)."""
    model = run_config(run_dir).get("pretrained_model_name_or_path")
    return (model_family(cwd / str(model)) or "") if isinstance(model, str) and model else ""


class RunManager:
    """Starts queued runs one at a time. The queue is kept on disk: a queued run is a launch record without a
    start time in its folder's ui_runs.json (written atomically), which the launch completes; a UI started later
    takes up the records it finds (adopt) after the runs a previous UI left running."""

    def __init__(self, roots: list[Path], python: str = sys.executable, cwd: Path | None = None,
                 on_change: Callable[[], None] | None = None):
        self.roots = roots
        self.python = python
        self.cwd = cwd or Path.cwd()
        self.queue: list[Job] = []
        self.current: Job | None = None
        self.waiting_for: list[Path] = []  # runs a previous UI started that are still running
        self.closed = False
        self._lock = threading.Lock()
        self._records = threading.Lock()  # read-modify-write of the folders' launch records
        self._on_change = on_change

    def submit(self, run_dir: Path, config_text: str, resume: bool = False) -> None:
        """Queue a run of `config_text` (written to run_dir/run_config.toml), or a resume of the folder's."""
        run_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            write_atomically(run_dir / RUN_CONFIG, lambda tmp: tmp.write_text(config_text, encoding="utf-8"))
        job = Job(run_dir, self.command(run_dir, resume), family=model_family_of(run_dir, self.cwd))
        with self._records:
            launches = read_launches(run_dir)
            launches.append({"queued": job.queued_at, "argv": job.argv, "pid": None, "exit": None,
                             "family": job.family})
            self._write_launches(run_dir, launches)
        with self._lock:
            self.queue.append(job)
        self.start_next()

    def command(self, run_dir: Path, resume: bool) -> list[str]:
        """The trainer's command line for the folder's run_config.toml (an argument list, never a shell)."""
        return [self.python, str(TRAINER), "--config", str(run_dir / RUN_CONFIG)] + (
            ["--resume", "latest"] if resume else [])

    def adopt(self) -> None:
        """Take up the runs queued on disk under the roots (oldest first), to start once the runs that a previous
        UI left running have ended."""
        jobs, running = [], []
        for run_dir in find_runs(self.roots):
            launches = read_launches(run_dir)
            last = launches[-1] if launches else {}
            if "queued" in last and "time" not in last and not last.get("cancelled") and last.get("argv"):
                # The command is made again, not read back: a file under the roots never names what runs.
                jobs.append(Job(run_dir, self.command(run_dir, "--resume" in last["argv"]), queued_at=last["queued"],
                                family=last.get("family", "")))
            elif last.get("pid") and run_status(run_dir).status == "running":
                running.append(run_dir)
        with self._lock:
            known = {job.run_dir for job in self.queue}
            self.queue += sorted((job for job in jobs if job.run_dir not in known), key=lambda job: job.queued_at)
            self.waiting_for = running
        if running:
            threading.Thread(target=self._wait_for_previous, daemon=True).start()
        self.start_next()

    def _wait_for_previous(self) -> None:
        while not self.closed and any(run_status(d).status == "running" for d in self.waiting_for):
            time.sleep(1.0)
        with self._lock:
            self.waiting_for = []
        self.start_next()

    def close(self) -> None:
        """The UI stops: nothing more is started; the queue stays on disk for the next UI."""
        self.closed = True

    def start_next(self) -> None:
        with self._lock:
            if self.closed or self.waiting_for or not self.queue:
                return
            if self.current is not None:
                return  # starting, running, or its waiter has not recorded the exit yet (it calls start_next)
            # A run started elsewhere (the command line, a previous UI) on the same folder holds its lock.
            job = self.queue.pop(0)
            self.current = job
        self._launch(job)

    def _launch(self, job: Job) -> None:
        for name in REQUESTS.values():  # asked of an earlier attempt that ended before doing it
            (job.run_dir / name).unlink(missing_ok=True)
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
                self._record(job.run_dir, -1, time=time.time(), exit=127)
                with self._lock:
                    self.current = None
                self.start_next()
                return
        self._record(job.run_dir, -1, time=time.time(), pid=job.process.pid)
        threading.Thread(target=self._wait, args=(job, len(read_launches(job.run_dir)) - 1), daemon=True).start()
        self._changed()

    def _wait(self, job: Job, index: int) -> None:
        assert job.process is not None
        exit_status = job.process.wait()
        self._record(job.run_dir, index, exit=exit_status)
        with self._lock:
            if self.current is job:
                self.current = None
        self._changed()
        self.start_next()

    def _record(self, run_dir: Path, index: int, **fields: Any) -> None:
        """Add `fields` to launch `index` (-1: the latest) of the folder's record."""
        with self._records:
            launches = read_launches(run_dir)
            if -len(launches) <= index < len(launches):
                launches[index].update(fields)
                self._write_launches(run_dir, launches)

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
        return run_status(run_dir, job.process if job is not None else None, queued)

    def stop(self, run_dir: Path) -> str:
        """SIGTERM to the run's trainer (it finishes the step and saves a state), or take it off the queue."""
        with self._lock:
            for job in self.queue:
                if job.run_dir == run_dir:
                    self.queue.remove(job)
                    self._record(run_dir, -1, cancelled=time.time())
                    return "removed from the queue"
            current = self.current if self.current is not None and self.current.run_dir == run_dir else None
        if current is not None and current.process is not None and current.process.poll() is None:
            current.process.send_signal(signal.SIGTERM)
        else:
            pid = lock_holder(run_dir)
            if pid is None:
                launches = read_launches(run_dir)
                pid = launches[-1].get("pid") if launches else None
                pid = pid if trainer_alive(pid) else None
            if pid is None:
                return "not running"
            os.kill(pid, signal.SIGTERM)
        self._record(run_dir, -1, stop_requested=time.time())  # every page shows "stopping" until it ends
        return "stopping: the trainer finishes its step and saves a state"

    def request(self, run_dir: Path, what: str) -> tuple[bool, str]:
        """Ask the running trainer for a sample round or a LoRA file after its current step: a file in its folder
        that it removes once done (library/training/requests.py)."""
        status = self.status(run_dir)
        if status.status != "running" or status.phase == "stopping":
            return False, f"not running: there is no trainer to ask (the run is {status.status})"
        if what == "sample" and not status.can_sample:
            return False, ("the run makes no samples (sample prompts and sample_every_n_steps / _epochs): "
                           "the trainer has no prompts to sample")
        name = REQUESTS[what]
        (run_dir / name).touch()
        return True, ("samples asked for: the trainer makes them after this step" if what == "sample" else
                      "a LoRA file asked for: the trainer saves it after this step")

    def delete(self, run_dir: Path, confirmed: bool) -> tuple[bool, str, list[Path]]:
        """Delete the files a run made in its folder (its outputs and the UI's records; nothing else there), and
        the folder when that empties it. Never while it is queued or running. Without `confirmed` nothing is deleted:
        the files that would be are returned."""
        status = self.status(run_dir)
        if status.status in ("queued", "running") or lock_holder(run_dir) is not None:
            return False, (f"the run is {status.status}: stop it first (the files of a running run are never "
                           "deleted)"), []
        files = run_files(run_dir, status.output_name)
        if not confirmed:
            return False, "", files
        for path in sorted(files, key=lambda p: len(p.parts), reverse=True):  # samples before their folder
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.is_dir():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
        kept = [p.name for p in run_dir.iterdir()] if run_dir.is_dir() else []
        if not kept and not any(run_dir == root for root in self.roots):
            run_dir.rmdir()
        self._changed()
        return True, f"deleted {len(files)} file(s) of {status.name}" + (
            f"; kept what was not the run's: {', '.join(sorted(kept)[:5])}" if kept else ""), files

    def all_runs(self) -> list[RunStatus]:
        with self._lock:
            known = [job.run_dir for job in self.queue] + ([self.current.run_dir] if self.current else [])
        dirs = list(dict.fromkeys(known + find_runs(self.roots)))
        return [self.status(d) for d in dirs]


def run_files(run_dir: Path, output_name: str | None) -> list[Path]:
    """What a run made in its folder: the UI's and the trainer's files, and the outputs named after its output name
    (LoRA files, snapshots, state folders, the loss chart, samples)."""
    name = output_name or "last"  # the trainer's default output name

    def its(path: Path) -> bool:
        return path.name.startswith((f"{name}.", f"{name}-", f"{name}_")) and (
            path.suffix in OUTPUT_SUFFIXES or path.name.endswith("-state"))

    found = [run_dir / n for n in RUN_FILES if (run_dir / n).exists()]
    found += [p for p in sorted(run_dir.iterdir()) if its(p)]
    sample = run_dir / "sample"
    if sample.is_dir():
        samples = [p for p in sorted(sample.iterdir()) if its(p)]
        found += samples
        if len(samples) == len(list(sample.iterdir())):
            found.append(sample)  # the folder goes with them when they are all it holds
    return found
