"""SIGTERM / SIGINT on the real command (issue 17, preemption and case 9): the step under way is finished, a state
is saved, trackers are flushed, the exit is 143 / 130 with one line, and --resume latest continues bit-exactly."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from library.network.kohya_format import load_kohya_lora
from library.training.state import TrainState, find_latest_state, state_problems

REPO = Path(__file__).resolve().parents[2]
STEPS = 40
# Hang guards only: a quiet run takes about 10 s; these allow a machine many times slower.
RUN_LIMIT_S = 300


class Run:
    """The command in a subprocess, its stderr collected as it comes (tqdm writes progress there)."""

    def __init__(self, config: Path, *extra: str, processes: int = 1):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        launcher = [] if processes == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                                              "--master_port", str(29500 + (os.getpid() + 7) % 1000)]
        self.process = subprocess.Popen([sys.executable, *launcher, str(REPO / "train_network.py"), "--config",
                                         str(config), *extra], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE)
        self.err = b""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := os.read(self.process.stderr.fileno(), 4096):
            self.err += chunk

    def wait_for(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + RUN_LIMIT_S
        while time.monotonic() < deadline:
            match = re.search(pattern, self.err.decode(errors="replace"))
            if match:
                return match
            assert self.process.poll() is None, self.text()
            time.sleep(0.01)
        raise AssertionError(f"no {pattern!r} within {RUN_LIMIT_S} s:\n{self.text()}")

    def finish(self) -> int:
        status = self.process.wait(timeout=RUN_LIMIT_S)
        self._reader.join(timeout=10)
        return status

    def text(self) -> str:
        return self.err.decode(errors="replace")


@pytest.fixture
def configs(tiny_sd1_dir, sample_data_dir, tmp_path) -> dict[str, Path]:
    data = tmp_path / "data" / "1_sks shape"
    data.mkdir(parents=True)
    for image in sorted((sample_data_dir / "10_sks shape").glob("*.png"))[:6]:
        shutil.copy(image, data / image.name)
        shutil.copy(image.with_suffix(".txt"), data / image.with_suffix(".txt").name)
    body = (f'pretrained_model_name_or_path = "{tiny_sd1_dir}"\ntrain_data_dir = "{data.parent}"\n'
            f'resolution = 64\ncaption_extension = ".txt"\ntrain_batch_size = 2\nmax_train_steps = {STEPS}\n'
            'seed = 4\nlearning_rate = 1e-3\nlr_scheduler = "cosine"\nnetwork_dropout = 0.1\n')
    paths = {}
    for name, extra in (("reference", ""), ("preempted", "save_state = true\n"), ("plain", "")):
        paths[name] = tmp_path / f"{name}.toml"
        paths[name].write_text(body + extra + f'output_dir = "{tmp_path / name}"\nlogging_dir = '
                                              f'"{tmp_path / name / "logs"}"\nlog_with = "tensorboard"\n')
    return paths


def one_line_and_no_traceback(run: Run, expected: str) -> None:
    lines = [line for line in re.split(r"[\r\n]", run.text()) if line.strip()]
    assert "Traceback" not in run.text(), run.text()
    assert re.fullmatch(expected, lines[-1]), lines[-1]


@pytest.mark.slow  # a reference, a preempted and a resumed run: about 24 s on 2 CPU cores
def test_sigterm_saves_a_state_and_resume_latest_is_bit_exact(configs):
    reference = Run(configs["reference"])
    assert reference.finish() == 0, reference.text()

    out = configs["preempted"].parent / "preempted"
    run = Run(configs["preempted"])
    run.wait_for(rf" [1-9]\d*/{STEPS} ")  # a step is done: the loop is running
    run.process.send_signal(signal.SIGTERM)
    assert run.finish() == 143, run.text()
    state_dir = find_latest_state(out)
    assert state_dir is not None and state_problems(state_dir) == []
    stopped_at = TrainState.read(state_dir).global_step
    assert 1 <= stopped_at < STEPS and state_dir.name == f"last-step{stopped_at:08d}-state"
    one_line_and_no_traceback(run, rf"stopped by SIGTERM after step {stopped_at}; saved {re.escape(str(state_dir))}; "
                                   "continue with --resume latest")
    assert not (out / "last.safetensors").exists()
    # The trackers were flushed: tensorboard holds every step up to the preemption.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (out / "logs").rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("loss/current")] == list(range(1, stopped_at + 1))

    resumed = Run(configs["preempted"], "--resume", "latest")
    assert resumed.finish() == 0, resumed.text()
    expected = load_kohya_lora(configs["reference"].parent / "reference" / "last.safetensors")[0]
    got = load_kohya_lora(out / "last.safetensors")[0]
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_sigint_without_states_stops_with_one_line(configs):
    out = configs["plain"].parent / "plain"
    run = Run(configs["plain"])
    run.wait_for(rf" [1-9]\d*/{STEPS} ")
    run.process.send_signal(signal.SIGINT)
    assert run.finish() == 130, run.text()
    one_line_and_no_traceback(run, r"stopped by SIGINT after step \d+; no state saved \(set save_state_on_preemption "
                                   r"to save one\)")
    assert find_latest_state(out) is None and not list(out.glob("*.safetensors"))
    assert not (out / "train.lock").exists()


def test_sigint_while_the_model_loads_is_one_line(configs):
    run = Run(configs["plain"])
    run.wait_for(r"training images")  # the data is scanned; the model loads next
    run.process.send_signal(signal.SIGINT)
    assert run.finish() == 130, run.text()
    one_line_and_no_traceback(run, r"stopped by SIGINT .*")


@pytest.mark.slow  # three two-process launches: about 50 s on 2 CPU cores
def test_sigterm_to_the_launcher_stops_both_processes_at_one_step_and_resume_is_bit_exact(configs, tmp_path):
    """torchrun passes SIGTERM on to every process; they agree on the step to stop at and save one state."""
    def launch(config: Path, *extra: str) -> Run:
        return Run(config, *extra, processes=2)

    reference = launch(configs["reference"])
    assert reference.finish() == 0, reference.text()
    out = configs["preempted"].parent / "preempted"
    run = launch(configs["preempted"])
    run.wait_for(rf" [1-9]\d*/{STEPS} ")
    run.process.send_signal(signal.SIGTERM)
    assert run.finish() != 0
    assert len(re.findall(r"stopped by SIGTERM after step (\d+)", run.text())) == 2, run.text()
    steps = set(re.findall(r"stopped by SIGTERM after step (\d+)", run.text()))
    assert len(steps) == 1, run.text()  # both processes stopped after the same step
    state_dir = find_latest_state(out)
    assert state_dir is not None and TrainState.read(state_dir).global_step == int(steps.pop())

    resumed = launch(configs["preempted"], "--resume", "latest")
    assert resumed.finish() == 0, resumed.text()
    expected = load_kohya_lora(configs["reference"].parent / "reference" / "last.safetensors")[0]
    got = load_kohya_lora(out / "last.safetensors")[0]
    assert all(torch.equal(expected[k], got[k]) for k in expected)
