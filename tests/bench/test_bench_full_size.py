"""bench/full_size.py --tiny runs the full-size pipeline on the tiny FLUX and Qwen-Image: files as users have them,
train_network.py in fp32 compute with a low-precision base, and one record per run with every field; it refuses to
measure on a loaded machine unless --force."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "full_size.py"
PHASES = {"load", "caching", "load_denoiser", "quantize", "first_step", "steps"}  # files read by phase
FIELDS = {"run", "model", "base_precision", "compute_dtype", "resolution", "batch_size", "rank", "t5_length",
          "blocks_to_swap", "steps", "s_per_step", "phase_order", "seconds", "launch_to_first_step_s", "peak_rss_gib",
          "peak_reset_per_phase", "estimate_gib", "estimate_error_pct", "baseline_rss_gib", "load_average",
          "available_gib_before", "cpu_model", "threads",
          "time", "command", "config", "log"}


def _bench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_the_tiny_mode_writes_a_record_per_run_with_every_field(tmp_path):
    out = tmp_path / "results.json"
    result = _bench("--tiny", "--force", "--runs", "flux-nf4,qwen-nf4", "--steps", "3", "--threads", "1",
                    "--work", str(tmp_path / "work"), "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    records = json.loads(out.read_text())
    assert [r["run"] for r in records] == ["flux-nf4", "qwen-nf4"]
    for record in records:
        assert set(record) == FIELDS
        assert record["base_precision"] == "nf4" and record["compute_dtype"] == "float32"
        assert record["model"] in ("FLUX.1-dev (tiny)", "Qwen-Image (tiny)") and record["resolution"] == 256
        assert set(record["peak_rss_gib"]) == PHASES | {"overall"}
        assert all(0 < value < 8 for value in record["peak_rss_gib"].values())
        assert record["peak_rss_gib"]["overall"] == max(record["peak_rss_gib"][p] for p in PHASES)
        assert set(record["estimate_gib"]) == PHASES == set(record["estimate_error_pct"]) == set(record["seconds"])
        assert record["phase_order"] == ["load", "caching", "load_denoiser", "quantize", "first_step", "steps"]
        assert 0 < record["baseline_rss_gib"] < record["peak_rss_gib"]["load"]
        assert all(value >= 0 for value in record["seconds"].values())
        assert record["s_per_step"] > 0 and isinstance(record["load_average"], float) and record["cpu_model"]
        log = Path(record["log"]).read_text()
        assert "frozen base stored as nf4" in log and "computed in float32" in log
    # a second invocation appends
    result = _bench("--tiny", "--force", "--runs", "flux-fp8", "--steps", "2", "--threads", "1",
                    "--work", str(tmp_path / "work"), "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(out.read_text())
    assert [r["run"] for r in records] == ["flux-nf4", "qwen-nf4", "flux-fp8"]
    assert records[-1]["base_precision"] == "fp8"
    assert "frozen base stored as fp8" in Path(records[-1]["log"]).read_text()
    # the estimate set again from the configs, the measurements kept
    for record in records:
        record["estimate_gib"] = {}
    out.write_text(json.dumps(records))
    assert _bench("--reestimate", "--out", str(out)).returncode == 0
    again = json.loads(out.read_text())
    assert all(set(r["estimate_gib"]) == PHASES for r in again)
    assert [r["peak_rss_gib"] for r in again] == [r["peak_rss_gib"] for r in records]


def test_a_loaded_machine_is_refused_without_force(tmp_path, monkeypatch, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("full_size", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "full_size", module)  # its dataclass looks its module up
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.os, "getloadavg", lambda: (3.7, 1.0, 1.0))
    ran = []
    monkeypatch.setattr(module, "run_one", lambda *args: ran.append(args))
    out = tmp_path / "results.json"
    assert module.main(["--runs", "flux-nf4", "--work", str(tmp_path), "--out", str(out)]) == 2
    assert "load average is 3.70, over 2.5" in capsys.readouterr().err
    assert not ran and not out.exists()
    with pytest.raises(SystemExit):
        module.main(["--runs", "flux-nine"])
