"""Runs started from the web UI with the real trainer: one that fails at start, one SIGKILLed mid-run (shown as
failed with its last log lines, never as running), and a UI restarted while a run trains (it finds the run)."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the web UI needs fastapi: pip install -r requirements.txt")
from fastapi.testclient import TestClient  # noqa: E402

from library.ui.app import Settings, create_app  # noqa: E402
from tests.helpers.ui import reap_runs  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ORIGIN = {"Origin": "http://127.0.0.1:7860"}
QUICKSTART = {"pretrained_model_name_or_path": "models/digits-base", "train_data_dir": "data/digits/train",
              "caption_extension": ".txt", "resolution": "32", "train_batch_size": "4", "network_dim": "4",
              "learning_rate": "1e-3", "seed": "0", "max_train_steps": "2000"}


def client(tmp_path: Path) -> TestClient:
    app = create_app(Settings(roots=[REPO, tmp_path], cwd=REPO))
    return TestClient(app, base_url="http://127.0.0.1:7860")


def wait_for(check, timeout: float = 240.0, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out")


@pytest.fixture
def runs_reaped(tmp_path):
    """The 2000-step run is killed by the test itself; if the test stops before that, it must not train on."""
    yield
    reap_runs(tmp_path)


@pytest.mark.usefixtures("runs_reaped")
def test_failing_and_killed_runs_and_a_ui_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    broken_model = tmp_path / "empty_model"
    (broken_model / "unet").mkdir(parents=True)  # an SD folder to the family detectors, without its parts
    failing, killed = tmp_path / "failing", tmp_path / "killed"
    first = client(tmp_path)
    # Two UIs, so the two runs train side by side (one UI runs one at a time).
    other = client(tmp_path)
    started = first.post("/runs/start", data={**QUICKSTART, "output_dir": str(killed)}, headers=ORIGIN)
    assert started.status_code == 200 and "queued a run" in started.text
    assert other.post("/runs/start", data={**QUICKSTART, "pretrained_model_name_or_path": str(broken_model),
                                           "output_dir": str(failing)}, headers=ORIGIN).status_code == 200
    assert first.get("/runs/status", params={"path": str(killed)}).json()["status"] == "running"
    again = other.post("/runs/start", data={**QUICKSTART, "output_dir": str(killed)}, headers=ORIGIN)
    assert again.status_code == 400 and "is in use by a run" in again.text

    # A run that fails at start: the UI's checks pass (the folder is an SD folder), the trainer cannot load it.
    status = wait_for(lambda: (s := other.get("/runs/status", params={"path": str(failing)}).json())["status"]
                      != "running" and s)
    assert status["status"] == "failed", status
    log = (failing / "train.log").read_text(errors="replace")
    assert any("empty_model" in line for line in status["log_tail"]), (status, log)
    assert status["message"]

    # The UI restarts while the run trains: a fresh app (no memory of the process) finds it running.
    wait_for(lambda: first.get("/runs/status", params={"path": str(killed)}).json()["step"] >= 2)
    restarted = client(tmp_path)  # shares nothing with `first` but the folders
    status = restarted.get("/runs/status", params={"path": str(killed)}).json()
    assert status["status"] == "running" and status["step"] >= 2 and status["total_steps"] == 2000
    assert str(killed) in restarted.get("/runs").text

    # SIGKILL (as the out-of-memory killer does): no final status is written; the run shows failed.
    pid = json.loads((killed / "ui_runs.json").read_text())[-1]["pid"]
    os.kill(pid, signal.SIGKILL)
    status = wait_for(lambda: (s := restarted.get("/runs/status", params={"path": str(killed)}).json())["status"]
                      != "running" and s, timeout=30)
    assert status["status"] == "failed" and "killed" in status["message"], status
    assert any("steps" in line for line in status["log_tail"]), status["log_tail"]
    listing = restarted.get("/runs").text
    row = listing[listing.index(str(killed)):]
    assert "failed" in row[:600] and "running" not in row[:600]


@pytest.mark.slow  # 40 s on two loaded cores, most of it loading
@pytest.mark.usefixtures("runs_reaped")
def test_sample_now_and_save_now_on_a_running_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = tmp_path / "run"
    ui = client(tmp_path)
    started = ui.post("/runs/start", headers=ORIGIN, data={
        **QUICKSTART, "output_dir": str(run), "output_name": "now", "_prompts": "a photo of sks --w 32 --h 32 --s 2",
        "sample_every_n_steps": "1000"})  # the prompts are read for a run that samples
    assert "queued a run" in started.text

    def status() -> dict:
        return ui.get("/runs/status", params={"path": str(run)}).json()
    wait_for(lambda: status()["step"] >= 1)
    for what in ("save", "sample"):
        assert ui.post("/runs/request", data={"path": str(run), "what": what}, headers=ORIGIN).status_code == 200
    wait_for(lambda: not (run / "save_now").exists() and not (run / "sample_now").exists())
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    asked = {e["request"]: e["step"] for e in events if e["event"] == "request"}
    saved = next(e for e in events if e["event"] == "save")
    sampled = next(e for e in events if e["event"] == "samples")
    assert saved["step"] == asked["save_now"] and (run / saved["path"]).is_file()  # a LoRA file at that step
    assert sampled["step"] == asked["sample_now"] and (run / sampled["paths"][0]).is_file()
    assert status()["status"] == "running" and status()["samples"][0]["prompt"] == "a photo of sks"
    ui.post("/runs/stop", data={"path": str(run)}, headers=ORIGIN)
    assert wait_for(lambda: (s := status())["status"] != "running" and s)["status"] == "stopped"
