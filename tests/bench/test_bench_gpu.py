"""bench/gpu.py on the CPU: the one command's tiny form end to end (the plan's cells, then the CUDA tests, which
skip here, into one JSON report and one log), the grid's tiny cells, and the plan's arithmetic, so the GPU
benchmark cannot rot where no GPU runs it. No timing is asserted."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "gpu.py"
CUDA_TEST_MODULES = {"test_mixed_precision", "test_fp8_base", "test_block_swap", "test_ddp_nccl",
                     "test_regional_compile"}


@pytest.fixture(scope="module")
def gpu_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_tiny_command_runs_the_plan_and_the_cuda_tests_into_one_report_and_log(gpu_bench, tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.json", "gpu.log"]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["tiny"] and report["mode"] == "plan"
    cells = {(c["model"], c["name"]): c for c in report["cells"]}
    planned = [(c["model"], c["name"]) for c in gpu_bench.PLAN]
    assert list(cells) == [key for key in planned if "-compile-" not in key[1]]  # the plan's order, no compile
    for key, cell in cells.items():
        assert "error" not in cell and "skipped" not in cell, (key, cell)
        assert cell["resolution"] == 64 and len(cell["losses"]) == 2 and cell["finite_losses"]
        assert all(math.isfinite(v) and v > 0 for v in cell["losses"])
        assert cell["forward_tflop"] > 0 and cell["lora_parameters"] > 0
        assert cell["peak_allocated_gib"] is None and cell["swapped_blocks"] == 0  # no CUDA: no swap
        fp8 = cell["frozen_storage"].get("float8_e4m3fn", 0)
        assert (fp8 > 0) == (cell["base"] == "fp8"), (key, cell["frozen_storage"])
    flux = cells[("flux", "bf16-gc-eager-nchw-fp8base")]
    assert cells[("flux", "bf16-gc-eager-nchw-fp8base-b2")]["batch_size"] == 2
    assert cells[("flux", "bf16-gc-eager-nchw-fp8base-b2")]["forward_tflop"] == pytest.approx(
        2 * flux["forward_tflop"])
    # fp8 storage costs no FLOPs: the same forward as the bf16 base
    assert cells[("flux", "bf16-gc-eager-nchw")]["forward_tflop"] == pytest.approx(flux["forward_tflop"])

    tests = report["tests"]
    assert tests["returncode"] == 0 and not tests["timed_out"]
    assert set(tests["counts"]) == {"skipped"} and tests["counts"]["skipped"] >= 11  # no CUDA here
    assert {case["test"].split("::")[0].rsplit(".", 1)[-1] for case in tests["cases"]} == CUDA_TEST_MODULES
    assert all("needs a CUDA device" in case["message"] for case in tests["cases"])
    log = (tmp_path / "gpu.log").read_text()
    assert all(f" {name} " in log for _, name in cells)
    assert f"{tests['counts']['skipped']} skipped" in log


def test_tiny_grid_reports_every_cell_with_finite_losses_and_flops(gpu_bench, tmp_path, fresh_accelerator_state):
    assert gpu_bench.main(["--grid", "--tiny", "--device", "cpu", "--no_tests", "--models", "sd15,sdxl,flux",
                           "--steps", "1", "--warmup", "1", "--peak_tflops", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["tiny"] and report["mode"] == "grid" and report["peak_tflops"] == 1.0 and report["tests"] is None
    cells = {(c["model"], c["name"]): c for c in report["cells"]}
    expected = {("sd15", "bf16-gc-eager-nchw"), ("sd15", "bf16-nogc-eager-cl"), ("sd15", "fp16-gc-eager-nchw"),
                ("sdxl", "bf16-gc-eager-nchw"), ("sdxl", "bf16-nogc-eager-cl"), ("sdxl", "fp16-gc-eager-nchw"),
                ("flux", "bf16-gc-eager-nchw"), ("flux", "bf16-nogc-eager-nchw"), ("flux", "fp16-gc-eager-nchw")}
    assert set(cells) == expected
    for (model, name), cell in cells.items():
        assert "error" not in cell, (model, name, cell.get("error"))
        assert cell["weight_dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[cell["precision"]]
        assert cell["frozen_storage"] == {cell["weight_dtype"]: cell["frozen_storage"][cell["weight_dtype"]]}
        assert cell["gradient_checkpointing"] == ("-gc-" in name)
        assert cell["fused_adamw"] and cell["lora_parameters"] > 0
        assert len(cell["losses"]) == 2 and cell["timed_steps"] == 1 and cell["finite_losses"]
        assert all(math.isfinite(v) and v > 0 for v in cell["losses"])
        assert cell["forward_tflop"] > 0
        assert cell["step_model_tflop"] == pytest.approx(3 * cell["forward_tflop"])
        assert cell["mfu"] == pytest.approx(cell["achieved_tflops"] / 1.0)
        assert cell["s_per_step"] > 0 and cell["images_per_s"] > 0
        assert cell["grad_scaler"] == (cell["precision"] == "fp16" and torch.cuda.is_available())
        assert cell["peak_allocated_gib"] is None  # CPU
    # The same model and batch give the same forward FLOPs in every cell; SDXL's UNet costs more than SD1's.
    for model in ("sd15", "sdxl", "flux"):
        assert len({c["forward_tflop"] for (m, _), c in cells.items() if m == model}) == 1
    assert cells[("sdxl", "bf16-gc-eager-nchw")]["forward_tflop"] > cells[("sd15", "bf16-gc-eager-nchw")][
        "forward_tflop"]
    assert (tmp_path / "gpu.log").read_text().count(" s/step ") == len(expected)


def test_the_plan_covers_the_models_and_fits_its_time_limit(gpu_bench):
    plan = gpu_bench.plan(tiny=False)
    by_model = {(c["model"], c["resolution"]) for c in plan}
    assert by_model == {("sd15", 512), ("sdxl", 1024), ("flux", 1024)}
    flux_fp8 = [c for c in plan if c["model"] == "flux" and c["base"] == "fp8" and not c["torch_compile"]]
    assert {c["blocks_to_swap"] for c in flux_fp8} == {0, 16}
    assert any(c["precision"] == "fp16" for c in plan) and any(c["torch_compile"] for c in plan)
    assert len({(c["model"], c["name"]) for c in plan}) == len(plan)
    # What must run (every cell but the compile ones) fits the default limit with the tests' reserve.
    eager = sum(c["estimate_s"] for c in plan if not c["torch_compile"])
    assert eager + gpu_bench.TESTS_RESERVE_S <= gpu_bench.TIME_LIMIT_S
    tiny = gpu_bench.plan(tiny=True, warmup=1, steps=1)
    assert not any(c["torch_compile"] for c in tiny) and {c["resolution"] for c in tiny} == {64}
    assert all(c["warmup"] == 1 and c["steps"] == 1 for c in tiny)


def test_cells_past_the_time_limit_are_reported_skipped_without_running(gpu_bench):
    lines = []
    clock = gpu_bench.Clock(limit_s=100.0, tests_reserve_s=60.0)
    cells = [gpu_bench.make_cell("flux", 1024, "bf16", True, base="fp8", estimate_s=41.0)]
    results = gpu_bench.run_cells(cells, torch.device("cpu"), False, None, clock, lines.append)
    assert "time limit" in results[0]["skipped"] and "losses" not in results[0]
    assert lines == [gpu_bench.summary_line(results[0])] and "skipped" in lines[0]


def test_only_names_unknown_cells_before_writing_anything(gpu_bench, tmp_path):
    with pytest.raises(SystemExit, match="no cell named nope; the cells: sd15/bf16-gc-eager-nchw"):
        gpu_bench.main(["--tiny", "--no_tests", "--only", "nope", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_full_grid_covers_compile_checkpointing_channels_last_and_fp16(gpu_bench):
    unet = {c["name"] for c in gpu_bench.grid("sdxl", tiny=False)}
    assert len(unet) == 9 and "bf16-nogc-compile-cl" in unet and "fp16-gc-eager-nchw" in unet
    flux = {c["name"] for c in gpu_bench.grid("flux", tiny=False)}
    assert flux == {"bf16-gc-eager-nchw", "bf16-gc-compile-nchw", "bf16-nogc-eager-nchw", "bf16-nogc-compile-nchw",
                    "fp16-gc-eager-nchw"}


def test_peak_table_prefers_the_specific_name(gpu_bench):
    names = list(gpu_bench.PEAK_BF16_TFLOPS)
    assert names.index("H100 PCIe") < names.index("H100")
    assert gpu_bench.peak_of(torch.device("cpu"), 123.0) == (123.0, "--peak_tflops")
    assert gpu_bench.peak_of(torch.device("cpu"), None)[0] is None


def test_a_failing_cell_is_reported_and_the_plan_goes_on(gpu_bench, monkeypatch):
    def run_cell(cell, device, tiny, peak):
        if cell["model"] == "sd15":
            raise RuntimeError("CUDA error: an illegal memory access")
        return {**cell, "s_per_step": 1.0, "images_per_s": 1.0, "first_step_s": 1.0, "peak_allocated_gib": None,
                "forward_tflop": 1.0, "mfu": None, "swapped_blocks": 0, "finite_losses": True}

    monkeypatch.setattr(gpu_bench, "run_cell", run_cell)
    cells = [gpu_bench.make_cell("sd15", 512, "bf16", True), gpu_bench.make_cell("sdxl", 1024, "bf16", True)]
    lines = []
    results = gpu_bench.run_cells(cells, torch.device("cpu"), False, None, gpu_bench.Clock(1e6, 0), lines.append)
    assert results[0]["error"] == "RuntimeError: CUDA error: an illegal memory access"
    assert "error" not in results[1] and results[1]["s_per_step"] == 1.0
    assert "illegal memory access" in lines[0] and " s/step " in lines[1]
