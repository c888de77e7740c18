"""The memory estimate before loading: counted from the files' headers, smaller under lower precisions, and a run
that cannot fit (a simulated limit) refused before loading, naming the options that would fit."""
from __future__ import annotations

import pytest
import torch

from library.config import UserError, parse_config
from library.memory import estimate as memory
from library.memory.check import check_memory
from library.memory.precision import BasePrecision


@pytest.fixture(scope="module")
def files(tiny_flux_dir, tmp_path_factory):
    from library.families.flux.tiny import save_tiny_flux_files

    return save_tiny_flux_files(tiny_flux_dir, tmp_path_factory.mktemp("flux_files"))


def test_counts_come_from_the_headers(files, tiny_flux_dir):
    from diffusers import FluxTransformer2DModel

    counts = memory.count_file(files["transformer"], "denoiser")["denoiser"]
    transformer = FluxTransformer2DModel.from_pretrained(tiny_flux_dir, subfolder="transformer")
    assert counts.matrices + counts.other == sum(p.numel() for p in transformer.parameters())
    assert counts.matrices > counts.other  # the matrices (BFL's fused qkv among them) are most of the weights


def test_lower_precisions_estimate_less(files):
    counts = {"denoiser": memory.count_file(files["transformer"], "denoiser")["denoiser"]}
    totals = [memory.estimate(counts, memory.Settings(kind, kind and "fp8", torch.bfloat16, torch.bfloat16, 4,
                                                      True)).parts["denoiser as stored"]
              for kind in (None, "fp8", "nf4")]
    assert totals[0] > totals[1] > totals[2]
    assert totals[0] - totals[1] == counts["denoiser"].matrices  # 2 bytes a matrix weight in bf16, 1 in fp8


def test_a_run_that_cannot_fit_stops_before_loading_naming_what_fits(files, tiny_flux_dir, tmp_path):
    paths = [f"--{name}={files[name]}" for name in ("clip_l", "t5xxl", "ae")]
    config, _ = parse_config([f"--pretrained_model_name_or_path={files['transformer']}", *paths,
                              f"--model_config={tiny_flux_dir}", f"--train_data_dir={tmp_path}",
                              f"--output_dir={tmp_path / 'out'}", "--mixed_precision=bf16",
                              "--gradient_checkpointing"])
    where = (torch.device("cpu"), 1)  # the device and the processes sharing it
    precision = BasePrecision.from_config(config, torch.bfloat16)

    def need(kind):
        counts: dict[str, memory.Counts] = {}
        for path, part in memory.model_files(files["transformer"], {"text": [files["clip_l"], files["t5xxl"]],
                                                                     "vae": [files["ae"]]}):
            for name, found in memory.count_file(path, part).items():
                counts[name] = counts.get(name, memory.Counts()) + found
        return memory.estimate(counts, memory.Settings(kind, kind and "fp8", torch.bfloat16, torch.bfloat16,
                                                       config.network_dim, True)).total

    check_memory(config, *where, precision, torch.bfloat16, available=need(None) + 1)  # fits: no error
    limit = (need(None) + need("fp8")) / 2
    with pytest.raises(UserError) as refused:
        check_memory(config, *where, precision, torch.bfloat16, available=limit)
    text = "\n".join(refused.value.problems)
    assert "stopped before loading" in text
    assert 'base_model_precision = "fp8"' in text and 'base_model_precision = "nf4"' in text
    with pytest.raises(UserError, match="none of base_model_precision"):
        check_memory(config, *where, precision, torch.bfloat16, available=1.0)


def test_a_full_matrix_network_dim_counts_no_more_than_the_matrices(files):
    counts = {"denoiser": memory.count_file(files["transformer"], "denoiser")["denoiser"]}
    huge = memory.estimate(counts, memory.Settings(None, None, torch.bfloat16, torch.bfloat16, 100000, True))
    assert huge.parts["LoRA and optimizer"] == counts["denoiser"].matrices * 16
