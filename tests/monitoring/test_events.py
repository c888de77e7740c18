"""The run's event stream (docs/events.md): what the Trackers hook writes, and how a reader reads it back."""
from __future__ import annotations

import json
import os
import signal

from library.config import UserError
from library.monitoring.events import EVENTS_FILE, read_events
from library.monitoring.tracking import Trackers
from library.training.faults import Interrupted, outcome


def test_metrics_become_step_and_validation_events(tmp_path):
    trackers = Trackers()
    trackers.open_events(tmp_path, "mylora")
    trackers.plan(total_steps=20, step=0, epochs=2, batches_per_epoch=10)
    trackers.log({"loss/current": 0.5, "loss/average": 0.4, "lr/unet": 1e-4, "lr/textencoder": 5e-5,
                  "loss/timestep/0-99": 0.9, "loss/timestep/100-199": 0.3, "throughput/s_per_step": 0.25,
                  "throughput/samples_per_s": 16.0, "memory/peak_rss_gib": 1.0}, step=3)
    trackers.log({"loss/validation/t100": 0.2, "loss/validation/t500": 0.4, "loss/validation/mean": 0.3}, step=3)
    trackers.event("samples", step=3, epoch=None, paths=["sample/a.png"])
    trackers.event("end", **outcome(Interrupted(signal.SIGTERM, "stopped by SIGTERM after step 3")))
    trackers.finish()

    events = list(read_events(tmp_path / EVENTS_FILE))
    assert [e["event"] for e in events] == ["start", "plan", "step", "validation", "samples", "end"]
    start, plan, step, validation, samples, end = events
    assert start["pid"] == os.getpid() and start["output_name"] == "mylora" and start["version"] == 1
    assert plan["total_steps"] == 20
    assert step["step"] == 3 and step["total_steps"] == 20 and step["loss"] == 0.5 and step["loss_average"] == 0.4
    assert step["lr"] == {"unet": 1e-4, "textencoder": 5e-5}
    assert step["timestep_loss"] == [[0, 99, 0.9], [100, 199, 0.3]]
    assert step["s_per_step"] == 0.25
    assert validation["losses"] == {"100": 0.2, "500": 0.4} and validation["mean"] == 0.3
    assert samples["paths"] == ["sample/a.png"]
    assert end["status"] == "stopped" and "after step 3" in end["message"]


def test_reader_skips_a_line_cut_short(tmp_path):
    path = tmp_path / EVENTS_FILE
    path.write_text(json.dumps({"event": "start", "pid": 1}) + "\n" + '{"event": "step", "st', encoding="utf-8")
    assert [e["event"] for e in read_events(path)] == ["start"]
    assert list(read_events(tmp_path / "missing.jsonl")) == []


def test_outcome_of_failures():
    assert outcome(UserError(["a", "b"])) == {"status": "failed", "message": "a\nb"}
    assert outcome(RuntimeError("boom")) == {"status": "failed", "message": "RuntimeError: boom"}


def test_no_stream_without_open(tmp_path):
    trackers = Trackers()  # not the main process: nothing is written anywhere
    trackers.log({"loss/current": 1.0}, step=1)
    trackers.event("end", status="finished", step=1)
    assert trackers.events is None
