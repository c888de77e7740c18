"""Runs killed with SIGKILL at random moments, during saves too, or stopped by SIGTERM, always leave a resumable
output_dir."""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from library.network.kohya_format import load_kohya_lora, read_metadata
from library.training.state import TrainState, find_latest_state

REPO = Path(__file__).resolve().parents[2]
STEPS = 10


def start(config: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(REPO / "train_network.py"), "--config", str(config), *extra],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def saving_now(output_dir: Path) -> bool:
    return output_dir.is_dir() and any(p.name.startswith(".") for p in output_dir.iterdir())


@pytest.mark.slow  # a run killed and resumed again and again: about 60 s on 2 CPU cores
def test_sigkill_at_random_moments_then_resume_latest(tiny_sd1_dir, sample_data_dir, tmp_path):
    data = tmp_path / "data" / "1_sks shape"
    data.mkdir(parents=True)
    for image in sorted((sample_data_dir / "10_sks shape").glob("*.png"))[:6]:
        shutil.copy(image, data / image.name)
        shutil.copy(image.with_suffix(".txt"), data / image.with_suffix(".txt").name)
    body = (f'pretrained_model_name_or_path = "{tiny_sd1_dir}"\ntrain_data_dir = "{data.parent}"\n'
            f'resolution = 64\ncaption_extension = ".txt"\ntrain_batch_size = 2\nmax_train_steps = {STEPS}\n'
            'seed = 4\nlearning_rate = 1e-3\nlr_scheduler = "cosine"\nnetwork_dropout = 0.1\n'
            'save_every_n_steps = 1\nsave_state = true\nsave_last_n_steps_state = 2\n')
    reference_dir, crash_dir = tmp_path / "reference", tmp_path / "crash"
    reference = tmp_path / "reference.toml"
    reference.write_text(body + f'output_dir = "{reference_dir}"\n')
    crashing = tmp_path / "crash.toml"
    crashing.write_text(body + f'output_dir = "{crash_dir}"\n')

    done = start(reference)
    assert done.wait(timeout=300) == 0, done.stderr.read()

    rng = random.Random(int(os.environ.get("CRASH_TEST_SEED", time.time_ns() % 10_000)))
    kills = []
    for attempt in range(6):
        process = start(crashing, "--resume", "latest")
        deadline = time.monotonic() + rng.uniform(4.0, 12.0)
        during_save = attempt % 2 == 1  # every other run is killed the moment a save is under way
        while process.poll() is None and time.monotonic() < deadline:
            if during_save and saving_now(crash_dir):
                break
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
        process.wait()
        kills.append((during_save, round(time.monotonic() - deadline, 2), process.returncode))

    assert any(returncode == -signal.SIGKILL for _, _, returncode in kills), kills

    # Preemption: SIGTERM once training runs finishes the step, saves a state at it and exits 143.
    process = start(crashing, "--resume", "latest")
    started = find_latest_state(crash_dir)
    while process.poll() is None and find_latest_state(crash_dir) == started:
        time.sleep(0.005)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=300)
    if process.returncode != 0:  # 0: it had already finished all steps
        assert process.returncode == 143, err
        saved = find_latest_state(crash_dir)
        step = TrainState.read(saved).global_step
        stopped_in_loop = f"stopped by SIGTERM after step {step}; saved {saved}" in err
        # The last step's state may be saved before the signal lands, in the final save outside the step loop.
        stopped_after = step == STEPS and "stopped by SIGTERM outside the training steps" in err
        assert (stopped_in_loop or stopped_after) and "Traceback" not in err, err

    final = start(crashing, "--resume", "latest")
    assert final.wait(timeout=300) == 0, (kills, final.stderr.read())
    assert read_metadata(crash_dir / "last.safetensors")["ss_steps"] == str(STEPS)
    expected, got = load_kohya_lora(reference_dir / "last.safetensors")[0], \
        load_kohya_lora(crash_dir / "last.safetensors")[0]
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), kills
    assert not [p.name for p in crash_dir.iterdir() if p.name.startswith(".")]
