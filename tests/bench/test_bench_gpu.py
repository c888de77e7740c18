"""bench/gpu.py in its tiny CPU mode: the report has every cell of the reduced grid with finite losses and FLOP
counts, so the GPU benchmark cannot rot where no GPU runs it. No timing is asserted."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"


@pytest.fixture(scope="module")
def gpu_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_mode_reports_every_cell_with_finite_losses_and_flops(gpu_bench, tmp_path, fresh_accelerator_state):
    report_path = tmp_path / "report.json"
    assert gpu_bench.main(["--tiny", "--device", "cpu", "--models", "sd15,sdxl,flux", "--steps", "1", "--warmup",
                           "1", "--peak_tflops", "1", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["tiny"] and report["peak_tflops"] == 1.0
    cells = {(c["model"], c["name"]): c for c in report["cells"]}
    expected = {("sd15", "bf16-gc-eager-nchw"), ("sd15", "bf16-nogc-eager-cl"), ("sd15", "fp16-gc-eager-nchw"),
                ("sdxl", "bf16-gc-eager-nchw"), ("sdxl", "bf16-nogc-eager-cl"), ("sdxl", "fp16-gc-eager-nchw"),
                ("flux", "bf16-gc-eager-nchw"), ("flux", "bf16-nogc-eager-nchw"), ("flux", "fp16-gc-eager-nchw")}
    assert set(cells) == expected
    for (model, name), cell in cells.items():
        assert "error" not in cell, (model, name, cell.get("error"))
        assert cell["weight_dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[cell["precision"]]
        assert cell["gradient_checkpointing"] == ("-gc-" in name)
        assert cell["fused_adamw"] and cell["lora_parameters"] > 0
        assert len(cell["losses"]) == 2 and cell["finite_losses"]
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
